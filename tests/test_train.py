"""End-to-end training runs on a tiny model: run folders, resume after SIGKILL, eval, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    REPO,
    TINY_CONFIG,
    kill_at_first_checkpoint,
    make_image_folder,
    run_tool_in_process,
    tiny_args,
)

from coop.config.checks import ConfigError, epochs_for_shots
from coop.config.load import load_config
from coop.config.run_names import run_name

TRAIN = [sys.executable, str(REPO / "tools" / "train.py")]
EVAL = [sys.executable, str(REPO / "tools" / "eval.py")]


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=os.environ.copy(), **kw)


def run_here(cmd):
    """`run(cmd)` in this process, log lines included (`run_tool_in_process`): the tools' real
    processes (exit code, console, a SIGKILL) are tested by the kill of
    test_resume_after_sigkill_is_exact, the first eval of test_eval_same_and_other_dataset and
    test_corrupt_image_is_named_or_skipped's loader workers."""
    return run_tool_in_process(Path(cmd[1]), cmd[2:], log=True)


def run_forked(cmd):
    """`run_here(cmd)` in a process forked from this one (`fork_tool`), which takes the loader
    workers of a failed run with it; their shutdown would stall this process for seconds."""
    import gc
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        pid = os.fork()
        if pid == 0:
            try:
                gc.disable()  # no collection in the child: a collected loader waits for its workers
                res = run_here(cmd)
                result.write_text(json.dumps([res.returncode, res.stdout, res.stderr]))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        code, out, err = json.loads(result.read_text())
    return subprocess.CompletedProcess(cmd, code, out, err)


def load_ckpt(path):
    return torch.load(path, weights_only=True)


def test_train_writes_run_folder(image_folder, tmp_path):
    out = tmp_path / "run"
    res = run_here(TRAIN + tiny_args(image_folder, out, **{"prompt.depth": 2, "prompt.csc": "true"}))
    assert res.returncode == 0, res.stderr[-2000:]
    # exactly the files the README's run-folder list names
    listing = (REPO / "README.md").read_text().split("containing:\n\n", 1)[1].split("\n\n", 1)[0]
    named = {line[3:].split("`")[0].rstrip("/") for line in listing.splitlines() if line.startswith("- `")}
    assert {"config.yaml", ".lock", "tb"} <= named
    assert sorted(p.name for p in out.iterdir()) == sorted(named)
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["n_test"] == 12 and metrics["epochs"] == 4 and metrics["shots"] == 4 and metrics["seed"] == 1
    )
    assert 0 <= metrics["accuracy"] <= 100
    ckpt = load_ckpt(out / "checkpoint.pt")
    assert set(ckpt["prompt"]) == {"ctx", "deep_ctx"}
    assert ckpt["prompt"]["ctx"].shape == (3, 4, 64) and ckpt["prompt"]["deep_ctx"].shape == (1, 3, 4, 64)
    assert ckpt["finished"] and ckpt["epoch"] == 4 and len(ckpt["history"]) == 4
    assert ckpt["optimizer"]["state"]  # momentum buffers are kept for resuming
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.prompt.depth == 2 and cfg.data.root == str(image_folder)
    rows = (out / "history.csv").read_text().splitlines()
    assert rows[0] == "epoch,loss,train_acc,lr,time_s" and len(rows) == 5
    assert "test accuracy" in (out / "log.txt").read_text()

    # a finished run is not trained again
    mtime = (out / "checkpoint.pt").stat().st_mtime_ns
    again = run_here(TRAIN + tiny_args(image_folder, out, **{"prompt.depth": 2, "prompt.csc": "true"}))
    assert again.returncode == 0 and "not training again" in again.stderr
    assert (out / "checkpoint.pt").stat().st_mtime_ns == mtime
    # ... and a different config on the same folder is refused with one line
    other = run_here(TRAIN + tiny_args(image_folder, out, **{"prompt.depth": 3, "prompt.csc": "true"}))
    assert other.returncode == 2 and "different config (prompt.depth" in other.stderr
    assert "Traceback" not in other.stderr


@pytest.mark.parametrize("aug_views", [0, 2])
def test_resume_after_sigkill_is_exact(image_folder, tmp_path, aug_views):
    extra = {"train.epochs": 8, "train.aug_views": aug_views}
    ref = tmp_path / "uninterrupted"
    assert run_here(TRAIN + tiny_args(image_folder, ref, **extra)).returncode == 0

    out = tmp_path / "killed"
    kill_at_first_checkpoint(TRAIN + tiny_args(image_folder, out, **extra), out)
    killed_at = load_ckpt(out / "checkpoint.pt")["epoch"] if (out / "checkpoint.pt").exists() else 0
    assert killed_at < 8, "the kill came too late to test resuming"

    res = run_here(TRAIN + tiny_args(image_folder, out, **extra))
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = load_ckpt(ref / "checkpoint.pt"), load_ckpt(out / "checkpoint.pt")
    assert torch.equal(a["prompt"]["ctx"], b["prompt"]["ctx"])
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (ref, out))
    assert ma["accuracy"] == mb["accuracy"] and ma["final_train_loss"] == mb["final_train_loss"]
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]
    assert [r["lr"] for r in a["history"]] == [r["lr"] for r in b["history"]]


def test_eval_same_and_other_dataset(image_folder, tmp_path):
    out = tmp_path / "run"
    assert run_here(TRAIN + tiny_args(image_folder, out)).returncode == 0
    metrics = json.loads((out / "metrics.json").read_text())
    res = run(EVAL + ["--checkpoint", str(out / "checkpoint.pt")])
    assert res.returncode == 0, res.stderr[-2000:]
    again = json.loads((out / "eval_imagefolder.json").read_text())
    assert again["accuracy"] == metrics["accuracy"] and again["n_test"] == metrics["n_test"]

    other = make_image_folder(tmp_path / "other", classes=("yellow_thing", "red_thing"), n_test=3)
    res = run_here(
        EVAL
        + [
            "--checkpoint",
            str(out / "checkpoint.pt"),
            f"data.root={other}",
            "--out",
            str(tmp_path / "o.json"),
        ]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "o.json").read_text())["n_test"] == 6


def test_eval_refuses_csc_transfer(image_folder, tmp_path):
    out = tmp_path / "run"
    assert (
        run_here(TRAIN + tiny_args(image_folder, out, **{"prompt.csc": "true", "train.epochs": 2})).returncode
        == 0
    )
    other = make_image_folder(tmp_path / "other", classes=("a_thing", "b_thing"), n_test=2)
    res = run_here(EVAL + ["--checkpoint", str(out / "checkpoint.pt"), f"data.root={other}"])
    assert res.returncode == 2 and "class-specific context" in res.stderr and "Traceback" not in res.stderr


def test_non_finite_loss_stops_with_last_good_checkpoint(image_folder, tmp_path):
    out = tmp_path / "run"
    res = run_here(TRAIN + tiny_args(image_folder, out, **{"train.lr": 1e38, "train.epochs": 5}))
    assert res.returncode == 1 and "non-finite" in res.stderr and "last good checkpoint" in res.stderr
    ckpt = load_ckpt(out / "checkpoint.pt")
    assert ckpt["epoch"] >= 1 and not ckpt["finished"]
    assert torch.isfinite(ckpt["prompt"]["ctx"]).all()
    assert not (out / "metrics.json").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["data.nope=1"], "unknown or invalid config key 'data.nope'"),
        (["train.precision=fp8"], "train.precision must be one of amp, fp32, fp16, got 'fp8'"),
        (["train.lr=0"], "train.lr must be a number > 0, got 0"),
        (["train.epochs=1"], "train.warmup_epochs=1 must be less than the 1 training epochs"),
        (["data.root=/no/such/folder"], "/no/such/folder"),
        (["--config", "/no/such.yaml"], "config file not found: /no/such.yaml"),
    ],
)
def test_bad_input_is_one_line(image_folder, tmp_path, args, message):
    # in-process (no torch import per case); the subprocess contract is tested above and below
    res = run_tool_in_process(REPO / "tools" / "train.py", tiny_args(image_folder, tmp_path / "r") + args)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], res.stderr[-1500:]
    assert "Traceback" not in res.stderr


def test_recipe_rules_and_shipped_configs():
    assert [epochs_for_shots(k, "dtd") for k in (1, 2, 4, 8, 16)] == [50, 100, 100, 200, 200]
    assert epochs_for_shots(16, "imagenet") == 50
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        if any("." in key for key in yaml.safe_load(path.read_text())):
            continue  # a sweep grid of dotted keys (ablations, protocols), not a run config
        cfg = load_config(str(path))
        assert run_name(cfg).count("/") == 4
    with pytest.raises(ConfigError, match="'prompt.size'"):
        load_config(None, ["prompt.size=3"])


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_image_is_named_or_skipped(tmp_path, workers):
    folder = make_image_folder(tmp_path / "data", n_train=3, n_test=2)
    bad = folder / "train" / "red_thing" / "1.png"
    bad.write_bytes(b"not a png at all")
    extra = {"data.num_workers": workers, "train.epochs": 1, "train.warmup_epochs": 0}
    res = (run_forked if workers else run_here)(TRAIN + tiny_args(folder, tmp_path / "run", **extra))
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"cannot read image {bad}" in errors[0]
    assert "Traceback" not in res.stderr

    tool = run if workers else run_here  # the workers log the skipped image: a real process's stderr
    res = tool(TRAIN + tiny_args(folder, tmp_path / "run2", **extra, **{"data.skip_corrupt": "true"}))
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"skipping cannot read image {bad}" in res.stderr


def test_zero_epochs_is_the_zero_shot_baseline(image_folder, tmp_path):
    """epochs=0 with ctx_init evaluates zero-shot CLIP with that template through the same pipeline."""
    import coop
    from coop.data import build_dataset
    from coop.train.engine import clip_transforms
    from coop.train.features import encode_images

    out = tmp_path / "zs"
    res = run_here(
        TRAIN + tiny_args(image_folder, out, **{"train.epochs": 0, "prompt.ctx_init": "'a photo of a'"})
    )
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["epochs"] == 0 and metrics["n_ctx"] == 4

    clip = coop.load_clip(str(TINY_CONFIG))
    ds = build_dataset("imagefolder", str(image_folder))
    feats, labels, _ = encode_images(clip, ds.test, clip_transforms(clip)[1], device=torch.device("cpu"))
    names = [c.replace("_", " ") for c in ds.classnames]
    with torch.no_grad():
        text = clip.encode_text(clip.tokenize([f"a photo of a {c}." for c in names]))
        preds = coop.cosine_logits(feats, text, clip.logit_scale).argmax(-1)
    assert metrics["accuracy"] == pytest.approx(100.0 * float((preds == labels).float().mean()))

    bad = run_here(TRAIN + tiny_args(image_folder, tmp_path / "x", **{"train.epochs": 0}))
    assert bad.returncode == 2 and "set prompt.ctx_init" in bad.stderr


def test_base_to_new(tmp_path):
    """Train on the first ceil(n/2) classes, then evaluate the shared context on the other half."""
    from coop.data import build_dataset, subsample_classes

    folder = make_image_folder(tmp_path / "data", classes=("a_thing", "b_thing", "c_thing"), n_test=2)
    full = build_dataset("imagefolder", str(folder))
    base, new = subsample_classes(full, "base"), subsample_classes(full, "new")
    assert base.classnames == ["a_thing", "b_thing"] and new.classnames == ["c_thing"]
    assert {d.label for d in new.test} == {0} and {d.classname for d in new.test} == {"c_thing"}
    assert len(base.test) + len(new.test) == len(full.test)

    out = tmp_path / "run"
    res = run_here(TRAIN + tiny_args(folder, out, **{"data.subsample_classes": "base", "train.epochs": 2}))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((out / "metrics.json").read_text())["n_test"] == 4
    assert load_ckpt(out / "checkpoint.pt")["classnames"] == ["a_thing", "b_thing"]
    res = run_here(EVAL + ["--checkpoint", str(out / "checkpoint.pt"), "data.subsample_classes=new"])
    assert res.returncode == 0, res.stderr[-2000:]
    new_metrics = json.loads((out / "eval_imagefolder_new.json").read_text())
    assert new_metrics["n_test"] == 2 and new_metrics["accuracy"] == 100.0  # one class: always right
    from coop.results.tables import load_runs, summarize

    runs = load_runs(tmp_path)
    table = summarize(runs, by=[])
    base_acc = json.loads((out / "metrics.json").read_text())["accuracy"]
    assert table["new_accuracy_mean"][0] == 100.0
    assert table["hm_mean"][0] == pytest.approx(2 * base_acc * 100 / (base_acc + 100))
    cfg = load_config(None, ["data.subsample_classes=new"])
    assert run_name(cfg).endswith("depth1_new/seed1")

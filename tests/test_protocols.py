"""The evaluation protocols end to end: zero-shot and linear-probe runs against direct computations,
eval.targets on CoOp-layout ImageNet variants, the protocol grids, and one protocol on bundled data."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_CONFIG, run_tool_in_process
from PIL import Image
from test_methods import coop_search_by_hand

from coop.config.load import load_config
from coop.data import ImageDataset, build_dataset
from coop.model.weights import load_clip
from coop.train.engine import clip_transforms
from coop.train.evaluation import evaluate_checkpoint_targets
from coop.train.grid import load_grid
from coop.train.runner import train_run
from coop.train.sweep import plan

pytestmark = pytest.mark.filterwarnings("ignore:'penalty' was deprecated:FutureWarning")

COLOURS = {"red": (200, 40, 40), "green": (40, 200, 40), "blue": (40, 40, 200), "yellow": (200, 200, 40)}
WNIDS = {"n01": "red", "n02": "green", "n03": "blue", "n04": "yellow"}


def paint(path, colour, seed):
    gen = np.random.default_rng(seed)
    pixels = np.clip(np.array(colour) + gen.integers(-40, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """A CoOp DATA folder: imagefolder (with val), ImageNet and its test-only variants, by colour."""
    root = tmp_path_factory.mktemp("DATA")
    n = 0
    for split, count in (("train", 6), ("val", 3), ("test", 4)):
        for name, colour in COLOURS.items():
            for i in range(count):
                paint(root / "folder" / split / f"{name} thing" / f"{i}.png", colour, n := n + 1)
    listing = "".join(f"{w} {c} thing\n" for w, c in WNIDS.items())
    for split, count in (("train", 6), ("val", 3)):
        for wnid, c in WNIDS.items():
            for i in range(count):
                paint(root / "imagenet" / "images" / split / wnid / f"{i}.png", COLOURS[c], n := n + 1)
    (root / "imagenet" / "classnames.txt").write_text(listing)
    variants = {
        "imagenetv2/imagenetv2-matched-frequency-format-val": {str(i): w for i, w in enumerate(WNIDS)},
        "imagenet-adversarial/imagenet-a": {w: w for w in ("n02", "n04")},  # a class subset, as -A
    }
    for images, folders in variants.items():
        for folder, wnid in folders.items():
            for i in range(2):
                paint(root / images / folder / f"{i}.png", COLOURS[WNIDS[wnid]], n := n + 1)
        (root / images.split("/")[0] / "classnames.txt").write_text(listing)
    return root


def tiny_cfg(out, *extra):
    return load_config(
        None,
        [
            f"model.name={TINY_CONFIG}",
            "model.pretrained=none",
            "data.num_workers=0",
            "data.shots=4",
            "train.epochs=3",
            "train.batch_size=4",
            "train.lr=0.05",
            "device=cpu",
            f"output_dir={out}",
            *extra,
        ],
    )


@torch.no_grad()
def direct_features(clip, items):
    _, test_tf = clip_transforms(clip)
    images = torch.stack([ImageDataset(items, test_tf)[i][0] for i in range(len(items))])
    return clip.encode_image(images), torch.tensor([d.label for d in items])


@torch.no_grad()
def test_zeroshot_run_equals_direct_computation(data_root, tmp_path):
    folder = str(data_root / "folder")
    metrics = train_run(
        tiny_cfg(tmp_path / "zs", "method=zeroshot", "data.name=imagefolder", f"data.root={folder}")
    )
    clip = load_clip(str(TINY_CONFIG), pretrained=None)
    ds = build_dataset("imagefolder", folder)
    image, labels = direct_features(clip, ds.test)
    text = clip.encode_text(clip.tokenize([f"a photo of a {c}." for c in ds.classnames]))
    logits = F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
    expected = 100.0 * (logits.argmax(-1) == labels).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(expected, abs=1e-9)
    assert (
        metrics["method"] == "zeroshot"
        and metrics["epochs"] == 0
        and metrics["template"] == "a photo of a {}."
    )
    ckpt = torch.load(tmp_path / "zs" / "checkpoint.pt", weights_only=True)
    assert ckpt["prompt"] == {} and ckpt["finished"]


@torch.no_grad()
def test_linear_probe_run_equals_sklearn(data_root, tmp_path):
    folder = str(data_root / "folder")
    metrics = train_run(
        tiny_cfg(tmp_path / "lp", "method=linear_probe", "data.name=imagefolder", f"data.root={folder}")
    )
    clip = load_clip(str(TINY_CONFIG), pretrained=None)
    ds = build_dataset("imagefolder", folder, shots=4, seed=1)
    (tx, ty), (vx, vy), (sx, sy) = (direct_features(clip, items) for items in (ds.train, ds.val, ds.test))
    as_np = lambda t: t.double().numpy()  # noqa: E731
    clf, c = coop_search_by_hand(as_np(tx), ty.numpy(), as_np(vx), vy.numpy())
    assert metrics["C"] == pytest.approx(c, rel=1e-12)
    expected = 100.0 * float(np.mean(clf.predict(as_np(sx)) == sy.numpy()))
    assert metrics["accuracy"] == pytest.approx(expected, abs=1e-9)
    assert metrics["method"] == "linear_probe" and metrics["n_test"] == len(ds.test)
    # the fitted classifier is what the checkpoint holds, and it transfers by class name
    ckpt = torch.load(tmp_path / "lp" / "checkpoint.pt", weights_only=True)
    assert set(ckpt["prompt"]) == {"weight", "bias", "C"} and ckpt["prompt"]["weight"].shape == (4, 32)


def test_eval_targets_on_imagenet_variants(data_root, tmp_path):
    out = tmp_path / "dg"
    cfg = tiny_cfg(
        out, "data.name=imagenet", f"data.root={data_root}", "eval.targets=[imagenetv2,imagenet_a]"
    )
    metrics = train_run(cfg)
    files = sorted(p.name for p in out.glob("eval_*.json"))
    assert files == ["eval_imagenet_a.json", "eval_imagenetv2.json"]
    a = json.loads((out / "eval_imagenet_a.json").read_text())
    v2 = json.loads((out / "eval_imagenetv2.json").read_text())
    assert set(metrics) <= set(a)  # the same fields as metrics.json (plus trained_on, ...)
    assert a["dataset"] == "imagenet_a" and a["trained_on"] == "imagenet"
    assert len(a["per_class_accuracy"]) == 2 and a["n_test"] == 4  # prompts for A's own 2 classes
    assert len(v2["per_class_accuracy"]) == 4 and v2["n_test"] == 8

    # the same prompt scored directly, for A's classes, matches the file
    again = evaluate_checkpoint_targets(out / "checkpoint.pt", ["imagenet_a"])
    assert again["eval_imagenet_a.json"]["accuracy"] == a["accuracy"]

    # a finished run asked for one more target evaluates only that one
    (out / "eval_imagenetv2.json").unlink()
    before = (out / "eval_imagenet_a.json").stat().st_mtime_ns
    train_run(cfg)
    assert (out / "eval_imagenetv2.json").is_file()
    assert (out / "eval_imagenet_a.json").stat().st_mtime_ns == before


def test_csc_and_test_only_refusals(data_root, tmp_path):
    from coop.data import DataError
    from coop.methods import TransferError

    with pytest.raises(DataError, match="imagenet_a is a test-only dataset"):
        train_run(tiny_cfg(tmp_path / "a", "data.name=imagenet_a", f"data.root={data_root}", "data.shots=0"))
    out = tmp_path / "csc"
    cfg = tiny_cfg(out, "data.name=imagenet", f"data.root={data_root}", "prompt.csc=true", "train.epochs=2")
    train_run(cfg)
    with pytest.raises(TransferError, match="class-specific context"):
        evaluate_checkpoint_targets(out / "checkpoint.pt", ["imagenet_a"])


PROTOCOL_RUNS = {  # per method: datasets x shots x seeds
    "few_shot": 11 * 5 * 3,
    "base_to_new": 11 * 3,
    "cross_dataset": 3,
    "domain_generalization": 3,
}


@pytest.mark.parametrize("protocol", sorted(PROTOCOL_RUNS))
def test_protocol_grids_plan(protocol, tmp_path):
    grid = load_grid(  # two methods, one with a per-dataset recipe that yields the grid's keys
        str(REPO / "configs" / "protocols" / f"{protocol}.yaml"), ["method=[coop,linear_probe]"]
    )
    runs = plan(grid, tmp_path, check_data=False)
    assert len(runs) == 2 * PROTOCOL_RUNS[protocol]
    assert len({r.folder for r in runs}) == len(runs)
    cfg = load_config(None, runs[0].overrides)
    assert cfg.model.name == "ViT-B-16" and cfg.model.pretrained == "openai" and cfg.data.shots in (1, 16)
    if protocol == "domain_generalization":
        assert list(cfg.eval.targets) == ["imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r"]
    if protocol == "cross_dataset":
        assert len(cfg.eval.targets) == 10 and "imagenet" not in cfg.eval.targets


@pytest.mark.slow
def test_few_shot_protocol_on_bundled_data(tmp_path, monkeypatch):
    """The README's offline smoke test: the few-shot grid on the bundled textile images, three methods
    (tools/sweep.py in this process, each run a tools/train.py process; tools/collect.py a process)."""
    runs = tmp_path / "runs"
    overrides = [
        "data.name=textile", "data.shots=2", "data.seed=1", f"model.name={TINY_CONFIG}",
        "model.pretrained=none", "train.epochs=2", "train.batch_size=4", "device=cpu",
        "data.num_workers=0", "method=[coop,zeroshot,linear_probe]",
    ]  # fmt: skip
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    monkeypatch.chdir(REPO)  # the runs' working directory, as the README's command gives it
    res = run_tool_in_process(
        REPO / "tools" / "sweep.py",
        ["--grid", "configs/protocols/few_shot.yaml", "--out", runs, "--jobs", "1", *overrides],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list(runs.rglob("metrics.json"))) == 3
    res = subprocess.run(  # the real process of tools/collect.py's tests
        [sys.executable, str(REPO / "tools" / "collect.py"), str(runs), "--table", "datasets"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    table = pd.read_csv(runs / "results_datasets.csv")
    assert len(table) == 3 and "textile" in "".join(table.columns)

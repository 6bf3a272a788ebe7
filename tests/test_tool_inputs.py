"""Every tool works on every run folder it accepts, or refuses it in one line; output places and
the user's own files are checked before any work; killed writes leave nothing behind for good.

Tools run in process (`run_tool_in_process`); where a refusal must come before the work, the work
is replaced by a function that fails the test if it is reached. Tests run as root, for whom a
read-only folder is still writable: a place that cannot be written is a path under a regular file,
or a folder that `os.access` (what `coop.io.require_writable` asks) reports as not writable.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY_CONFIG, make_image_folder, run_tool_in_process, tiny_args

import coop
from coop.config.load import load_config
from coop.train.runner import train_run

TOOLS = REPO / "tools"
ADVICE = "weights_only` set to `False`"  # torch's advice, never repeated by a tool


def tool(name: str, *args):
    return run_tool_in_process(TOOLS / f"{name}.py", [str(a) for a in args])


def one_line_error(res, *words: str) -> str:
    """The tool's stderr, checked to be one `error:` line (exit 2) holding `words`."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr and ADVICE not in res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def never(*args, **kwargs):
    raise AssertionError("the work ran before the refusal")


class Evil:  # a pickled object that weights_only=True refuses
    pass


@pytest.fixture(scope="module")
def trained(image_folder, tmp_path_factory):
    """A finished tiny CoOp run whose model.name was given as a path relative to the repository."""
    out = tmp_path_factory.mktemp("trained") / "run"
    relative = TINY_CONFIG.relative_to(REPO)
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        train_run(
            load_config(None, tiny_args(image_folder, out, **{"train.epochs": 2, "model.name": relative}))
        )
    finally:
        os.chdir(cwd)
    return SimpleNamespace(run=out, folder=image_folder, relative=str(relative))


# ---------------------------------------------------------------- model files by absolute path


def test_model_config_given_relative_is_recorded_absolute(trained, tmp_path, monkeypatch):
    from coop.interop import export_run, read_export

    config = (trained.run / "config.yaml").read_text()
    assert f"name: {TINY_CONFIG}" in config and trained.relative not in config.replace(str(TINY_CONFIG), "")
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative path no longer resolves
    _, card = read_export(export_run(trained.run, tmp_path / "p.safetensors"))
    assert card["model.name"] == str(TINY_CONFIG) == card["config"]["model"]["name"]
    assert coop.load_classifier(tmp_path / "p.safetensors").classnames == [
        "blue_thing",
        "green_thing",
        "red_thing",
    ]


def test_a_run_saved_with_a_relative_model_path_resumes(trained, tmp_path, monkeypatch):
    """A folder written before model files were made absolute is the same run, not another config."""
    from coop.train.runner import check_same_config

    old = torch.load(trained.run / "checkpoint.pt", weights_only=True)["config"]
    old["model"]["name"] = trained.relative
    monkeypatch.chdir(REPO)
    new = json.loads(json.dumps(old))
    new["model"]["name"] = str(TINY_CONFIG)
    check_same_config(old, new, tmp_path)  # no RunError


# ---------------------------------------------------------------- eval, export, predict, collect


def test_eval_takes_the_run_folder(trained, tmp_path):
    out = tmp_path / "m.json"
    res = tool("eval", trained.run, "--out", out)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["checkpoint"] == str(trained.run / "checkpoint.pt")
    res = tool("eval", trained.run, "--checkpoint", trained.run / "checkpoint.pt")
    assert res.returncode == 2 and "give one run" in res.stderr


@pytest.mark.parametrize("place", ["under_a_file", "not_writable"])
def test_unwritable_output_is_refused_before_any_work(trained, tmp_path, monkeypatch, place):
    """eval, export, predict, train and import_checkpoint: one line naming the place, nothing computed."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    if place == "under_a_file":
        where, words = blocker / "sub", ("is a file, not a folder",)
    else:  # what a read-only folder (or file system) looks like to os.access
        where, words = tmp_path / "ro", ("is not writable",)
        where.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != where and real(p, mode, **kw))
    monkeypatch.setattr("coop.train.evaluation.evaluate_on", never)
    monkeypatch.setattr("coop.interop.load_classifier", never)
    monkeypatch.setattr("coop.interop.export.load_checkpoint", never)
    monkeypatch.setattr("coop.interop.importer.read_state_dict", never)
    monkeypatch.setattr("coop.train.runner.setup", never)
    one_line_error(tool("eval", trained.run, "--out", where / "m.json"), str(where), *words)
    one_line_error(tool("export", trained.run, "--out", where / "p.safetensors"), *words)
    one_line_error(tool("predict", trained.run, trained.folder / "test", "--out", where / "p.csv"), *words)
    one_line_error(tool("train", *tiny_args(trained.folder, where / "run")), *words)
    res = tool("import_checkpoint", "--from", "coop", tmp_path / "x.pth", "--out", where / "imp", "--no-eval")
    one_line_error(res, *words)
    monkeypatch.setattr("coop.results.tables.load_runs", never)
    one_line_error(tool("collect", trained.run.parent, "--out", where / "tables"), *words)


def test_a_folder_of_the_users_own_files_is_never_overwritten(trained, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own\n")
    monkeypatch.setattr("coop.train.runner.setup", never)
    monkeypatch.setattr("coop.interop.importer.read_state_dict", never)
    one_line_error(tool("train", *tiny_args(trained.folder, mine)), str(mine), "not a coop run folder")
    res = tool("import_checkpoint", "--from", "coop", tmp_path / "x.pth", "--out", mine, "--no-eval")
    one_line_error(res, "not a coop run folder")
    from coop.train.lock import NotARunFolderError

    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun rank k > 0 refuses too, before its log.rank<k>.txt
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(NotARunFolderError):
        train_run(load_config(None, tiny_args(trained.folder, mine)))
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml"]
    assert (mine / "config.yaml").read_text() == "my: own\n"


def test_run_folders_of_ours_and_what_a_sweep_writes_first_are_accepted(tmp_path):
    from coop.train.lock import is_run_folder

    (tmp_path / "swept").mkdir()
    (tmp_path / "swept" / "sweep.log").write_text("=== sweep\n")
    (tmp_path / "swept" / "log.rank1.txt").write_text("")  # a torchrun rank k > 0, before rank 0's lock
    assert is_run_folder(tmp_path / "new") and is_run_folder(tmp_path / "swept")
    (tmp_path / "swept" / "notes.txt").write_text("")
    assert not is_run_folder(tmp_path / "swept")
    (tmp_path / "swept" / ".lock").write_text("1\n")
    assert is_run_folder(tmp_path / "swept")
    old = tmp_path / "before_locks"  # a run folder written before runs left .lock behind
    old.mkdir()
    for name in ("config.yaml", "log.txt"):
        (old / name).write_text("")
    assert not is_run_folder(old)
    (old / "checkpoint.pt").write_bytes(b"")
    assert is_run_folder(old)


def test_a_killed_writes_temporary_file_is_removed_on_the_next_start(tmp_path):
    from coop.train.lock import run_lock

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").write_text("")
    stale = [
        folder / ".checkpoint.pt.k3_x9a2q.tmp",
        folder / "clients" / "client0" / ".personal_round2.pt.abcdefgh.tmp",
    ]
    stale[1].parent.mkdir(parents=True)
    kept = [folder / "notes.tmp", folder / ".hidden.tmp", folder / "checkpoint.pt"]
    for p in stale + kept:
        p.write_bytes(b"half")
    with run_lock(folder):
        assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)


def test_refused_pickles_name_the_global_and_never_advise_turning_the_safety_off(trained, tmp_path):
    from coop.model.errors import ModelError
    from coop.model.weights import load_clip
    from coop.train.checkpoint import CheckpointError
    from coop.train.runner import read_resume_checkpoint

    evil = tmp_path / "evil" / "checkpoint.pt"
    evil.parent.mkdir()
    ckpt = torch.load(trained.run / "checkpoint.pt", weights_only=True)
    torch.save({**ckpt, "extra": Evil()}, evil)
    wanted = f"it asks for {__name__}.Evil"
    one_line_error(tool("eval", evil.parent), str(evil), wanted, "refused")
    one_line_error(tool("export", evil.parent, "--out", tmp_path / "p.safetensors"), wanted)
    one_line_error(tool("predict", evil.parent, trained.folder / "test", "--out", tmp_path / "p.csv"), wanted)
    with pytest.raises(CheckpointError, match=f"cannot resume: .*{wanted}") as e:
        read_resume_checkpoint(evil)
    assert ADVICE not in str(e.value)
    weights = tmp_path / "w.pt"
    torch.save({"visual.proj": Evil()}, weights)
    with pytest.raises(ModelError, match=f"{weights} needs arbitrary unpickling .*{wanted}") as e:
        load_clip(str(TINY_CONFIG), pretrained=str(weights))
    assert ADVICE not in str(e.value)


def test_garbage_weights_and_incomplete_cards_are_one_line_naming_the_file(trained, tmp_path):
    from safetensors.torch import save_file

    from coop.interop import export_run

    garbage = tmp_path / "w.safetensors"
    garbage.write_bytes(os.urandom(64))
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(100)}, str(good))
    truncated = tmp_path / "t.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    for weights in (garbage, truncated):
        res = tool(
            "train",
            *tiny_args(trained.folder, tmp_path / f"run_{weights.stem}", **{"model.pretrained": weights}),
        )
        one_line_error(res, str(weights), "as safetensors")

    from safetensors import safe_open

    exported = export_run(trained.run, tmp_path / "p.safetensors")
    with safe_open(str(exported), framework="pt") as f:
        card, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    del card["classnames"]
    save_file(tensors, str(tmp_path / "nocls.safetensors"), metadata=card)
    res = tool(
        "predict", tmp_path / "nocls.safetensors", trained.folder / "test", "--out", tmp_path / "p.csv"
    )
    one_line_error(res, str(tmp_path / "nocls.safetensors"), "lacks classnames")


# ---------------------------------------------------------------- federated runs


@pytest.fixture(scope="module")
def federated(tmp_path_factory):
    """Finished PromptFL and FedOTP runs (2 clients, 2 rounds) through the in-process grid."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_personal_fl import BASE, LocalGrid, run_inprocess

    data = make_image_folder(
        tmp_path_factory.mktemp("fl_data"), classes=("r", "g", "b", "y"), n_train=4, n_test=2
    )
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    try:
        runs = {}
        for method in ("promptfl", "fedotp"):
            folder = tmp_path_factory.mktemp(method) / "run"
            overrides = [*BASE, f"data.root={data}", f"fl.method={method}", "fl.rounds=2", "prompt.n_ctx=2"]
            runs[method] = (folder, run_inprocess(folder, overrides, LocalGrid(2)))
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    return SimpleNamespace(runs=runs, data=data)


def test_eval_evaluates_a_promptfl_run_and_refuses_other_federated_runs_in_one_line(federated, tmp_path):
    folder, metrics = federated.runs["promptfl"]
    out = tmp_path / "m.json"
    res = tool("eval", folder, "--out", out)
    assert res.returncode == 0, res.stderr
    evaluated = json.loads(out.read_text())
    assert evaluated["accuracy"] == pytest.approx(metrics["accuracy"], abs=1e-3)  # the global prompt
    assert evaluated["final_train_loss"] is not None
    one_line_error(tool("eval", federated.runs["fedotp"][0]), "fl.method=fedotp", "metrics.json")


def test_a_federated_runs_global_and_client_models_export_and_predict(federated, tmp_path):
    from coop.interop import read_export
    from coop.interop.federated import run_model

    folder, metrics = federated.runs["fedotp"]
    res = tool("export", folder, "--out", tmp_path / "global.safetensors")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["model"] == "global" and json.loads(res.stdout)["tensors"] == {
        "global.ctx": [2, 64]
    }
    res = tool("export", folder, "--out", tmp_path / "c1.safetensors", "--client", 1)
    assert res.returncode == 0, res.stderr
    tensors, card = read_export(tmp_path / "c1.safetensors")
    assert (
        card["federated"] == "fedotp"
        and card["model"] == "client 1"
        and set(tensors) == {"global.ctx", "local.ctx"}
    )

    # the global model's accuracy is the run's `accuracy`: the global prompt alone on the test split
    test = federated.data / "test"
    res = tool(
        "predict",
        tmp_path / "global.safetensors",
        test,
        "--out",
        tmp_path / "g.csv",
        "--topk",
        1,
        "--device",
        "cpu",
    )
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader((tmp_path / "g.csv").open()))
    hits = [r["path"].split("/")[0] == r["class_1"] for r in rows]
    assert 100.0 * sum(hits) / len(hits) == pytest.approx(metrics["accuracy"], abs=1e-3)

    # client 1's model: the checkpoint's global part and that client's own part, as its state file holds
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    rnd = ckpt["strategy"]["personal_round"][1]
    own = torch.load(folder / f"clients/client1/personal_round{rnd}.pt", weights_only=True)["tensors"]
    assert torch.equal(tensors["local.ctx"], own["local.ctx"]) and torch.equal(
        tensors["global.ctx"], ckpt["prompt"]["global.ctx"]
    )
    clf = coop.load_classifier(folder, client=1)
    assert not clf.method.global_only and torch.equal(
        clf.method.local_prompt.prompt_learner.ctx, own["local.ctx"]
    )
    assert run_model(folder, ckpt)[1] == "global"

    one_line_error(tool("export", folder, "--out", tmp_path / "x.safetensors", "--client", 2), "clients 0..1")
    promptfl = federated.runs["promptfl"][0]
    one_line_error(
        tool("export", promptfl, "--out", tmp_path / "x.safetensors", "--client", 0), "fl.method=promptfl"
    )
    (folder / f"clients/client0/personal_round{ckpt['strategy']['personal_round'][0]}.pt").rename(
        tmp_path / "moved.pt"
    )
    one_line_error(tool("export", folder, "--out", tmp_path / "x.safetensors", "--client", 0), "state-dir")


def test_collect_personal_table_of_runs_without_personal_metrics_is_one_line(federated, tmp_path):
    import shutil

    shutil.copytree(federated.runs["promptfl"][0], tmp_path / "runs" / "promptfl")
    res = tool("collect", tmp_path / "runs", "--table", "personal")
    one_line_error(res, "no personal metrics")


# ---------------------------------------------------------------- torchrun


def test_one_line_errors_come_from_rank_0_alone(monkeypatch, capsys):
    """Under torchrun every rank meets the same bad input: rank 0 prints it, the others exit silently."""
    import sys

    sys.path.insert(0, str(TOOLS))
    import _cli

    from coop.config.checks import ConfigError

    message = "train.batch_size=4: a global batch of 4 images cannot be split across 5 ranks"

    def main():
        raise ConfigError(message)

    for rank, printed in (("1", []), ("0", [f"error: {message}"])):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            _cli.run_cli(main)
        assert info.value.code == 2 and capsys.readouterr().err.splitlines() == printed


def test_a_batch_that_does_not_split_is_refused_before_the_model_is_built(
    image_folder, tmp_path, monkeypatch
):
    from coop.config.checks import ConfigError
    from coop.train.engine import setup

    monkeypatch.setenv("WORLD_SIZE", "5")
    monkeypatch.setattr("coop.train.engine.distributed.init", lambda device, backend="auto": device)
    monkeypatch.setattr("coop.train.engine.load_clip", never)
    cfg = load_config(None, tiny_args(image_folder, tmp_path / "run"))  # 3 classes x 4 shots, batch 4
    with pytest.raises(
        ConfigError, match="train.batch_size=4: a global batch of 4 images cannot be split across 5"
    ):
        setup(cfg)

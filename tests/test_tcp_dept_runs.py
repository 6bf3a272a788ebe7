"""TCP and DePT runs end to end on cached features: base-to-new training, a run interrupted (or
killed with SIGKILL) and resumed ends bit-identical to an uninterrupted one, and the new classes
are scored as each method defines (TCP rebuilds its prompts and teacher, DePT drops its head)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import REPO, TINY_CONFIG, interrupted_at, kill_at_first_checkpoint
from test_protocols import data_root, tiny_cfg  # noqa: F401  (data_root is a fixture)

from coop.results.tables import load_runs
from coop.train.runner import train_run

CASES = {
    "tcp": ["method=tcp", "tcp.layer=1", "train.optimizer=adam", "train.eps=1e-3"],
    "coop+dept": ["method=coop", "dept.enabled=true", "prompt.n_ctx=2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_base_to_new_run_resumes_bit_identical(data_root, tmp_path, case):  # noqa: F811
    args = [*CASES[case], "data.name=imagenet", f"data.root={data_root}", "data.subsample_classes=base"]
    whole = tmp_path / "whole"
    train_run(tiny_cfg(whole, *args))
    resumed = tmp_path / "resumed"
    with interrupted_at(2), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(resumed, *args))
    assert torch.load(resumed / "checkpoint.pt", weights_only=True)["epoch"] == 2
    train_run(tiny_cfg(resumed, *args))
    a = torch.load(whole / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert set(a["prompt"]) == set(b["prompt"]) and len(a["prompt"]) >= 5
    for name, t in a["prompt"].items():
        assert torch.equal(t, b["prompt"][name]), name
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]
    base = json.loads((whole / "metrics.json").read_text())
    new = json.loads((whole / "eval_imagenet_new.json").read_text())
    assert len(base["per_class_accuracy"]) == len(new["per_class_accuracy"]) == 2
    assert set(load_runs(tmp_path)["method"]) == {case}  # DePT runs collect as their own row
    if case == "coop+dept":
        assert base["dept_head"] is True and new["dept_head"] is False  # the head is for base classes only
        assert len(a["optimizer"]["param_groups"]) == 2  # the head and FiLM at 6.5x the prompt's rate
        lrs = [g["lr"] for g in a["optimizer"]["param_groups"]]
        assert lrs[1] == pytest.approx(6.5 * lrs[0])
    else:
        assert new["tcp_layer"] == 1 and a["optimizer"]["param_groups"][0]["eps"] == 1e-3


def test_dept_resume_after_sigkill_is_exact(data_root, tmp_path):  # noqa: F811
    """kill -9 in the middle of a DePT run (two parameter groups in the optimizer state), then
    resume: the same tensors and losses as an uninterrupted run."""
    args = [*CASES["coop+dept"], "data.name=imagenet", f"data.root={data_root}", "train.epochs=10"]
    ref = tmp_path / "uninterrupted"
    train_run(tiny_cfg(ref, *args))
    out = tmp_path / "killed"
    tiny = [f"model.name={TINY_CONFIG}", "model.pretrained=none", "data.num_workers=0", "data.shots=4"]
    tiny += ["train.batch_size=4", "train.lr=0.05", "device=cpu", f"output_dir={out}"]  # as tiny_cfg
    kill_at_first_checkpoint([sys.executable, str(REPO / "tools" / "train.py"), *tiny, *args], out)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] < 10, "the kill came too late"
    train_run(tiny_cfg(out, *args))
    a = torch.load(ref / "checkpoint.pt", weights_only=True)
    b = torch.load(out / "checkpoint.pt", weights_only=True)
    for name, t in a["prompt"].items():
        assert torch.equal(t, b["prompt"][name]), name
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]

"""One run across ranks (coop.distributed, gloo on CPU) equals the one-process run.

Two-rank runs are forked from this process (`torch.multiprocessing`, start method fork: no
seconds of imports per rank) with torchrun's environment variables set, and call the same
`train_run` that `torchrun tools/train.py` calls. Every rank records what its method's `loss`
receives and the prompts it holds at every step; the one-process runs record the same in-process.
The global batch (5) does not split evenly: shares of 3 and 2 images.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import REPO, make_image_folder, run_tool_in_process, tiny_args

import coop.train.runner
from coop import distributed
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.train.engine import rank_share
from coop.train.sweep import Run, slot_gpus, train_command
from coop.train.sweep_submitit import submitit_parameters

EPOCHS, BATCH = 2, 5  # 12 training images: 2 steps of 5 per epoch, shares of 3 and 2 on 2 ranks
RUNS = {
    # a feature method on cached augmented views, and a pixel method through its prompted tower
    "coop": {"method": "coop", "train.aug_views": 2},
    "maple": {"method": "maple", "prompt.depth": 2, "vision.depth": 2},
    # a closed-form fit on gathered train and val features (its data gets a val split)
    "linear_probe": {"method": "linear_probe"},
    # a fit (the cache of augmented views), SGD with a last, smaller batch, then tuning on val
    "tip_adapter_f": {"method": "tip_adapter_f", "tip.augment_epochs": 2, "tip.search_step": [4, 3]},
    # two stages (4 steps: LayerNorms for 2, then the head): only the stage's tensors are reduced;
    # at its own lr (Adam at 0.05 moves a LayerNorm weight whose gradient is all rounding by 2e-6)
    "2sfs": {"method": "2sfs", "train.drop_last": True, "train.lr": 2e-4},
}
WITH_VAL = ("linear_probe", "tip_adapter_f")
SGD = ["coop", "maple", "2sfs"]
KILL_AT = 3  # rank 1 is killed at its 4th step: mid-way through epoch 2, after epoch 1's checkpoint


def overrides(folder, out, name: str) -> list[str]:
    extra = {"train.epochs": EPOCHS, "train.batch_size": BATCH, "train.warmup_epochs": 0}
    return tiny_args(folder, out, **extra, **{"train.eval_batch_size": 5}, **RUNS[name])


@contextmanager
def recording(records: list, kill_at: int | None = None):
    """Record (inputs, labels, prompts before the step) of every `Method.loss` call of the runs
    started inside; with `kill_at`, SIGKILL this process at that call."""
    real_setup = coop.train.runner.setup

    def setup(cfg, *args, **kwargs):
        s = real_setup(cfg, *args, **kwargs)
        loss = s.method.loss

        def spy(x, y):
            if len(records) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            prompts = {k: v.detach().clone() for k, v in s.method.learnable().items()}
            records.append((x.detach().clone(), y.clone(), prompts))
            return loss(x, y)

        s.method.loss = spy
        return s

    coop.train.runner.setup = setup
    try:
        yield
    finally:
        coop.train.runner.setup = real_setup


def run_job(args: list[str], cache: Path, record: Path, kill_at: int | None = None) -> None:
    """`train_run` with its own feature cache, its `loss` calls recorded into `record`."""
    records: list = []
    old, os.environ["COOP_CACHE_DIR"] = os.environ.get("COOP_CACHE_DIR"), str(cache)
    try:
        with recording(records, kill_at):
            coop.train.runner.train_run(load_config(None, args))
    finally:
        os.environ.pop("COOP_CACHE_DIR") if old is None else os.environ.update(COOP_CACHE_DIR=old)
    torch.save(records, record)


def _rank(rank: int, world: int, port: int, jobs: list, kill_rank: int | None) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    logging.getLogger("coop").setLevel(logging.INFO)  # as the tools log: rank 1's file must filter it
    try:
        for args, cache, record in jobs:
            run_job(
                args, cache, record.with_suffix(f".rank{rank}.pt"), KILL_AT if rank == kill_rank else None
            )
    finally:
        distributed.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(jobs: list, world: int = 2, kill_rank: int | None = None) -> None:
    """Run `jobs` (args, cache dir, record path) one after the other on `world` forked ranks."""
    mp.start_processes(
        _rank, args=(world, free_port(), jobs, kill_rank), nprocs=world, join=True, start_method="fork"
    )


@pytest.fixture(scope="module")
def runs(image_folder, tmp_path_factory):
    """Each method on 1 rank (in-process) and on 2 ranks; the coop run also killed and resumed."""
    root = tmp_path_factory.mktemp("distributed")
    with_val = make_image_folder(root / "with_val", n_test=2)
    shutil.copytree(with_val / "train", with_val / "val")
    data = {name: with_val if name in WITH_VAL else image_folder for name in RUNS}
    out = {}
    for name in RUNS:
        run_job(overrides(data[name], root / f"{name}1", name), root / "cache1", root / f"{name}1.pt")
        out[name, 1] = root / f"{name}1"
    spawn([(overrides(data[n], root / f"{n}2", n), root / "cache2", root / f"{n}2.pt") for n in RUNS])
    for name in RUNS:
        out[name, 2] = root / f"{name}2"
    killed = [(overrides(image_folder, root / "killed", "coop"), root / "cache3", root / "killed.pt")]
    with pytest.raises(mp.ProcessExitedException, match="signal SIGKILL"):
        spawn(killed, kill_rank=1)
    out["killed_epoch"] = torch.load(root / "killed" / "checkpoint.pt", weights_only=True)["epoch"]
    spawn(killed)
    out["killed"] = root / "killed"
    out["root"] = root
    return out


def records(folder: Path, rank: int | None = None) -> list:
    suffix = "" if rank is None else f".rank{rank}"
    return torch.load(folder.with_name(folder.name + suffix + ".pt"), weights_only=True)


def ckpt(folder: Path) -> dict:
    return torch.load(folder / "checkpoint.pt", weights_only=True)


def metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


@pytest.mark.parametrize("name", SGD)
def test_two_ranks_train_on_the_one_process_batches(runs, name):
    """Rank 0's share then rank 1's is the one-process batch: the same images in the same order,
    the same augmentation (pixels) or cached view (features), at every step."""
    one, ranks = records(runs[name, 1]), [records(runs[name, 2], r) for r in (0, 1)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) == EPOCHS * (12 // BATCH)
    for step, (x, y, _) in enumerate(one):
        (x0, y0, _), (x1, y1, _) = ranks[0][step], ranks[1][step]
        assert (len(y0), len(y1)) == (3, 2)  # an odd global batch: the first rank takes one more
        assert torch.equal(torch.cat([y0, y1]), y) and torch.equal(torch.cat([x0, x1]), x)


@pytest.mark.parametrize("name", SGD)
def test_two_ranks_end_with_the_one_process_prompts_and_metrics(runs, name):
    one, two = ckpt(runs[name, 1]), ckpt(runs[name, 2])
    assert set(one["prompt"]) == set(two["prompt"])
    for key, tensor in one["prompt"].items():
        assert not torch.equal(tensor, records(runs[name, 1])[0][2][key])  # training moved it
        torch.testing.assert_close(two["prompt"][key], tensor, rtol=0, atol=1e-6)
    for step, (_, _, prompts) in enumerate(records(runs[name, 1])):
        for key, tensor in prompts.items():
            torch.testing.assert_close(records(runs[name, 2], 0)[step][2][key], tensor, rtol=0, atol=1e-6)
    m1, m2 = metrics(runs[name, 1]), metrics(runs[name, 2])
    # metrics.json rounds to 6 decimals: two losses within 1e-6 may round 1e-6 apart
    assert m2.pop("final_train_loss") == pytest.approx(m1.pop("final_train_loss"), abs=1.5e-6)
    assert m1 == m2  # accuracy, macro-F1, per-class accuracy: the sharded evaluation gathers the same
    assert [r["train_acc"] for r in one["history"]] == [r["train_acc"] for r in two["history"]]


@pytest.mark.parametrize("name", SGD)
def test_every_rank_holds_the_same_prompts_after_every_step(runs, name):
    rank0, rank1 = (records(runs[name, 2], r) for r in (0, 1))
    for (_, _, p0), (_, _, p1) in zip(rank0[1:], rank1[1:], strict=True):
        assert all(torch.equal(p0[k], p1[k]) for k in p0)


def test_two_ranks_fit_the_linear_probe_as_one_process(runs):
    one, two = ckpt(runs["linear_probe", 1]), ckpt(runs["linear_probe", 2])
    assert all(torch.equal(one["prompt"][k], two["prompt"][k]) for k in ("weight", "bias", "C"))
    assert metrics(runs["linear_probe", 1]) == metrics(runs["linear_probe", 2])


def test_two_ranks_fit_train_and_tune_tip_adapter_f_as_one_process(runs):
    """Tip-Adapter-F's cache (fit), its AdamW steps over shares of 3+2, 3+2 and 1+1 images, and its
    alpha/beta search on val end where one process ends."""
    one, two = ckpt(runs["tip_adapter_f", 1]), ckpt(runs["tip_adapter_f", 2])
    for key, tensor in one["prompt"].items():
        torch.testing.assert_close(two["prompt"][key], tensor, rtol=0, atol=1e-6)
    m1, m2 = metrics(runs["tip_adapter_f", 1]), metrics(runs["tip_adapter_f", 2])
    # metrics.json rounds to 6 decimals: two losses within 1e-6 may round 1e-6 apart
    assert m2.pop("final_train_loss") == pytest.approx(m1.pop("final_train_loss"), abs=1.5e-6)
    assert m1 == m2 and "tip_alpha" in m1


def test_only_rank_0_writes_the_run_folder(runs):
    one, two = runs["coop", 1], runs["coop", 2]
    assert sorted(p.name for p in two.iterdir()) == sorted(
        [*(p.name for p in one.iterdir()), "log.rank1.txt"]
    )
    assert "test accuracy" in (two / "log.txt").read_text()
    assert " INFO " not in (two / "log.rank1.txt").read_text()  # warnings only


def test_sharded_feature_cache_equals_the_one_process_cache(runs):
    """Train views (augmented) and test features, encoded in whole batches by two ranks, gathered
    and written by rank 0: the same files as one process writes."""
    files = {
        n: {p.name: torch.load(p, weights_only=True) for p in (runs["root"] / n / "features").glob("*.pt")}
        for n in ("cache1", "cache2")
    }
    # coop's views and test (maple scores through its prompted tower: nothing cached); the linear
    # probe's train, val and test (Tip-Adapter-F reads the same val and test); Tip-Adapter-F's views
    assert len(files["cache1"]) == 6 and files["cache1"].keys() == files["cache2"].keys()
    for key, one in files["cache1"].items():
        two = files["cache2"][key]
        assert all(torch.equal(one[k], two[k]) for k in ("features", "labels", "index"))


def test_kill_of_rank_1_then_resume_equals_the_uninterrupted_run(runs):
    assert runs["killed_epoch"] == 1  # rank 1 died mid-way through epoch 2; epoch 1's checkpoint was kept
    a, b = ckpt(runs["coop", 2]), ckpt(runs["killed"])
    assert all(torch.equal(a["prompt"][k], b["prompt"][k]) for k in a["prompt"])
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]
    assert metrics(runs["coop", 2]) == metrics(runs["killed"])


def test_shares_are_contiguous_and_differ_by_at_most_one():
    sizes = [distributed.share(5, distributed.World(r, 4)) for r in range(4)]
    assert sizes == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_bad_distributed_configurations_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        ConfigError, match=r"train.batch_size=3: a global batch of 3 images cannot be split across 4"
    ):
        rank_share(torch.arange(3), 3)
    with pytest.raises(ConfigError, match="train.dist_backend=nccl needs CUDA, and this run is on cpu"):
        distributed.init(torch.device("cpu"), "nccl")
    with pytest.raises(ConfigError, match="train.dist_backend"):
        load_config(None, ["train.dist_backend=mpi"])


def test_sweep_runs_a_multi_gpu_point_as_one_torchrun(runs, image_folder, tmp_path):
    """`--gpus-per-run 2` launches `torchrun --nproc-per-node=2 tools/train.py` (here on 2 CPU
    ranks, for real): one summary line, and the metrics of the same run forked above."""
    folder = tmp_path / "run"
    run = Run(
        [a for a in overrides(image_folder, folder, "coop") if not a.startswith("output_dir=")], {}, folder
    )
    cmd = train_command(run, REPO / "tools" / "train.py", None, gpus_per_run=2)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "COOP_CACHE_DIR": str(tmp_path / "cache")}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(res.stdout.splitlines()) == 1 and json.loads(res.stdout)["output_dir"] == str(folder)
    assert metrics(folder) == metrics(runs["coop", 2])
    args = argparse.Namespace(
        executor="slurm",
        gpus_per_run=4,
        gpus_per_node=None,
        timeout_min=60,
        cpus_per_task=None,
        partition="gpu",
        jobs=None,
    )
    params = submitit_parameters(args, n_runs=3)
    assert params["gpus_per_node"] == 4 and params["tasks_per_node"] == 1  # torchrun starts the 4 ranks
    assert [slot_gpus(list("0123"), slot, 2) for slot in (0, 1)] == ["0,1", "2,3"]


def test_federated_runs_refuse_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = run_tool_in_process(REPO / "tools" / "federated.py", [])
    assert res.returncode == 2 and "launch it without torchrun" in res.stderr


def _gradient_rank(rank: int, world: int, port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.init(torch.device("cpu"))
    x = torch.arange(10.0).view(5, 2)  # a global batch of 5 items, shared 3 / 0 / 2
    mine = x[[0, 1, 2]] if rank == 0 else x[:0] if rank == 1 else x[[3, 4]]
    w, unused = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
    if len(mine):
        ((mine @ w) ** 2).mean().backward()  # the mean over this rank's share only
    total = distributed.average_gradients([w, unused], len(mine))
    torch.save({"total": total, "grad": w.grad, "unused": unused.grad}, out / f"rank{rank}.pt")
    distributed.close()


def test_gradients_are_the_global_batch_mean_with_unequal_and_empty_shares(tmp_path):
    mp.start_processes(_gradient_rank, args=(3, free_port(), tmp_path), nprocs=3, start_method="fork")
    x = torch.arange(10.0).view(5, 2)
    expected = (2 * (x @ torch.ones(2))[:, None] * x).mean(0)  # d/dw of mean((x w)^2) over all 5
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["total"] == 5 and torch.allclose(got["grad"], expected, rtol=1e-6)
        assert torch.equal(got["unused"], torch.zeros(1))  # no gradient anywhere: zero on every rank

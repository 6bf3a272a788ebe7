"""Benchmark one run across ranks: epoch time of 1 rank vs N ranks (torchrun, coop.distributed).

    python tools/bench/bench_ddp.py [--ranks 2] [--device cpu|cuda] [--model ViT-B-16] [--shots 16]
    python tools/bench/bench_ddp.py --model configs/models/coop-tiny.json --depth 2 --shots 4   # seconds

For each rank count (1, then `--ranks`) the script starts `torchrun --standalone
--nproc-per-node=K` on itself; every rank builds the same run (bundled textile images, random
weights: offline) and times `coop.train.engine.train_one_epoch` between barriers, so an epoch's time is
the slowest rank's. Two workloads:
  * CoOp on cached features (`train.aug_views=1`): a step is a text-tower pass over the prompts
    and one all-reduce of the context gradients; the one-off sharded feature encoding is timed too;
  * MaPLe on pixels (`train.aug_views=0`): every step loads, augments and encodes its share of
    the batch through the prompted image tower.
It prints a table of epoch times, the speed-up over one rank, and the work per step. On a CPU,
ranks compete for the same cores (each runs one thread): 2 gloo ranks then measure the overhead
of the process group, not a speed-up. With `--device cuda` each rank takes its own GPU (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from _cli import setup_logging  # noqa: E402

WORKLOADS = {
    "coop (cached features)": ["method=coop", "train.aug_views=1"],
    "maple (pixels)": ["method=maple", "train.aug_views=0"],
}


def worker(args) -> None:
    """One rank: time `--epochs` epochs (after `--warmup` untimed ones) of each workload."""
    import logging

    import torch

    from coop import distributed
    from coop.config.load import load_config
    from coop.train.engine import setup, train_one_epoch
    from coop.train.run_features import training_features
    from coop.train.schedule import build_optimizer

    logging.getLogger("coop").setLevel(logging.WARNING)
    rows = []
    for name, keys in WORKLOADS.items():
        overrides = [
            f"model.name={args.model}",
            "model.pretrained=none",
            "data.name=textile",
            f"data.shots={args.shots}",
            f"data.num_workers={args.workers}",
            f"train.batch_size={args.batch_size}",
            "train.cache_features=false",
            f"device={args.device}",
            *keys,
            *([f"prompt.depth={args.depth}", f"vision.depth={args.depth}"] if args.depth else []),
        ]
        s = setup(load_config(None, overrides))
        optimizer = build_optimizer(s.method.param_groups(), s.cfg.train)
        distributed.barrier()
        t0 = time.perf_counter()
        feats = training_features(s)
        encode = time.perf_counter() - t0
        times = []
        for epoch in range(args.warmup + args.epochs):
            distributed.barrier()
            t0 = time.perf_counter()
            train_one_epoch(s, optimizer, epoch, feats)
            if s.device.type == "cuda":
                torch.cuda.synchronize(s.device)
            distributed.barrier()
            times.append(time.perf_counter() - t0)
        rows.append(
            {
                "workload": name,
                "ranks": distributed.world().size,
                "epoch_s": statistics.median(times[args.warmup :]),
                "encode_s": encode if feats is not None else None,
                "images": len(s.dataset.train),
            }
        )
    if distributed.is_main():
        print("RESULT " + json.dumps(rows), flush=True)
    distributed.close()


def launch(args, argv: list[str], ranks: int) -> list[dict]:
    """Run this script's worker (with `argv`) under torchrun with `ranks` processes; rank 0's rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run([*cmd, __file__, "--worker", *argv], capture_output=True, text=True, env=env)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"error: {ranks} ranks failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def print_table(rows: list[dict]) -> None:
    base = {r["workload"]: r["epoch_s"] for r in rows if r["ranks"] == 1}
    print("| workload | ranks | epoch (s) | speed-up | one-off feature encoding (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        encode = "" if r["encode_s"] is None else f"{r['encode_s']:.3f}"
        speedup = base[r["workload"]] / r["epoch_s"]
        print(f"| {r['workload']} | {r['ranks']} | {r['epoch_s']:.3f} | {speedup:.2f}x | {encode} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="the N of 1 vs N ranks")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (one GPU per rank, NCCL)")
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--shots", type=int, default=16, help="textile shots per class (3 classes)")
    ap.add_argument("--batch-size", type=int, default=8, help="the global batch")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    ap.add_argument("--workers", type=int, default=0, help="data.num_workers per rank")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--depth", type=int, help="MaPLe's prompt depth (default: its recipe's 9; tiny model: 2)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    setup_logging()
    if args.ranks < 2:
        raise SystemExit("error: --ranks must be >= 2")
    rows = launch(args, argv, 1) + launch(args, argv, args.ranks)
    rows.sort(key=lambda r: (list(WORKLOADS).index(r["workload"]), r["ranks"]))
    print(
        f"{args.model} (random weights) on {args.device}, textile {args.shots} shots, global batch "
        f"{args.batch_size}, {args.threads} thread(s) per rank, median of {args.epochs} epoch(s)"
    )
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

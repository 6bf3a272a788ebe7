"""Benchmark torch's CPU threads on an idle machine and beside one busy process: which OpenMP
settings the tools start with (`tools/_cli.py`, docs/performance.md).

    python tools/bench/bench_threads.py [--epochs 10] [--repeats 5] [--classes 100] [--model ViT-B-16]

For each setting of OpenMP's environment (torch's defaults; `OMP_WAIT_POLICY=PASSIVE`, the tools'
default; `OMP_NUM_THREADS=1`), a fresh process (OpenMP reads its environment once, when torch
loads it) times, after a warm-up:

- the demo's training epoch on cached features (`configs/demo.yaml`, ViT-B-16 with random
  weights, 16 shots of the 3 textile classes, 4 views: random features of the cache's shape
  stand in for the encoded images, which the epoch only indexes);
- the text step: forward and backward of `PromptClassifier.text_features()` for `--classes`
  ImageNet class names (CoOp, 4 context tokens at the end), bench_text's step.

Each setting runs twice: alone, then beside one busy-looping process that this benchmark starts
(and stops). Printed: the median times, and the ratios busy / idle and setting / torch's
defaults. A machine that other jobs already load gives ratios of that load, not of an idle one.
Small settings (`--epochs 2 --repeats 2 --classes 10`) run in about a minute on 2 cores.
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
from _cli import run_cli  # noqa: E402 - OpenMP's settings before torch (this process runs none)

REPO = Path(__file__).resolve().parents[2]
# name -> the OpenMP environment of the measuring process (COOP_OMP_DEFAULTS=0: nothing else added)
SETTINGS = {
    "torch's defaults": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}
OMP_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def measure(epochs: int, repeats: int, classes: int, model: str = "ViT-B-16") -> dict:
    """In this process: the median demo epoch on cached features and the median text step (s)."""
    import torch
    from _bench import imagenet_prompts

    from coop.config.load import load_config
    from coop.train.engine import setup, train_one_epoch

    torch.manual_seed(0)
    overrides = [f"model.name={model}", "model.pretrained=none", "device=cpu"]
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), overrides)
    s = setup(cfg)
    items = s.dataset.train
    views, dim = int(cfg.train.aug_views), s.clip.embed_dim
    feats = torch.nn.functional.normalize(torch.randn(views, len(items), dim), dim=-1)  # (V, N, E)
    labels = torch.tensor([d.label for d in items])
    trained = [p for p in s.method.learnable().values() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.002, momentum=0.9)

    def epoch(e: int) -> float:
        start = time.perf_counter()
        train_one_epoch(s, optimizer, e, (feats, labels))
        return time.perf_counter() - start

    epoch(0)  # warm-up
    epoch_times = [epoch(e) for e in range(1, epochs + 1)]

    _, classifier = imagenet_prompts(s.clip, classes, 4, "end")

    def text_step() -> float:
        start = time.perf_counter()
        classifier.text_features().square().sum().backward()
        return time.perf_counter() - start

    text_step()  # warm-up
    text_times = [text_step() for _ in range(repeats)]
    return {
        "threads": torch.get_num_threads(),
        "epoch_s": statistics.median(epoch_times),
        "text_s": statistics.median(text_times),
        "n_train": len(items),
    }


def child_env(env_extra: dict, environ=os.environ) -> dict:
    """`environ` with exactly `env_extra` as OpenMP's environment (the tools add nothing to it)."""
    env = {k: v for k, v in environ.items() if k not in OMP_KEYS}
    return {**env, **env_extra, "COOP_OMP_DEFAULTS": "0"}


def run_setting(env_extra: dict, args) -> dict:
    """`measure` in a fresh process whose OpenMP environment is exactly `env_extra`."""
    env = child_env(env_extra)
    cmd = [sys.executable, __file__, "--child", f"--epochs={args.epochs}", f"--repeats={args.repeats}"]
    cmd += [f"--classes={args.classes}", f"--model={args.model}"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def busy_process() -> subprocess.Popen:
    """One process that keeps one core busy until it is killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--epochs", type=int, default=10, help="timed demo epochs per setting (the median counts)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed text steps per setting (the median counts)")
    ap.add_argument("--classes", type=int, default=100, help="ImageNet class names of the text step")
    ap.add_argument("--model", default="ViT-B-16", help="the demo's model, or another (name or config JSON)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.epochs < 1 or args.repeats < 1:
        raise SystemExit("error: --epochs and --repeats must be >= 1")
    if args.child:
        print(json.dumps(measure(args.epochs, args.repeats, args.classes, args.model)))
        return 0

    print(f"{os.cpu_count()} CPUs; load average before: {load_average()}")
    rows = {}
    for load in ("idle", "busy"):
        busy = busy_process() if load == "busy" else None
        try:
            for name, env in SETTINGS.items():
                rows[name, load] = run_setting(env, args)
                r = rows[name, load]
                print(
                    f"{name:24s} {load:4s}: {r['threads']} thread(s), demo epoch {r['epoch_s'] * 1000:7.1f} ms, "
                    f"text step {r['text_s'] * 1000:7.1f} ms (load average {load_average()})"
                )
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()

    base = "torch's defaults"
    n = rows[base, "idle"]["n_train"]
    print(
        f"\nmedians: demo epoch on cached features ({n} images, median of {args.epochs}), text step "
        f"({args.classes} classes, median of {args.repeats}); 'busy': beside one busy-looping process"
    )
    print(
        "| setting | threads | epoch idle | epoch busy | busy / idle | text idle | text busy | busy / idle |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in SETTINGS:
        idle, busy = rows[name, "idle"], rows[name, "busy"]
        print(
            f"| {name} | {idle['threads']} | {idle['epoch_s'] * 1000:.0f} ms | {busy['epoch_s'] * 1000:.0f} ms | "
            f"{busy['epoch_s'] / idle['epoch_s']:.1f}x | {idle['text_s'] * 1000:.0f} ms | "
            f"{busy['text_s'] * 1000:.0f} ms | {busy['text_s'] / idle['text_s']:.1f}x |"
        )
    print("\nagainst torch's defaults under the same load (time / defaults' time):")
    for name in list(SETTINGS)[1:]:
        cells = [
            f"{what} {load} {rows[name, load][key] / rows[base, load][key]:.2f}x"
            for what, key in (("epoch", "epoch_s"), ("text", "text_s"))
            for load in ("idle", "busy")
        ]
        print(f"  {name}: {', '.join(cells)}")
    return 0


if __name__ == "__main__":
    run_cli(main)

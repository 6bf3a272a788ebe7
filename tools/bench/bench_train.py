"""Benchmark training epochs: CoOp's per-step image encoding vs cached image features.

    python tools/bench/bench_train.py [--model ViT-B-32] [--shots 16] [--views 1] [--epochs 3]

On the bundled textile images (random weights, so it runs offline), in the same process and with
the training code itself (`coop.train.engine.train_one_epoch`):
  * `--warmup` untimed epochs of each path first (DataLoader workers, allocator, kernels);
  * `--epochs` epochs the CoOp way (`aug_views=0`: load, augment and encode every image through
    the frozen image tower at every step);
  * the one-off cost of caching `--views` feature views per training image;
  * `--epochs` epochs on the cached features (`aug_views=--views`);
and prints the optimizer steps each side ran, the mean time per epoch and per step, the
per-epoch ratio and the break-even number of epochs. Small settings (`--model
configs/models/coop-tiny.json --shots 2 --epochs 1`) run in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402

from coop.config.load import load_config  # noqa: E402
from coop.train.engine import setup, train_one_epoch  # noqa: E402
from coop.train.run_features import training_features  # noqa: E402


def timed_epochs(s, optimizer, feats, first: int, n: int, steps: list[int]) -> tuple[float, int]:
    """Wall time and optimizer steps of epochs first..first+n-1 (`steps` counts every step)."""
    before = steps[0]
    start = time.perf_counter()
    for epoch in range(first, first + n):
        train_one_epoch(s, optimizer, epoch, feats)
    return time.perf_counter() - start, steps[0] - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-32", help="open_clip model name or model-config JSON")
    ap.add_argument("--shots", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--views", type=int, default=1, help="cached views per image (train.aug_views)")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per path")
    ap.add_argument("--warmup", type=int, default=1, help="untimed epochs per path first")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    if args.epochs < 1 or args.views < 1:
        raise SystemExit("error: --epochs and --views must be >= 1")
    _cli.setup_logging()
    logging.getLogger("coop").setLevel(logging.WARNING)

    overrides = [
        f"model.name={args.model}",
        "model.pretrained=none",
        "data.name=textile",
        f"data.shots={args.shots}",
        f"data.num_workers={args.workers}",
        f"train.batch_size={args.batch_size}",
        f"train.aug_views={args.views}",
        "train.cache_features=false",
        "train.precision=fp32",
        "device=cpu",
    ]
    s = setup(load_config(None, overrides))
    trained = [p for p in s.method.learnable().values() if p.requires_grad]  # CoOp's prompts
    opt = torch.optim.SGD(trained, lr=0.002, momentum=0.9)
    steps = [0]
    opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    n = len(s.dataset.train)
    print(
        f"{args.model} (random weights), textile {args.shots} shots: {n} training images, "
        f"batch {args.batch_size}, {torch.get_num_threads()} threads; "
        f"{args.warmup} warm-up + {args.epochs} timed epoch(s) per path"
    )

    timed_epochs(s, opt, None, 0, args.warmup, steps)
    t0 = time.perf_counter()
    feats = training_features(s)
    t_cache = time.perf_counter() - t0
    timed_epochs(s, opt, feats, 0, args.warmup, steps)
    t_coop, steps_coop = timed_epochs(s, opt, None, args.warmup, args.epochs, steps)
    t_cached, steps_cached = timed_epochs(s, opt, feats, args.warmup, args.epochs, steps)

    per = {"coop": t_coop / args.epochs, "cached": t_cached / args.epochs}
    print(
        f"epoch, encoding every step (CoOp, aug_views=0): {per['coop'] * 1000:9.1f} ms "
        f"({steps_coop} steps in {args.epochs} epochs, {t_coop / max(steps_coop, 1) * 1000:.1f} ms/step)"
    )
    print(f"one-off feature cache ({args.views} view(s)):        {t_cache * 1000:9.1f} ms")
    print(
        f"epoch on cached features (aug_views={args.views}):      {per['cached'] * 1000:9.1f} ms "
        f"({steps_cached} steps in {args.epochs} epochs, {t_cached / max(steps_cached, 1) * 1000:.1f} ms/step)"
    )
    print(
        f"speed-up per epoch: {per['coop'] / per['cached']:.1f}x; the cache pays for itself after "
        f"{t_cache / max(per['coop'] - per['cached'], 1e-9):.1f} epochs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

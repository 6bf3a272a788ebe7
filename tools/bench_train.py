"""Benchmark one training epoch: CoOp's per-step image encoding vs cached image features.

    python tools/bench_train.py [--model ViT-B-32] [--shots 16] [--views 1]

On the bundled textile images (random weights, so it runs offline), times in the same process
  * one epoch the CoOp way (augment + encode every image through the frozen image tower per step),
  * the one-off cost of caching `--views` feature views per training image,
  * one epoch on the cached features,
and prints the per-epoch ratio and the break-even number of epochs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import setup_logging  # noqa: E402

from coop.config import load_config  # noqa: E402
from coop.engine import setup, train_one_epoch, training_features  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--shots", type=int, default=16)
    ap.add_argument("--views", type=int, default=1, help="cached views per image (train.aug_views)")
    ap.add_argument("--epochs", type=int, default=3, help="cached epochs to average over")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    setup_logging()
    logging.getLogger("coop").setLevel(logging.WARNING)

    overrides = [
        f"model.name={args.model}",
        "model.pretrained=none",
        "data.name=textile",
        f"data.shots={args.shots}",
        f"data.num_workers={args.workers}",
        f"train.aug_views={args.views}",
        "train.cache_features=false",
        "device=cpu",
    ]
    s = setup(load_config(None, overrides))
    opt = torch.optim.SGD(s.classifier.prompt_learner.parameters(), lr=0.002, momentum=0.9)
    n = len(s.dataset.train)
    print(
        f"{args.model} (random weights), textile {args.shots} shots: {n} training images, "
        f"batch 32, {torch.get_num_threads()} threads"
    )

    t0 = time.perf_counter()
    train_one_epoch(s, opt, 0, None, "fp32")
    t_coop = time.perf_counter() - t0

    t0 = time.perf_counter()
    feats = training_features(s)
    t_cache = time.perf_counter() - t0

    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        train_one_epoch(s, opt, epoch, feats, "fp32")
    t_cached = (time.perf_counter() - t0) / args.epochs

    print(f"epoch, encoding every step (CoOp, aug_views=0): {t_coop * 1000:9.1f} ms")
    print(f"one-off feature cache ({args.views} view(s)):        {t_cache * 1000:9.1f} ms")
    print(f"epoch on cached features (aug_views={args.views}):      {t_cached * 1000:9.1f} ms")
    print(
        f"speed-up per epoch: {t_coop / t_cached:.1f}x; the cache pays for itself after "
        f"{t_cache / max(t_coop - t_cached, 1e-9):.1f} epochs"
    )


if __name__ == "__main__":
    main()

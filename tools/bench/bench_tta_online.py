"""Benchmark the online test-time methods (TDA, DPE, BoostAdapter): their cost per image over plain
zero-shot inference on the same views.

    python tools/bench/bench_tta_online.py [--model ViT-B-16] [--classes 1000] [--images 20]
                                           [--views 1 64] [--dataset imagenet_a] [--device cpu]

Random weights, the first N ImageNet class names, one template ("a photo of a {}."), so the host's
text features are computed once, outside the timing, by both sides (a method at its untimed
warm-up image). For each view count V, a stream of `--images` images (random pixels, V views
each) is encoded once and timed ("encode"). The image encoder's cost is the same on both sides,
and on a loaded CPU its noise buries the methods' own cost, so the two sides are then timed on
the stored features (the model's `encode_image` answers from them): zero-shot scoring
(`host_logits`) and each method's `predict` (its caches, and DPE's AdamW step) with the
settings of its original on `--dataset`. The overhead is the difference per image; the ratio
compares full inference, encode + method against encode + zero-shot scoring.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import build_models, imagenet_method, sync  # noqa: E402

from coop.config.load import load_config  # noqa: E402
from coop.tta import TTA_METHODS  # noqa: E402
from coop.tta.base import host_logits  # noqa: E402

ONLINE = ("tda", "dpe", "boostadapter")
TEMPLATE = "zeroshot.templates=a photo of a {}."


def per_image(step, stream: list[torch.Tensor], device: torch.device) -> float:
    """Seconds per image of `step(views, i)` over `stream`, after one untimed warm-up image."""
    step(stream[0], -1)
    sync(device)
    start = time.perf_counter()
    for i, views in enumerate(stream):
        step(views, i)
    sync(device)
    return (time.perf_counter() - start) / len(stream)


def timed_encode(clip, stream: list[torch.Tensor], device: torch.device) -> tuple[float, dict]:
    """(seconds per image to encode the views, {id(views): their features})."""
    stored = {}

    @torch.no_grad()
    def encode(views, i):
        stored[id(views)] = clip.encode_image(views)

    return per_image(encode, stream, device), stored


def overhead(
    model: str, classes: int, images: int, views: tuple[int, ...], dataset: str, device: torch.device
) -> list[dict]:
    """Rows {"method", "views", "encode_ms", "zeroshot_ms", "method_ms", "overhead_ms", "ratio"}:
    milliseconds per image of encoding the views, of zero-shot scoring and of each online method on
    the encoded views, the method's overhead over zero-shot scoring, and the ratio of full inference
    (encode + method over encode + zero-shot)."""
    _, clip = build_models(model, device)
    host = imagenet_method(clip, "zeroshot", classes, [TEMPLATE])
    prepared = host.prepare()  # the methods prepare theirs at the untimed warm-up image
    size = clip.image_size
    rows = []
    for v in views:
        gen = torch.Generator().manual_seed(v)
        stream = [torch.randn(v, 3, size, size, generator=gen).to(device) for _ in range(images)]
        encode_s, stored = timed_encode(clip, stream, device)
        clip.encode_image = lambda x, stored=stored: stored[id(x)]  # these views' stored features
        try:
            base = per_image(torch.no_grad()(lambda x, i: host_logits(host, x, prepared)), stream, device)
            for name in ONLINE:
                cfg = load_config(overrides=["method=zeroshot", f"data.name={dataset}", TEMPLATE])
                cost = per_image(TTA_METHODS[name](host, cfg).predict, stream, device)
                rows.append(
                    {
                        "method": name,
                        "views": v,
                        "encode_ms": encode_s * 1000,
                        "zeroshot_ms": base * 1000,
                        "method_ms": cost * 1000,
                        "overhead_ms": (cost - base) * 1000,
                        "ratio": (encode_s + cost) / (encode_s + base),
                    }
                )
        finally:
            del clip.encode_image  # the model's own again
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=1000, help="first N ImageNet class names")
    ap.add_argument("--images", type=int, default=20, help="timed images per stream")
    ap.add_argument("--views", type=int, nargs="+", default=[1, 64], help="views per image")
    ap.add_argument("--dataset", default="imagenet_a", help="whose original settings the methods take")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"model {args.model}, {args.classes} ImageNet classes, {args.images} images, settings of {args.dataset}"
    )
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, fp32")
    print(
        f"{'method':<13} {'views':>5} {'encode ms':>10} {'zero-shot ms':>13} {'method ms':>10} "
        f"{'overhead ms':>12} {'ratio':>6}"
    )
    for r in overhead(args.model, args.classes, args.images, tuple(args.views), args.dataset, device):
        print(
            f"{r['method']:<13} {r['views']:>5} {r['encode_ms']:>10.1f} {r['zeroshot_ms']:>13.2f} "
            f"{r['method_ms']:>10.2f} {r['overhead_ms']:>12.2f} {r['ratio']:>6.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

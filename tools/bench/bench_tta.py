"""Benchmark TPT per image: ours (the starting prompt's forward shared by all images, the fast
text pass) against the original-style reference (77 tokens x all classes, forward, backward,
forward per image).

    python tools/bench/bench_tta.py [--model configs/models/coop-tiny.json] [--classes 200 1000]
                                    [--images 3] [--views 64] [--memory]

For each class count: the best time per image of both sides over `--images` images (after one
warm-up image; the reference's images first, then ours image by image with our two phases), in
wall and process CPU time, our one-off cost (the starting prompt's forward and graph),
the phases (the reference's forward with graph, backward, forward; our backward through the kept
graph and our forward, each timed alone), the bound R / (B + F) and the share of it reached, and
the largest logit difference. The host is zero-shot CLIP with TPT's prompt, on the first N ImageNet
class names, random weights; the V views are random image features (the frozen image tower's
forward is the same on both sides and outside the times). `--memory` adds one TPT image at the
largest class count: the bytes each side's graph saves for the backward pass (ours also with
tpt.grad_checkpointing) and, on CUDA, the peak allocated memory. The default, the tiny test model
on a CPU, runs in a few minutes; `--model ViT-B-16 --device cuda` is gpu_check.py's `tpt` section.
What is measured and the bound: tools/bench/_tta.py; the figures: docs/test_time.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import build_models  # noqa: E402
from _cli import run_cli  # noqa: E402
from _tta import memory, per_image, print_memory, print_per_image  # noqa: E402

TINY_MODEL = str(Path(__file__).resolve().parents[2] / "configs/models/coop-tiny.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=TINY_MODEL, help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, nargs="+", default=[200, 1000], help="first N ImageNet names")
    ap.add_argument(
        "--images", type=int, default=3, help="timed images per side, the best counts (after a warm-up image)"
    )
    ap.add_argument("--views", type=int, default=64, help="views per image (TPT: 64)")
    ap.add_argument("--memory", action="store_true", help="also the memory of one image at the largest count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.images < 1 or args.views < 1:
        raise ValueError(f"--images and --views must be >= 1, got {args.images} and {args.views}")
    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    name = Path(args.model).stem if args.model.endswith(".json") else args.model
    print(f"TPT per image, model {name} (random weights), zero-shot host, fp32, {args.views} views, "
          f"best of {args.images} image(s) after one warm-up image")  # fmt: skip
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    rows = []
    for n in args.classes:
        rows.append(per_image(oc, clip, n, args.views, args.images, device))
        print_per_image(rows[-1])
    print("\n| classes | clock | reference / image | ours / image | speed-up | bound R / (B + F) | reached |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for clock in ("wall", "cpu"):
            r = row[clock]
            print(
                f"| {row['classes']} | {clock} | {r['reference_ms']:,.0f} ms | {r['ours_ms']:,.0f} ms | "
                f"{r['speedup']:.2f}x | {r['bound']:.2f}x | {r['reached']:.0%} |"
            )
    if args.memory:
        print(f"\none TPT image at {max(args.classes)} classes")
        print_memory(memory(oc, clip, max(args.classes), args.views, device))
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Benchmark the prompt text side: our trimmed, length-bucketed Transformer vs CoOp's full-77 one.

(With shared context and the class at the end, the common [SOS][v1..vM] prefix is also computed
once for all classes.)

    python tools/bench_text.py [--model ViT-B-16] [--classes 100] [--repeats 3] [--threads N]

Times forward + backward of `PromptClassifier.text_features()` for ImageNet class names (random
weights) against the reference CoOp computation (`coop.reference`, full 77 tokens through
open_clip's own modules) in the same process, and prints the speed ratio and the largest
differences of outputs and gradients.
"""

from __future__ import annotations

import argparse
import logging
import time

import open_clip
import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

import coop
from coop.reference import coop_text_features


def timed(compute, learner, repeats: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Best wall time of forward+backward over `repeats`, plus the output and ctx gradient."""
    best = float("inf")
    for _ in range(repeats):
        learner.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = compute()
        out.square().sum().backward()
        best = min(best, time.perf_counter() - start)
    return best, out.detach(), learner.ctx.grad.clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--n-ctx", type=int, default=4)
    ap.add_argument("--position", default="end")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    oc = open_clip.create_model(args.model, pretrained=None).eval()
    clip = coop.CLIP.from_openclip(oc)
    names = list(IMAGENET_CLASSNAMES[: args.classes])
    learner = coop.PromptLearner(clip, names, n_ctx=args.n_ctx, position=args.position)
    classifier = coop.PromptClassifier(clip, learner)
    oc.requires_grad_(False)

    lengths = (learner.eos + 1).float()
    print(f"model {args.model}, {len(names)} ImageNet classes, n_ctx {args.n_ctx}, position {args.position}")
    print(f"tokens per prompt: mean {lengths.mean():.1f}, max {int(lengths.max())} (reference: 77)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    def reference():
        return coop_text_features(oc, learner)

    timed(classifier.text_features, learner, 1)  # warm-up
    t_ours, out_ours, g_ours = timed(classifier.text_features, learner, args.repeats)
    t_ref, out_ref, g_ref = timed(reference, learner, args.repeats)

    out_diff = float((out_ours - out_ref).abs().max())
    grad_diff = float((g_ours - g_ref).abs().max())
    print(f"reference CoOp (77 tokens): {t_ref * 1000:8.1f} ms  forward+backward")
    path = "cut, bucketed, shared prefix" if learner.shared_prefix > 1 else "cut, bucketed"
    print(f"coop ({path}): {t_ours * 1000:8.1f} ms  forward+backward")
    print(f"speed-up: {t_ref / t_ours:.2f}x")
    print(
        f"max |diff| output: {out_diff:.2e} (scale {float(out_ref.abs().max()):.2f}), "
        f"ctx grad: {grad_diff:.2e} (scale {float(g_ref.abs().max()):.2e})"
    )


if __name__ == "__main__":
    main()

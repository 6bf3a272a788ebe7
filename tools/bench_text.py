"""Benchmark the prompt text side: our trimmed, length-bucketed Transformer vs CoOp's full-77 one.

(With shared context and the class at the end or in the middle, the common [SOS][v1..] prefix
is also computed once for all classes.)

    python tools/bench_text.py [--model ViT-B-16] [--classes 100] [--n-ctx 4] [--repeats 3]

Times forward + backward of `PromptClassifier.text_features()` for ImageNet class names (random
weights) against the reference CoOp computation (`coop.reference`, full 77 tokens through
open_clip's own modules) in the same process, and prints the speed ratio and the largest
differences of outputs and gradients. Method: the reference's prompts are tokenised once,
before timing (as CoOp does at build time); each side gets `--warmup` untimed calls, then the
best of `--repeats` timed calls counts. Small sizes (`--model configs/models/coop-tiny.json
--classes 10`) run in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import build_models, imagenet_prompts, max_rel_diff, text_sides, time_text  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--n-ctx", type=int, default=4)
    ap.add_argument("--position", default="end", choices=("end", "middle", "front"))
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per side first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    learner, classifier = imagenet_prompts(clip, args.classes, args.n_ctx, args.position)
    lengths = (learner.eos + 1).float()
    print(
        f"model {args.model}, {learner.n_cls} ImageNet classes, n_ctx {args.n_ctx}, position {args.position}"
    )
    print(f"tokens per prompt: mean {lengths.mean():.1f}, max {int(lengths.max())} (reference: 77)")
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")

    sides = text_sides(oc, classifier)
    t_ref, out_ref, g_ref = time_text(sides["reference"], learner, device, "fp32", args.repeats, args.warmup)
    t_ours, out_ours, g_ours = time_text(sides["coop"], learner, device, "fp32", args.repeats, args.warmup)

    print(f"reference CoOp (77 tokens): {t_ref * 1000:8.1f} ms  forward+backward")
    path = "cut, bucketed, shared prefix" if learner.shared_prefix > 1 else "cut, bucketed"
    print(f"coop ({path}): {t_ours * 1000:8.1f} ms  forward+backward")
    print(
        f"speed-up: {t_ref / t_ours:.2f}x (best of {args.repeats} after {args.warmup} warm-up call(s) each)"
    )
    print(
        f"max |diff| output: {float((out_ours - out_ref).abs().max()):.2e} "
        f"(scale {float(out_ref.abs().max()):.2f}), ctx grad relative: {max_rel_diff(g_ours, g_ref):.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

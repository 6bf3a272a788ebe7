"""Attention of the pooled token and class tokens to each prompt token, per layer: end vs middle.

    python tools/attention.py runs/.../seed1/checkpoint.pt --classes dog cat [--out DIR]

Runs the text encoder with its attention modules returning their weights
(coop.results.attention_maps.attention_maps: head-averaged softmax(q k^T / sqrt(d)) under the tower's mask) on
the checkpoint's learned context placed in each layout of --positions (default end and middle;
the trained layout is always included).
Only the class-token position differs between layouts: the same ctx/deep_ctx tensors are
used, so the untrained layout shows the trained vectors in an arrangement they never saw.
Writes into --out (default `<checkpoint folder>/attention/`):
  attention_<class>.png  rows = layers, columns = layouts; queries = class tokens and the pooled
                         token ([EOS] in CLIP's tower, CoCa's class token after the text), keys =
                         every token up to [EOS], then CoCa's class token (grey = hidden by the mask);
  attention_roles.png    per layer: pooled -> context, class -> context, context -> class mass;
  attention.json         the matrices and the per-layer role summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import add_model_args, run_cli, setup_logging, tokenizer_hint  # noqa: E402

from coop.results.attention_maps import attention_figures  # noqa: E402
from coop.train.checkpoint import load_trained  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run's checkpoint.pt")
    ap.add_argument("--classes", nargs="+", help="class names to draw (default: the first two of the run)")
    ap.add_argument(
        "--positions",
        nargs="+",
        default=["end", "middle"],
        choices=("end", "middle", "mid", "front"),
        help="layouts to compare (default: end middle)",
    )
    ap.add_argument("--out", help="output folder (default: <checkpoint folder>/attention)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    setup_logging(args.verbose)

    with tokenizer_hint(args.tokenizer):
        clip, learner, _ = load_trained(args.checkpoint, args.device, args.pretrained, args.tokenizer)
    classes = args.classes or learner.classnames[:2]
    positions = list(dict.fromkeys(["middle" if p == "mid" else p for p in args.positions]))
    if learner.position not in positions:
        positions.append(learner.position)
    out = Path(args.out) if args.out else Path(args.checkpoint).parent / "attention"
    written, data = attention_figures(clip, learner, classes, positions, out)
    print(f"trained layout: {learner.position}; layouts drawn: {', '.join(positions)}")
    print("mean attention mass per layer (averaged over the classes):")
    for pos, d in data["positions"].items():
        for key, values in d["summary"].items():
            print(f"  {pos:<7} {key:<11} " + " ".join(f"{v:.2f}" for v in values))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Nearest vocabulary words of each learned context vector (CoOp's prompt interpretation).

    python tools/interpret_prompt.py runs/.../seed1/checkpoint.pt [--topk 5] [--out DIR]

For every context vector -- shared or per class (csc), the input layer and every deep layer --
prints the top-k nearest token embeddings by Euclidean distance and by cosine similarity, and
writes them as `prompt_words.json` and `prompt_words.csv` next to the checkpoint (or into
--out). Works for any supported backbone: the words come from the run's own token-embedding
table. Deep-layer vectors replace hidden states, so their nearest input words are a rough guide.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import add_model_args, run_cli, setup_logging, tokenizer_hint  # noqa: E402

from coop.results.nearest_words import embedding_table, format_words_table, nearest_words  # noqa: E402
from coop.train.checkpoint import load_trained  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run's checkpoint.pt")
    ap.add_argument("--topk", type=int, default=5, help="words per vector and metric (default 5)")
    ap.add_argument("--out", help="folder for prompt_words.json/.csv (default: the checkpoint's folder)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    if args.topk < 1:
        ap.error(f"--topk must be >= 1, got {args.topk}")

    with tokenizer_hint(args.tokenizer):
        clip, learner, ckpt = load_trained(args.checkpoint, args.device, args.pretrained, args.tokenizer)
    rows = nearest_words(learner, embedding_table(clip.text.token_embedding), clip.tokenizer, args.topk)
    model = ckpt["config"]["model"]
    print(
        f"{args.checkpoint}: {model['name']} ({model['pretrained']}), n_ctx={learner.n_ctx}, "
        f"position={learner.position}, csc={learner.csc}, depth={learner.depth}"
    )
    print(format_words_table(rows))
    out = Path(args.out) if args.out else Path(args.checkpoint).parent
    out.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(args.checkpoint), "model": model, "n_ctx": learner.n_ctx,
            "position": learner.position, "csc": learner.csc, "depth": learner.depth, "topk": args.topk}  # fmt: skip
    (out / "prompt_words.json").write_text(json.dumps({**meta, "words": rows}, indent=1) + "\n")
    with open(out / "prompt_words.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'prompt_words.json'} and {out / 'prompt_words.csv'}")
    return 0


if __name__ == "__main__":
    run_cli(main)

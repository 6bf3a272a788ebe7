"""Save a tiny offline stand-in for a model's Hugging Face tokenizer, to run its tiny config offline.

    python tools/make_tokenizer.py configs/models/siglip-tiny.json --out tok/siglip-tiny
    python tools/train.py model.name=configs/models/siglip-tiny.json model.tokenizer=tok/siglip-tiny ...

The kind follows the model's tokenizer (SigLIP: T5, MetaCLIP 2: mT5, CLIPA: BERT, SigLIP2: Gemma;
`coop.model.tiny_tokenizers`), or --kind; the saved tokenizer is loaded back and checked against the
model's text tower. Models with CLIP's BPE need none (it ships with open_clip). The tiny tokenizer
knows about 100 tokens: it is for smoke runs and tests on random weights, never for real weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="an open_clip model name or a model-config .json")
    ap.add_argument("--out", required=True, help="the directory to save the tokenizer in")
    ap.add_argument("--kind", choices=("t5", "mt5", "bert", "gemma"), help="default: the model's family's")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)

    from coop.io import require_writable
    from coop.model.tiny_tokenizers import make_tiny_tokenizer

    out = require_writable(args.out, folder=True)
    tok = make_tiny_tokenizer(args.model, out, args.kind)
    print(
        json.dumps(
            {"out": str(out), "vocab_size": tok.vocab_size, "sos_id": tok.sos_id, "eos_id": tok.eos_id}
        )
    )
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Classify a folder of images with a trained prompt: a run folder or an exported file.

    python tools/predict.py RUN_OR_FILE IMAGES_DIR --out predictions.csv [--topk 5] [--device cuda]
    python tools/predict.py prompts.safetensors photos/ --out p.csv --classnames cat dog bird

Every image under IMAGES_DIR (recursively) gets one row: its path relative to IMAGES_DIR, then the
top-k classes and their probabilities (class_1, prob_1, ..., class_k, prob_k), best first; an
unreadable image gets a row with empty classes and a warning. --classnames scores other classes,
where the method transfers (shared context, vision prompts). A federated run's folder gives its
global model, or with --client K (FedOTP, FedPGP) client K's own. A run or export made on another
machine records that machine's tokenizer directory (`model.tokenizer`, SigLIP, MetaCLIP 2, ...):
--tokenizer DIR gives the directory here.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import TOKENIZER_HELP, run_cli, setup_logging, tokenizer_hint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "source", metavar="RUN_OR_FILE", help="a run folder, its checkpoint.pt, or a .safetensors export"
    )
    ap.add_argument("images", metavar="IMAGES_DIR", help="folder of images (searched recursively)")
    ap.add_argument("--out", required=True, help="the CSV file to write")
    ap.add_argument("--topk", type=int, default=5, help="classes per image (default 5)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--classnames", nargs="+", metavar="NAME", help="score these classes instead")
    ap.add_argument("--client", type=int, help="a federated FedOTP/FedPGP run folder: client K's own model")
    ap.add_argument("--pretrained", default="config", help="weights override (tag or file) for the model")
    ap.add_argument("--tokenizer", metavar="DIR", help=TOKENIZER_HELP)
    ap.add_argument("--device", default="auto")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.topk < 1 or args.batch_size < 1:
        ap.error("--topk and --batch-size must be >= 1")
    setup_logging(args.verbose)

    from coop.interop import load_classifier
    from coop.interop.classifier import list_image_files, predict_files
    from coop.io import require_writable

    out = require_writable(args.out)  # before any image is scored
    root = Path(args.images)
    files = list_image_files(root)
    if not files:
        print(f"error: no images under {root}", file=sys.stderr)
        return 2
    with tokenizer_hint(args.tokenizer):
        clf = load_classifier(
            args.source, device=args.device, classnames=args.classnames, pretrained=args.pretrained,
            client=args.client, tokenizer=args.tokenizer,
        )  # fmt: skip
    k = min(args.topk, len(clf.classnames))
    out.parent.mkdir(parents=True, exist_ok=True)
    n_bad = 0
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", *(f"{c}_{i}" for i in range(1, k + 1) for c in ("class", "prob"))])
        for path, top in predict_files(clf, files, k, args.batch_size):
            n_bad += top is None
            cells = [] if top is None else [x for name, p in top for x in (name, f"{p:.6f}")]
            writer.writerow([path.relative_to(root).as_posix(), *cells])
    print(
        json.dumps(
            {"out": str(out), "images": len(files), "unreadable": n_bad, "classes": len(clf.classnames)}
        )
    )
    return 0


if __name__ == "__main__":
    run_cli(main)

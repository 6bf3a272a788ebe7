"""Write class descriptions (`data.descriptions`) with a local Hugging Face language model.

    python tools/describe.py dtd --root $DATA --model /models/Qwen2.5-7B-Instruct --out dtd.json
    python tools/describe.py classes.txt --model /models/llama --out mine.json --sentences 20 --max-words 30

CLASSES_OR_DATASET is a dataset name (its class names, read from the dataset's folder under --root
without writing anything) or a text file with one class per line. The model is a causal language
model saved in a directory (`save_pretrained`), read offline (`coop.data.describe`). Each class is
asked CuPL-style questions (`coop.data.describe.QUESTIONS`, or --questions FILE: one per line, "{}"
for the class), and its answers are cut to one sentence of at most --max-words words; the defaults
are HiCroPL's recipe, 50 sentences of at most 50 words. Sampling is seeded (--seed) per class.

The file `{class: [sentences]}` is written atomically after every class; a run on an existing file
keeps its classes and describes the others (resume after an interruption). Check it with
`tools/check_data.py DATA --dataset NAME --descriptions FILE`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.data import DATASETS, DataError  # noqa: E402
from coop.data.describe import (  # noqa: E402
    MAX_WORDS,
    QUESTIONS,
    SENTENCES,
    TEMPERATURE,
    describe_classes,
    load_language_model,
)
from coop.data.doctor import read_source  # noqa: E402


def read_lines(path: str, what: str) -> list[str]:
    """The non-blank lines of a text file, stripped; DataError in one line if there are none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{what} {path} is not readable ({e})") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError(f"{what} {path} has no lines")
    return lines


def classnames_of(source: str, root: str | None) -> list[str]:
    """The classes of a dataset name (read-only, from --root) or of a file with one class per line."""
    if source in DATASETS:
        return list(read_source(source, root).classnames)
    if Path(source).is_file():
        return read_lines(source, "class file")
    raise DataError(
        f"{source} is neither a dataset ({', '.join(sorted(DATASETS))}) nor a file of class names"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "classes", metavar="CLASSES_OR_DATASET", help="a dataset name, or a file with one class per line"
    )
    ap.add_argument("--model", required=True, help="the folder of a causal language model (save_pretrained)")
    ap.add_argument("--out", required=True, help="the JSON file to write (kept and completed if it exists)")
    ap.add_argument("--root", help="the DATA folder, for a dataset name")
    ap.add_argument("--sentences", type=int, default=SENTENCES, help=f"per class (default {SENTENCES})")
    ap.add_argument("--max-words", type=int, default=MAX_WORDS, help=f"per sentence (default {MAX_WORDS})")
    ap.add_argument("--questions", help='a file of questions, one per line, "{}" for the class name')
    ap.add_argument("--temperature", type=float, default=TEMPERATURE, help=f"(default {TEMPERATURE})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    if args.sentences < 1 or args.max_words < 1:
        ap.error("--sentences and --max-words must be >= 1")
    questions = read_lines(args.questions, "questions file") if args.questions else list(QUESTIONS)
    bad = [q for q in questions if "{}" not in q]
    if bad:
        raise DataError(f"questions file {args.questions}: {bad[0]!r} has no '{{}}' for the class name")
    classnames = classnames_of(args.classes, args.root)
    lm = load_language_model(args.model, args.device)
    done = describe_classes(
        lm,
        classnames,
        args.out,
        args.sentences,
        args.max_words,
        args.seed,
        questions=questions,
        temperature=args.temperature,
    )
    missing = [c for c in classnames if c not in done]
    print(f"{len(classnames) - len(missing)} of {len(classnames)} classes described in {args.out}")
    return 1 if missing else 0


if __name__ == "__main__":
    run_cli(main)

"""Print the support matrix of every open_clip model: its family, whether text prompts and vision
prompts enter its towers, the tokenizer it needs and open_clip's pretrained tags for it
(`coop.model.support`, `coop.results.model_table`).

    python tools/models.py                          # every model open_clip ships
    python tools/models.py --family SigLIP --why    # one family, with every refusal in full
    python tools/models.py --write docs/models.md   # regenerate the manual's page

Nothing downloads: every tower is built on the meta device, without weights. Exit 2 with one line
for an unknown family.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli  # noqa: E402

from coop.model.support import FAMILY_NAMES, support_table  # noqa: E402
from coop.results.model_table import coverage, models_document, models_markdown  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", metavar="F", help=f"one of: {', '.join(FAMILY_NAMES)}")
    ap.add_argument("--why", action="store_true", help="add each refusal in full")
    ap.add_argument("--write", metavar="PATH", help="write the whole page (docs/models.md) to PATH")
    args = ap.parse_args(argv)
    if args.write:
        if args.family or args.why:
            ap.error("--write writes every model with its refusals; drop --family and --why")
        Path(args.write).write_text(models_document(support_table()))
        print(f"wrote {args.write}")
        return 0
    rows = support_table(args.family)
    print(models_markdown(rows, why=args.why), end="")
    if args.family is None:
        print(f"\n{coverage(rows)}")
    return 0


if __name__ == "__main__":
    run_cli(main)

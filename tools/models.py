"""Print the support matrix of every open_clip model: its family, whether text prompts and vision
prompts enter its towers, which methods do not run on it, the tokenizer it needs and open_clip's
pretrained tags for it (`coop.model.support`, `coop.results.model_table`).

    python tools/models.py                          # every model open_clip ships
    python tools/models.py --family SigLIP --why    # one family, with every refusal in full
    python tools/models.py coca_ViT-B-32            # one model, with every method's verdict
    python tools/models.py configs/models/coca-tiny.json   # ... or a model config .json
    python tools/models.py --write docs/models.md   # regenerate the manual's page

Nothing downloads: every tower is built on the meta device, without weights. A method's verdict is
its own check of the towers (`Method.check_towers`), as preflight runs it before a run. Exit 2 with
one line for an unknown family, model name or config file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli  # noqa: E402

from coop.config.load import load_config  # noqa: E402
from coop.methods import METHODS  # noqa: E402
from coop.model.support import FAMILY_NAMES, model_support, support_table  # noqa: E402
from coop.results.model_table import (  # noqa: E402
    MethodChecks,
    coverage,
    model_markdown,
    models_document,
    models_markdown,
)


def method_checks() -> MethodChecks:
    """Every method of tools/train.py and tools/federated.py with its recipe's config."""
    from coop.federated.task import FEDERATED_BASE, FL_METHODS

    checks = {f"method={n}": (cls, load_config(None, [f"method={n}"])) for n, cls in METHODS.items()}
    for n, cls in FL_METHODS.items():
        checks[f"fl.method={n}"] = (cls, load_config(None, [f"fl.method={n}"], base=FEDERATED_BASE))
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "model", nargs="?", metavar="NAME_OR_JSON", help="one open_clip model or model config .json"
    )
    ap.add_argument("--family", metavar="F", help=f"one of: {', '.join(FAMILY_NAMES)}")
    ap.add_argument("--why", action="store_true", help="add each refusal in full")
    ap.add_argument("--write", metavar="PATH", help="write the whole page (docs/models.md) to PATH")
    args = ap.parse_args(argv)
    if args.write and (args.family or args.why or args.model):
        ap.error("--write writes every model with its refusals; drop NAME_OR_JSON, --family and --why")
    if args.model and args.family:
        ap.error("give one model or one --family, not both")
    if args.model:
        row = model_support(args.model)  # ModelError (one line) for an unknown name or a missing file
        print(model_markdown(row, method_checks()), end="")
        return 0
    if args.write:
        Path(args.write).write_text(models_document(support_table(), method_checks()))
        print(f"wrote {args.write}")
        return 0
    rows = support_table(args.family)
    print(models_markdown(rows, method_checks(), why=args.why), end="")
    if args.family is None:
        print(f"\n{coverage(rows)}")
    return 0


if __name__ == "__main__":
    run_cli(main)

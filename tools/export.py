"""Export a finished run's learned prompts as safetensors, with a metadata card in the header.

    python tools/export.py RUN_DIR --out prompts.safetensors

The card names the method, the open_clip model and pretrained tag, the class names and the run's
resolved config; `coop.load_classifier("prompts.safetensors")` and `tools/predict.py` use it.
RUN_DIR may also be the run's checkpoint.pt.
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
    ap.add_argument("run", help="a run folder (or its checkpoint.pt)")
    ap.add_argument("--out", required=True, help="the .safetensors file to write")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)

    from coop.interop import export_run, read_export

    out = export_run(args.run, args.out)
    tensors, card = read_export(out)
    shapes = {k: list(t.shape) for k, t in tensors.items()}
    print(
        json.dumps(
            {"out": str(out), "method": card["method"], "classes": len(card["classnames"]), "tensors": shapes}
        )
    )
    return 0


if __name__ == "__main__":
    run_cli(main)

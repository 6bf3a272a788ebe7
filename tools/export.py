"""Export a finished run's learned prompts as safetensors, with a metadata card in the header.

    python tools/export.py RUN_DIR --out prompts.safetensors
    python tools/export.py FEDERATED_RUN_DIR --out client3.safetensors --client 3

The card names the method, the open_clip model and pretrained tag, the class names and the run's
resolved config; `coop.load_classifier("prompts.safetensors")` and `tools/predict.py` use it.
RUN_DIR may also be the run's checkpoint.pt. A federated run (tools/federated.py) exports its
global model; FedOTP and FedPGP runs also have one personalised model per client: --client K.
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
    ap.add_argument("--client", type=int, help="a federated FedOTP/FedPGP run: client K's own model")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)

    from coop.interop import export_run, read_export

    out = export_run(args.run, args.out, client=args.client)
    tensors, card = read_export(out)
    shapes = {k: list(t.shape) for k, t in tensors.items()}
    summary = {
        "out": str(out),
        "method": card["method"],
        "classes": len(card["classnames"]),
        "tensors": shapes,
    }
    if card["federated"]:
        summary.update(federated=card["federated"], model=card["model"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    run_cli(main)

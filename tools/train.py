"""Train CoOp prompts on a few-shot dataset.

    python tools/train.py [--config configs/coop/vit_b16.yaml] [key=value ...]

Without --config the defaults are CoOp's recipe (coop/config/load.py). Examples:

    python tools/train.py data.name=dtd data.root=$DATA data.shots=16 prompt.position=middle
    python tools/train.py model.pretrained=none data.shots=4     # offline, random weights

Rerunning the same command on the same output_dir resumes; a finished run is not trained again.
One run across N GPUs or CPU processes: `torchrun --nproc-per-node N tools/train.py ...`
(docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.config.load import load_config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="experiment YAML (keys as in coop/config/load.py)")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.shots=4")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)
    cfg = load_config(args.config, args.overrides)

    from coop import distributed
    from coop.train.runner import train_run

    metrics = train_run(cfg)
    summary = {k: metrics[k] for k in ("accuracy", "macro_f1", "n_test", "epochs", "shots", "seed")}
    if distributed.is_main():  # under torchrun, one summary line
        print(json.dumps({"output_dir": cfg.output_dir, **summary}))
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Adapt a classifier to the test split at test time: TPT, C-TPT, ZERO, TDA, DPE, BoostAdapter.

    python tools/tta.py --config configs/tta/<method>.yaml data.name=... data.root=... [tta.init=RUN]

Without tta.init the host is zero-shot CLIP with the config's hand-written prompt; with it, the
run folder's or export's method (its model: a model.* that disagrees is refused). Other keys as in
tools/train.py (data.*, model.*, output_dir, device, data.seed), and tta.views (64), tta.augment.
Writes a run folder: config.yaml, log.txt, metrics.json (accuracy, top5, ece, macro_f1, per-class
accuracy), outputs.safetensors (logits, labels, index). Rerunning the same command resumes.
Episodic methods run across ranks: `torchrun --nproc-per-node N tools/tta.py ...` (docs/test_time.md).
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
    ap.add_argument("--config", help="test-time YAML, e.g. configs/tta/zero.yaml")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. tta.views=16")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)

    from coop import distributed
    from coop.tta.host import tta_config
    from coop.tta.runner import tta_run

    cfg = tta_config(args.config, args.overrides)
    metrics = tta_run(cfg)
    summary = {k: metrics[k] for k in ("accuracy", "top5", "ece", "macro_f1", "n_test", "tta_method", "seed")}
    if distributed.is_main():
        print(json.dumps({"output_dir": cfg.output_dir, **summary}))
    return 0


if __name__ == "__main__":
    run_cli(main)

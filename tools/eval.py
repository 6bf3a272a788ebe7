"""Evaluate a saved run (any method) on a dataset's test split.

    python tools/eval.py --checkpoint output/.../checkpoint.pt [key=value ...] [--out FILE]
    python tools/eval.py --checkpoint output/.../checkpoint.pt eval.targets=[imagenetv2,imagenet_a]

Overrides change the run's saved config, e.g. `data.name=dtd data.root=$DATA` evaluates a shared
context on another dataset (class-specific context cannot be transferred). The metrics are printed
as JSON and written to --out (default: eval_<dataset>.json beside the checkpoint, or
eval_<dataset>_new.json for `data.subsample_classes=new`: the base-to-new protocol).

With `eval.targets=[...]` every listed dataset is evaluated, each into eval_<dataset>.json beside
the checkpoint, as a training run does after it finishes. `torchrun --nproc-per-node N
tools/eval.py ...` shards the test images across N ranks (docs/distributed.md).
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
    ap.add_argument("--checkpoint", required=True, help="a run's checkpoint.pt")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    ap.add_argument("--out", help="where to write the metrics JSON")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    setup_logging(args.verbose)

    from coop import distributed
    from coop.config import load_config
    from coop.evaluation import evaluate_checkpoint, evaluate_checkpoint_targets
    from coop.io import write_json

    targets = [o for o in args.overrides if o.split("=", 1)[0].strip() == "eval.targets"]
    if targets:
        names = list(load_config(None, targets[-1:]).eval.targets)
        rest = [o for o in args.overrides if o not in targets]
        for name, metrics in evaluate_checkpoint_targets(args.checkpoint, names, rest).items():
            if distributed.is_main():
                print(
                    json.dumps({"file": name, **{k: metrics[k] for k in ("dataset", "accuracy", "n_test")}})
                )
        return 0
    metrics = evaluate_checkpoint(args.checkpoint, args.overrides)
    classes = "" if metrics["subsample_classes"] == "all" else f"_{metrics['subsample_classes']}"
    name = f"eval_{metrics['dataset']}{classes}.json"
    out = Path(args.out) if args.out else Path(args.checkpoint).parent / name
    write_json(out, metrics)  # rank 0 alone writes under torchrun
    if distributed.is_main():
        print(json.dumps({k: metrics[k] for k in ("dataset", "accuracy", "macro_f1", "n_test")}))
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Evaluate a saved run (any method; of federated runs, PromptFL's) on a dataset's test split.

    python tools/eval.py output/.../seed1 [key=value ...] [--out FILE]
    python tools/eval.py --checkpoint output/.../checkpoint.pt eval.targets=[imagenetv2,imagenet_a]

Overrides change the run's saved config, e.g. `data.name=dtd data.root=$DATA` evaluates a shared
context on another dataset (class-specific context cannot be transferred). The metrics are printed
as JSON and written to --out (default: eval_<dataset>.json beside the checkpoint, or
eval_<dataset>_new.json for `data.subsample_classes=new`: the base-to-new protocol).

With `eval.targets=[...]` every listed dataset is evaluated, each into eval_<dataset>.json beside
the checkpoint, as a training run does after it finishes. The run is its folder or its
checkpoint.pt (as the first argument, or --checkpoint). A federated FedOTP, FedPGP or latent-domain
run is refused: its metrics.json holds its evaluations, and tools/predict.py scores images with it. `torchrun --nproc-per-node N
tools/eval.py ...` shards the test images across N ranks (docs/distributed.md). A run made on
another machine records that machine's tokenizer directory (`model.tokenizer`, SigLIP, MetaCLIP 2,
...): --tokenizer DIR gives the directory here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import TOKENIZER_HELP, run_cli, setup_logging, tokenizer_hint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a run's checkpoint.pt (or give the run as the first argument)")
    ap.add_argument(
        "overrides",
        nargs="*",
        metavar="ARG",
        help="the run (folder or checkpoint.pt), then key=value overrides",
    )
    ap.add_argument("--out", help="where to write the metrics JSON")
    ap.add_argument("--tokenizer", metavar="DIR", help=f"{TOKENIZER_HELP} (the override model.tokenizer=DIR)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    runs = [o for o in args.overrides if "=" not in o]
    args.overrides = [o for o in args.overrides if "=" in o]
    if args.tokenizer is not None:
        args.overrides.append(f"model.tokenizer={args.tokenizer}")
    if len(runs) + (args.checkpoint is not None) != 1:
        ap.error("give one run: its folder or checkpoint.pt (first argument or --checkpoint)")
    setup_logging(args.verbose)

    from coop import distributed
    from coop.config.load import load_config
    from coop.interop.export import run_checkpoint
    from coop.io import require_writable, write_json
    from coop.train.evaluation import evaluate_checkpoint, evaluate_checkpoint_targets

    args.checkpoint = run_checkpoint(args.checkpoint or runs[0])
    # before any work: the metrics file (or eval_<dataset>.json beside the checkpoint) can be written
    require_writable(args.out or args.checkpoint.parent / "eval.json")
    targets = [o for o in args.overrides if o.split("=", 1)[0].strip() == "eval.targets"]
    if targets:
        names = list(load_config(None, targets[-1:]).eval.targets)
        rest = [o for o in args.overrides if o not in targets]
        with tokenizer_hint(args.tokenizer):
            evaluated = evaluate_checkpoint_targets(args.checkpoint, names, rest)
        for name, metrics in evaluated.items():
            if distributed.is_main():
                print(
                    json.dumps({"file": name, **{k: metrics[k] for k in ("dataset", "accuracy", "n_test")}})
                )
        return 0
    with tokenizer_hint(args.tokenizer):
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

"""Import a checkpoint trained by an original codebase (CoOp, CoCoOp, KgCoOp, the MaPLe or
PromptSRC repository) as an ordinary run folder.

    python tools/import_checkpoint.py --from maple PATH/MultiModalPromptLearner/model.pth.tar-5 \\
        --out runs/imported/maple_dtd data.name=dtd data.root=$DATA model.name=ViT-B-16
    python tools/eval.py --checkpoint runs/imported/maple_dtd/checkpoint.pt

--from: coop, cocoop, kgcoop, vpt, ivlp, maple or promptsrc. The file is a Dassl checkpoint
(`model.pth.tar-<epoch>`), read with torch.load(weights_only=True); a file that needs arbitrary
unpickling is refused. The folder gets `config.yaml` (the method's recipe, what the tensors imply:
prompt.n_ctx, prompt.csc, prompt.depth, vision.n_ctx, vision.depth; then your key=value
overrides) and a finished `checkpoint.pt`; the class names come from data.name (base-to-new
checkpoints: data.subsample_classes=base), the class-token position from prompt.position (end).

Unless --no-eval, the run is evaluated on its test split (metrics.json) and on eval.targets, which
needs the model's weights (model.pretrained) and the data; --no-eval only checks the shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

from coop.interop import IMPORTABLE  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="method", required=True, choices=IMPORTABLE, help="the original trainer")
    ap.add_argument("checkpoint", help="the original's model.pth.tar-<epoch>")
    ap.add_argument("--out", required=True, help="the run folder to write")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config settings, e.g. data.name=dtd")
    ap.add_argument("--no-eval", action="store_true", help="write the folder without evaluating it")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_intermixed_args()  # key=value may follow --out, as in the example
    setup_logging(args.verbose)

    from coop.interop import import_checkpoint

    folder = import_checkpoint(
        args.method, args.checkpoint, args.out, args.overrides, evaluate=not args.no_eval
    )
    summary = {"output_dir": str(folder), "from": args.method}
    metrics = folder / "metrics.json"
    if metrics.is_file():
        summary.update(
            {k: v for k, v in json.loads(metrics.read_text()).items() if k in ("accuracy", "n_test")}
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    run_cli(main)

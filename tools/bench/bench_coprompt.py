"""Benchmark one CoPrompt training step: ours vs the original's way, at 100 and 1,000 classes.

    python tools/bench/bench_coprompt.py [--model ViT-B-16] [--classes 100 1000] [--batch 4]
                                   [--memory-classes 1000] [--no-memory] [--device cpu] [--json FILE]

`tools/bench/bench_vl.py --method coprompt` with CoPrompt's defaults (every other option of
bench_vl.py applies). Both sides compute the same step on random weights with CoPrompt's ImageNet
recipe (depth 12, n_ctx 4, W 8) for the first N ImageNet class names and a made-up descriptions
file of 5 sentences per class: forward, loss and backward into every learned tensor (the prompts,
the couplings and both adapters), on batches of two views.

- ours: `coop.methods.coprompt.CoPrompt.loss`: the text tower cut after [EOS] with the shared
  prefix (MaPLe's), the frozen image tower on the second view without a graph, the description
  features encoded once per run;
- the reference: `coop.reference.coprompt.coprompt_loss`, as ShuvenduRoy/CoPrompt's
  `CustomCLIP.forward`: every class's 77-token prompt every step, open_clip's own modules, the
  description embeddings computed once at build time (untimed, as on our side).

It prints the wall and CPU time of each side (best of `--repeats`, the sides alternating), the
speed-up, the bound the token counts give (tokens x layers x width^2), the largest differences of
loss and gradients, and the peak memory of our step at `--memory-classes` with and without
`train.grad_checkpointing`, each in a fresh process. The reference at 1,000 classes needs about
30 GB (its graph of 77,000 text tokens): where the device has less free, it is skipped with a
message and the bound stands alone. Small sizes run in seconds: `--model
configs/models/coop-tiny.json --classes 5 --batch 2 --set prompt.depth=2`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402 - first: OpenMP's settings (tools/_cli.py) before torch loads
import bench_vl  # noqa: E402

DEFAULTS = ["--method", "coprompt", "--classes", "100", "1000"]


def main(argv=None) -> int:
    """bench_vl's main with CoPrompt's defaults; options given here win (argparse keeps the last)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    return bench_vl.main([*DEFAULTS, *argv])


if __name__ == "__main__":
    _cli.run_cli(main)

"""The quick-start demo: a 16-shot CoOp run on the bundled textile images.

    python tools/demo.py [key=value ...]

Runs `configs/demo.yaml` (ViT-B-16, OpenAI weights). When those weights are neither cached nor
downloadable (an offline machine), it says so loudly and runs the same pipeline on random weights
(`model.pretrained=none`): the run then shows the machinery working, not CLIP's accuracy.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import run_cli, setup_logging  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("coop.demo")


def main() -> int:
    setup_logging()
    from coop.config.load import load_config
    from coop.model.weights import pretrained_available
    from coop.train.runner import train_run

    overrides = sys.argv[1:]
    cfg = load_config(str(REPO / "configs" / "demo.yaml"), overrides)
    if not pretrained_available(cfg.model.name, cfg.model.pretrained):
        log.warning(
            "OpenCLIP weights '%s' for %s are not cached and cannot be downloaded here: running the demo "
            "on RANDOM weights (model.pretrained=none). Accuracy will be near chance.",
            cfg.model.pretrained,
            cfg.model.name,
        )
        cfg = load_config(str(REPO / "configs" / "demo.yaml"), [*overrides, "model.pretrained=none"])
        if "output_dir" not in " ".join(overrides):
            cfg.output_dir = "output/demo-random-weights"
    metrics = train_run(cfg)
    print(
        json.dumps(
            {"output_dir": cfg.output_dir, **{k: metrics[k] for k in ("accuracy", "macro_f1", "n_test")}}
        )
    )
    files = sorted(p.name + "/" * p.is_dir() for p in Path(cfg.output_dir).iterdir())
    print(f"run folder: {cfg.output_dir} ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    run_cli(main)

"""Test-time adaptation: methods that adapt a trained or zero-shot classifier to unlabelled test
images, one image (episodic) or one stream of images (online) at a time (`coop.tta.base`).

    method = build_tta(host, cfg)            # cfg.tta.method names a class of TTA_METHODS
    tta_run(cfg)                             # coop.tta.runner: the pass over the test split

Modules: `base` (the interface), `views` (the views of a test image), `host` (the classifier the
method adapts: zero-shot, or a run folder or export), `runner` (the pass and its run folder),
`outputs` (per-image outputs in atomic chunks), and one module per method (`zero`).

The test-time layer, the top of the package: may import coop.interop (a run folder or export as
the host, `coop.tta.host`), coop.federated, coop.train, coop.methods, coop.model, coop.data,
coop.config and the root modules. Imported by: the tools.
"""

from __future__ import annotations

from omegaconf import DictConfig

from coop.methods.base import Method
from coop.tta.base import TestTimeError, TestTimeMethod, confident_views, entropy, host_features, host_logits
from coop.tta.boostadapter import BoostAdapter
from coop.tta.dpe import DPE
from coop.tta.tda import TDA
from coop.tta.tpt import CTPT, TPT
from coop.tta.zero import Zero

TTA_METHODS: dict[str, type[TestTimeMethod]] = {
    "tpt": TPT,
    "ctpt": CTPT,
    "zero": Zero,
    "tda": TDA,
    "dpe": DPE,
    "boostadapter": BoostAdapter,
}


def tta_class(name: str) -> type[TestTimeMethod]:
    """The class of `tta.method=name`; a one-line TestTimeError if it is not available."""
    if name not in TTA_METHODS:
        raise TestTimeError(
            f"tta.method={name} is not available (available: {', '.join(sorted(TTA_METHODS))})"
        )
    return TTA_METHODS[name]


def build_tta(host: Method, cfg: DictConfig) -> TestTimeMethod:
    """The test-time method `cfg.tta.method` around `host`; a one-line TestTimeError if it is not
    available or cannot start from the host (`TestTimeMethod.check_host`)."""
    return tta_class(cfg.tta.method)(host, cfg)


__all__ = [
    "CTPT",
    "DPE",
    "TDA",
    "BoostAdapter",
    "TPT",
    "TTA_METHODS",
    "TestTimeError",
    "TestTimeMethod",
    "Zero",
    "build_tta",
    "tta_class",
    "confident_views",
    "entropy",
    "host_features",
    "host_logits",
]

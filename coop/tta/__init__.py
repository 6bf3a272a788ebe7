"""Test-time adaptation: methods that adapt a trained or zero-shot classifier to unlabelled test
images, one image (episodic) or one stream of images (online) at a time (`coop.tta.base`).

The test-time layer, a sibling of coop.federated: may import coop.train, coop.methods, coop.model,
coop.data, coop.config and the root modules. Imported by: the tools.
"""

from __future__ import annotations

from coop.tta.base import (
    TestTimeError,
    TestTimeMethod,
    confident_views,
    entropy,
    host_features,
    host_logits,
)
from coop.tta.boostadapter import BoostAdapter
from coop.tta.dpe import DPE
from coop.tta.tda import TDA

TTA_METHODS: dict[str, type[TestTimeMethod]] = {"tda": TDA, "dpe": DPE, "boostadapter": BoostAdapter}

__all__ = [
    "TTA_METHODS",
    "TestTimeError",
    "TestTimeMethod",
    "confident_views",
    "entropy",
    "host_features",
    "host_logits",
]

"""The test-time layer's one interface: a method that adapts to unlabelled test images.

A test-time method wraps a *host*: a `coop.methods.Method` that already classifies (zero-shot
CLIP with its hand-written prompt, or a trained CoOp, CoCoOp, MaPLe, ... run restored from its run
folder or export). The runner (`coop.tta.runner`) builds the host, wraps it, and for each test
image i hands the method the image's views and its position in the split:

    method = build_tta(host, cfg)           # cfg.tta.method names it
    logits = method.predict(views, i)       # (n_cls,): views (V, 3, H, W), views[0] the image itself

Two kinds (`kind`):

    episodic  every image adapts from the same starting state, which `predict` leaves unchanged
              (TPT, C-TPT, ZERO): results depend neither on the order of the images nor on how
              they are shared across processes
    online    state (caches, prototypes) carries over from image to image along a seeded stream
              (TDA, DPE, BoostAdapter); `state()` is what a checkpoint keeps with the stream's
              position, `load_state` restores it, so a killed pass resumes bit-identically

Views are pixels so that any host can score them, through its own (possibly prompted) image tower.
`host_features` and `host_logits` are the two ways in: a method that reads only features (TDA,
DPE, ZERO on a feature host) encodes each view once; one that changes the prompt (TPT) re-scores.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig
from torch import nn

from coop.methods.base import Method


class TestTimeError(ValueError):
    """A test-time setting that cannot work: a host the method cannot start from, views or a
    selection fraction out of range. One line, raised before any work."""

    __test__ = False  # not a pytest class, despite its name


class TestTimeMethod(nn.Module):
    """Base class of the test-time methods.

    Args:
        host: the classifier to adapt; frozen, in eval mode.
        cfg: the run config; a method reads `tta.*` and its own `<name>.*` keys.
    """

    __test__ = False  # not a pytest class, despite its name
    name = "tta"
    kind = "episodic"  # or "online"
    # the augmented views where `tta.augment` is null (`coop.tta.views`): TPT's rule by dataset
    # ("tpt"), or "augmix" / "crop_flip" on every dataset, as the method's original does
    augment = "tpt"

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__()
        type(self).check_host(host)
        self.host = host.eval()
        self.cfg = cfg

    @classmethod
    def check_host(cls, host: Method) -> None:
        """A one-line TestTimeError when this method cannot start from `host` (e.g. TPT from a
        linear probe, which has no prompt). By default every host works."""

    @classmethod
    def views_for(cls, cfg: DictConfig) -> int | None:
        """How many views (the image itself included) this method's original takes on
        `cfg.data.name`, for a runner whose `tta.views` is left unset; None: no preference. The
        online methods answer per dataset (TDA: the image alone on the cross-dataset sets)."""
        return None

    def predict(self, views: torch.Tensor, index: int) -> torch.Tensor:
        """The logits (n_cls,) of test image `index` from its views (V, 3, H, W), views[0] being the
        image under the test transform; their argmax is the prediction. An episodic method leaves
        its starting state as it found it; an online one updates its state."""
        raise NotImplementedError

    def state(self) -> dict[str, torch.Tensor]:
        """What carries over between images (an online method's caches or prototypes), as plain
        tensors for a checkpoint; episodic methods carry nothing."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what `state` returned."""
        if state:
            raise TestTimeError(f"tta.method={self.name} carries no state, got {sorted(state)}")

    def describe(self) -> dict:
        """Method-specific fields for metrics.json."""
        return {}


def host_features(host: Method, views: torch.Tensor, prepared=None) -> torch.Tensor:
    """Unnormalised image features (V, E) of the views through the host's image tower: CLIP's own
    for a feature host, the host's prompted tower for a pixel host (`Method.towers`; `prepared` as
    for `Method.logits`, so that a method that keeps it does not recompute the host's text)."""
    if host.input == "features":
        return host.clip.encode_image(views)
    return host.towers(views, prepared).image


def host_logits(host: Method, views: torch.Tensor, prepared=None) -> torch.Tensor:
    """The host's logits (V, n_cls) of the views; `prepared` as for `Method.logits`."""
    x = host.clip.encode_image(views) if host.input == "features" else views
    return host.logits(x, prepared)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats of softmax(logits) along the last dimension, in fp32."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def n_confident(views: int, fraction: float) -> int:
    """How many of `views` views a selection at `fraction` keeps: int(views * fraction), rounded down
    as TPT's and ZERO's code do (6 of 64 at 0.1), but at least one (one view: the image itself)."""
    return max(1, int(views * fraction))


def confident_views(logits: torch.Tensor, fraction: float) -> torch.Tensor:
    """Indices of the `n_confident` views (rows of `logits`, (V, n_cls)) with the lowest entropy,
    most confident first; ties keep the lower index (a stable sort)."""
    k = n_confident(logits.shape[0], fraction)
    return torch.sort(entropy(logits), stable=True).indices[:k]


def check_fraction(key: str, value: float) -> float:
    """A selection fraction in (0, 1], or a one-line TestTimeError naming the key."""
    value = float(value)
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise TestTimeError(f"{key}={value} must be in (0, 1]")
    return value

"""What the online methods (TDA, DPE, BoostAdapter) share: the per-class caches of test features,
the scoring of an image's views, the cache's affinity logits, and the per-dataset settings.

An image's views are scored as TDA's `get_clip_logits` scores them (DPE's and BoostAdapter's are
copies of it): with f_v the L2-normalised feature of view v and W the normalised class text
features, the view logits are s f_v W^T (s = 100 in all three originals). One view: the image's own
logits, their entropy (nats) and softmax. Several views: the `n_confident` views of lowest entropy
(`coop.tta.base.confident_views`); the image's feature is their features' mean, NOT renormalised,
its logits their logits' mean, its loss the entropy of their mean probability, its probability
map that mean, its class the argmax of the mean logits (`score_views`).

A `ClassCache` holds, per class, up to `capacity` entries (feature, loss[, probability map]) in
padded tensors, so that `state()` is plain tensors. Two update rules:

    admit  TDA's `update_cache`: a class with room appends; a full one replaces its LAST entry only
           when the new loss is strictly lower; the class's entries are then sorted by loss (stable)
    push   BoostAdapter's negative cache (`fifo=True`): append, and drop the oldest beyond capacity

Cache logits (TDA's `compute_cache_logits`) of a key f against the entries' keys K and values L:
alpha exp(-(beta - beta f K^T)) L, the entries in class order, then slot order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from coop.methods.base import Method
from coop.methods.zeroshot import ZeroShot
from coop.tta.base import TestTimeError, confident_views, entropy, host_features

# The ImageNet test sets with ImageNet's classes: TDA's and DPE's "A/V/R/S" (their configs' names
# imagenet_a, imagenet_v, imagenet_r, imagenet_s are ours below).
IMAGENET_OOD = ("imagenet_a", "imagenetv2", "imagenet_r", "imagenet_sketch")
IMAGENET_FAMILY = ("imagenet", *IMAGENET_OOD)


def settings(cfg: DictConfig, section: str, table: dict[str, dict], default: str = "imagenet") -> dict:
    """The `section.*` keys of `cfg`, each null key replaced by the original's value for
    `cfg.data.name` in `table` (a dataset without a row takes `default`'s row)."""
    own = OmegaConf.to_container(cfg[section])
    row = table.get(str(cfg.data.name), table[default])
    return {k: (row[k] if v is None and k in row else v) for k, v in own.items()}


def original_views(cfg: DictConfig, table: dict[str, dict], default: str = "imagenet") -> int:
    """The views per image of the original on `cfg.data.name` (`table`'s "views")."""
    return int(table.get(str(cfg.data.name), table[default])["views"])


def check_text_host(name: str, host: Method) -> None:
    """A one-line TestTimeError when `host` exposes no class text features (`Method.towers`)."""
    if isinstance(host, ZeroShot) or type(host).towers is not Method.towers:
        return
    raise TestTimeError(
        f"tta.method={name} reads the host's class text features, and method={host.name} exposes none"
    )


def encode(host: Method, views: torch.Tensor, prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, W): the views' L2-normalised image features (V, E) and the class text features the host
    scores them with, normalised: (n_cls, E), or (V, n_cls, E) where they depend on the image
    (CoCoOp); both fp32. `prepared` is the host's `prepare()`."""
    if host.input == "features":
        image = host_features(host, views)
        text = prepared if isinstance(host, ZeroShot) else host.towers(image, prepared).text
    else:  # a pixel host's prompted image tower: one pass gives both
        towers = host.towers(views, prepared)
        image, text = towers.image, towers.text
    return F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1)


def view_logits(features: torch.Tensor, text: torch.Tensor, scale: float) -> torch.Tensor:
    """s f W^T: (V, n_cls) from features (V, E) and text (n_cls, E) or (V, n_cls, E)."""
    if text.dim() == 3:
        return scale * torch.einsum("ve,vce->vc", features, text)
    return scale * features @ text.T


def mean_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the mean probability of the rows of `logits` (k, n_cls): TPT's and TDA's
    `avg_entropy`, the log of the mean clamped at the dtype's lowest value."""
    logp = logits.log_softmax(-1)
    avg = torch.logsumexp(logp, dim=0) - math.log(logits.shape[0])
    avg = avg.clamp(min=torch.finfo(avg.dtype).min)
    return -(avg * avg.exp()).sum(-1)


@dataclass
class Scored:
    """An image scored from its views (`score_views`).

    Attributes:
        feature: (E,) the cache key: the image's feature or the confident views' mean.
        logits: (n_cls,) the image's logits before any cache.
        loss: () entropy in nats: of the image's softmax or of the confident views' mean probability.
        probs: (n_cls,) the probability map the negative cache keeps.
        pred: the predicted class.
    """

    feature: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor
    probs: torch.Tensor
    pred: int


def score_views(features: torch.Tensor, logits: torch.Tensor, fraction: float) -> Scored:
    """TDA's `get_clip_logits` after the encoding: features (V, E) normalised, logits (V, n_cls)."""
    if features.shape[0] == 1:
        return score_image(features, logits, 0)
    keep = confident_views(logits, fraction)  # most confident first
    picked = logits[keep]  # (k, n_cls)
    mean = picked.mean(0)
    feature = features[keep].mean(0)  # not renormalised
    return Scored(feature, mean, mean_entropy(picked), picked.softmax(-1).mean(0), int(mean.argmax()))


def score_image(features: torch.Tensor, logits: torch.Tensor, v: int) -> Scored:
    """View `v` scored alone (the image itself, or one of BoostAdapter's boosting views)."""
    return Scored(features[v], logits[v], entropy(logits[v]), logits[v].softmax(-1), int(logits[v].argmax()))


def affinity_logits(
    feature: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, alpha: float, beta: float
) -> torch.Tensor:
    """alpha exp(-(beta - beta f K^T)) L: (n_cls,) from the key f (E,), keys K (N, E), values L (N, n_cls)."""
    affinity = keys @ feature  # (N,)
    return alpha * (torch.exp(-(beta - beta * affinity)) @ values)


class ClassCache:
    """Per class up to `capacity` entries of (key (E,), loss[, probability map (n_cls,)]).

    Args:
        n_cls: classes.
        capacity: entries per class (TDA's shot capacity).
        dim: the keys' width E.
        probs: whether entries keep a probability map (TDA's negative cache).
        device: where the tensors live (the features').
    """

    def __init__(self, n_cls: int, capacity: int, dim: int, probs: bool = False, device=None):
        self.capacity = capacity
        self.keys = torch.zeros(n_cls, capacity, dim, device=device)  # (n_cls, S, E)
        self.loss = torch.zeros(n_cls, capacity, device=device)  # (n_cls, S)
        self.count = torch.zeros(n_cls, dtype=torch.long, device=device)  # (n_cls,) entries used, from slot 0
        self.probs = (
            torch.zeros(n_cls, capacity, n_cls, device=device) if probs else None
        )  # (n_cls, S, n_cls)

    def __bool__(self) -> bool:
        return bool(self.count.any())

    def _write(self, c: int, slot: int, key: torch.Tensor, loss: torch.Tensor, probs) -> None:
        self.keys[c, slot] = key
        self.loss[c, slot] = loss
        if self.probs is not None:
            self.probs[c, slot] = probs

    def admit(self, c: int, key: torch.Tensor, loss: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        """TDA's rule: append while there is room; when full, replace the last (highest-loss) entry
        only on a strictly lower loss; then sort the class's entries by loss, stably."""
        n = int(self.count[c])
        if n < self.capacity:
            self.count[c] = n = n + 1
        elif not loss < self.loss[c, n - 1]:
            return
        self._write(c, n - 1, key, loss, probs)
        order = torch.sort(self.loss[c, :n], stable=True).indices
        self.keys[c, :n] = self.keys[c, order]
        self.loss[c, :n] = self.loss[c, order]
        if self.probs is not None:
            self.probs[c, :n] = self.probs[c, order]

    def push(self, c: int, key: torch.Tensor, loss: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        """BoostAdapter's negative cache (first in, first out): append; when full, drop the oldest."""
        n = int(self.count[c])
        if n == self.capacity:  # shift the entries one slot towards the front
            self.keys[c, :-1] = self.keys[c, 1:].clone()
            self.loss[c, :-1] = self.loss[c, 1:].clone()
            if self.probs is not None:
                self.probs[c, :-1] = self.probs[c, 1:].clone()
            n -= 1
        self._write(c, n, key, loss, probs)
        self.count[c] = n + 1

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(keys (N, E), classes (N,), probability maps (N, n_cls) or None): the entries in class
        order, then slot order, as the originals concatenate their cache dicts."""
        used = torch.arange(self.capacity, device=self.count.device) < self.count[:, None]  # (n_cls, S)
        classes = used.nonzero()[:, 0]
        return self.keys[used], classes, None if self.probs is None else self.probs[used]

    def widened(self, extra: int) -> ClassCache:
        """A copy with `extra` more entries per class (BoostAdapter's per-image cache)."""
        n_cls, _, dim = self.keys.shape
        wide = ClassCache(n_cls, self.capacity + extra, dim, self.probs is not None, self.keys.device)
        wide.keys[:, : self.capacity] = self.keys
        wide.loss[:, : self.capacity] = self.loss
        wide.count = self.count.clone()
        if self.probs is not None:
            wide.probs[:, : self.capacity] = self.probs
        return wide

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.keys": self.keys, f"{prefix}.loss": self.loss, f"{prefix}.count": self.count}
        if self.probs is not None:
            out[f"{prefix}.probs"] = self.probs
        return {k: v.clone() for k, v in out.items()}

    def load_state(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        for name in ("keys", "loss", "count") + (("probs",) if self.probs is not None else ()):
            own, saved = getattr(self, name), state[f"{prefix}.{name}"]
            if own.shape != saved.shape:
                raise TestTimeError(
                    f"the saved {prefix}.{name} has shape {tuple(saved.shape)}, expected {tuple(own.shape)}"
                )
            setattr(self, name, saved.to(own.device, own.dtype, copy=True))

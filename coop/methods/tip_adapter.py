"""Tip-Adapter and Tip-Adapter-F: zero-shot CLIP plus a key-value cache of the few-shot images.

As in Tip-Adapter (Zhang et al., ECCV 2022; main.py and utils.py of gaopengcuhk/Tip-Adapter), with
f the L2-normalised image feature (B, E), W_zs the zero-shot classifier (C, E), K the cache keys
(NK, E) and L the one-hot cache values (NK, C):

    logits = 100 f W_zs^T + alpha * exp(-(beta - beta f K^T)) L

- K: each few-shot training image's features averaged over `tip.augment_epochs` (10) views of
  RandomResizedCrop(scale 0.5-1, bicubic) + flip (`train.crop_scale` in the recipe), unnormalised,
  then L2-normalised (`Method.fit_request`: the engine's feature cache with views).
- W_zs: per template the normalised class features, averaged, renormalised; Tip-Adapter's templates
  are CoOp's per dataset and, for ImageNet, the 7 IMAGENET_TEMPLATES_SELECT (`tip.templates`).
- `tip_adapter` learns nothing: alpha and beta come from its grid search on the val features
  (`tune`): beta_i = 0.1 + i (s_beta - 0.1) / 200, alpha_j = 0.1 + j (s_alpha - 0.1) / 20 (upper ends
  excluded), beta outer, alpha inner, the first best val accuracy kept.
- `tip_adapter_f` trains the keys W_a (NK, E), initialised to K, by SGD at the initial alpha and beta
  (`tip.init_alpha`, `tip.init_beta`), then runs the same search with W_a in place of K.

The per-dataset init_alpha, init_beta and search scales of its configs are `coop.config.recipes`'s
`TIP_SETTINGS`. Logits are formed with autocast off, in the cache's dtype: fp32, or fp16 under
`train.precision=fp16` (the original's half-precision adapter); the 100 is Tip-Adapter's fixed
scale, not the model's logit scale. Scoring other classes (new classes, another dataset) keeps
the cache's columns by class name; a class without cache entries gets zero-shot logits alone.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.data.imagenet_variants import TEST_ONLY_DATASETS
from coop.methods.base import FeatureRequest, Method, TowerLayers, TransferError
from coop.methods.zeroshot import (
    COOP_TEMPLATES,
    DEFAULT_TEMPLATE,
    IMAGENET_TEMPLATES_SELECT,
    resolve_templates,
    template_features,
)
from coop.model.clip import CLIP

log = logging.getLogger(__name__)

CLIP_SCALE = 100.0  # Tip-Adapter's `100. * features @ clip_weights`
IMAGENET_FAMILY = ("imagenet", *TEST_ONLY_DATASETS)  # the same classes: the ImageNet ensemble


def tip_templates(choice: str, dataset: str) -> list[str]:
    """`tip.templates`: "tip" is Tip-Adapter's (CoOp's template per dataset, the 7 selected
    ImageNet templates for ImageNet and its variants); anything else as `zeroshot.templates`."""
    if choice != "tip":
        return resolve_templates(choice, dataset, "tip.templates")
    if dataset in IMAGENET_FAMILY:
        return list(IMAGENET_TEMPLATES_SELECT)
    return [COOP_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)]


def tip_logits(f, zs, keys, values, alpha: float, beta: float) -> torch.Tensor:
    """100 f zs^T + alpha exp(-(beta - beta f keys^T)) values, term by term as Tip-Adapter writes it.

    Args:
        f: L2-normalised image features (B, E).
        zs: the zero-shot classifier (C, E).
        keys: cache keys (NK, E) (Tip-Adapter-F: the trained W_a).
        values: one-hot cache values (NK, C).
        alpha, beta: the residual ratio and the sharpness.
    """
    affinity = f @ keys.t()  # (B, NK)
    cache = ((-1) * (beta - beta * affinity)).exp() @ values  # (B, C)
    return CLIP_SCALE * f @ zs.t() + cache * alpha


def search_grid(scale: float, steps: int) -> list[float]:
    """Tip-Adapter's grid: 0.1 + i (scale - 0.1) / steps for i < steps (the upper end excluded)."""
    return [i * (scale - 0.1) / steps + 0.1 for i in range(steps)]


def search_alpha_beta(f, zs, keys, values, labels, scale, steps) -> tuple[float, float, float]:
    """Tip-Adapter's `search_hp` on val features: (beta, alpha, val accuracy in %).

    Args:
        f, zs, keys, values: as for `tip_logits` (f: the val split's normalised features).
        labels: val labels (N,).
        scale, steps: [beta, alpha] upper ends and grid sizes (`tip.search_scale`, `tip.search_step`).
    """
    clip = CLIP_SCALE * f @ zs.t()  # (N, C), the same for every grid point
    affinity = f @ keys.t()  # (N, NK)
    best, best_beta, best_alpha = -1, None, None
    for beta in search_grid(float(scale[0]), int(steps[0])):
        cache = ((-1) * (beta - beta * affinity)).exp() @ values  # (N, C)
        for alpha in search_grid(float(scale[1]), int(steps[1])):
            correct = int(((clip + cache * alpha).argmax(-1) == labels).sum())
            if correct > best:  # strictly better: the first best point is kept
                best, best_beta, best_alpha = correct, beta, alpha
    return best_beta, best_alpha, 100.0 * best / len(labels)


def normalise(features: torch.Tensor) -> torch.Tensor:
    """features / ||features|| along the last dim, as Tip-Adapter divides (no epsilon)."""
    return features / features.norm(dim=-1, keepdim=True)


class TipAdapter(Method):
    """Zero-shot CLIP plus the training-free cache model; alpha and beta tuned on val.

    Args:
        clip, classnames: as for every method.
        cfg: reads `tip.*` and `data.name`.
    """

    name = "tip_adapter"
    trainer = "none"
    keys_name = "keys"  # what the checkpoint calls the keys the logits use

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        tip_templates(str(cfg.tip.templates), cfg.data.name)  # a known name or a template

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        tip = cfg.tip
        self.alpha, self.beta = float(tip.init_alpha), float(tip.init_beta)
        self.search_scale, self.search_step = list(tip.search_scale), list(tip.search_step)
        self.tunes_on_val = bool(tip.search)
        self.augment_epochs = int(tip.augment_epochs)
        self.fit_request = FeatureRequest(views=self.augment_epochs, augment=True)
        self.template_choice = str(tip.templates)
        self.templates = tip_templates(self.template_choice, cfg.data.name)
        dim = clip.embed_dim
        self.register_buffer("keys", torch.zeros(0, dim))  # (NK, E), set by `fit`
        self.register_buffer("values", torch.zeros(0, self.n_cls))  # (NK, C), one-hot
        self._zs: torch.Tensor | None = None  # (C, E), once per run: it depends on the class names only

    # ---------------------------------------------------------------- the cache model

    def cache_keys(self) -> torch.Tensor:
        return self.keys

    def zero_shot_weights(self) -> torch.Tensor:
        """W_zs (C, E) in the cache's dtype, computed once with autocast off."""
        if self._zs is None:
            device = self.clip.logit_scale.device
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                self._zs = template_features(self.clip, self.classnames, self.templates)
        return self._zs.to(self.values.device, self.values.dtype)

    def fit(self, train: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """The cache: keys = normalised mean of the views (V, N, E), values = one-hot labels."""
        feats, labels = train
        dtype, device = self.clip.logit_scale.dtype, self.clip.logit_scale.device
        keys = normalise(feats.float().mean(0))  # (N, E): the views' mean, then normalised
        with torch.no_grad():
            self.keys = keys.to(device, dtype)
            self.values = F.one_hot(labels.long(), self.n_cls).to(device, dtype)  # (NK, C)
        log.info("%s: cache of %d keys (%d views each)", self.name, len(keys), feats.shape[0])
        return {}

    def logits(self, image_features: torch.Tensor, prepared=None) -> torch.Tensor:
        keys = self.cache_keys()
        with torch.autocast(image_features.device.type, enabled=False):
            f = normalise(image_features.to(keys.dtype))  # (B, E)
            return tip_logits(f, self.zero_shot_weights(), keys, self.values, self.alpha, self.beta)

    def tune(self, train, val: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """Tip-Adapter's alpha/beta grid search on the val features; the best pair is kept."""
        vx, vy = val
        keys = self.cache_keys()
        with torch.no_grad(), torch.autocast(vx.device.type, enabled=False):
            f = normalise(vx.to(keys.device, keys.dtype))  # (N, E)
            labels = vy.to(keys.device)
            zs, scale, steps = self.zero_shot_weights(), self.search_scale, self.search_step
            beta, alpha, acc = search_alpha_beta(f, zs, keys, self.values, labels, scale, steps)
        self.alpha, self.beta = alpha, beta
        log.info("%s: alpha=%.4g beta=%.4g (val accuracy %.2f%%)", self.name, alpha, beta, acc)
        return {"tip_alpha": alpha, "tip_beta": beta, "val_accuracy": acc}

    # ---------------------------------------------------------------- checkpoints

    def learnable(self) -> dict[str, torch.Tensor]:
        """The cache and the chosen alpha and beta (float64 scalars, exactly as chosen)."""
        scalars = {k: torch.tensor(getattr(self, k), dtype=torch.float64) for k in ("alpha", "beta")}
        return {self.keys_name: self.cache_keys(), "values": self.values, **scalars}

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """The cache of `classnames`; its value columns follow the class names, so a subset
        (ImageNet-A/-R) keeps its columns and a class without cache entries gets a zero column."""
        expected = {self.keys_name, "values", "alpha", "beta"}
        if set(tensors) != expected:
            raise TransferError(
                f"{self.name} expects tensors {sorted(expected)}, the checkpoint has {sorted(tensors)}"
            )
        index = {name: i for i, name in enumerate(classnames)}
        saved = tensors["values"]  # (NK, C_trained)
        values = torch.zeros(saved.shape[0], self.n_cls, dtype=saved.dtype)
        for j, name in enumerate(self.classnames):
            if name in index:
                values[:, j] = saved[:, index[name]]
        missing = sum(name not in index for name in self.classnames)
        if missing:
            log.info(
                "%s: %d of %d classes have no cache entries: zero-shot logits alone",
                self.name,
                missing,
                self.n_cls,
            )
        self.set_keys(tensors[self.keys_name].clone())
        self.values = values.to(self.values.device, self.values.dtype)
        self.alpha, self.beta = float(tensors["alpha"]), float(tensors["beta"])

    def set_keys(self, keys: torch.Tensor) -> None:
        self.keys = keys.to(self.keys.device, self.keys.dtype)

    def describe(self) -> dict:
        return {
            "tip_alpha": self.alpha,
            "tip_beta": self.beta,
            "tip_augment_epochs": self.augment_epochs,
            "tip_templates": self.template_choice,
        }


class TipAdapterF(TipAdapter):
    """Tip-Adapter with the cache keys trained: W_a (NK, E), initialised to the cache keys."""

    name = "tip_adapter_f"
    trainer = "sgd"
    keys_name = "adapter"

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.adapter = nn.Parameter(torch.zeros(0, clip.embed_dim))  # (NK, E), set by `fit`

    def cache_keys(self) -> torch.Tensor:
        return self.adapter

    def fit(self, train: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """The cache, and W_a starting at its keys (in the model's dtype: fp16 under fp16)."""
        super().fit(train)
        self.set_keys(self.keys.clone())
        return {}

    def set_keys(self, keys: torch.Tensor) -> None:
        """W_a := keys; in place where the shape agrees, so that the optimizer keeps its tensor
        (a resumed run's `fit` creates W_a, then the checkpoint's values are copied into it)."""
        if self.adapter.shape == keys.shape:
            with torch.no_grad():
                self.adapter.copy_(keys)
        else:
            self.adapter = nn.Parameter(keys.to(self.keys.device, self.keys.dtype))

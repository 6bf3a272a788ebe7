"""TDA (Karmanov et al., CVPR 2024; kdiAAA/TDA, tda_runner.py and utils.py): a training-free
dynamic adapter, a positive and a negative cache of test features that grow along the stream.

For each test image, scored from its views as `coop.tta.online.score_views` describes (feature f,
logits z, loss H in nats, probability map p, class y):

    1. the positive cache admits (f, H) under class y (`ClassCache.admit`, shot capacity 3)
    2. if lower < H / log2(C) < upper (nats divided by log2 of the classes, as TDA's `get_entropy`
       does), the negative cache admits (f, H, p) under y (shot capacity 2)
    3. logits = z + alpha+ exp(-(beta+ - beta+ f K+^T)) onehot(classes+)
                  - alpha- exp(-(beta- - beta- f K-^T)) [mask_lo < P- < mask_hi]

The current image is in the caches before it is scored. Settings (`tda.*`, null: the original's
value for the dataset, its configs/<dataset>.yaml): `TDA_SETTINGS`; a dataset without a file
(the bundled demo data, an image folder) takes ImageNet's. Views: TDA's loaders give the image
alone (the test transform) on ImageNet and the 10 cross-dataset sets, and 64 AugMix views on
ImageNet-A, -V2, -R and -Sketch (`views_for`). The scale s of z is TDA's hard-coded 100, not the
model's logit scale (`tda.scale`; null: the model's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.methods.base import Method
from coop.tta.base import TestTimeError, TestTimeMethod, check_fraction
from coop.tta.online import (
    IMAGENET_OOD,
    ClassCache,
    Scored,
    affinity_logits,
    check_text_host,
    encode,
    original_views,
    score_views,
    settings,
    view_logits,
)

# TDA's configs/<dataset>.yaml: the positive cache's alpha and beta differ per dataset; its
# negative cache (capacity 2, alpha 0.117, beta 1, entropy band (0.2, 0.5), mask (0.03, 1)) and
# the positive capacity 3 are the same in every file (the `tda.*` defaults).
_POSITIVE = {  # dataset: (alpha, beta); TDA's fgvc, imagenet_v and imagenet_s are ours below
    "caltech101": (5.0, 5.0),
    "dtd": (2.0, 3.0),
    "eurosat": (4.0, 8.0),
    "fgvc_aircraft": (2.0, 2.0),
    "food101": (1.0, 1.0),
    "imagenet": (2.0, 5.0),
    "imagenet_a": (2.0, 5.0),
    "imagenet_r": (1.0, 8.0),
    "imagenet_sketch": (2.363, 7.45),
    "imagenetv2": (1.0, 8.0),
    "oxford_flowers": (1.0, 5.0),
    "oxford_pets": (2.0, 7.0),
    "stanford_cars": (1.0, 7.0),
    "sun397": (2.0, 3.0),
    "ucf101": (3.0, 8.0),
}
TDA_SETTINGS = {
    dataset: {"pos_alpha": alpha, "pos_beta": beta, "views": 64 if dataset in IMAGENET_OOD else 1}
    for dataset, (alpha, beta) in _POSITIVE.items()
}


class TDA(TestTimeMethod):
    """TDA's positive and negative caches over any host with class text features."""

    name = "tda"
    kind = "online"
    table = TDA_SETTINGS  # the original's per-dataset values of the null keys, and its views
    augment = "augmix"  # TDA's OOD loaders: AugMixAugmenter(augmix=True)

    @classmethod
    def check_host(cls, host: Method) -> None:
        check_text_host(cls.name, host)

    @classmethod
    def views_for(cls, cfg: DictConfig) -> int:
        return original_views(cfg, cls.table)

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__(host, cfg)
        self.settings = s = settings(cfg, self.name, self.table)
        self.fraction = check_fraction(f"{self.name}.fraction", s["fraction"])
        for band in ("neg_entropy", "neg_mask"):
            if not s[band][0] < s[band][1]:
                raise TestTimeError(f"{self.name}.{band}={s[band]} must be [lower, upper] with lower < upper")
        self.scale = float(host.clip.logit_scale.exp()) if s["scale"] is None else float(s["scale"])
        self._prepared = None  # (host.prepare(),) once, at the first image
        self.pos: ClassCache | None = None  # built at the first image, when the width is known
        self.neg: ClassCache | None = None

    # -- one image ------------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, views: torch.Tensor, index: int) -> torch.Tensor:
        features, logits = self.encode(views)
        image = self.score(features, logits)
        n_cls = logits.shape[-1]
        self.build_caches(n_cls, features.shape[-1], features.device)
        s = self.settings
        if s["pos_enabled"]:
            self.pos.admit(image.pred, image.feature, image.loss)
        lower, upper = s["neg_entropy"]
        if s["neg_enabled"] and lower < float(image.loss / math.log2(n_cls)) < upper:
            self.update_negative(image)
        return self.combine(image, self.positive_cache(features, logits))

    def encode(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised features (V, E), view logits (V, n_cls)), the host's text prepared once."""
        if self._prepared is None:
            self._prepared = (self.host.prepare(),)
        features, text = encode(self.host, views, self._prepared[0])
        return features, view_logits(features, text, self.scale)

    def score(self, features: torch.Tensor, logits: torch.Tensor) -> Scored:
        """The image from its views (TDA's `get_clip_logits`)."""
        return score_views(features, logits, self.fraction)

    def update_negative(self, image: Scored) -> None:
        """TDA's negative cache admits by loss, as the positive one does."""
        self.neg.admit(image.pred, image.feature, image.loss, image.probs)

    def positive_cache(self, features: torch.Tensor, logits: torch.Tensor) -> ClassCache:
        """The positive cache the image is scored with (BoostAdapter adds the image's own views)."""
        return self.pos

    def combine(self, image: Scored, pos: ClassCache) -> torch.Tensor:
        """z + the positive cache's logits - the negative cache's (TDA's `final_logits`)."""
        s, out = self.settings, image.logits.clone()
        n_cls = out.shape[-1]
        if s["pos_enabled"] and pos:
            keys, classes, _ = pos.entries()
            values = F.one_hot(classes, n_cls).to(keys.dtype)
            out += affinity_logits(image.feature, keys, values, s["pos_alpha"], s["pos_beta"])
        if s["neg_enabled"] and self.neg:
            keys, _, probs = self.neg.entries()
            lower, upper = s["neg_mask"]
            values = ((probs > lower) & (probs < upper)).to(keys.dtype)
            out -= affinity_logits(image.feature, keys, values, s["neg_alpha"], s["neg_beta"])
        return out

    # -- state ----------------------------------------------------------------------------------

    def build_caches(self, n_cls: int, dim: int, device) -> None:
        if self.pos is None:
            s = self.settings
            self.pos = ClassCache(n_cls, int(s["pos_capacity"]), dim, device=device)
            self.neg = ClassCache(n_cls, int(s["neg_capacity"]), dim, probs=True, device=device)

    def state(self) -> dict[str, torch.Tensor]:
        if self.pos is None:  # no image seen yet
            return {}
        return {**self.pos.state("pos"), **self.neg.state("neg")}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            self.pos = self.neg = None
            return
        n_cls, _, dim = state["pos.keys"].shape
        self.pos = self.neg = None
        self.build_caches(n_cls, dim, self.host.clip.logit_scale.device)
        self.pos.load_state(state, "pos")
        self.neg.load_state(state, "neg")

    def describe(self) -> dict:
        return {"scale": self.scale, **{k: v for k, v in self.settings.items()}}

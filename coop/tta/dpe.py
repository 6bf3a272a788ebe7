"""DPE (Zhang et al., NeurIPS 2024; zhangce01/DPE-CLIP, main_dpe.py and utils.py): dual prototype
evolution, textual prototypes that evolve along the stream and visual prototypes from a cache,
both refined by residuals learned on each image.

State: the textual prototypes T (C, E), starting at the host's normalised class text features, the
count n of updates, and a positive cache (TDA's rule, capacity 3) of features whose loss is the
entropy divided by log2(C). For each test image, with f_v the views' normalised features:

    1. residuals R_t = 0 (C, E); W = norm(T + R_t) per class; view logits s f_v W^T (s = 100)
    2. the image scored as TDA scores it (`score_views`): feature f, logits z(W), loss H, class y
    3. the cache admits (f, H / log2 C) under y; the visual prototypes P (K, E) are the means of
       the cached features of each of the K classes present, in class order; R_v = 0 (K, E)
    4. one AdamW step (fresh state; lr `lr_text` for R_t, `lr_image` for R_v; eps 1e-3, weight
       decay 0.1) on  entropy(softmax(z(W) + alpha exp(-(beta - beta f Q^T)) onehot))
                      + align * InfoNCE(Q, W[classes]; temperature 0.01),  Q = norm(P + R_v)
       where InfoNCE is info_nce-pytorch's unpaired form: rows normalised, the cross-entropy of
       Q_k W_j^T / 0.01 with the diagonal as the label, averaged over k
    5. inference with the stepped residuals: z' from W' = norm(T + R_t) on the image itself (on
       ImageNet-A: all views, scored again as in 2), plus the cache term of Q' = norm(P + R_v)
    6. if entropy(softmax(logits)) / log2 C < 0.1: n += 1, T = T n/(n+1) + W' / (n+1)
       (T is not renormalised; W = norm(T) at the next image)

The residuals are dropped after each image; T, n and the cache carry over. Settings (`dpe.*`,
null: the original's configs/<dataset>.yaml, `DPE_SETTINGS`): alpha, beta, the two learning rates
and align per dataset. Views: DPE's loaders give 64 AugMix views on ImageNet and its four test
sets, the image alone on the 10 cross-dataset sets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.methods.base import Method
from coop.tta.base import TestTimeError, TestTimeMethod, check_fraction, entropy
from coop.tta.online import (
    IMAGENET_FAMILY,
    ClassCache,
    Scored,
    affinity_logits,
    check_text_host,
    encode,
    original_views,
    score_image,
    score_views,
    settings,
    view_logits,
)

_ORIGINAL = {  # DPE's configs/<dataset>.yaml: dataset: (alpha, beta, lr (text = image), align)
    "caltech101": (15.0, 5.0, 0.0006, 0.2),
    "dtd": (6.0, 3.0, 0.0006, 0.2),
    "eurosat": (3.0, 8.0, 0.00005, 0.2),
    "fgvc_aircraft": (6.0, 2.0, 0.0006, 0.2),
    "food101": (3.0, 1.0, 0.0002, 0.2),
    "imagenet": (6.0, 5.0, 0.0006, 0.5),
    "imagenet_a": (6.0, 5.0, 0.0003, 2.5),
    "imagenet_r": (3.0, 8.0, 0.0006, 0.0),
    "imagenet_sketch": (7.0, 7.45, 0.0006, 0.2),
    "imagenetv2": (3.0, 8.0, 0.0005, 0.5),
    "oxford_flowers": (2.5, 5.0, 0.0001, 0.2),
    "oxford_pets": (4.0, 7.0, 0.00005, 0.2),
    "stanford_cars": (3.0, 7.0, 0.0001, 1.5),
    "sun397": (6.0, 3.0, 0.0002, 0.2),
    "ucf101": (9.0, 8.0, 0.0004, 0.2),
}
DPE_SETTINGS = {
    dataset: {
        "alpha": alpha,
        "beta": beta,
        "lr_text": lr,
        "lr_image": lr,
        "align": align,
        "views": 64 if dataset in IMAGENET_FAMILY else 1,
        "infer_all_views": dataset == "imagenet_a",
    }
    for dataset, (alpha, beta, lr, align) in _ORIGINAL.items()
}


def info_nce(query: torch.Tensor, keys: torch.Tensor, temperature: float) -> torch.Tensor:
    """info_nce-pytorch's loss without negatives: row k of `query` (K, E) against row k of `keys`
    (K, E), the other rows its negatives; rows normalised, mean over k."""
    logits = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T  # (K, K)
    return F.cross_entropy(logits / temperature, torch.arange(len(query), device=query.device))


class DPE(TestTimeMethod):
    """DPE's evolving textual prototypes and cached visual prototypes over a host's class text."""

    name = "dpe"
    kind = "online"
    augment = "augmix"  # DPE's get_preprocess: AugMixAugmenter(augmix=True)

    @classmethod
    def check_host(cls, host: Method) -> None:
        check_text_host(cls.name, host)
        if host.name == "cocoop":
            raise TestTimeError(
                "tta.method=dpe evolves one set of class text features, and method=cocoop's depend on the image"
            )

    @classmethod
    def views_for(cls, cfg: DictConfig) -> int:
        return original_views(cfg, DPE_SETTINGS)

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__(host, cfg)
        self.settings = s = settings(cfg, self.name, DPE_SETTINGS)
        self.fraction = check_fraction("dpe.fraction", s["fraction"])
        self.scale = float(host.clip.logit_scale.exp()) if s["scale"] is None else float(s["scale"])
        self.text: torch.Tensor | None = None  # T (C, E), from the host at the first image
        self.updates = 0  # n
        self.cache: ClassCache | None = None
        self._prepared = None

    def predict(self, views: torch.Tensor, index: int) -> torch.Tensor:
        s = self.settings
        with torch.no_grad():
            features = self.start(views)
        n_cls, dim = self.text.shape
        text_res = torch.zeros(n_cls, dim, device=features.device, requires_grad=True)  # R_t
        with torch.enable_grad():
            weights = F.normalize(self.text + text_res, dim=-1)  # W (C, E)
            image = score_views(features, view_logits(features, weights, self.scale), self.fraction)
            self.cache.admit(image.pred, image.feature.detach(), image.loss.detach() / math.log2(n_cls))
            protos, classes = self.prototypes()
            image_res = torch.zeros_like(protos, requires_grad=True)  # R_v
            keys = F.normalize(protos + image_res, dim=-1)  # Q (K, E)
            loss = entropy(self.with_cache(image, keys, classes))
            loss = loss + s["align"] * info_nce(keys, weights[classes], 0.01)
            groups = [(text_res, s["lr_text"]), (image_res, s["lr_image"])]
            optimizer = torch.optim.AdamW(
                [
                    {"params": [p], "lr": lr, "eps": s["eps"], "weight_decay": s["weight_decay"]}
                    for p, lr in groups
                ]
            )
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            weights = F.normalize(self.text + text_res, dim=-1)  # W'
            if s["infer_all_views"]:  # DPE on ImageNet-A: the views scored again with W'
                final = score_views(features, view_logits(features, weights, self.scale), self.fraction)
            else:  # elsewhere its `images[0]`: the image itself
                final = score_image(features, view_logits(features[:1], weights, self.scale), 0)
            out = self.with_cache(final, F.normalize(protos + image_res, dim=-1), classes)
            if float(entropy(out) / math.log2(n_cls)) < s["update_entropy"]:
                self.updates += 1
                n = self.updates
                self.text = self.text * (n / (n + 1)) + weights * (1 / (n + 1))
        return out

    def start(self, views: torch.Tensor) -> torch.Tensor:
        """The views' normalised features; at the first image, T and the cache from the host."""
        if self._prepared is None:
            self._prepared = (self.host.prepare(),)
        features, text = encode(self.host, views, self._prepared[0])
        if self.text is None:
            self.text = text.clone()
            self.cache = ClassCache(
                len(text), int(self.settings["capacity"]), text.shape[-1], device=text.device
            )
        return features

    def prototypes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P (K, E), classes (K,)): each cached class's mean feature, in class order."""
        present = self.cache.count.nonzero()[:, 0]
        count = self.cache.count[present, None, None].to(self.cache.keys.dtype)
        return (self.cache.keys[present] / count).sum(1), present  # padding slots are zeros

    def with_cache(self, image: Scored, keys: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """z + alpha exp(-(beta - beta f Q^T)) onehot(classes): (C,)."""
        values = F.one_hot(classes, image.logits.shape[-1]).to(keys.dtype)
        return image.logits + affinity_logits(
            image.feature, keys, values, self.settings["alpha"], self.settings["beta"]
        )

    def state(self) -> dict[str, torch.Tensor]:
        if self.text is None:
            return {}
        return {"text": self.text.clone(), "updates": torch.tensor(self.updates), **self.cache.state("pos")}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            self.text, self.cache, self.updates = None, None, 0
            return
        device = self.host.clip.logit_scale.device
        self.text = state["text"].to(device, torch.float32, copy=True)
        self.updates = int(state["updates"])
        n_cls, dim = self.text.shape
        self.cache = ClassCache(n_cls, int(self.settings["capacity"]), dim, device=device)
        self.cache.load_state(state, "pos")

    def describe(self) -> dict:
        return {"scale": self.scale, **self.settings}

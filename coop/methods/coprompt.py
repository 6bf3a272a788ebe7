"""CoPrompt: MaPLe's prompts with two residual adapters, distilled toward class descriptions and
the frozen model's view of a second augmentation (Roy and Etemad, ICLR 2024; `trainers/coprompt.py`
of ShuvenduRoy/CoPrompt).

One training step, for a batch of images with labels y, each in two augmented views x1, x2:

    t      = MaPLe's prompted text features                                  (n_cls, E)
    v      = MaPLe's prompted image features of x1                           (B, E)
    t'     = text_ratio  * A_t(t) + (1 - text_ratio)  * t     (0.2)          adapters: Linear(E, E/r,
    v'     = image_ratio * A_v(v) + (1 - image_ratio) * v     (0.1)          no bias), ReLU, Linear(E/r,
                                                                             E, no bias), ReLU; r = 4
    logits = logit_scale.exp() * norm(v') @ norm(t').T
    d      = one description sentence of every class: index i ~ U{0..S-1} drawn once per step
             for all classes, from a generator seeded by (data.seed, epoch, step)   (n_cls, E)
    v0     = the frozen tower's features of x2                               (B, E)
    loss   = CE(logits, y) + weight * [(1 - mean_c cos(t'_c, d_c)) + (1 - mean_b cos(v'_b, v0_b))]

(`coprompt.distill=mse`: the original's other branch, MSE(norm t', norm d) + MSE(norm v', norm v0)
in place of the two cosine terms.) The adapters act at evaluation too; the distillation terms only
train. Each sentence's features come from the frozen text tower, L2-normalised, once per run, at the
first training step, so evaluation (another dataset's classes, `eval.targets`) needs no descriptions.
The original stacks its sentences as (S, n_cls, E), which needs the same count for every class;
with unequal counts class c takes sentence i mod S_c (S = the largest count).

Recipe (configs/trainers/coprompt.yaml merged with `trainers/constants.py` per dataset): n_ctx 2
from "a photo of a", depth 9, weight 1.0, SGD lr 0.0035, 8 epochs, batch 4, cosine after one
constant warm-up epoch at 1e-5, both views from Resize(224x224) + Dassl's RandAugment(2, 10)
(`train.transform=randaugment`); per dataset n_ctx, depth, weight and Food-101's 5 epochs
(`coop.config.recipes`).

Learned tensors: MaPLe's (`coop.methods.maple`), and `adapter_image.fc.{0,2}.weight`,
`adapter_text.fc.{0,2}.weight` (the official names).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.config.checks import ConfigError
from coop.data.descriptions import load_descriptions
from coop.data.images import derive_seed
from coop.methods.base import TowerLayers, Towers
from coop.methods.descriptions import DescriptionFeatures, description_features
from coop.methods.maple import MaPLe
from coop.model.clip import CLIP

log = logging.getLogger(__name__)

COS_EPS = 1e-7  # the original's nn.CosineSimilarity(dim=1, eps=1e-07)


class Adapter(nn.Module):
    """CoPrompt's adapter: Linear(E, E // r, no bias), ReLU, Linear(E // r, E, no bias), ReLU."""

    def __init__(self, width: int, reduction: int):
        super().__init__()
        hidden = width // reduction
        self.fc = nn.Sequential(
            nn.Linear(width, hidden, bias=False),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, width, bias=False),
            nn.ReLU(inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.to(self.fc[0].weight.dtype))


def residual(adapter: Adapter, x: torch.Tensor, ratio: float) -> torch.Tensor:
    """ratio * adapter(x) + (1 - ratio) * x, in the adapter's dtype (the original's)."""
    x = x.to(adapter.fc[0].weight.dtype)
    return ratio * adapter(x) + (1 - ratio) * x


def step_index(seed: int, epoch: int, step: int, n: int) -> int:
    """The sentence index of a training step: uniform on 0..n-1, from (seed, epoch, step) alone."""
    gen = torch.Generator().manual_seed(derive_seed(seed, epoch, step))
    return int(torch.randint(n, (1,), generator=gen))


def coprompt_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    t: torch.Tensor,
    d: torch.Tensor,
    v: torch.Tensor,
    v0: torch.Tensor,
    *,
    weight: float,
    distill: str = "cosine",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CoPrompt's loss and its unweighted terms {"ce", "text", "image"}, in fp32.

    Args:
        logits, labels: (B, n_cls) and (B,).
        t, d: the adapted text features and the sampled description features (n_cls, E).
        v, v0: the adapted image features of view 1 and the frozen ones of view 2 (B, E).
        weight: the original's TRAINER.W on the sum of the two distillation terms.
        distill: "cosine" (1 - mean cosine) or "mse" (mean squared error of the normalised features).
    """
    with torch.autocast(logits.device.type, enabled=False):
        t, d, v, v0 = (F.normalize(x.float(), dim=-1) for x in (t, d, v, v0))
        if distill == "cosine":
            text = 1.0 - F.cosine_similarity(t, d, dim=1, eps=COS_EPS).mean()
            image = 1.0 - F.cosine_similarity(v, v0, dim=1, eps=COS_EPS).mean()
        else:
            text, image = F.mse_loss(t, d), F.mse_loss(v, v0)
        terms = {"ce": F.cross_entropy(logits.float(), labels), "text": text, "image": image}
        return terms["ce"] + weight * (text + image), terms


class CoPrompt(MaPLe):
    """MaPLe's coupled prompts, residual adapters on both towers' features, and consistency
    terms toward a sampled description and the frozen model's features of a second view.

    Args:
        clip, classnames: as for every method.
        cfg: reads MaPLe's keys, `coprompt.*`, `data.descriptions` and `data.seed`.
    """

    name = "coprompt"
    train_views = 2  # x1 for the prompted towers, x2 for the frozen image tower

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        if not cfg.data.descriptions:
            raise ConfigError(
                "method=coprompt distils toward class descriptions: set data.descriptions=FILE "
                "(JSON: class name -> sentences; tools/describe.py writes one)"
            )

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        c = cfg.coprompt
        self.weight, self.distill = float(c.weight), str(c.distill)
        self.image_ratio, self.text_ratio = float(c.image_ratio), float(c.text_ratio)
        width = int(clip.embed_dim)
        self.adapter_image = Adapter(width, int(c.reduction)).to(self.device)
        self.adapter_text = Adapter(width, int(c.reduction)).to(self.device)
        self.descriptions_file = str(cfg.data.descriptions)
        self.seed = int(cfg.data.seed)
        self._sentences: DescriptionFeatures | None = None  # once per run
        self.step_sentence = 0  # this step's sentence index (`start_step`)
        self.last_terms: dict[str, torch.Tensor] = {}

    def learnable(self) -> dict[str, torch.Tensor]:
        adapters = {f"adapter_image.{k}": p for k, p in self.adapter_image.named_parameters()}
        adapters |= {f"adapter_text.{k}": p for k, p in self.adapter_text.named_parameters()}
        return {**super().learnable(), **adapters}

    def sentences(self) -> DescriptionFeatures:
        """Every class's normalised sentence features (`coop.methods.descriptions`), encoded on first use."""
        if self._sentences is None:
            described = load_descriptions(self.descriptions_file, self.classnames)
            self._sentences = description_features(self.clip, described)
            counts = self._sentences.counts
            log.info(
                "CoPrompt: %d description sentences of %d classes (%d to %d per class) from %s",
                int(counts.sum()),
                len(counts),
                int(counts.min()),
                int(counts.max()),
                self.descriptions_file,
            )
        return self._sentences

    def start_step(self, epoch: int, step: int) -> None:
        self.step_sentence = step_index(self.seed, epoch, step, int(self.sentences().counts.max()))

    def towers(self, images: torch.Tensor, prepared=None) -> Towers:
        text, prompts = self.prepare() if prepared is None else prepared
        image = residual(self.adapter_image, self.image_features(images, prompts), self.image_ratio)
        text = residual(self.adapter_text, text, self.text_ratio)
        return Towers(self.cosine(image, text), text, image)

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`images`: (B, 2, 3, H, W), the two views of each image (`train_views`)."""
        if images.dim() != 5 or images.shape[1] != 2:
            raise ValueError(
                f"method=coprompt trains on two views (B, 2, 3, H, W), got {tuple(images.shape)}"
            )
        parts = self.towers(images[:, 0])
        d = self.sentences().pick(self.step_sentence)
        v0 = self.frozen_image_features(images[:, 1])
        total, terms = coprompt_loss(
            parts.logits, labels, parts.text, d, parts.image, v0, weight=self.weight, distill=self.distill
        )
        self.last_terms = {k: x.detach() for k, x in terms.items()}
        return total, parts.logits

    def to_half(self) -> None:
        """The original's PREC=fp16: as MaPLe's, and both adapters are half (`.to(clip_model.dtype)`)."""
        super().to_half()
        self.adapter_image.half()
        self.adapter_text.half()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "coprompt_weight": self.weight,
            "coprompt_distill": self.distill,
            "coprompt_image_ratio": self.image_ratio,
            "coprompt_text_ratio": self.text_ratio,
        }

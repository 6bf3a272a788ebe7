"""KgCoOp: CoOp plus a pull of the learned class features towards hand-crafted CLIP ones.

As in KgCoOp (Yao et al., CVPR 2023), with w_c the class-c text feature of the learned prompt and
w_c^clip the frozen feature of KgCoOp's hand-crafted template for the dataset ("a photo of a {}, a
type of texture." for DTD, "a photo of a {}." for ImageNet, CoOp's template elsewhere):

    loss = CE(logits, y) + kgcoop.weight * (1 - mean_c cos(w_c, w_c^clip))      (weight 8.0)

Prompts, logits and evaluation are CoOp's (every position, csc and depth); the regulariser only
changes training. w_c^clip is computed once per run, on the first training step, and never stored
in checkpoints, with autocast off (fp32 under fp32 and amp; under fp16 the half-precision
model's features, normalised in fp32). `kgcoop.templates` picks the templates as
`zeroshot.templates` does: "kgcoop" (the default, KgCoOp's own), "coop" (CoOp's: "{} texture."
for DTD), "coop_ensemble", "ensemble" or a literal "...{}...".

KgCoOp's code computes w^clip with a second CLIP that it leaves in fp16 (also under PREC=fp32) and
normalises in fp16, so its w^clip have norms of 1 +- 4e-4; ours are exact fp32 unit vectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from coop.methods.base import TowerLayers, Towers
from coop.methods.coop import CoOp
from coop.methods.zeroshot import resolve_templates, template_features
from coop.model.clip import CLIP

WEIGHT = 8.0  # KgCoOp's lambda


class KgCoOp(CoOp):
    """CoOp whose training loss adds `weight * (1 - mean_c cos(w_c, w_c^clip))`.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.*` (as CoOp), `kgcoop.weight`, `kgcoop.templates` and `data.name`.
    """

    name = "kgcoop"

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        cls.templates_of(cfg)

    @staticmethod
    def templates_of(cfg: DictConfig) -> tuple[str, list[str]]:
        """(`kgcoop.templates`, the template strings it names on `data.name`)."""
        choice = str(OmegaConf.select(cfg, "kgcoop.templates", default="kgcoop"))
        return choice, resolve_templates(choice, cfg.data.name, "kgcoop.templates")

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.weight = float(OmegaConf.select(cfg, "kgcoop.weight", default=WEIGHT))
        self.template_choice, self.templates = self.templates_of(cfg)
        self._clip_features: torch.Tensor | None = None  # (n_cls, E), normalised, once per run

    def clip_features(self) -> torch.Tensor:
        """w^clip: the frozen, L2-normalised template features (n_cls, E) in fp32, computed once."""
        if self._clip_features is None:
            device = self.clip.logit_scale.device
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                self._clip_features = template_features(self.clip, self.classnames, self.templates).float()
        return self._clip_features

    def regulariser(self, text_features: torch.Tensor) -> torch.Tensor:
        """1 - mean_c cos(w_c, w_c^clip) for unnormalised learned features (n_cls, E)."""
        learned = F.normalize(text_features.float(), dim=-1)
        return 1.0 - (learned * self.clip_features()).sum(-1).mean()

    def extra_loss(self, towers: Towers) -> torch.Tensor:
        return self.weight * self.regulariser(towers.text)

    def loss(self, image_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.towers(image_features)
        return F.cross_entropy(t.logits.float(), labels) + self.extra_loss(t), t.logits

    def describe(self) -> dict:
        return {**super().describe(), "kgcoop_weight": self.weight, "kgcoop_templates": self.template_choice}

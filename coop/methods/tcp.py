"""TCP: textual-based class-aware prompts (Yao et al., CVPR 2024; `trainers/tcp.py` of its code).

    t_zs     = norm(CLIP text features of the dataset's teacher template)        (n_cls, E), frozen
    tokens   = meta_net(t_zs).view(n_cls, M, W)     meta_net = Linear(E, E/4) -> QuickGELU -> Linear(E/4, M W)
    prompt   = [SOS][ctx x M] + the dataset's prompt template after its four placeholders
               ("X X X X {}, a type of pet." -> [SOS][v1..v4] {class}, a type of pet.);
               the context slots are the prompt's first M positions: 1..M after [SOS], 0..M-1
               for a tokenizer without one (SigLIP's, MetaCLIP 2's: [v1..v4] {class}, ...)
    text     = text tower, the M context slots replaced by `tokens` at the input of block
               `tcp.layer` (8), with no positional embedding; blocks >= 8 see class-specific rows
    logits   = logit_scale.exp() * norm(img) @ norm(text).T
    loss     = CE(logits, y) + tcp.weight * (1 - mean_c cos(text_c, t_zs_c))    (weight 8.0)

Only `ctx` (M, W), N(0, 0.02), and the meta-net (default init) train; TCP runs on cached image
features. Other classes (base-to-new's new half, another dataset) rebuild t_zs and the prompts
from their own names with the learned ctx and meta-net.

The text pass keeps the exact fast paths: [SOS][v1..vM] ([v1..vM] without [SOS]) is computed
once for every class in blocks 0..layer-1; at `tcp.layer` the rows stop sharing it (only [SOS]
stays shared, nothing without it) because their context slots now differ
(`coop.model.text_encoder.deep_by_block`).

Widths come from the model (the original's `reshape(..., 512)` and fixed four tokens break on
ViT-L and for M != 4); the weight is `tcp.weight` (the original hard-codes 8.0 and ignores its `W`
setting). See docs/tcp_dept.md for every difference.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from coop.config.checks import ConfigError
from coop.methods.base import Method, TowerLayers
from coop.methods.zeroshot import DEFAULT_TEMPLATE, template_features
from coop.model.blocks import QuickGELU
from coop.model.clip import CLIP, cosine_logits
from coop.model.prompt import N_CTX_DEFAULT, PromptError, PromptLearner

LAYER = 8  # the text block whose input takes the class-aware tokens (`tcp.layer`)
WEIGHT = 8.0  # the original's hard-coded weight of the knowledge term (`tcp.weight`)
PLACEHOLDERS = 4  # the words of each prompt template that the context replaces

# TCP's CUSTOM_TEMPLATES (the prompt): its first four words are the context slots.
PROMPT_TEMPLATES = {
    "oxford_pets": "X X X X {}, a type of pet.",
    "oxford_flowers": "X X X X {}, a type of flower.",
    "fgvc_aircraft": "X X X X {}, a type of aircraft.",
    "dtd": "X X X X {} texture.",
    "eurosat": "X X X X {}.",
    "stanford_cars": "X X X X {}, a type of car",  # no full stop, as in the original
    "food101": "X X X X {}, a type of food.",
    "sun397": "X X X X {}.",
    "caltech101": "X X X X {}.",
    "ucf101": "a photo of a person doing {}.",
    "imagenet": "a photo of a {}.",
    "imagenet_sketch": "a photo of a {}.",
    "imagenetv2": "a photo of a {}.",
    "imagenet_a": "a photo of a {}.",
    "imagenet_r": "a photo of a {}.",
}
# TCP's CUSTOM_TEMPLATES_ori (the teacher t_zs and the meta-net's input).
TEACHER_TEMPLATES = {
    "oxford_pets": "a photo of a {}, a type of pet.",
    "oxford_flowers": "a photo of a {}, a type of flower.",
    "fgvc_aircraft": "a photo of an aircraft {}.",
    "dtd": "a photo of a {}, a type of texture.",
    "eurosat": "a centered satellite photo of {}.",
    "stanford_cars": "a photo of a {}.",
    "food101": "a photo of a {}, a type of food.",
    "sun397": "a photo of a {}.",
    "caltech101": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
    "imagenet": "a photo of a {}.",
    "imagenet_sketch": "a photo of a {}.",
    "imagenetv2": "a photo of a {}.",
    "imagenet_a": "a photo of a {}.",
    "imagenet_r": "a photo of a {}.",
}
DEFAULT_PROMPT = "X X X X {}."  # datasets outside the tables (textile, imagefolder)


def prompt_suffix(template: str) -> str:
    """What follows the context in a TCP prompt template: its words after the four placeholders."""
    words = template.split(" ")
    if len(words) <= PLACEHOLDERS or "{}" not in " ".join(words[PLACEHOLDERS:]):
        raise PromptError(f"TCP prompt template {template!r} needs {PLACEHOLDERS} words before '{{}}'")
    return " ".join(words[PLACEHOLDERS:])


class ClassTokenNet(nn.Sequential):
    """TCP's meta-net: Linear(E, E//4) -> QuickGELU -> Linear(E//4, M W), default init."""

    def __init__(self, embed_dim: int, n_ctx: int, width: int):
        super().__init__(
            OrderedDict(
                [
                    ("linear1", nn.Linear(embed_dim, embed_dim // 4)),
                    ("relu", QuickGELU()),  # the original's name for its QuickGELU
                    ("linear2", nn.Linear(embed_dim // 4, n_ctx * width)),
                ]
            )
        )


class TCP(Method):
    """Class-aware tokens from the zero-shot text features replace the context at one text block.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.n_ctx` (M, 4), `prompt.ctx_init`, `tcp.layer`, `tcp.weight`, `data.name`;
            position end, shared context and depth 1 only (the original's prompt).
    """

    name = "tcp"
    trainer = "sgd"
    text_prompt = True

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """As every prompt method's, its own prompt layout, and `tcp.layer` below the text tower's
        last block."""
        super().check_config(cfg, towers)
        p = cfg.prompt
        if p.position != "end" or p.csc or int(p.depth) != 1:
            raise ConfigError(
                "method=tcp builds its own prompt: prompt.position=end, prompt.csc=false, prompt.depth=1 "
                f"(got {p.position}, {p.csc}, {p.depth})"
            )
        layer = int(OmegaConf.select(cfg, "tcp.layer", default=LAYER))
        if not 1 <= layer < towers.text:
            raise ConfigError(
                f"tcp.layer must be in 1..{towers.text - 1} (the text tower's blocks), got {layer}"
            )

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)  # check_config: the layout and tcp.layer
        p = cfg.prompt
        dataset = str(cfg.data.name)
        self.layer = int(OmegaConf.select(cfg, "tcp.layer", default=LAYER))
        self.weight = float(OmegaConf.select(cfg, "tcp.weight", default=WEIGHT))
        self.teacher_template = TEACHER_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)
        self.prompt_template = PROMPT_TEMPLATES.get(dataset, DEFAULT_PROMPT)
        n_ctx = N_CTX_DEFAULT if p.n_ctx is None else int(p.n_ctx)
        self.prompt_learner = PromptLearner(
            clip, classnames, n_ctx=n_ctx, ctx_init=p.ctx_init, template=prompt_suffix(self.prompt_template)
        )
        pl = self.prompt_learner
        self.meta_net = ClassTokenNet(clip.embed_dim, pl.n_ctx, clip.width).to(pl.ctx.device)
        self._teacher: torch.Tensor | None = None  # (n_cls, E), normalised, once per run

    def learnable(self) -> dict[str, torch.Tensor]:
        meta = {f"meta_net.{k}": t for k, t in self.meta_net.named_parameters()}
        return {**self.prompt_learner.prompt_tensors(), **meta}

    def teacher(self) -> torch.Tensor:
        """t_zs: the frozen, L2-normalised teacher-template features (n_cls, E), fp32, computed once."""
        if self._teacher is None:
            device = self.clip.logit_scale.device
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                self._teacher = template_features(self.clip, self.classnames, [self.teacher_template]).float()
        return self._teacher

    def class_tokens(self) -> torch.Tensor:
        """The class-aware tokens (n_cls, M, W) that replace the context at block `layer`."""
        pl = self.prompt_learner
        t = self.meta_net(self.teacher().to(self.meta_net.linear1.weight.dtype))  # (n_cls, M W)
        return t.view(pl.n_cls, pl.n_ctx, -1)  # (n_cls, M, W)

    def text_features(self) -> torch.Tensor:
        """Unnormalised class text features (n_cls, E)."""
        pl = self.prompt_learner
        prompts, _ = pl()  # (n_cls, L, W)
        start = pl.shared_prefix  # [SOS][v1..vM] or [v1..vM]: shared by every class before `layer`
        deep = {self.layer: self.class_tokens()}
        return self.clip.text.encode_with_shared_prefix(
            prompts[:1, :start], prompts[:, start:], pl.eos, deep, pl.slots
        )

    def regulariser(self, text_features: torch.Tensor) -> torch.Tensor:
        """1 - mean_c cos(text_c, t_zs_c) for unnormalised text features (n_cls, E)."""
        return 1.0 - (F.normalize(text_features.float(), dim=-1) * self.teacher()).sum(-1).mean()

    def prepare(self) -> torch.Tensor:
        return self.text_features()

    def logits(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> torch.Tensor:
        text = self.text_features() if prepared is None else prepared
        return cosine_logits(image_features, text, self.clip.logit_scale)

    def loss(self, image_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.text_features()
        logits = cosine_logits(image_features, text, self.clip.logit_scale)
        return F.cross_entropy(logits, labels) + self.weight * self.regulariser(text), logits

    def describe(self) -> dict:
        return {"n_ctx": self.prompt_learner.n_ctx, "tcp_layer": self.layer, "tcp_weight": self.weight}

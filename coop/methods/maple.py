"""MaPLe: vision prompts coupled to the text prompts (the MaPLe repository's `trainers/maple.py`).

    text      = CoOp context `ctx` (M, W) + deep text prompts `deep_ctx` (J-1, M, W) replaced
                before text blocks 1..J-1 (J = `prompt.depth`)                  (n_cls, E)
    vision    = [proj(ctx), compound_prompt_projections[0](deep_ctx[0]), ...]   J x (M, W_v)
    image     = image tower with vision[0] appended and vision[i] replacing the last M hidden
                states before block i                                           (B, E)
    logits    = logit_scale.exp() * norm(image) @ norm(text).T

Every coupling layer is a Linear(W, W_v) (W, W_v: the text and vision widths, read off the model
rather than the original's fixed 512 and 768). `proj` has its own default initialisation; the
J-1 deeper layers start as identical copies of one default-initialised layer, as the original's
`_get_clones` makes them. The vision loss therefore reaches the text prompts through the
coupling. The vision token count and depth are `prompt.n_ctx` and `prompt.depth`; a different
`vision.*` value is a config error.

Recipe (vit_b16_c2_ep5_batch4_2ctx): n_ctx 2 from "a photo of a" (`[V1][V2] of a {class}.`),
depth 9, SGD lr 0.0035, 5 epochs, batch 4; the cross-dataset config: depth 3, lr 0.0026, 2 epochs.

Learned tensors (checkpoint names = official names after `prompt_learner.`): `ctx`, `deep_ctx[i]`
= `compound_prompts_text.{i}`, `proj.weight`/`proj.bias`, `compound_prompt_projections.{i}.*`.
"""

from __future__ import annotations

import copy

import torch
from omegaconf import DictConfig
from torch import nn

from coop.methods.base import TowerLayers
from coop.methods.ivlp import IVLP, check_shared_depth
from coop.model.prompt import PromptError


class MaPLe(IVLP):
    """IVLP's text side; vision prompts are per-layer linear projections of the text prompts.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.*` (M, J, phrase, position; csc is refused) and `train.grad_checkpointing`.
    """

    name = "maple"

    @classmethod
    def check_vision(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """The vision prompts are as deep as the text prompts: `prompt.depth` within the image tower."""
        check_shared_depth(cls.name, cfg, towers)

    def build_vision(self, cfg: DictConfig) -> None:
        pl = self.prompt_learner
        if pl.csc:
            raise PromptError(
                "prompt.csc=true is not defined for maple: every image shares one set of vision prompts, "
                "projected from one shared text context"
            )
        width = pl.ctx.shape[-1]
        self.proj = nn.Linear(width, self.tower_width).to(self.device)
        single = nn.Linear(width, self.tower_width).to(self.device)
        self.compound_prompt_projections = nn.ModuleList(copy.deepcopy(single) for _ in range(pl.depth - 1))

    def learnable(self) -> dict[str, torch.Tensor]:
        coupling = {f"proj.{k}": p for k, p in self.proj.named_parameters()}
        coupling |= {
            f"compound_prompt_projections.{k}": p
            for k, p in self.compound_prompt_projections.named_parameters()
        }
        return {**self.prompt_learner.prompt_tensors(), **coupling}

    def vision_prompts(self) -> list[torch.Tensor]:
        pl = self.prompt_learner
        first = self.proj(pl.ctx.to(self.proj.weight.dtype))  # (M, W_v)
        deep = [layer(pl.deep_ctx[i]) for i, layer in enumerate(self.compound_prompt_projections)]
        return [first, *deep]  # J x (M, W_v)

    def to_half(self) -> None:
        """The original's PREC=fp16: as IVLP's, and `proj` is half too (the original calls
        `self.proj.half()`); the deeper coupling layers stay fp32, their outputs cast to half."""
        super().to_half()
        self.proj.half()

    def describe(self) -> dict:
        pl = self.prompt_learner
        return {"n_ctx": pl.n_ctx, "position": pl.position, "csc": pl.csc, "depth": pl.depth}

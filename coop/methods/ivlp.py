"""IVLP: independent deep prompts in both towers (the MaPLe repository's `trainers/independentVL.py`).

    text   = CoOp context (`prompt.n_ctx`, from `prompt.ctx_init`) + deep text prompts replaced
             before text blocks 1..J_t-1 (J_t = `prompt.depth`)                (n_cls, E)
    image  = image tower with `vision.n_ctx` tokens appended and replaced before blocks
             1..J_v-1 (J_v = `vision.depth`), independent of the text           (B, E)
    logits = logit_scale.exp() * norm(image) @ norm(text).T

Recipe (vit_b16_c2_ep5_batch4_2+2ctx): 2 text + 2 vision tokens, depth 12 + 12, "a photo of a",
SGD lr 0.0035, 5 epochs, batch 4. With n_ctx = 2 the prompt reads `[V1][V2] of a {class}.`: the
phrase's first 2 tokens learn, "of a" stays frozen text; the phrase initialises the context only
for n_ctx <= 4, as in the original (`phrase_max_ctx`).

Learned tensors (checkpoint names -> official names): `ctx` -> `prompt_learner.ctx`, `deep_ctx[i-1]`
-> `text_encoder.transformer.resblocks.{i}.VPT_shallow`, `vision_ctx` -> `image_encoder.VPT`,
`vision_deep_ctx[i-1]` -> `image_encoder.transformer.resblocks.{i}.VPT_shallow` (i = 1..J-1).
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from coop.config.checks import ConfigError
from coop.methods.base import TowerLayers
from coop.methods.coop import build_learner, require_transferable
from coop.methods.vpt import VisionPromptMethod, VisionPrompts, vision_settings
from coop.model.clip import CLIP
from coop.model.prompt import PromptClassifier, PromptLearner

PHRASE_MAX_CTX = 4  # the original uses ctx_init only when n_ctx <= 4


def check_shared_depth(method: str, cfg: DictConfig, towers: TowerLayers) -> None:
    """A one-line ConfigError when `prompt.depth`, the depth of both towers' prompts (MaPLe's and
    HiCroPL's), is above the image tower's layers."""
    depth = int(cfg.prompt.depth)
    if towers.image is not None and depth > towers.image:
        raise ConfigError(
            f"prompt.depth={depth} is above the image tower's {towers.image} layers "
            f"({method} prompts both towers to the same depth)"
        )


class IVLP(VisionPromptMethod):
    """CoOp's text prompts (any position, csc, depth) plus independent deep vision prompts.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.*`, `vision.n_ctx`, `vision.depth` and `train.grad_checkpointing`.
    """

    name = "ivlp"
    phrase_max_ctx = PHRASE_MAX_CTX
    text_prompt = True

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        learner = build_learner(clip, cfg, classnames, phrase_max_ctx=self.phrase_max_ctx)
        self.classifier = PromptClassifier(clip, learner)
        self.build_vision(cfg)

    def build_vision(self, cfg: DictConfig) -> None:
        """The vision side: independent `VisionPrompts` of `vision.n_ctx` tokens, `vision.depth` deep."""
        n_ctx, depth = vision_settings(cfg)
        self.vision = VisionPrompts(n_ctx, depth, self.tower_width, self.tower_layers).to(self.device)

    @property
    def prompt_learner(self) -> PromptLearner:
        return self.classifier.prompt_learner

    def learnable(self) -> dict[str, torch.Tensor]:
        vision = {f"vision_{k}": p for k, p in self.vision.named_parameters()}
        return {**self.prompt_learner.prompt_tensors(), **vision}

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        require_transferable(self.prompt_learner.csc, classnames, self.classnames)
        super().load_learnable(tensors, classnames)

    def text_features(self) -> torch.Tensor:
        return self.classifier.text_features()  # every exact fast path of the text tower

    def vision_prompts(self) -> list[torch.Tensor]:
        return self.vision()

    def to_half(self) -> None:
        """The original's PREC=fp16: CLIP and the input-layer text context (`ctx`, built from CLIP's
        half embeddings) are half and trained so; deep text and all vision prompts stay fp32 and
        are cast to half in the forward pass."""
        super().to_half()
        pl = self.prompt_learner
        pl.ctx.data = pl.ctx.data.half()
        pl.token_embeds = pl.token_embeds.half()

    def describe(self) -> dict:
        pl = self.prompt_learner
        return {
            "n_ctx": pl.n_ctx,
            "position": pl.position,
            "csc": pl.csc,
            "depth": pl.depth,
            "vision_n_ctx": self.vision.n_ctx,
            "vision_depth": self.vision.depth,
        }

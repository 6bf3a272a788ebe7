"""VPT (deep vision prompts, frozen text) and the base of the methods that prompt the image tower.

As in the MaPLe repository's VPT trainer (`trainers/vpt.py`, config vit_b16_c2_ep5_batch4_4):

    text     = frozen CLIP features of "a photo of a {class}."                 (n_cls, E)
    image    = image tower with `vision.n_ctx` tokens appended after the positional embedding and
               replaced before blocks 1..J-1 (J = `vision.depth`)          (B, E)
    logits   = logit_scale.exp() * norm(image) @ norm(text).T

Only the vision tokens train: `vision_ctx` (n_ctx, W_v) for the input layer and `vision_deep_ctx`
(J-1, n_ctx, W_v) for blocks 1..J-1, all N(0, 0.02), shared by every image. They are the
official `image_encoder.VPT` and `image_encoder.transformer.resblocks.{i}.VPT_shallow`.

`VisionPromptMethod` is what VPT, IVLP and MaPLe share: the method sees pixels (`input =
"pixels"`), the prompted tower runs every step, and the pieces are separate methods (text
features, vision prompts, prompted and frozen image features) so that a subclass can add loss
terms on any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from coop.config.checks import ConfigError, check_depth
from coop.methods.base import Method, TowerLayers, Towers
from coop.model.clip import CLIP, cosine_logits
from coop.model.prompt import PromptError

VPT_TEMPLATE = "a photo of a {}."  # the VPT trainer's fixed text prompt


class VisionPrompts(nn.Module):
    """Deep vision prompts: `ctx` (n_ctx, W_v) for the input layer and `deep_ctx` (J-1, n_ctx, W_v)
    for blocks 1..J-1, initialised N(0, 0.02).

    Args:
        n_ctx: tokens per layer (>= 1).
        depth: J, counting the input layer (1..layers of the tower).
        width: the tower's width W_v.
        layers: the tower's block count (the upper bound of `depth`).
    """

    def __init__(self, n_ctx: int, depth: int, width: int, layers: int):
        super().__init__()
        if n_ctx < 1:
            raise PromptError(f"vision.n_ctx must be >= 1, got {n_ctx}")
        check_depth("vision.depth", depth, layers, "image", PromptError)
        self.n_ctx, self.depth = n_ctx, depth
        self.ctx = nn.Parameter(torch.empty(n_ctx, width).normal_(std=0.02))
        self.deep_ctx = (
            nn.Parameter(torch.empty(depth - 1, n_ctx, width).normal_(std=0.02)) if depth > 1 else None
        )

    def forward(self) -> list[torch.Tensor]:
        """The J prompts, each (n_ctx, W_v): the input layer's, then blocks 1..J-1's."""
        deep = [] if self.deep_ctx is None else list(self.deep_ctx.unbind(0))
        return [self.ctx, *deep]


def vision_settings(cfg: DictConfig) -> tuple[int, int]:
    """(`vision.n_ctx`, `vision.depth`) of a run config; both must be set (the recipes set them)."""
    n_ctx, depth = OmegaConf.select(cfg, "vision.n_ctx"), OmegaConf.select(cfg, "vision.depth")
    for key, value in (("vision.n_ctx", n_ctx), ("vision.depth", depth)):
        if value is None:
            raise PromptError(f"method={cfg.method} needs {key} (an integer >= 1)")
    return int(n_ctx), int(depth)


class VisionPromptMethod(Method):
    """A frozen CLIP whose image tower takes prompts; subclasses say what the text and vision
    prompts are (`text_features`, `vision_prompts`).

    Per step: text t = `text_features()` (n_cls, E), vision prompts p = `vision_prompts()`,
    image v = `image_features(images, p)` (B, E); logits = `cosine(v, t)`; PromptSRC-style losses
    also use the frozen tower's `frozen_image_features(images)` of the same batch.
    """

    trainer = "sgd"
    input = "pixels"
    adds_image_tokens = True

    @classmethod
    def image_tower_use(cls, cfg: DictConfig) -> str | None:
        return "prompts the image tower"

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)  # a tower without tokens (RN50, ConvNeXt, FastViT): refused
        cls.check_vision(cfg, towers)

    @classmethod
    def check_vision(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """The image tower's keys: `vision.n_ctx` and `vision.depth` set, the depth within its
        layers (VPT, IVLP, PromptSRC)."""
        try:
            _, depth = vision_settings(cfg)
        except PromptError as e:
            raise ConfigError(str(e)) from None
        check_depth("vision.depth", depth, towers.image, "image")

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)  # ModelError: an image tower that takes no prompts
        tower = clip.visual
        self.tower_layers, self.tower_width = int(tower.layers), int(tower.width)
        # whether an average or attention pool also reads the added tokens (docs/image_tower.md)
        tower.pool_prompts = bool(OmegaConf.select(cfg, "vision.pool_prompts", default=False))
        self.grad_checkpointing = bool(OmegaConf.select(cfg, "train.grad_checkpointing", default=False))

    @property
    def device(self) -> torch.device:
        return self.clip.logit_scale.device

    def text_features(self) -> torch.Tensor:
        """Unnormalised class text features (n_cls, E)."""
        raise NotImplementedError

    def vision_prompts(self) -> list[torch.Tensor]:
        """The J vision prompts, each (n_ctx, W_v), input layer first."""
        raise NotImplementedError

    def image_features(self, images: torch.Tensor, prompts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Unnormalised prompted image features (B, E) of images (B, 3, H, W)."""
        prompts = self.vision_prompts() if prompts is None else prompts
        dtype = self.clip.logit_scale.dtype  # half under fp16: the official `.half()` of every prompt
        prompts = [p.to(dtype) for p in prompts]
        return self.clip.encode_image(images, prompts=prompts, grad_checkpointing=self.grad_checkpointing)

    @torch.no_grad()
    def frozen_image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Unnormalised features (B, E) of the unprompted, frozen tower (zero-shot CLIP's)."""
        return self.clip.encode_image(images)

    def cosine(self, image_features: torch.Tensor, text_features: torch.Tensor) -> torch.Tensor:
        """logit_scale.exp() * norm(image) @ norm(text).T in fp32: (B, n_cls)."""
        return cosine_logits(image_features, text_features, self.clip.logit_scale)

    def prepare(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(text features, vision prompts): neither depends on the image, so once per evaluation."""
        return self.text_features(), self.vision_prompts()

    def towers(self, images: torch.Tensor, prepared=None) -> Towers:
        text, prompts = self.prepare() if prepared is None else prepared
        image = self.image_features(images, prompts)  # (B, E)
        return Towers(self.cosine(image, text), text, image)

    def logits(self, images: torch.Tensor, prepared=None) -> torch.Tensor:
        return self.towers(images, prepared).logits

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(images)
        return F.cross_entropy(logits.float(), labels), logits

    def to_half(self) -> None:
        """fp16 as in the MaPLe repository: CLIP in half; prompts stay fp32 and are cast to half in
        the forward pass (`image_features`); subclasses halve what the original keeps in half."""
        self.clip.half()


class VPT(VisionPromptMethod):
    """Deep vision prompts with CLIP's frozen "a photo of a {class}." text features.

    Args:
        clip, classnames: as for every method.
        cfg: reads `vision.n_ctx`, `vision.depth` and `train.grad_checkpointing`; `prompt.*`
            does not apply.
    """

    name = "vpt"

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        n_ctx, depth = vision_settings(cfg)
        self.vision = VisionPrompts(n_ctx, depth, self.tower_width, self.tower_layers).to(self.device)
        texts = [VPT_TEMPLATE.format(c.replace("_", " ")) for c in self.classnames]
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            features = clip.encode_text(clip.tokenize(texts)).float()  # (n_cls, E), fp32 as in the original
        self.register_buffer("fixed_text_features", features, persistent=False)

    def learnable(self) -> dict[str, torch.Tensor]:
        return {f"vision_{k}": p for k, p in self.vision.named_parameters()}

    def text_features(self) -> torch.Tensor:
        return self.fixed_text_features

    def vision_prompts(self) -> list[torch.Tensor]:
        return self.vision()

    def describe(self) -> dict:
        return {"vision_n_ctx": self.vision.n_ctx, "vision_depth": self.vision.depth}

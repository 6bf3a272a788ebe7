"""The timm ViT trunks open_clip builds, walked module by module: one back end of
`coop.model.image_tower.ImageTower`.

open_clip's `TimmModel` holds a timm trunk and its own head (`trunk.*`, `head.*`); this back end
takes both over (the same modules under the same keys, not copies: the weights are held once, which
matters at load for EVA02-E and PE-Core-bigG) and runs the stages `ImageTower` places prompts
between, each through timm's own modules and methods:

    x = trunk.patch_embed(images)                            embed: patches,
    x, rope = trunk._pos_embed(x)                                   class/register tokens, positions
                                                                    (rotary angles on Eva trunks)
    x = trunk.norm_pre(x)                                    pre
    x = trunk.blocks[i](x[, rope])                           blocks
    feats = head(trunk.forward_head(trunk.norm(x)))          pool: timm's token / average / attention
                                                                   (MAP) pool, fc_norm, trunk head;
                                                                   open_clip's projection

Covered: timm `VisionTransformer` trunks (SigLIP/SigLIP2, MobileCLIP-B and -L, ViTamin, the gap
ViTs) and `Eva` trunks (EVA01/EVA02 with RoPE and SwiGLU, PE-Core with RoPE and a MAP head).
Towers without a token sequence (ConvNeXt, FastViT, Swin, ResNets) and other timm ViT variants are
refused in one line by `timm_config_refusal`, and so is every timm tower under a timm release
outside the tested range (`coop.versions`).
"""

from __future__ import annotations

import torch
from open_clip.timm_model import TimmModel
from timm.models.convnext import ConvNeXt
from timm.models.eva import Eva
from timm.models.fastvit import FastVit
from timm.models.vision_transformer import VisionTransformer as TimmViT
from torch import nn

from coop.model.errors import ModelError
from coop.model.image_tower import ImageTower
from coop.versions import untested


class TimmImageTower(ImageTower):
    """open_clip's timm image tower with the `ImageTower` stages; keys equal open_clip's `visual.*`.

    Args:
        visual: open_clip's `TimmModel`; its trunk and head become this tower's modules (shared
            with `visual`, not copied), so whatever changes one (dtype, device, requires_grad,
            hooks) changes the other. Copy `visual` first to keep an independent one.
        name: the model's name, for messages.
    """

    def __init__(self, visual: nn.Module, name: str | None = None):
        super().__init__()
        refusal = timm_config_refusal(visual, name)
        if refusal:
            raise ModelError(refusal)
        self.trunk = visual.trunk
        self.head = visual.head
        self.n_prefix = int(self.trunk.num_prefix_tokens)
        self.rotary = isinstance(self.trunk, Eva) and self.trunk.rope is not None
        self.image_size = tuple(visual.image_size)
        self.preprocess_cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})

    @classmethod
    def from_openclip(cls, visual: nn.Module, name: str | None = None) -> TimmImageTower:
        """The tower of open_clip's `TimmModel` `visual` (any weights); a ModelError naming the model
        when its trunk is not a timm ViT this back end covers."""
        return cls(visual, name)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.trunk.blocks

    @property
    def width(self) -> int:
        return int(self.trunk.embed_dim)

    @property
    def output_dim(self) -> int:
        """The feature size: the last linear layer of open_clip's head, else of timm's, else the width."""
        linears = [m for m in self.head.modules() if isinstance(m, nn.Linear)]
        if linears:
            return linears[-1].out_features
        if isinstance(self.trunk.head, nn.Linear):
            return self.trunk.head.out_features
        return int(self.trunk.num_features)

    def embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Patches, prefix tokens and positions (B, N+P, W) before norm_pre; the rotary angles for
        the P patches ([sin | cos], Eva) or None."""
        x = self.trunk.patch_embed(images)
        if isinstance(self.trunk, Eva):
            return self.trunk._pos_embed(x)  # (x, rope); its patch dropout: the identity in eval
        # timm's patch dropout drops no patch: CLIP runs its towers in eval mode (ImageTransformer's rule)
        return self.trunk.patch_drop(self.trunk._pos_embed(x)), None

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk.norm_pre(x)

    def run_block(self, i: int, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        block = self.trunk.blocks[i]
        if not self.rotary:
            return block(x)
        if getattr(self.trunk, "rope_mixed", False):
            rope = rope[i]  # depth-dependent angles (depth, heads, T, 2D)
        return block(x, rope=rope)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, W) final hidden states -> (B, E): timm's norm and head (its pool), open_clip's head."""
        return self.head(self.trunk.forward_head(self.trunk.norm(x)))

    def final_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every token after timm's final norms (norm, then fc_norm where the tower has one)."""
        return self.trunk.fc_norm(self.trunk.norm(x))

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        """What timm's and open_clip's heads do to a pooled token, applied to every token."""
        return self.head(self.trunk.head(tokens))


def timm_config_refusal(visual: nn.Module, name: str | None = None) -> str | None:
    """Why the timm back end cannot walk this image tower (one line naming the model), else None."""
    name = name or type(visual).__name__
    if not isinstance(visual, TimmModel):
        return f"model {name}'s image tower {type(visual).__name__} is not a timm tower"
    problem = untested("timm")  # the walk reads timm's internals (`_pos_embed`, rotary angles)
    if problem:
        return f"{problem}: model {name}'s timm image tower is not walked, so it takes no vision prompts"
    trunk = visual.trunk
    if isinstance(trunk, (ConvNeXt, FastVit)):
        return (
            f"model {name}'s image tower is timm's {type(trunk).__name__}, a convolutional tower: it has no "
            "token sequence, so it takes no vision prompts (CLIP-LoRA runs with lora.towers=[text])"
        )
    if type(trunk) not in (TimmViT, Eva):
        return (
            f"model {name}'s image tower is timm's {type(trunk).__name__}, not a ViT or EVA trunk, the two "
            "our forward walks, so it takes no vision prompts (CLIP-LoRA runs with lora.towers=[text])"
        )
    if "pool" in dict(visual.head.named_children()):
        pool = type(visual.head.pool).__name__
        return f"model {name}'s image tower pools in open_clip's head ({pool}), not in timm's trunk"
    return None

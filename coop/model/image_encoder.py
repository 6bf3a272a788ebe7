"""open_clip's ViT image tower, re-implemented: one back end of `coop.model.image_tower.ImageTower`.

The module mirrors OpenCLIP's `VisionTransformer` parameter for parameter (the state-dict keys
equal open_clip's `visual.*` keys without the prefix, checked one by one at load), but it is our
own forward code, built from the same blocks as `coop.model.text_encoder` without the causal mask.
The stages `ImageTower` runs, with the prompts it places:

    x = [class_embedding; conv1(images) patches] + positional_embedding     embed  (B, 1+P, W)
    x = ln_pre(x)                                                           pre    (identity: CLIPA)
    x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))                            blocks (no mask)
    feats = ln_post(x[:, 0]) @ proj                                         pool   (class token)
          = ln_post(mean of the patches) @ proj                                    (CLIPA: average,
                                                                                    LayerNorm after it)
          = ln_post(attn_pool(x))[:, 0] @ proj                                     (CoCa: attention pool)

These are the vision-prompt semantics of the MaPLe/IVLP/VPT code (their `VisionTransformer_MaPLe`
and `ResidualAttentionBlock_IVLP`): prompts appended after the positions, before ln_pre, replaced
at blocks 1..J-1. Without prompts the forward is exactly open_clip's `encode_image`.

Towers this back end does not cover (ResNets, layer scale, custom blocks, CoCa's
"parallel"/"cascade" pools) are refused by `vision_config_from_openclip` with a one-line
`ModelError` that names the model; `coop.model.clip` then tries the timm back end or keeps
open_clip's module. open_clip's patch dropout is no stage here: it drops patches in training mode
only, and `coop.model.clip.CLIP` keeps its towers in eval mode, where it is the identity (the rule
of both back ends, docs/image_tower.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from open_clip.transformer import QuickGELU as OpenClipQuickGELU
from open_clip.transformer import ResidualAttentionBlock, VisionTransformer
from torch import nn

from coop.model.blocks import Resblocks, load_checked
from coop.model.errors import ModelError
from coop.model.image_tower import ImageTower


@dataclass(frozen=True)
class VisionConfig:
    """Sizes of open_clip's ViT tower; the block fields share `TextConfig`'s names (same blocks)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    heads: int = 12
    layers: int = 12
    mlp_width: int = 3072
    output_dim: int = 512
    quick_gelu: bool = False
    gelu_approximate: str = "none"
    ln_eps: float = 1e-5
    ln_pre: bool = True  # False: CLIPA
    pool: str = "tok"  # "tok": the class token; "avg": the mean of the patches (CLIPA)
    final_ln_after_pool: bool = False  # CLIPA: ln_post on the pooled feature, not on every token

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Sequence length without prompts: the class token and the patches."""
        return 1 + self.grid**2


class ImageTransformer(ImageTower):
    """open_clip's ViT image encoder; `state_dict()` keys equal OpenCLIP's `visual.*` keys.

    Args:
        cfg: the sizes.
        attn_pool: open_clip's `AttentionalPooler` (CoCa), kept as open_clip's module, or None.
    """

    def __init__(self, cfg: VisionConfig, attn_pool: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(w))
        self.positional_embedding = nn.Parameter(torch.empty(cfg.tokens, w))
        self.ln_pre = nn.LayerNorm(w, eps=cfg.ln_eps) if cfg.ln_pre else nn.Identity()
        self.transformer = Resblocks(cfg, causal=False)
        self.attn_pool = attn_pool
        self.ln_post = nn.LayerNorm(w if attn_pool is None else cfg.output_dim, eps=cfg.ln_eps)
        self.proj = nn.Parameter(torch.empty(self.ln_post.normalized_shape[0], cfg.output_dim))
        # What `coop.model.clip.CLIP` reads off an image tower (open_clip's attributes of the same names).
        self.image_size = (cfg.image_size, cfg.image_size)
        self.preprocess_cfg: dict = {}

    @classmethod
    def from_openclip(cls, visual: nn.Module, name: str | None = None) -> ImageTransformer:
        """Copy an OpenCLIP `VisionTransformer` (any weights); the given module is not modified.

        Args:
            visual: open_clip's image tower (`model.visual`).
            name: the model's name, for error messages.
        Raises:
            ModelError: the tower is not one this back end covers (`vision_config_from_openclip`).
            ValueError: its state-dict keys or shapes differ from ours.
        """
        pool = copy.deepcopy(visual.attn_pool) if visual.attn_pool is not None else None
        tower = cls(vision_config_from_openclip(visual, name), pool)
        load_checked(tower, visual.state_dict(), "image", prefix="visual.")
        tower.preprocess_cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
        return tower.to(next(visual.parameters()).device)

    @property
    def width(self) -> int:
        return self.cfg.width

    @property
    def output_dim(self) -> int:
        return self.cfg.output_dim

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.resblocks

    def embed(self, images: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Patch embeddings after the class token, plus positions: (B, 1+P, W), before ln_pre."""
        x = self.conv1(images)  # (B, W, gh, gw)
        b, width = x.shape[:2]
        x = x.reshape(b, width, -1).transpose(1, 2)  # (B, W, P) -> (B, P, W)
        cls = self.class_embedding.to(x.dtype).expand(b, 1, -1)  # (B, 1, W)
        return torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype), None  # (B, 1+P, W)

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_pre(x)

    def run_block(self, i: int, x: torch.Tensor, rope: None) -> torch.Tensor:
        return self.blocks[i](x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, W) final hidden states -> (B, E) features, open_clip's `_pool` and `proj`."""
        if self.attn_pool is not None:
            return self.ln_post(self.attn_pool(x))[:, 0] @ self.proj  # CoCa: the first query
        if self.cfg.final_ln_after_pool:
            return self.ln_post(self._pooled(x)) @ self.proj
        return self._pooled(self.ln_post(x)) @ self.proj

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1:].mean(dim=1) if self.cfg.pool == "avg" else x[:, 0]  # (B, W)

    def final_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Every token after ln_post (B, T, W); a ModelError for CoCa (`token_refusal`)."""
        if self.token_refusal is not None:
            raise ModelError(f"the image tower {self.token_refusal}")
        return self.ln_post(x)

    @property
    def token_refusal(self) -> str | None:
        """CoCa's ln_post and projection act on the attention pool's outputs (width output_dim), not
        on the tokens (width W): no token has a feature of its own, and none can be defined without
        choosing one, so FedOTP and MMRL are refused rather than given invented features."""
        if self.attn_pool is None:
            return None
        return (
            "pools by attention (CoCa): its ln_post and projection act on the pool's outputs, so its "
            "tokens have no features of their own"
        )

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens @ self.proj  # (B, T, W) @ (W, E) -> (B, T, E)


def vision_config_from_openclip(visual: nn.Module, name: str | None = None) -> VisionConfig:
    """Read the sizes off an OpenCLIP ViT image tower; a ModelError naming the model if this back
    end does not cover it (conv patches, class token, learned positions, plain pre-LN blocks,
    class-token or average pooling or CoCa's attention pool, ln_post, proj)."""
    name = name or type(visual).__name__
    if not isinstance(visual, VisionTransformer):
        raise ModelError(f"model {name} has a {type(visual).__name__} image tower, not open_clip's ViT")
    problems = []
    if visual.attn_pool is not None and getattr(visual, "attn_pool_contrastive", None) is not None:
        problems.append(f"'{visual.attn_pool_type}' attention pooling")
    if visual.pool_type not in ("tok", "avg"):
        problems.append(f"pooling '{visual.pool_type}'")
    if not isinstance(visual.ln_pre, (nn.LayerNorm, nn.Identity)):
        problems.append(f"ln_pre {type(visual.ln_pre).__name__}")
    if visual.proj is None:
        problems.append("no projection")
    if len(set(visual.image_size)) != 1 or len(set(visual.patch_size)) != 1:
        problems.append("non-square image or patch size")
    for block in visual.transformer.resblocks:
        if type(block) is not ResidualAttentionBlock or hasattr(block, "ln_1_kv"):
            problems.append(f"custom block {type(block).__name__}")
            break
        if not (isinstance(block.ls_1, nn.Identity) and isinstance(block.ls_2, nn.Identity)):
            problems.append("layer scale")
            break
        if not block.attn._qkv_same_embed_dim or block.attn.in_proj_bias is None:
            problems.append("attention without packed, biased q|k|v")
            break
    norms = [m for m in visual.modules() if isinstance(m, nn.LayerNorm)]
    if len({m.eps for m in norms}) > 1:
        problems.append("LayerNorms with different eps")
    act = visual.transformer.resblocks[0].mlp.gelu if not problems else None
    if act is not None and not isinstance(act, (OpenClipQuickGELU, nn.GELU)):
        problems.append(f"MLP activation {type(act).__name__}")
    if problems:
        raise ModelError(f"model {name}'s image tower is not one our ViT covers: {', '.join(problems)}")
    block = visual.transformer.resblocks[0]
    quick = isinstance(act, OpenClipQuickGELU)
    return VisionConfig(
        image_size=visual.image_size[0],
        patch_size=visual.patch_size[0],
        width=visual.conv1.out_channels,
        heads=block.attn.num_heads,
        layers=len(visual.transformer.resblocks),
        mlp_width=block.mlp.c_fc.out_features,
        output_dim=visual.proj.shape[1],
        quick_gelu=quick,
        gelu_approximate="none" if quick else act.approximate,
        ln_eps=visual.ln_post.eps,
        ln_pre=isinstance(visual.ln_pre, nn.LayerNorm),
        pool=visual.pool_type,
        final_ln_after_pool=bool(visual.final_ln_after_pool),
    )

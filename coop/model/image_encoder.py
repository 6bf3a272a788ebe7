"""CLIP's ViT image tower, re-implemented so that vision prompts can enter the sequence.

The module mirrors OpenCLIP's standard `VisionTransformer` parameter for parameter (the state-dict
keys equal open_clip's `visual.*` keys without the prefix, checked one by one at load), but it is
our own forward code, built from the same blocks as `coop.model.text_encoder` without the causal mask:

    x = conv1(images)                                         # (B, W, gh, gw) patch embedding
    x = [class_embedding; patches] + positional_embedding     # (B, 1+P, W)
    x = [x; prompts[0]]                                       # (B, 1+P+M, W) vision prompts appended,
    x = ln_pre(x)                                             #   without positional embedding
    for each block i:  if 1 <= i < J: x[:, -M:] = prompts[i]  # replaced, not added
                       x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))       (no mask)
    feats = ln_post(x[:, 0]) @ proj                           # (B, E)

MMRL's representation tokens take another path, `encode_with_inserted`: K tokens inserted after
[CLS] at one block and replaced at later ones (`coop.model.inserted.InsertedTokens`), with the
frozen tower's features of the same images from the blocks before the insertion on, shared.

These are the vision-prompt semantics of the MaPLe/IVLP/VPT code (their `VisionTransformer_MaPLe`
and `ResidualAttentionBlock_IVLP`): J = len(prompts) counts the input layer, blocks >= J carry the
previous outputs, and every image shares the same tokens. Without prompts the forward is exactly
open_clip's `encode_image`.

Towers this forward does not cover (ResNets, timm towers, attentional pooling, average pooling,
layer scale, custom blocks, no ln_pre, patch dropout) are refused by `vision_config_from_openclip`
with a one-line `ModelError` that names the model; `coop.model.clip.CLIP` then keeps open_clip's module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from open_clip.transformer import QuickGELU as OpenClipQuickGELU
from open_clip.transformer import ResidualAttentionBlock, VisionTransformer
from torch import nn
from torch.utils.checkpoint import checkpoint

from coop.model.blocks import Resblocks, load_checked
from coop.model.inserted import InsertedTokens


class ModelError(ValueError):
    """The model name, pretrained tag, weights file or tower cannot be used; the message says which."""


@dataclass(frozen=True)
class VisionConfig:
    """Sizes of a standard ViT tower; the block fields share `TextConfig`'s names (same blocks)."""

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

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens(self) -> int:
        """Sequence length without prompts: the class token and the patches."""
        return 1 + self.grid**2


class ImageTransformer(nn.Module):
    """CLIP's ViT image encoder; `state_dict()` keys equal OpenCLIP's `visual.*` keys."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.conv1 = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(w))
        self.positional_embedding = nn.Parameter(torch.empty(cfg.tokens, w))
        self.ln_pre = nn.LayerNorm(w, eps=cfg.ln_eps)
        self.transformer = Resblocks(cfg, causal=False)
        self.ln_post = nn.LayerNorm(w, eps=cfg.ln_eps)
        self.proj = nn.Parameter(torch.empty(w, cfg.output_dim))
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
            ModelError: the tower is not a standard ViT (`vision_config_from_openclip`).
            ValueError: its state-dict keys or shapes differ from ours.
        """
        tower = cls(vision_config_from_openclip(visual, name))
        load_checked(tower, visual.state_dict(), "image", prefix="visual.")
        tower.preprocess_cfg = dict(getattr(visual, "preprocess_cfg", {}) or {})
        return tower.to(next(visual.parameters()).device)

    @property
    def layers(self) -> int:
        return self.cfg.layers

    @property
    def width(self) -> int:
        return self.cfg.width

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.resblocks

    def forward(
        self,
        images: torch.Tensor,
        prompts: Sequence[torch.Tensor] | None = None,
        grad_checkpointing: bool = False,
        tokens: bool = False,
    ) -> torch.Tensor:
        """Encode images (B, 3, H, W) into unnormalised image features (B, E).

        Args:
            images: (B, 3, H, W) normalised pixels at the tower's image size.
            prompts: None (plain CLIP) or J tensors, one per prompted layer, each (M, W) shared by
                all images or (B, M, W) per image: `prompts[0]` is appended after the positional
                embedding, `prompts[i]` replaces the last M hidden states before block i (i < J).
            grad_checkpointing: recompute each block in the backward pass instead of storing its
                activations (when gradients are enabled).
            tokens: return every token after ln_post, projected: (B, 1+P(+M), E), [CLS] first
                (FedOTP's patch features; open_clip's `output_tokens` gives them unprojected).
        """
        depth, m = self._check_prompts(prompts)
        x = self.embed(images)  # (B, 1+P, W)
        b = len(x)
        if depth:
            x = torch.cat([x, _per_image(prompts[0], b, x.dtype)], dim=1)  # (B, 1+P+M, W)
        x = self.ln_pre(x)
        for i, block in enumerate(self.blocks):
            if 1 <= i < depth:
                x = torch.cat([x[:, :-m], _per_image(prompts[i], b, x.dtype)], dim=1)  # replace the last M
            x = _run(block, x, grad_checkpointing)
        if tokens:
            return self.ln_post(x) @ self.proj  # (B, T, W) @ (W, E) -> (B, T, E)
        return self.ln_post(x[:, 0]) @ self.proj  # (B, W) @ (W, E) -> (B, E)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Patch embeddings after the class token, plus positions: (B, 1+P, W), before ln_pre."""
        x = self.conv1(images)  # (B, W, gh, gw)
        b, width = x.shape[:2]
        x = x.reshape(b, width, -1).transpose(1, 2)  # (B, W, P) -> (B, P, W)
        cls = self.class_embedding.to(x.dtype).expand(b, 1, -1)  # (B, 1, W)
        return torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)  # (B, 1+P, W)

    def encode_with_inserted(
        self,
        images: torch.Tensor,
        inserted: InsertedTokens,
        frozen: bool = False,
        grad_checkpointing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MMRL's image tower: K tokens inserted after [CLS] at block `inserted.layers[0]` and
        replaced at the later listed blocks.

        Args:
            images: (B, 3, H, W) normalised pixels.
            inserted: the tokens, each (K, W), and their 0-based blocks.
            frozen: also return the plain tower's features of the same images; the blocks before
                the insertion are the same computation for both, so they run once.
            grad_checkpointing: as in `forward`.
        Returns:
            (features (B, E) = ln_post(x[:, 0]) @ proj, the K tokens' final hidden states after
            ln_post (B, K, W), the frozen tower's features (B, E) without gradients or None).
        """
        first, k = inserted.layers[0], inserted.tokens[0].shape[0]
        x = self.ln_pre(self.embed(images))  # (B, 1+P, W)
        for block in self.blocks[:first]:
            x = _run(block, x, grad_checkpointing)
        plain = None
        if frozen:
            with torch.no_grad():
                z = x
                for block in self.blocks[first:]:
                    z = block(z)
                plain = self.ln_post(z[:, 0]) @ self.proj  # (B, E)
        for i in range(first, self.layers):
            x = _run(self.blocks[i], inserted.before(i, x), grad_checkpointing)  # (B, 1+K+P, W)
        x = self.ln_post(x[:, : 1 + k])  # (B, 1+K, W): [CLS] and the inserted tokens
        return x[:, 0] @ self.proj, x[:, 1:], plain

    def _check_prompts(self, prompts) -> tuple[int, int]:
        """(J, M) of the prompts, (0, 0) for none; one-line errors for shapes that cannot work."""
        if prompts is None:
            return 0, 0
        depth = len(prompts)
        if depth < 1:
            raise ValueError("vision prompts: got an empty list (pass None for no prompts)")
        if depth > self.layers:
            raise ValueError(f"vision prompt depth {depth} exceeds the image tower's {self.layers} layers")
        m = prompts[0].shape[-2]
        if m < 1:
            raise ValueError("vision prompts need at least 1 token per layer (vision.n_ctx >= 1)")
        for i, p in enumerate(prompts):
            if p.dim() not in (2, 3) or p.shape[-2:] != (m, self.width):
                raise ValueError(
                    f"vision prompts[{i}] has shape {tuple(p.shape)}; expected ({m}, {self.width}) or (B, {m}, {self.width})"
                )
        return depth, m


def _run(block: nn.Module, x: torch.Tensor, grad_checkpointing: bool) -> torch.Tensor:
    """One block, recomputed in the backward pass under `grad_checkpointing` (with gradients on)."""
    if grad_checkpointing and torch.is_grad_enabled():
        return checkpoint(block, x, use_reentrant=False)
    return block(x)


def _per_image(p: torch.Tensor, b: int, dtype: torch.dtype) -> torch.Tensor:
    """(M, W) shared tokens or (B, M, W) per-image tokens -> (B, M, W) in the stream's dtype."""
    return p.to(dtype).expand(b, -1, -1)


def vision_config_from_openclip(visual: nn.Module, name: str | None = None) -> VisionConfig:
    """Read the sizes off an OpenCLIP image tower; a ModelError naming the model if it is not a
    standard ViT (conv patches, class token, learned positions, ln_pre, plain pre-LN blocks,
    class-token pooling, ln_post, proj)."""
    name = name or type(visual).__name__
    if not isinstance(visual, VisionTransformer):
        raise ModelError(
            f"model {name} has a {type(visual).__name__} image tower, not a standard OpenCLIP ViT; "
            "vision prompts need ViT-B-32, ViT-B-16, ViT-L-14, ViT-H-14 or a config of the same kind"
        )
    problems = []
    if visual.attn_pool is not None:
        problems.append("attentional pooling")
    if visual.pool_type != "tok":
        problems.append(f"pooling '{visual.pool_type}' instead of the class token")
    if not isinstance(visual.ln_pre, nn.LayerNorm):
        problems.append("no ln_pre")
    if not isinstance(visual.patch_dropout, nn.Identity):
        problems.append("patch dropout")
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
        raise ModelError(f"model {name}'s image tower is not a standard OpenCLIP ViT: {', '.join(problems)}")
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
        ln_eps=visual.ln_pre.eps,
    )

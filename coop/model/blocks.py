"""The Transformer blocks that both of CLIP's towers are made of, under OpenCLIP's key names.

    Block(cfg, causal=True)        pre-LN residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x))
    Resblocks(cfg, causal)         `transformer.resblocks.{i}`, cfg.layers blocks
    load_checked(module, src, ..)  OpenCLIP weights into our tower, every key and shape checked

`cfg` is a `coop.model.text_encoder.TextConfig` or a `coop.model.image_encoder.VisionConfig`: the fields the
blocks read (width, heads, layers, mlp_width, quick_gelu, gelu_approximate, ln_eps) have the same
names in both. Most text towers' blocks are causal (`TextConfig.causal`); the image tower's are not.
Each block has a full-sequence forward and a packed one (`coop.model.packing`, the text tower's rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coop.model.packing import Packing


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), the activation the OpenAI checkpoints were trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with OpenCLIP's packed q|k|v projection layout.

    Causal by default (the text tower); `causal=False` gives the image tower's unmasked attention.
    """

    def __init__(self, width: int, heads: int, causal: bool = True):
        super().__init__()
        if width % heads:
            raise ValueError(f"text width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.causal = causal
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))  # rows: q | k | v
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        # An optional update of the packed projection set by a method (CLIP-LoRA's low-rank q|k|v
        # adapters): a callable (..., W) -> (..., 3W), deliberately not a submodule, so CLIP's
        # weights, state dict and dtype stay exactly as loaded. None: the frozen projection.
        self.qkv_delta = None

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        """The packed q|k|v projection of (..., W) hidden states: (..., 3W), plus `qkv_delta(x)`."""
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        return qkv if self.qkv_delta is None else qkv + self.qkv_delta(x)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, length, width = x.shape
        qkv = self.in_proj(x)  # (N, L, 3W)
        qkv = qkv.view(n, length, 3, self.heads, width // self.heads)  # (N, L, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (N, H, L, Dh)
        return q, k, v

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        n, _, length, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(n, length, -1))  # (N, H, L, Dh) -> (N, L, W)

    def forward(self, x: torch.Tensor, need_weights: bool = False, mask: torch.Tensor | None = None):
        """Self-attention of (N, L, W) normalised hidden states (causal unless built otherwise).

        Args:
            x: (N, L, W).
            need_weights: also return the attention probabilities, computed explicitly as
                softmax(q k^T / sqrt(Dh) + mask); the default path is fused SDPA.
            mask: (N, 1, L, L) bool, True where a query sees a key, in place of the causal mask
                (CoCa's text tower also hides its padding keys).
        Returns:
            (N, L, W), or ((N, L, W), (N, H, L, L) probabilities) with `need_weights`.
        """
        q, k, v = self.qkv(x)
        if not need_weights:
            if mask is not None:
                return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            return self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=self.causal))
        length = x.shape[1]
        hidden = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)  # keys after the query
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (N, H, L, L)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif self.causal:
            scores = scores.masked_fill(hidden, float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.merge(weights @ v), weights  # (N, H, L, Dh) -> (N, L, W)

    def forward_packed(
        self,
        x: torch.Tensor,
        packing: Packing,
        k_prefix: torch.Tensor | None = None,
        v_prefix: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of packed rows (`coop.model.packing`) that follow a prefix whose keys/values are given.

        Args:
            x: (G, T, W) normalised hidden states of the rows' own tokens, packed.
            packing: the layout of the T tokens.
            k_prefix, v_prefix: (G, H, P, Dh) keys and values of each group's prefix, or None.
            out: packed indices whose outputs are wanted (default: all).
        Returns:
            (G, T or len(out), W).
        """
        qkv = self.in_proj(x)  # (G, T, 3W)
        return self.out_proj(packing.attention(qkv, self.heads, k_prefix, v_prefix, out))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.width, cfg.mlp_width)
        self.gelu = QuickGELU() if cfg.quick_gelu else nn.GELU(approximate=cfg.gelu_approximate)
        self.c_proj = nn.Linear(cfg.mlp_width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg, causal: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg.width, cfg.heads, causal)
        self.ln_2 = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, need_weights: bool = False, mask: torch.Tensor | None = None):
        """(N, L, W) -> (N, L, W); with `need_weights`, also the (N, H, L, L) attention weights.
        `mask`: see `CausalSelfAttention.forward`."""
        if not need_weights:
            x = x + self.attn(self.ln_1(x), mask=mask)
            return x + self.mlp(self.ln_2(x))
        y, weights = self.attn(self.ln_1(x), need_weights=True, mask=mask)
        x = x + y
        return x + self.mlp(self.ln_2(x)), weights

    def forward_at(self, x: torch.Tensor, at: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output at one token per row: (N, L, W), at (N,) -> (N, W). Every token gives
        keys and values; only token `at` queries, and only it goes through the MLP (the last block
        of a tower that reads one token). `mask`: as in `forward` (default: causal or none)."""
        rows = torch.arange(len(x), device=x.device)
        q, k, v = self.attn.qkv(self.ln_1(x))  # (N, H, L, Dh) each
        q = q[rows, :, at].unsqueeze(2)  # (N, H, 1, Dh)
        if mask is not None:
            mask = mask[rows, :, at].unsqueeze(2)  # (N, 1, 1, L)
        elif self.attn.causal:
            mask = (torch.arange(x.shape[1], device=x.device) <= at[:, None])[:, None, None]  # (N, 1, 1, L)
        y = self.attn.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))  # (N, 1, W)
        x = x[rows, at] + y[:, 0]  # (N, W)
        return x + self.mlp(self.ln_2(x))

    def forward_packed(self, x: torch.Tensor, packing: Packing, k_prefix=None, v_prefix=None, last=False):
        """(G, T, W) packed rows after a prefix -> (G, T, W), or (G, N, W) at each row's last
        token with `last` (the only one read after the last block; keys still come from all)."""
        if not last:
            x = x + self.attn.forward_packed(self.ln_1(x), packing, k_prefix, v_prefix)
        else:
            y = self.attn.forward_packed(self.ln_1(x), packing, k_prefix, v_prefix, out=packing.last)
            x = x[:, packing.last] + y  # (G, N, W)
        return x + self.mlp(self.ln_2(x))


class Resblocks(nn.Module):
    """Holds the blocks under OpenCLIP's key names (`transformer.resblocks.{i}`)."""

    def __init__(self, cfg, causal: bool = True):
        super().__init__()
        self.resblocks = nn.ModuleList(Block(cfg, causal) for _ in range(cfg.layers))


def load_checked(module: nn.Module, src: dict[str, torch.Tensor], tower: str, prefix: str = "") -> None:
    """Copy OpenCLIP weights `src` into `module` (as fp32) after checking every key and shape.

    Args:
        module: our tower, whose state-dict keys must equal `src`'s.
        src: the OpenCLIP tower's state dict (keys without `prefix`).
        tower: "text" or "image", for the messages.
        prefix: what OpenCLIP's full keys start with (e.g. "visual."), for the messages.
    Raises:
        ValueError: keys or shapes differ; the message names the first differences.
    """
    dst = module.state_dict()
    if set(src) != set(dst):
        missing, extra = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
        raise ValueError(
            f"{tower}-tower keys differ from OpenCLIP's: missing {missing[:3]}, extra {extra[:3]}"
        )
    for key, value in src.items():
        if value.shape != dst[key].shape:
            raise ValueError(
                f"shape mismatch for {prefix}{key}: {tuple(value.shape)} vs {tuple(dst[key].shape)}"
            )
    module.load_state_dict({k: v.float() for k, v in src.items()})

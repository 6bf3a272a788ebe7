"""Reference CLIP-LoRA step on OpenCLIP's own modules, the way MaxZanella/CLIP-LoRA computes it.

Every class's prompt "a photo of a {class}." at the tower's full context (77 tokens for CLIP) runs
through the whole text tower at every step, and the low-rank updates are added to the weights: each adapted block's q, k and v
projections use W_t + s * B_t @ A_t (the original's merged `LinearLoRA`; with dropout, its unmerged
forward x W_t^T + b_t + s * drop(x) (B_t A_t)^T on given masks), written out block by
block with explicit loops over open_clip's `ResidualAttentionBlock`s (ln_1, the separate q, k, v
projections, attention with open_clip's additive causal mask where the tower has one, out_proj,
ln_2, mlp), pooled where open_clip pools (`coop.reference.text_parts`). Nothing here
shares code with `coop.model.lora` or our towers: it is the ground truth of the tests and the
original-style side of `tools/bench/bench_vl.py --method clip_lora`.

The image side of a timm tower (open_clip's `TimmModel`: SigLIP, EVA, PE-Core, ...) runs open_clip's
own unmodified forward with every adapted projection's weight replaced by W_t + s * B_t @ A_t
(`torch.func.functional_call`): timm's fused `qkv.weight` gets the update in its q, k or v rows,
its separate `q_proj`/`k_proj`/`v_proj` weights their own.

Learned tensors are named as `coop.model.lora.LoRAAdapters` names them: `{tower}.{block}.{t}_A` (r, W)
and `{tower}.{block}.{t}_B` (W, r), tower "text" or "vision", t in q, k, v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from open_clip.timm_model import TimmModel
from torch import nn
from torch.func import functional_call

from coop.reference.text_parts import pool_index, pooled_features, text_parts
from coop.reference.vision import vit_embeddings


def adapted_block(
    block: nn.Module,
    x: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    key: str,
    scale: float,
    mask: torch.Tensor | None,
    dropped: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One open_clip `ResidualAttentionBlock` on (N, L, W), q/k/v weights with LoRA added.

    Args:
        block: the block (its attention is an `nn.MultiheadAttention` with packed q|k|v).
        x: (N, L, W) hidden states, batch first.
        tensors: the learned A and B by name; `{key}.{t}_A` / `{key}.{t}_B` for adapted t.
        key: "text.{i}" or "vision.{i}".
        scale: s = alpha / sqrt(r).
        mask: (L, L) additive attention mask (open_clip's causal mask), or None.
        dropped: None (no dropout: LoRA merged into the weight), or a function (target key
            "{key}.{t}", h) -> the dropped-out (N, L, W) input of that target's low-rank branch.
    """
    attn = block.attn
    n, length, width = x.shape
    heads = attn.num_heads
    h = block.ln_1(x)
    weights = attn.in_proj_weight.chunk(3, dim=0)  # W_q, W_k, W_v, each (W, W)
    biases = attn.in_proj_bias.chunk(3, dim=0)
    projected = []
    for t, w, b in zip("qkv", weights, biases, strict=True):
        if f"{key}.{t}_A" not in tensors:
            y = F.linear(h, w, b)  # (N, L, W)
        elif dropped is None:  # LoRA added to the weight
            y = F.linear(h, w + scale * tensors[f"{key}.{t}_B"] @ tensors[f"{key}.{t}_A"], b)
        else:  # the frozen projection of h plus the update of the dropped-out h
            delta = scale * tensors[f"{key}.{t}_B"] @ tensors[f"{key}.{t}_A"]  # (W, W)
            y = F.linear(h, w, b) + F.linear(dropped(f"{key}.{t}", h), delta)
        projected.append(y.view(n, length, heads, width // heads).transpose(1, 2))  # (N, H, L, Dh)
    q, k, v = projected
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (N, H, L, Dh)
    y = attn.out_proj(y.transpose(1, 2).reshape(n, length, width))  # (N, L, W)
    x = x + block.ls_1(y)
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def text_features(
    oc: nn.Module, ids: torch.Tensor, tensors: dict, scale: float, dropped=None
) -> torch.Tensor:
    """(n_cls, E) unnormalised features of full-length ids (n_cls, L) through the adapted text
    tower of any family (`coop.reference.text_parts`: its mask, none without the causal one, and
    the token it pools); `dropped` as in `adapted_block` (None: no dropout)."""
    t = text_parts(oc)
    x = t.token_embedding(ids) + t.positional_embedding[: ids.shape[1]]  # (n_cls, L, W)
    mask = None if t.attn_mask is None else t.attn_mask[: ids.shape[1], : ids.shape[1]].to(x.dtype)
    for i, block in enumerate(t.transformer.resblocks):
        x = adapted_block(block, x, tensors, f"text.{i}", scale, mask, dropped)
    return pooled_features(oc, x, pool_index(oc, ids))


def image_features(visual: nn.Module, images: torch.Tensor, tensors: dict, scale: float) -> torch.Tensor:
    """(B, E) unnormalised features of open_clip's ViT or timm tower `visual` with the adapted blocks."""
    if isinstance(visual, TimmModel):
        return timm_image_features(visual, images, tensors, scale)
    x = visual.ln_pre(vit_embeddings(visual, images))  # (B, 1+P, W)
    for i, block in enumerate(visual.transformer.resblocks):
        x = adapted_block(block, x, tensors, f"vision.{i}", scale, None)
    return visual.ln_post(x[:, 0]) @ visual.proj


def timm_image_features(visual: nn.Module, images: torch.Tensor, tensors: dict, scale: float) -> torch.Tensor:
    """(B, E) unnormalised features of open_clip's `TimmModel` whose adapted q, k, v weights are
    W_t + s * B_t @ A_t: open_clip's forward on those weights (a fused `qkv.weight` holds W_q; W_k;
    W_v in its rows), the tower's own parameters untouched."""
    merged = {}
    for i, block in enumerate(visual.trunk.blocks):
        attn = block.attn
        delta = {
            t: scale * tensors[f"vision.{i}.{t}_B"] @ tensors[f"vision.{i}.{t}_A"]
            for t in "qkv"
            if f"vision.{i}.{t}_A" in tensors
        }
        if not delta:
            continue
        key = f"trunk.blocks.{i}.attn"
        if getattr(attn, "qkv", None) is not None:  # fused: rows q | k | v
            rows = attn.qkv.weight.chunk(3, dim=0)
            merged[f"{key}.qkv.weight"] = torch.cat(
                [w + delta[t] if t in delta else w for t, w in zip("qkv", rows, strict=True)]
            )
        else:
            for t, d in delta.items():
                merged[f"{key}.{t}_proj.weight"] = getattr(attn, f"{t}_proj").weight + d
    return functional_call(visual, merged, (images,))


def clip_lora_logits(
    oc: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    scale: float,
    logit_scale: float | None = None,
) -> torch.Tensor:
    """(B, n_cls) logits of one CLIP-LoRA step: every class's 77 tokens and the batch, adapted.

    Args:
        oc: an open_clip `CLIP` or `CustomTextCLIP` (an open_clip `TextTransformer`; open_clip's
            ViT or a timm tower).
        images: (B, 3, H, W).
        ids: (n_cls, L) ids of "a photo of a {class}." at the tower's full context (77 for CLIP).
        tensors: the learned A and B (`coop.model.lora.LoRAAdapters.tensors()` names).
        scale: s = alpha / sqrt(r).
        logit_scale: the original's fixed 100; None uses the model's exp(logit_scale).
    """
    text = text_features(oc, ids, tensors, scale)
    image = image_features(oc.visual, images, tensors, scale)
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    s = oc.logit_scale.exp() if logit_scale is None else logit_scale
    return s * image @ text.t()

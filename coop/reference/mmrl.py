"""Reference MMRL on OpenCLIP's own modules, written as yunncheng/MMRL's `clip/model_mmrl.py` runs it.

Every class's prompt runs at the full context length plus K (77 + K tokens, a fresh causal mask
over the longer sequence, [EOS] read at its index + K), every image's sequence at 197 + K for
ViT-B/16, tokens put in place with `torch.cat` before each listed block, and the frozen tower's
features come from a second, complete pass over the same images. Slow on purpose: ground truth
for the tests and the baseline of `tools/bench/bench_vl.py --method mmrl`.

The original knows CLIP's tokenizer only. The text side runs on any family's text modules
(`coop.reference.text_parts`: its mask, over 77+K when causal, and its pooled token); with a
tokenizer without a start token (`after=0`: SigLIP's, MetaCLIP 2's) the text tokens enter at
position 0, before the first text token, and the pooled token moves K to the right with the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from open_clip.timm_model import TimmModel
from torch import nn

from coop.reference.text_parts import pool_index, pooled_features, text_parts
from coop.reference.timm_vit import timm_vision_features
from coop.reference.vision import vision_features, vit_embeddings


def _put_tokens(x: torch.Tensor, tokens: torch.Tensor, first: bool, after: int = 1) -> torch.Tensor:
    """[x_0][tokens][x_1..] at the first listed block, [x_0][tokens][x_(1+K)..] at a later one;
    with `after=0`, [tokens][x_0..] and then [tokens][x_K..]."""
    b, k = len(x), len(tokens)
    rest = x[:, after:] if first else x[:, after + k :]
    return torch.cat([x[:, :after], tokens.to(x.dtype).unsqueeze(0).expand(b, -1, -1), rest], dim=1)


def mmrl_text_features(oc: nn.Module, ids: torch.Tensor, tokens, layers, after: int = 1) -> torch.Tensor:
    """(n_cls, E) text features of full-length prompts with the text tokens.

    Args:
        oc: an open_clip CLIP (or CustomTextCLIP).
        ids: (n_cls, 77) ids of the templated class names.
        tokens: one (K, W_t) tensor per listed block.
        layers: 0-based text blocks, increasing.
        after: 1: the tokens follow [SOS]; 0: a tokenizer without it, the tokens come first.
    """
    t = text_parts(oc)
    x = t.token_embedding(ids) + t.positional_embedding  # (n_cls, 77, W)
    for i, block in enumerate(t.transformer.resblocks):
        if i in layers:
            j = layers.index(i)
            x = _put_tokens(x, tokens[j], first=j == 0, after=after)  # (n_cls, 77+K, W)
        length = x.shape[1]
        mask = None  # a tower without the causal mask; else one over 77+K
        if t.attn_mask is not None:
            mask = torch.full((length, length), float("-inf"), device=x.device).triu(1)
        x = block(x, attn_mask=mask)
    index = pool_index(oc, ids)  # (n_cls,) before the insertion
    return pooled_features(oc, x, index + len(tokens[0]) * (index >= after))  # moved K to the right


def mmrl_image_features(visual: nn.Module, images: torch.Tensor, tokens, layers, proj_rep: torch.Tensor):
    """(f_cls, f_rep), each (B, E), of open_clip's ViT with the vision tokens after [CLS]; of a timm
    tower (SigLIP, EVA, PE-Core), timm's own forward with them as extra prefix tokens
    (`coop.reference.timm_vit`): f_cls its pooled feature of its own tokens, f_rep from the K rows
    after its final norms.

    Args:
        visual: open_clip's image tower.
        images: (B, 3, H, W).
        tokens: one (K, W_v) tensor per listed block.
        layers: 0-based image blocks, increasing.
        proj_rep: (W_v, E).
    """
    if isinstance(visual, TimmModel):
        features, rows = timm_vision_features(visual, images, inserted=(tokens, layers))  # rows (B, K, W)
        return features, rows.mean(dim=1) @ proj_rep
    x = visual.ln_pre(vit_embeddings(visual, images))  # (B, 1+P, W)
    for i, block in enumerate(visual.transformer.resblocks):
        if i in layers:
            j = layers.index(i)
            x = _put_tokens(x, tokens[j], first=j == 0)  # (B, 1+K+P, W)
        x = block(x) if visual.transformer.batch_first else block(x.transpose(0, 1)).transpose(0, 1)
    k = len(tokens[0])
    rep = visual.ln_post(x[:, 1 : 1 + k]).mean(dim=1) @ proj_rep  # (B, K, W) -> (B, W) -> (B, E)
    return visual.ln_post(x[:, 0]) @ visual.proj, rep


@torch.no_grad()
def mmrl_frozen_text(oc: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """t_zs (n_cls, E): the zero-shot model's normalised features, once per run in the original."""
    text = oc.encode_text(ids)
    return text / text.norm(dim=-1, keepdim=True)


def mmrl_step(
    oc: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    text_zs: torch.Tensor,
    rep_tokens: torch.Tensor,
    to_text,
    to_vision,
    proj_rep: torch.Tensor,
    text_layers,
    vision_layers,
    alpha: float,
    reg_weight: float,
    after: int = 1,
):
    """One MMRL training step's (loss, logits, logits_rep) as the original computes them.

    Args:
        oc: an open_clip CLIP (frozen).
        images, labels: (B, 3, H, W) and (B,).
        ids: (n_cls, 77) ids of the dataset's template with each class name.
        text_zs: (n_cls, E) `mmrl_frozen_text(oc, ids)`.
        rep_tokens: R (K, d_r); to_text / to_vision: one (weight, bias) pair per listed block.
        proj_rep: (W_v, E).
        text_layers, vision_layers: 0-based listed blocks of each tower.
        alpha, reg_weight: the fusion weight and lambda.
        after: where the text tokens enter (`mmrl_text_features`): 1 after [SOS], 0 without it.
    """
    text_tokens = [F.linear(rep_tokens, w, b) for w, b in to_text]
    vision_tokens = [F.linear(rep_tokens, w, b) for w, b in to_vision]
    with torch.no_grad():
        image_zs = vision_features(oc.visual, images)  # the second, complete image pass
        image_zs = image_zs / image_zs.norm(dim=-1, keepdim=True)
    text = mmrl_text_features(oc, ids, text_tokens, text_layers, after)
    image, image_rep = mmrl_image_features(oc.visual, images, vision_tokens, vision_layers, proj_rep)
    image = image / image.norm(dim=-1, keepdim=True)
    image_rep = image_rep / image_rep.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    scale = oc.logit_scale.exp()  # the original's 100 on OpenAI's weights
    logits, logits_rep = scale * image @ text.t(), scale * image_rep @ text.t()
    loss = (
        alpha * F.cross_entropy(logits, labels)
        + (1 - alpha) * F.cross_entropy(logits_rep, labels)
        + reg_weight * (1 - F.cosine_similarity(image, image_zs, dim=1).mean())
        + reg_weight * (1 - F.cosine_similarity(text, text_zs, dim=1).mean())
    )
    return loss, logits, logits_rep

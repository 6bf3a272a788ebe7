"""Reference HiCroPL step on OpenCLIP's own modules, as zzeoZheng/HiCroPL's `trainers/hicropl.py` runs it.

Its own structure: the prompts as per-layer lists of Parameters (`cross_prompts_text`, whose first
entry is the input context, and `cross_prompts_visual`); `CrossModalPromptLearner.forward` written
out, with each mapper's and pooling's multi-head attention spelled out from its weights (no
`nn.MultiheadAttention` call) and the mapped prompts written into the Parameters with
`.data.copy_`; every class's full 77-token prompt through open_clip's text modules
(`coop.reference.coop.deep_text_features`), the image prompts through open_clip's image modules
(`coop.reference.vision.vision_features`), the frozen features from open_clip's `encode_image`,
and `CustomCLIP.forward`'s fusion and loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from coop.reference.coop import deep_text_features, sentence_embeddings
from coop.reference.vision import vision_features


def gpt_clip_classifier(openclip_model: nn.Module, sentences_per_class: list[list[str]]) -> torch.Tensor:
    """The original's description features: per class `encode_text` of its sentences (77 tokens),
    each normalised, averaged, normalised. (n_cls, E)."""
    means = [f.mean(dim=0) for f in sentence_embeddings(openclip_model, sentences_per_class)]
    return torch.stack([f / f.norm() for f in means])


def attention(attn: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`attn(q, k, v)[0]` for unbatched (N, E) queries and (S, E) keys/values, written out: the
    in-projection split in three, softmax(Q K^T / sqrt(d)) per head, the out-projection."""
    e, h = attn.embed_dim, attn.num_heads
    wq, wk, wv = attn.in_proj_weight.chunk(3)
    bq, bk, bv = attn.in_proj_bias.chunk(3)
    d = e // h
    qh = (q @ wq.t() + bq).view(-1, h, d).transpose(0, 1)  # (h, N, d)
    kh = (k @ wk.t() + bk).view(-1, h, d).transpose(0, 1)
    vh = (v @ wv.t() + bv).view(-1, h, d).transpose(0, 1)
    weights = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(d), dim=-1)  # (h, N, S)
    out = (weights @ vh).transpose(0, 1).reshape(-1, e)
    return out @ attn.out_proj.weight.t() + attn.out_proj.bias


def attention_pooling(net: nn.Module, token_query, sequence_key, sequence_value) -> torch.Tensor:
    """The original's `AttentionPooling.forward` (LKP)."""
    token_query = token_query + attention(
        net.attn, net.ln_1(token_query), net.ln_1(sequence_key), net.ln_1(sequence_value)
    )
    return net.ln_2(token_query)


def cross_prompt_attention(net: nn.Module, q, k, v) -> torch.Tensor:
    """The original's `CrossPromptAttention.forward` (the knowledge mapper)."""
    q_proj, k_proj, v_proj = net.linear_q(q), net.linear_k(k), net.linear_v(v)
    q_proj = q_proj + attention(net.attn, net.ln_1(q_proj), net.ln_1(k_proj), net.ln_1(v_proj))
    c_fc, c_proj = net.ffn.c_fc, net.ffn.c_proj
    h = c_fc(net.ln_2(q_proj))
    return q_proj + c_proj(h * torch.sigmoid(1.702 * h))  # QuickGELU


def prompt_learner_forward(nets, cross_prompts_text, cross_prompts_visual, cross_layer: int) -> None:
    """`CrossModalPromptLearner.forward`'s mapping: T->I for layers < cross_layer, I->T above, the
    results written into the Parameters with `.data.copy_` (outside autograd).

    Args:
        nets: holds `text2visual_net`, `visual2text_net`, `attn_pooling_text_nets`,
            `attn_pooling_visual_nets`, `text_proxy_token` (L, 1, W), `visual_proxy_token` (J-L, 1, W_v).
        cross_prompts_text, cross_prompts_visual: J Parameters each, (M, W) and (M, W_v).
    """
    depth = len(cross_prompts_text)
    visual_prompts = torch.cat([cross_prompts_visual[i].unsqueeze(0) for i in range(cross_layer)], dim=0)
    proxy_text_tokens = []
    for i in range(cross_layer):
        proxy_text_tokens.append(
            attention_pooling(
                nets.attn_pooling_text_nets[i],
                nets.text_proxy_token[i],
                cross_prompts_text[i],
                cross_prompts_text[i],
            )
        )
    proxy_text_prompts = torch.cat(proxy_text_tokens, dim=0)
    visual_prompts = visual_prompts.view(-1, visual_prompts.shape[-1])
    proxy_text_prompts = proxy_text_prompts.view(-1, proxy_text_prompts.shape[-1])
    updated = cross_prompt_attention(
        nets.text2visual_net, visual_prompts, proxy_text_prompts, proxy_text_prompts
    )
    updated = updated.view(cross_layer, -1, updated.shape[-1])
    for i in range(cross_layer):
        cross_prompts_visual[i].data.copy_(updated[i])

    text_prompts = torch.cat([cross_prompts_text[i].unsqueeze(0) for i in range(cross_layer, depth)], dim=0)
    proxy_visual_tokens = []
    for i in range(cross_layer, depth):
        proxy_visual_tokens.append(
            attention_pooling(
                nets.attn_pooling_visual_nets[i - cross_layer],
                nets.visual_proxy_token[i - cross_layer],
                cross_prompts_visual[i],
                cross_prompts_visual[i],
            )
        )
    proxy_visual_prompts = torch.cat(proxy_visual_tokens, dim=0)
    text_prompts = text_prompts.view(-1, text_prompts.shape[-1])
    proxy_visual_prompts = proxy_visual_prompts.view(-1, proxy_visual_prompts.shape[-1])
    updated = cross_prompt_attention(
        nets.visual2text_net, text_prompts, proxy_visual_prompts, proxy_visual_prompts
    )
    updated = updated.view(depth - cross_layer, -1, updated.shape[-1])
    for i in range(cross_layer, depth):
        cross_prompts_text[i].data.copy_(updated[i - cross_layer])


def hicropl_forward(
    openclip_model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor | None,
    ids: torch.Tensor,
    slots: torch.Tensor,
    nets,
    cross_prompts_text,
    cross_prompts_visual,
    fixed_embeddings: torch.Tensor,
    cross_layer: int,
    lambd: float,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`CustomCLIP.forward`: (loss or None without labels, logits). Maps the prompts in place first.

    Args:
        ids, slots: `coop.reference.coop.reference_inputs` of the prompt ("X X .. X {class}.").
        fixed_embeddings: `gpt_clip_classifier` (n_cls, E), fp32.
    """
    oc = openclip_model
    logit_scale = oc.logit_scale.exp()
    with torch.no_grad():
        image_features_fixed = oc.encode_image(images)
        image_features_fixed = image_features_fixed / image_features_fixed.norm(dim=-1, keepdim=True)
    prompt_learner_forward(nets, cross_prompts_text, cross_prompts_visual, cross_layer)
    deep = torch.stack(list(cross_prompts_text[1:]))
    text_features = deep_text_features(oc, ids, slots, cross_prompts_text[0], deep)
    image_features = vision_features(oc.visual, images, list(cross_prompts_visual))

    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    image_features = image_features + image_features_fixed
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    text_features = text_features + fixed_embeddings.half()
    text_features = text_features / text_features.norm(dim=-1, keepdim=True)
    logits = logit_scale * image_features @ text_features.t()
    if labels is None:
        return None, logits
    loss_cls = F.cross_entropy(logits, labels)
    cos = nn.CosineSimilarity(dim=1, eps=1e-07)
    loss_distill_text = 1.0 - torch.mean(cos(text_features, fixed_embeddings))
    loss_distill_image = 1.0 - torch.mean(cos(image_features, image_features_fixed))
    return loss_cls + lambd * (loss_distill_text + loss_distill_image), logits

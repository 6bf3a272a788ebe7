"""Reference TCP computation on OpenCLIP's own modules, as TCP's `trainers/tcp.py` computes it.

Every class's full template ("X X X X {name}, a type of pet.") is tokenised to the context length,
the four placeholder tokens after [SOS] are replaced by `ctx` with `torch.cat`, and OpenCLIP's
text blocks run on all 77 positions; before block `layer` the four slots are replaced by the
meta-net's class tokens (the original's `ResidualAttentionBlock_MaPLe` with `layers=[8]` and
weight 1.0). Slow on purpose: ground truth for tests/test_tcp.py and tools/bench/bench_text.py.

The original knows CLIP's tokenizer only. With another family's tokenizer (`tokenizer`) the same
steps run on that family's text modules (`coop.reference.text_parts`: its mask, its pooled
token); without a start token (`sos=False`: SigLIP's, MetaCLIP 2's) the context slots are the
prompt's first four positions, 0..3, and they are where the class tokens enter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coop.model.tokenizer import clip_bpe
from coop.reference.text_parts import pool_index, pooled_features, text_parts


def tcp_teacher(
    openclip_model: nn.Module, classnames: list[str], template: str, tokenizer=None
) -> torch.Tensor:
    """t_zs: OpenCLIP's `encode_text` of the teacher template per class, L2-normalised (n_cls, E).
    `tokenizer`: the model's open_clip tokenizer (default: CLIP's)."""
    tokenizer = tokenizer or clip_bpe(openclip_model.context_length)
    ids = tokenizer([template.format(c.replace("_", " ")) for c in classnames])
    with torch.no_grad():
        t = openclip_model.encode_text(ids.to(openclip_model.logit_scale.device))
    return t / t.norm(dim=-1, keepdim=True)


def tcp_text_features(
    openclip_model: nn.Module,
    classnames: list[str],
    prompt_template: str,
    teacher: torch.Tensor,
    ctx: torch.Tensor,
    meta_net: dict[str, torch.Tensor],
    layer: int,
    tokenizer=None,
    sos: bool = True,
) -> torch.Tensor:
    """Unnormalised TCP text features (n_cls, E).

    Args:
        prompt_template: the dataset's prompt template with its four placeholder words, each one
            token in the tokenizer (CLIP's lower-cases "X"; a tokenizer without "X" takes "x").
        teacher: t_zs (n_cls, E) from `tcp_teacher`.
        ctx: (4, W) context vectors.
        meta_net: linear1.weight/bias and linear2.weight/bias of the meta-net.
        layer: the block whose input takes the class tokens.
        tokenizer: the model's open_clip tokenizer (default: CLIP's).
        sos: whether the tokenizer writes a start token; the context follows it, else opens the prompt.
    """
    oc, t = openclip_model, text_parts(openclip_model)
    tokenizer = tokenizer or clip_bpe(oc.context_length)
    ids = tokenizer([prompt_template.format(c.replace("_", " ")) for c in classnames]).to(ctx.device)
    n_cls, width, m = len(ids), ctx.shape[-1], ctx.shape[0]
    hidden = F.linear(teacher, meta_net["linear1.weight"], meta_net["linear1.bias"])
    hidden = hidden * torch.sigmoid(1.702 * hidden)  # QuickGELU
    tokens = F.linear(hidden, meta_net["linear2.weight"], meta_net["linear2.bias"]).reshape(n_cls, -1, width)
    n = int(sos)  # the slots: positions n..n+m-1
    embeds = t.token_embedding(ids)  # (n_cls, 77, W)
    x = torch.cat([embeds[:, :n], ctx.unsqueeze(0).expand(n_cls, -1, -1), embeds[:, n + m :]], dim=1)
    x = x + t.positional_embedding
    for i, block in enumerate(t.transformer.resblocks):
        if i == layer:
            x = torch.cat([x[:, :n], tokens, x[:, n + tokens.shape[1] :]], dim=1)
        x = block(x, attn_mask=t.attn_mask)
    return pooled_features(oc, x, pool_index(oc, ids))


def tcp_loss(
    openclip_model: nn.Module,
    image_features: torch.Tensor,
    labels: torch.Tensor,
    text: torch.Tensor,
    teacher: torch.Tensor,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits): CE on the cosine logits + weight * (1 - mean cos(norm(text), t_zs))."""
    text = text / text.norm(dim=-1, keepdim=True)
    image = image_features / image_features.norm(dim=-1, keepdim=True)
    logits = openclip_model.logit_scale.exp() * image @ text.t()
    score = 1.0 - torch.nn.CosineSimilarity(dim=1, eps=1e-7)(text, teacher).mean()
    return F.cross_entropy(logits, labels) + weight * score, logits

"""Reference CoOp and CoCoOp computations on OpenCLIP's own text modules.

What the original code computes: prompt pieces glued with `torch.cat`, every class padded to the
context length, CLIP's Transformer run on all of it (`text_tower`, with deep prompts replacing the
context slots); CoCoOp once per image, in a loop. `deep_text_features` is the same full-length
text side with learned tokens at given slots, the text side of the vision-language references
(`coop.reference.vision_prompts`, `coop.reference.promptsrc`). A `CustomTextCLIP`'s text modules are found by `coop.reference.text_parts`.
"""

from __future__ import annotations

import torch
from torch import nn

from coop.model.prompt import PromptLearner
from coop.model.tokenizer import clip_bpe
from coop.reference.text_parts import pool_index, pooled_features, text_parts


def coop_layout(learner: PromptLearner, embeds: torch.Tensor, ctx: torch.Tensor, name_lens: list[int]):
    """Assemble CoOp's prompts with `torch.cat`, exactly as CoOp's PromptLearner does.

    Args:
        embeds: token embeddings of "X .. X {name}." at full length, (n_cls, 77, W).
        ctx: (n_cls, M, W) context vectors (already expanded when shared).
        name_lens: BPE length of each class name.
    Returns:
        (n_cls, 77, W) prompts.
    """
    m = learner.n_ctx
    prefix = embeds[:, :1]  # (n_cls, 1, W)  [SOS]
    suffix = embeds[:, 1 + m :]  # (n_cls, *, W)  [CLASS][.][EOS][pad]
    if learner.position == "end":
        return torch.cat([prefix, ctx, suffix], dim=1)
    rows = []
    half = m // 2
    for i, c in enumerate(name_lens):
        cls, rest = suffix[i : i + 1, :c], suffix[i : i + 1, c:]
        if learner.position == "middle":
            parts = [prefix[i : i + 1], ctx[i : i + 1, :half], cls, ctx[i : i + 1, half:], rest]
        else:  # front
            parts = [prefix[i : i + 1], cls, ctx[i : i + 1], rest]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def reference_inputs(openclip_model: nn.Module, learner: PromptLearner) -> tuple:
    """What the reference computes before any prompt is assembled: (ids, name_lens, slots).

    ids are the full-length token ids (n_cls, 77) of "X .. X {name}.", name_lens the BPE length
    of each class name, slots (n_cls, 77) marks the context positions (used by deep prompts).
    They depend on the class names and layout only, so a benchmark prepares them once.
    """
    tokenizer_prefix = learner.ctx_init or " ".join(["X"] * learner.n_ctx)
    names = learner.classnames
    tokenizer = clip_bpe(openclip_model.context_length)
    device = learner.ctx.device
    ids = tokenizer([f"{tokenizer_prefix} {n}." for n in names]).to(device)  # (n_cls, 77)
    name_lens = [len(tokenizer.encode(n)) for n in names]
    # Which positions hold context vectors: push a marker through the same layout.
    n_cls = len(names)
    marker = torch.zeros(n_cls, ids.shape[1], 1, device=device)
    is_ctx = coop_layout(learner, marker, torch.ones(n_cls, learner.n_ctx, 1, device=device), name_lens)
    return ids, name_lens, is_ctx.squeeze(-1).bool()


def coop_text_features(
    openclip_model: nn.Module,
    learner: PromptLearner,
    inputs=None,
    ctx: torch.Tensor | None = None,
    classes: slice | None = None,
    deep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Text features (n_cls, E) of `learner`'s prompts, computed the CoOp way on the OpenCLIP model.

    Deep prompts replace the hidden states at the context slots before blocks 1..J-1; the slots are
    found by pushing position markers through the same `torch.cat` layout.

    Args:
        inputs: `reference_inputs(openclip_model, learner)`, computed here when None.
        ctx: context vectors to use instead of `learner.ctx`, same shape (CoCoOp's shifted ones).
        classes: only these classes' prompts (default: all); every class is computed on its own,
            so a benchmark may run the classes in slices to bound the memory.
        deep: deep prompts to use instead of `learner.deep_ctx`, same shape (TPT's tuned ones).
    """
    oc = openclip_model
    ids, name_lens, slots = inputs if inputs is not None else reference_inputs(openclip_model, learner)
    rows = slice(None) if classes is None else classes
    ids, name_lens, slots = ids[rows], name_lens[rows], slots[rows]
    n_cls = len(ids)
    embeds = text_parts(oc).token_embedding(ids)  # (n_cls, 77, W)
    ctx = learner.ctx if ctx is None else ctx
    ctx = ctx[rows] if learner.csc else ctx.unsqueeze(0).expand(n_cls, -1, -1)  # (n_cls, M, W)
    x = coop_layout(learner, embeds, ctx, name_lens)  # (n_cls, 77, W)
    deep = learner.deep_ctx if deep is None else deep
    deep = deep[: learner.depth - 1] if deep is not None else None
    if deep is not None and learner.csc:
        deep = deep[:, rows]  # (J-1, n_cls, M, W)
    return text_tower(oc, x, ids, slots, deep)


def eos_features(openclip_model: nn.Module, x: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """The end of open_clip's text tower, written out: ln_final of the last block's output x
    (n, L, W), each row's hidden state at its [EOS] index eos (n,), times text_projection: (n, E)."""
    oc = openclip_model
    x = oc.ln_final(x)
    pooled = x[torch.arange(len(x), device=x.device), eos]  # (n, W)
    proj = oc.text_projection
    return proj(pooled) if isinstance(proj, nn.Linear) else pooled @ proj


def text_tower(
    openclip_model: nn.Module,
    x: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    deep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Assembled full-length prompts (n_cls, 77, W) through OpenCLIP's own text modules.

    Before block i (1 <= i <= len(deep)) the hidden states at `slots` are replaced by `deep[i-1]`
    (no positional embedding is added to them). Any family whose text tower is an open_clip
    `TextTransformer` (`coop.reference.text_parts`: its mask, its pooled token, its projection);
    CoCa's, which appends a class token, is refused.

    Args:
        x: (n_cls, 77, W) token embeddings with the context already in place, without positions.
        ids: (n_cls, 77) token ids; [EOS] is at the largest id of each row.
        slots: (n_cls, 77) bool, True at the M context positions of each row.
        deep: optional (J-1, M, W) shared or (J-1, n_cls, M, W) class-specific deep tokens.
    Returns:
        (n_cls, E) unnormalised text features.
    """
    t = text_parts(openclip_model)
    if getattr(t, "cls_emb", None) is not None:
        raise ValueError("the reference text tower does not append CoCa's class token")
    n_cls, _, width = x.shape
    x = x + t.positional_embedding
    n_deep = 0 if deep is None else len(deep)
    for i, block in enumerate(t.transformer.resblocks):
        if 1 <= i <= n_deep:
            tokens = deep[i - 1] if deep[i - 1].dim() == 3 else deep[i - 1].unsqueeze(0).expand(n_cls, -1, -1)
            x = x.masked_scatter(slots.unsqueeze(-1).expand(-1, -1, width), tokens.reshape(-1, width))
        x = block(x, attn_mask=t.attn_mask)
    return pooled_features(openclip_model, x, pool_index(openclip_model, ids))


def cocoop_logits(
    openclip_model: nn.Module,
    learner: PromptLearner,
    meta_net: nn.Module,
    image_features: torch.Tensor,
    inputs=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CoCoOp's forward as its original code runs it: one full-77 text pass per image.

    The meta-net maps the L2-normalised image feature to a shift of every context vector,
    ctx_b = ctx + meta_net(img_b); image b is scored against the class features of its own prompts.

    Args:
        learner: the prompt layout and `ctx` (deep prompts, if any, are not shifted).
        meta_net: (B, E) -> (B, W).
        image_features: (B, E) image-tower outputs, unnormalised.
        inputs: `reference_inputs(openclip_model, learner)`, computed here when None.
    Returns:
        logits (B, n_cls) and unnormalised text features (B, n_cls, E).
    """
    inputs = inputs if inputs is not None else reference_inputs(openclip_model, learner)
    image_features = image_features / image_features.norm(dim=-1, keepdim=True)
    bias = meta_net(image_features)  # (B, W)
    shape = (len(bias),) + (1,) * (learner.ctx.dim() - 1) + (bias.shape[-1],)
    ctx_shifted = learner.ctx.unsqueeze(0) + bias.view(shape)  # (B, M, W) or (B, n_cls, M, W)
    logit_scale = openclip_model.logit_scale.exp()
    logits, texts = [], []
    for ctx_i, imf_i in zip(ctx_shifted, image_features, strict=True):
        text = coop_text_features(openclip_model, learner, inputs, ctx=ctx_i)  # (n_cls, E)
        texts.append(text)
        logits.append(logit_scale * imf_i @ (text / text.norm(dim=-1, keepdim=True)).t())
    return torch.stack(logits), torch.stack(texts)


def deep_text_features(
    openclip_model: nn.Module,
    ids: torch.Tensor,
    slots: torch.Tensor,
    ctx: torch.Tensor,
    deep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Text features (n_cls, E) of full 77-token prompts whose context slots hold learned tokens.

    The input layer's slots get `ctx`, blocks 1..len(deep) get `deep` (`text_tower`), exactly as
    the MaPLe repository's text side runs every class's whole prompt.

    Args:
        ids: (n_cls, 77) ids of the prompt text (e.g. "a photo of a {class}." or "X X {class}.").
        slots: (n_cls, 77) bool, True at the M learnable positions of each row.
        ctx: (M, W) shared or (n_cls, M, W) class-specific input-layer context.
        deep: optional (J-1, M, W) or (J-1, n_cls, M, W) deep text prompts.
    """
    oc = openclip_model
    n_cls = len(ids)
    token_embedding = text_parts(oc).token_embedding
    width = token_embedding.weight.shape[1]
    embeds = token_embedding(ids)  # (n_cls, 77, W)
    ctx = ctx if ctx.dim() == 3 else ctx.unsqueeze(0).expand(n_cls, -1, -1)  # (n_cls, M, W)
    x = embeds.masked_scatter(
        slots.unsqueeze(-1).expand(-1, -1, width), ctx.reshape(-1, width).to(embeds.dtype)
    )
    return text_tower(oc, x, ids, slots, deep)


def sentence_embeddings(
    openclip_model: nn.Module, sentences_per_class: list[list[str]]
) -> list[torch.Tensor]:
    """Each class's sentences through open_clip's `encode_text` (77 tokens), each row normalised:
    (S_c, E) per class, without gradients, as the description-using originals encode them at build."""
    tokenizer = clip_bpe(openclip_model.context_length)
    device = openclip_model.logit_scale.device
    with torch.no_grad():
        out = []
        for sentences in sentences_per_class:
            emb = openclip_model.encode_text(tokenizer(sentences).to(device))
            out.append(emb / emb.norm(dim=-1, keepdim=True))
    return out

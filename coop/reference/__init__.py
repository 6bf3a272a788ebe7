"""Reference CoOp, CoCoOp, VPT, IVLP, MaPLe and PromptSRC computations on OpenCLIP's own modules.

This is what the original code computes (prompt pieces glued with `torch.cat`, every class padded
to the context length, CLIP's Transformer run on all of it; CoCoOp once per image, in a loop; the
vision prompts of VPT, IVLP and MaPLe concatenated onto the sequence of open_clip's own
`VisionTransformer` modules, as the MaPLe repository's `VisionTransformer_MaPLe` and
`ResidualAttentionBlock_IVLP` do; on open_clip's timm towers, timm's own forward with the prompts
as extra prefix tokens, `coop.reference.timm_vit`; a `CustomTextCLIP`'s text modules are found by
`coop.reference.text_parts`). It is slow on purpose and serves as ground truth for the tests
and as the baseline of `tools/bench_text.py`, `tools/bench_cocoop.py` and `tools/bench_vl.py`.

Methods added later keep their reference in a module of their own, `coop.reference.<method>`.

Beside coop.methods: may import coop.model, coop.config and the root modules. Imported by the
tests and the benchmarks only.
"""

from __future__ import annotations

import torch
from open_clip.tokenizer import SimpleTokenizer
from torch import nn

from coop.model.prompt import PromptLearner
from coop.reference.text_parts import pool_index, pooled_features, text_parts
from coop.reference.vision import vision_features


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
    tokenizer = SimpleTokenizer(context_length=openclip_model.context_length)
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
) -> torch.Tensor:
    """Text features (n_cls, E) of `learner`'s prompts, computed the CoOp way on the OpenCLIP model.

    Deep prompts replace the hidden states at the context slots before blocks 1..J-1; the slots are
    found by pushing position markers through the same `torch.cat` layout.

    Args:
        inputs: `reference_inputs(openclip_model, learner)`, computed here when None.
        ctx: context vectors to use instead of `learner.ctx`, same shape (CoCoOp's shifted ones).
        classes: only these classes' prompts (default: all); every class is computed on its own,
            so a benchmark may run the classes in slices to bound the memory.
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
    deep = learner.deep_ctx[: learner.depth - 1] if learner.deep_ctx is not None else None
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


def _clip_logits(openclip_model: nn.Module, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """logit_scale.exp() * normalised image @ normalised text.T, as the original code writes it."""
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    return openclip_model.logit_scale.exp() * image @ text.t()


def vpt_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    text_ids: torch.Tensor | None,
    vision_prompts,
    text_features: torch.Tensor | None = None,
) -> torch.Tensor:
    """VPT: frozen text features of `text_ids` (open_clip's `encode_text`), prompted image tower.

    Args:
        images: (B, 3, H, W).
        text_ids: (n_cls, 77) ids of "a photo of a {class}.".
        vision_prompts: J tensors (M, W_vision).
        text_features: (n_cls, E) features computed once beforehand, as the original does at
            build time; then `text_ids` is not used.
    Returns:
        (B, n_cls) logits.
    """
    if text_features is None:
        with torch.no_grad():
            text_features = openclip_model.encode_text(text_ids)
    image = vision_features(openclip_model.visual, images, vision_prompts)
    return _clip_logits(openclip_model, image, text_features)


def ivlp_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    vision_prompts,
) -> torch.Tensor:
    """IVLP: independent deep text prompts (`deep_text_features`) and deep vision prompts.

    Args:
        ids, slots, text_ctx, deep_text: as in `deep_text_features` (`reference_inputs` gives
            ids and slots for a `PromptLearner`).
        vision_prompts: J_v tensors (M_v, W_vision).
    Returns:
        (B, n_cls) logits.
    """
    text = deep_text_features(openclip_model, ids, slots, text_ctx, deep_text)
    image = vision_features(openclip_model.visual, images, vision_prompts)
    return _clip_logits(openclip_model, image, text)


def maple_logits(
    openclip_model: nn.Module,
    images: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    projections,
) -> torch.Tensor:
    """MaPLe: the vision prompt of layer i is projections[i] of the text prompt of layer i.

    As the MaPLe repository's `MultiModalPromptLearner`: layer 0's vision tokens are `proj(ctx)`,
    layer i's are `compound_prompt_projections[i-1](compound_prompts_text[i-1])`, so vision
    gradients flow into the text prompts.

    Args:
        ids, slots: as in `deep_text_features`.
        text_ctx: (M, W_text) shared input-layer context (`prompt_learner.ctx`).
        deep_text: (J-1, M, W_text) deep text prompts (`compound_prompts_text`), or None for J = 1.
        projections: J modules W_text -> W_vision: `proj`, then `compound_prompt_projections`.
    Returns:
        (B, n_cls) logits.
    """
    if text_ctx.dim() != 2:
        raise ValueError(
            f"MaPLe couples one shared context (M, W) to the image tower; got {tuple(text_ctx.shape)}"
        )
    layers = [text_ctx] + ([] if deep_text is None else list(deep_text))
    vision_prompts = [project(t) for project, t in zip(projections, layers, strict=True)]
    return ivlp_logits(openclip_model, images, ids, slots, text_ctx, deep_text, vision_prompts)


def promptsrc_fixed_embeddings(openclip_model: nn.Module, classnames: list[str], templates) -> torch.Tensor:
    """PromptSRC's frozen text targets as its `VLPromptLearner` builds them: every template's
    prompts through open_clip's `encode_text` (full 77 tokens), stacked, averaged over templates,
    UNnormalised (the forward pass normalises them). (n_cls, E)."""
    tokenizer = SimpleTokenizer(context_length=openclip_model.context_length)
    names = [c.replace("_", " ") for c in classnames]
    device = openclip_model.logit_scale.device
    with torch.no_grad():
        per_template = [
            openclip_model.encode_text(tokenizer([t.replace("{}", c) for c in names]).to(device)).unsqueeze(1)
            for t in templates
        ]  # each (n_cls, 1, E)
    return torch.cat(per_template, dim=1).mean(dim=1)


def promptsrc_loss(
    openclip_model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    text_ctx: torch.Tensor,
    deep_text: torch.Tensor | None,
    vision_prompts,
    fixed_embeddings: torch.Tensor,
    text_weight: float = 25.0,
    image_weight: float = 10.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One PromptSRC training loss the way `trainers/promptsrc.py` computes it (its fp32 branch).

    IVLP's logits (`deep_text_features` on full 77-token prompts, `vision_features`), the frozen
    image tower (open_clip's `encode_image`) on the same images every step, and

        loss = CE + (KL(log_softmax(logits), log_softmax(zs_logits), sum, log_target) / numel
                     + text_weight * L1(text, fixed) + image_weight * L1(image, zs_image))

    Args:
        ids, slots, text_ctx, deep_text, vision_prompts: as in `ivlp_logits`.
        fixed_embeddings: `promptsrc_fixed_embeddings` (n_cls, E), computed once.
    Returns:
        (loss, {"ce", "text", "image", "kl"} unweighted terms).
    """
    oc = openclip_model
    text = deep_text_features(oc, ids, slots, text_ctx, deep_text)
    image = vision_features(oc.visual, images, vision_prompts)
    image = image / image.norm(dim=-1, keepdim=True)
    text = text / text.norm(dim=-1, keepdim=True)
    logit_scale = oc.logit_scale.exp()
    logits = logit_scale * image @ text.t()
    fixed = fixed_embeddings / fixed_embeddings.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        zs_image = oc.encode_image(images)
        zs_image = zs_image / zs_image.norm(dim=-1, keepdim=True)
        zs_logits = logit_scale * zs_image @ fixed.t()
    terms = {
        "ce": nn.functional.cross_entropy(logits, labels),
        "text": nn.functional.l1_loss(text, fixed, reduction="mean"),
        "image": nn.functional.l1_loss(image, zs_image, reduction="mean"),
        "kl": nn.functional.kl_div(
            nn.functional.log_softmax(logits, dim=1),
            nn.functional.log_softmax(zs_logits, dim=1),
            reduction="sum",
            log_target=True,
        )
        / logits.numel(),
    }
    scl = terms["kl"] + terms["text"] * text_weight + terms["image"] * image_weight
    return terms["ce"] + scl, terms

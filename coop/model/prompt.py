"""Learnable prompts (CoOp) and the cosine-similarity classifier built on them.

Prompt layouts, as in CoOp, for a class whose name has C BPE tokens ([CLASS]) and M context
vectors v1..vM; [SOS] and [EOS] are CLIP's start and end tokens, [.] the full stop of every prompt:

    end:    [SOS][v1 .. vM][CLASS][.][EOS]
    middle: [SOS][v1 .. v(M//2)][CLASS][v(M//2+1) .. vM][.][EOS]
    front:  [SOS][CLASS][v1 .. vM][.][EOS]

Every layout is the token sequence of "X X .. X {classname}." with its first 1+M+C tokens
permuted, so the frozen embeddings of all non-context tokens are computed once (a buffer) and the
context vectors are scattered into their slots on each forward pass.

With a phrase (`ctx_init`) and an explicit M below its token count P, the phrase stays in the
prompt and only its first M tokens are learnable (MaPLe's and IVLP's `[V1][V2] of a {class}.` for
M = 2 and "a photo of a"); the other P - M tokens are frozen text that moves with the context:

    end:    [SOS][v1 .. vM][phrase tokens M+1..P][CLASS][.][EOS]
    front:  [SOS][CLASS][v1 .. vM][phrase tokens M+1..P][.][EOS]

(middle has no single meaning there and is refused).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from coop.config.checks import check_depth
from coop.model.clip import CLIP, cosine_logits

log = logging.getLogger(__name__)
POSITIONS = {"end": "end", "middle": "middle", "mid": "middle", "front": "front"}


class PromptError(ValueError):
    """Prompt settings that cannot work (position, n_ctx, a class name too long, ...)."""


class _DefaultInt(int):
    """Marks `n_ctx` as not given, so that `ctx_init` may set it without a conflict."""


N_CTX_DEFAULT = _DefaultInt(4)


def context_slots(position: str, n_ctx: int, name_lens: list[int]) -> torch.Tensor:
    """Indices of the M context slots in each class's prompt: (n_cls, M)."""
    half = n_ctx // 2
    slots = []
    for c in name_lens:
        if position == "end":
            idx = list(range(1, 1 + n_ctx))
        elif position == "middle":
            idx = list(range(1, 1 + half)) + list(range(1 + half + c, 1 + n_ctx + c))
        else:  # front
            idx = list(range(1 + c, 1 + c + n_ctx))
        slots.append(idx)
    return torch.tensor(slots, dtype=torch.long)


def _warn_if_coop_differs(ctx_init: str, n_tokens: int) -> None:
    """CoOp counts the words of `ctx_init`, we count its BPE tokens; say so when they differ."""
    n_words = len(ctx_init.split(" "))  # CoOp's rule, empty strings from double spaces included
    if n_words == n_tokens:
        return
    if n_words < n_tokens:
        coop_does = (
            f"learn M={n_words} context vectors (the first {n_words} tokens) and keep the other "
            f"{n_tokens - n_words} tokens frozen in the prompt (prompt.n_ctx={n_words} does the same here)"
        )
    else:
        coop_does = (
            f"learn M={n_words} vectors, taken from the phrase's tokens and the [EOS]/padding after them"
        )
    log.warning(
        "ctx_init '%s' has %d words but %d BPE tokens: CoOp would %s; here all %d tokens are learned (n_ctx=%d)",
        ctx_init,
        n_words,
        n_tokens,
        coop_does,
        n_tokens,
        n_tokens,
    )


class PromptLearner(nn.Module):
    """Context vectors `ctx` (and deep context `deep_ctx`) plus the frozen class-name tokens.

    Args:
        clip: a `coop.CLIP`.
        classnames: class names; `_` is read as a space.
        n_ctx: number of context vectors M (default 4). With `ctx_init` and M unset it is the
            phrase's BPE token count P; an explicit M < P learns the phrase's first M tokens and
            keeps the rest as frozen text (see the module docstring); M > P is an error.
        ctx_init: optional phrase ("a photo of a") whose token embeddings initialise `ctx`. With M
            unset every BPE token of the phrase becomes a learnable vector. CoOp instead takes M =
            the phrase's word count (`len(ctx_init.split(" "))`) and learns the first M tokens; a
            phrase with more tokens than words ("a close-up photo of a": 5 words, 7 tokens) keeps
            its last tokens frozen there, and we learn all 7 (a warning says so; an explicit
            n_ctx=5 does what CoOp does). "a photo of a" is the same in both.
        position: where the class token sits: "end", "middle" (or "mid") or "front".
        csc: class-specific context (one set of M vectors per class) instead of shared. With
            `ctx_init`, every class starts from its own copy of the phrase; CoOp ignores CSC when
            `ctx_init` is given and trains one shared context.
        depth: J >= 1. J = 1 is plain CoOp; J > 1 adds `deep_ctx` that replaces the hidden states
            at the context slots before text blocks 1..J-1.
        phrase_max_ctx: the rule of the MaPLe repository's IVLP and MaPLe prompt learners: the
            phrase initialises the context only when M <= phrase_max_ctx (4 there); a larger M
            starts from random context ("X X .. X {class}."), as if `ctx_init` were unset. None
            (CoOp, CoCoOp, KgCoOp): the phrase always applies.
        template: what follows the context, "{}" standing for the class name: CoOp's "{}."
            by default; TCP's dataset templates ("{}, a type of pet.") need position end.
    """

    def __init__(
        self,
        clip: CLIP,
        classnames: list[str],
        n_ctx: int = N_CTX_DEFAULT,
        ctx_init: str | None = None,
        position: str = "end",
        csc: bool = False,
        depth: int = 1,
        phrase_max_ctx: int | None = None,
        template: str = "{}.",
    ):
        super().__init__()
        if template != "{}." and POSITIONS.get(position) != "end":
            raise PromptError(f"a prompt template other than '{{}}.' needs position end, got '{position}'")
        if position not in POSITIONS:
            raise PromptError(f"unknown class-token position '{position}' (choose end, middle or front)")
        check_depth("prompt.depth", int(depth), clip.text.cfg.layers, "text", PromptError)
        if not classnames:
            raise PromptError("no class names given")
        self.position = POSITIONS[position]
        self.csc = bool(csc)
        self.depth = int(depth)
        self.classnames = [name.replace("_", " ") for name in classnames]
        tokenizer = clip.tokenizer
        width = clip.width
        embedding = clip.text.token_embedding

        explicit = not isinstance(n_ctx, _DefaultInt)
        if ctx_init and explicit and phrase_max_ctx is not None and int(n_ctx) > phrase_max_ctx:
            log.info(
                "n_ctx=%d > %d: random context instead of ctx_init '%s' (the MaPLe repository's rule)",
                n_ctx,
                phrase_max_ctx,
                ctx_init,
            )
            ctx_init = None
        if ctx_init:
            ctx_init = ctx_init.replace("_", " ")
            init_ids = tokenizer.encode(ctx_init)
            n_phrase = len(init_ids)  # P: the phrase's tokens, the first M of them learnable
            if not explicit:
                n_ctx = n_phrase
                _warn_if_coop_differs(ctx_init, n_ctx)
            elif not 1 <= n_ctx <= n_phrase:
                raise PromptError(
                    f"n_ctx={n_ctx} conflicts with ctx_init '{ctx_init}', which has {n_phrase} tokens "
                    f"(n_ctx learns the phrase's first n_ctx tokens: 1..{n_phrase}, or leave it unset)"
                )
            if n_ctx < n_phrase and self.position == "middle":
                raise PromptError(
                    f"prompt.position=middle is not defined for n_ctx={n_ctx} below the {n_phrase} tokens "
                    f"of ctx_init '{ctx_init}' (use end or front, or n_ctx={n_phrase})"
                )
            prefix_text = ctx_init
        else:
            n_ctx = int(n_ctx)
            if n_ctx < 1:
                raise PromptError(f"n_ctx must be >= 1, got {n_ctx}")
            n_phrase = n_ctx
            prefix_text = " ".join(["X"] * n_ctx)
        self.n_ctx = n_ctx
        self.n_phrase = n_phrase  # context block length: M learnable + P - M frozen phrase tokens
        self.ctx_init = ctx_init or None

        name_lens = [len(tokenizer.encode(name)) for name in self.classnames]
        limit = clip.context_length
        texts = [template.format(name) for name in self.classnames]  # "name." by default
        for name, c, text in zip(self.classnames, name_lens, texts, strict=True):
            needed = 1 + n_phrase + len(tokenizer.encode(text)) + 1  # [SOS] ctx class [.] [EOS]
            if needed > limit:
                raise PromptError(
                    f"prompt for class '{name}' needs {needed} tokens, more than {limit} "
                    f"(n_ctx={n_phrase}, class name {c} tokens)"
                )
        ids = tokenizer([f"{prefix_text} {text}" for text in texts])  # (n_cls, 77)
        eos = clip.text.pool_positions(ids)  # each prompt's pooled token: [EOS] in CLIP's tower
        length = clip.text.cut_length(eos, ids.shape[1])  # through [EOS] where the tower cuts, else all
        ids = ids[:, :length]
        slots = context_slots(self.position, n_ctx, name_lens)  # (n_cls, M)
        # Rearrange "[SOS] X..X [CLASS] rest" into the chosen layout (the ctx ids are placeholders;
        # a phrase's frozen tokens M+1..P follow the learnable ones).
        order = torch.arange(length).repeat(len(self.classnames), 1)  # (n_cls, L)
        for row, c in enumerate(name_lens):
            ctx_src = list(range(1, 1 + n_phrase))
            cls_src = list(range(1 + n_phrase, 1 + n_phrase + c))
            if self.position == "end":
                new = ctx_src + cls_src
            elif self.position == "middle":
                half = n_ctx // 2
                new = ctx_src[:half] + cls_src + ctx_src[half:]
            else:
                new = cls_src + ctx_src
            order[row, 1 : 1 + n_phrase + c] = torch.tensor(new)
        ids = ids.gather(1, order)
        device = embedding.weight.device
        with torch.no_grad():
            token_embeds = embedding(ids.to(device))  # (n_cls, L, W)
        self.register_buffer("token_embeds", token_embeds, persistent=False)
        self.register_buffer("token_ids", ids.to(device), persistent=False)
        self.register_buffer("eos", eos.to(device), persistent=False)
        self.register_buffer("slots", slots.to(device), persistent=False)

        n_cls = len(self.classnames)
        shape = (n_cls, n_ctx, width) if self.csc else (n_ctx, width)
        if ctx_init:
            with torch.no_grad():
                init = embedding(torch.tensor(init_ids[:n_ctx], device=device)).float()  # (M, W)
            ctx = init.expand(shape).clone()
        else:
            ctx = torch.empty(shape, device=device).normal_(std=0.02)
        self.ctx = nn.Parameter(ctx)
        if self.depth > 1:
            deep = torch.empty((self.depth - 1, *shape), device=device).normal_(std=0.02)
            self.deep_ctx = nn.Parameter(deep)
        else:
            self.deep_ctx = None

    @property
    def n_cls(self) -> int:
        return len(self.classnames)

    @property
    def shared_prefix(self) -> int:
        """How many leading tokens every prompt shares: [SOS][v1..vM] (end) or [SOS][v1..vM/2]
        (middle) with shared context; 1 ([SOS] alone) otherwise."""
        if self.csc or self.position == "front":
            return 1
        return 1 + (self.n_ctx if self.position == "end" else self.n_ctx // 2)

    def forward(self, ctx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt embeddings (n_cls, L, W) and deep prompts (J-1, n_cls or 1, M, W) or None.

        `ctx` replaces the learner's own context (same shape), e.g. FedPGP's sigma + U V."""
        n_cls, _, width = self.token_embeds.shape
        ctx = self.ctx if ctx is None else ctx
        ctx = ctx if self.csc else ctx.unsqueeze(0).expand(n_cls, -1, -1)  # (n_cls, M, W)
        index = self.slots.unsqueeze(-1).expand(-1, -1, width)  # (n_cls, M, W)
        prompts = self.token_embeds.scatter(1, index, ctx.to(self.token_embeds.dtype))  # (n_cls, L, W)
        deep = None
        if self.deep_ctx is not None:
            deep = self.deep_ctx if self.csc else self.deep_ctx.unsqueeze(1)  # (J-1, n_cls|1, M, W)
        return prompts, deep

    def prompt_tensors(self) -> dict[str, torch.Tensor]:
        """The learnable tensors by name (what a checkpoint stores)."""
        return {name: p for name, p in self.named_parameters()}


class PromptClassifier(nn.Module):
    """Cosine-similarity classifier over prompt text features; only the prompts train."""

    def __init__(self, clip: CLIP, prompt_learner: PromptLearner):
        super().__init__()
        self.clip = clip
        self.prompt_learner = prompt_learner
        self.clip.requires_grad_(False)
        self.clip.eval()

    def text_features(self, ctx: torch.Tensor | None = None) -> torch.Tensor:
        """Unnormalised class text features (n_cls, E); `ctx` replaces the learner's own context."""
        prompts, deep = self.prompt_learner(ctx)
        pl, text = self.prompt_learner, self.clip.text
        slots = pl.slots if deep is not None else None
        start = pl.shared_prefix  # [SOS] or [SOS][v1..]: the same for every class, computed once
        return text.encode_with_shared_prefix(prompts[:1, :start], prompts[:, start:], pl.eos, deep, slots)

    def logits(self, image_features: torch.Tensor, text_features: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, n_cls) from precomputed image features (and, optionally, text features)."""
        if text_features is None:
            text_features = self.text_features()
        return cosine_logits(image_features, text_features, self.clip.logit_scale)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            image_features = self.clip.encode_image(images)
        return self.logits(image_features)

    def train(self, mode: bool = True) -> PromptClassifier:
        super().train(mode)
        self.clip.eval()
        return self

"""The full-sequence pass of the text tower: every token of every row, as open_clip runs it.

    feats = encode_full(text, x, eos)        # x (N, L, W) token embeddings -> (N, E)

`TextTransformer` runs here what has no exact cut (`TextTransformer.cuts`): towers without the
causal mask (SigLIP, CLIPA, MobileCLIP-S*), which see every token, padding included; CoCa token
ids with its padding id inside the text (open_clip hides that key too); and the attention maps of
`encode_with_attention`, which need the explicit (L, L) probabilities. Prompts enter as in the
packed pass: deep tokens replace the hidden states at the context slots, inserted tokens (MMRL)
grow the sequence after [SOS] (at its start for a tokenizer without one). CoCa's class token,
appended after the text, attends under open_clip's padding mask (`coca_mask`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def deep_by_block(deep_prompts) -> dict:
    """Deep tokens keyed by the block whose input they replace at the context slots.

    Args:
        deep_prompts: None; a tensor (J-1, N or 1, M, W) for blocks 1..J-1 (deep prompts); or a
            dict {block index >= 1: (N or 1, M, W)} (TCP: one block's class-aware tokens).
    """
    if deep_prompts is None:
        return {}
    if isinstance(deep_prompts, dict):
        if any(i < 1 for i in deep_prompts):
            raise ValueError(f"deep tokens enter blocks >= 1, got blocks {sorted(deep_prompts)}")
        return deep_prompts
    return {i + 1: tokens for i, tokens in enumerate(deep_prompts)}  # tokens: (N or 1, M, W)


def encode_full(
    text, x, eos, deep_prompts=None, slots=None, inserted=None, keys=None, need_weights=False, one_query=True
):
    """Every token of every row through the full-sequence blocks of `text` (a `TextTransformer`):
    the forward of towers without the cut (`cuts`), and of `encode_with_attention`.

    Args:
        x: (N, L, W) token embeddings of positions 0..L-1, without positions.
        eos: (N,) pooled positions (`pool_positions`).
        deep_prompts, slots: as in `encode_embeddings`; inserted: as in `encode_with_shared_prefix`.
        keys: (N, L) bool, False at padding (CoCa's mask, `coca_mask`); default: the tokens after [EOS].
        need_weights: also return every block's attention probabilities.
        one_query: the last block computes the pooled token's output only (`Block.forward_at`):
            the same features up to the order of floating-point sums, ~1/layers of the work less
            (docs/text_speed.md); False runs it on every token.
    Returns:
        (N, E) features; with `need_weights` also the (layers, N, H, L', L') probabilities.
    """
    n, length, width = x.shape
    x = x + text.positional_embedding[:length]  # (N, L, W)
    mask = None
    if text.cls_emb is not None:
        if inserted is not None:
            raise ValueError(f"{text.describe()}: inserted tokens do not fit CoCa's class token")
        cls = (text.cls_emb + text.positional_embedding[text.cfg.context_length]).to(x.dtype)  # (W,)
        x = torch.cat([x, cls.expand(n, 1, -1)], dim=1)  # (N, L+1, W)
        mask = coca_mask(eos, keys, length)
    deep = deep_by_block(deep_prompts)
    recompute = text._recompute() and not need_weights
    weights = []
    last = len(text.blocks) - 1
    for i, block in enumerate(text.blocks):
        if inserted is not None:
            x = inserted.before(i, x)  # (N, L+K, W) from its first block on
        grown = x.shape[1] > length + text.cfg.embed_cls  # K tokens inserted: later positions moved
        if i in deep:
            tokens = deep[i].to(x.dtype).expand(n, -1, -1)  # (N, M, W)
            at = inserted.shift(slots) if grown else slots  # (N, M)
            x = x.scatter(1, at.unsqueeze(-1).expand(-1, -1, width), tokens)
        if need_weights:
            x, w = block(x, need_weights=True, mask=mask)
            weights.append(w)
        elif i == last and one_query:  # only the pooled token's output is read
            at = text.pooled_index(eos, length, inserted if grown else None)
            return text._project(block.forward_at(x, at, mask))
        elif recompute:
            x = checkpoint(block, x, False, mask, use_reentrant=False)
        else:
            x = block(x, mask=mask)
    at = text.pooled_index(eos, length, inserted if grown else None)  # (N,)
    pooled = x[torch.arange(n, device=x.device), at]  # (N, W)
    feats = text._project(pooled)
    return (feats, torch.stack(weights)) if need_weights else feats


def coca_mask(eos: torch.Tensor, keys: torch.Tensor | None, length: int) -> torch.Tensor:
    """CoCa's attention mask, (N, 1, L+1, L+1), True where a query sees a key: causal, and a key
    hidden where the text token one place to its left is padding (open_clip's mask, which
    CoCa's weights were trained with, lists the class token's entry first, so every text
    entry lands one place to the right); key 0 is always seen, and the class token sees itself
    only when the text fills the context. Without `keys` (prompt embeddings), padding is
    every position after [EOS], as the tokenizer writes it."""
    if keys is None:
        keys = torch.arange(length, device=eos.device) <= eos[:, None]  # (N, L)
    keys = torch.cat([keys.new_ones(len(keys), 1), keys], dim=1)  # (N, L+1), one place right
    causal = torch.ones(length + 1, length + 1, dtype=torch.bool, device=keys.device).tril()
    return (causal & keys[:, None, :]).unsqueeze(1)  # (N, 1, L+1, L+1)

"""The packed pass of the text tower: the rows' own tokens in one sequence, after shared prefixes.

    feats = encode_packed(text, kv, x, eos, start, deep_prompts, slots, recompute)   # (G, N, E)

`TextTransformer` (`text`) runs here what has an exact cut (`TextTransformer.cuts`: a causal
tower pooled at [EOS] or at CoCa's class token): each row computes its own tokens through the last
one its pooled token sees, after G prefixes whose keys and values were computed once
(`TextTransformer.prefix_keys_values`), packed into one sequence per tile of rows
(`coop.model.packing`). Deep tokens replace the hidden states at the context slots; per-row tokens
at slots inside a shared prefix end the sharing there: only [SOS] stays shared, nothing for a
tokenizer without [SOS] (`_unshare_prefix`).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from coop.model.packing import Packing, pack, tiles
from coop.model.text_full import deep_by_block


def encode_packed(text, kv, x, eos, start: int, deep_prompts, slots, recompute: bool) -> torch.Tensor:
    """The one forward pass of prompts: rows' tokens start.. packed, after G prefixes.

    Rows run in class tiles (`coop.model.packing.tiles`), each through the whole tower in one
    packing: the same arithmetic per row, with per-token tensors of a tile's size.

    Args:
        text: the `TextTransformer`.
        kv: per block, (G, H, P, Dh) prefix keys and values with P = start; None for start 0.
        x: (G or 1, N, L, W) token embeddings of positions start.. .
        eos, deep_prompts, slots: as in `TextTransformer.encode_after_prefixes`.
        recompute: checkpoint every block (recomputed in the backward pass).
    Returns:
        (G, N, E) projected [EOS] features.
    """
    g = 1 if kv is None else kv[0][0].shape[0]
    deep = deep_by_block(deep_prompts)
    per_row = {i for i, tokens in deep.items() if len(tokens) > 1}  # else (1, M, W), shared
    needed = text.cut_length(eos, text.cfg.context_length)
    if x.shape[2] + start < needed:
        raise ValueError(f"{text.describe()} reads {needed} tokens of these rows, got {x.shape[2] + start}")
    feats = [
        _encode_tile(
            text,
            kv,
            x[:, rows],
            eos[rows],
            start,
            {i: tokens[rows] if i in per_row else tokens for i, tokens in deep.items()},
            per_row,
            None if slots is None else slots[rows],
            recompute,
        )
        for rows in tiles(text.row_lengths(eos) - start, g)
    ]
    return feats[0] if len(feats) == 1 else torch.cat(feats, 1)  # (G, N, E)


def _encode_tile(text, kv, x, eos, start: int, deep: dict, per_row: set, slots, recompute: bool):
    """`encode_packed` for one tile of rows; `deep` holds the tile's tokens by block, and
    `per_row` the blocks whose tokens are one set per row."""
    g = 1 if kv is None else kv[0][0].shape[0]
    width = x.shape[-1]
    packing = _pack(text, eos, start, g)
    own = x[:, packing.row, packing.pos.clamp(max=x.shape[2] - 1)]  # (G|1, T, W)
    h = own + text.positional_embedding[start + packing.pos]
    if text.cls_emb is not None:  # CoCa: each row's last token is the class token
        cls = text.cls_emb + text.positional_embedding[text.cfg.context_length]  # (W,)
        h = h.index_copy(1, packing.last, cls.to(h.dtype).expand(len(h), len(eos), -1))
    h = h.expand(g, -1, -1)  # (G, T, W)
    in_prefix = int((slots[0] < start).sum()) if deep else 0  # h slots sit in the prefix
    last = len(text.blocks) - 1
    kv = list(kv) if kv is not None else [(None, None)] * len(text.blocks)  # start 0: no prefix
    for i, block in enumerate(text.blocks):
        tokens = deep.get(i)
        if tokens is not None and in_prefix and i in per_row:  # per-row tokens in prefix slots
            h, packing, start = _unshare_prefix(text, h, packing, eos, start, in_prefix, g)
            kv[i:] = [(k[:, :, :start], v[:, :, :start]) for k, v in kv[i:]]  # [SOS] or nothing stays
            in_prefix = 0
        if tokens is not None and in_prefix < slots.shape[1]:  # slots among the rows' own tokens
            own = slots[:, in_prefix:] - start + packing.offsets[:, None]  # (N, M-h) packed indices
            rows = tokens[:, in_prefix:].expand(len(own), -1, -1).reshape(1, -1, width)  # (1, N(M-h), W)
            h = h.index_copy(1, own.reshape(-1), rows.to(h.dtype).expand(g, -1, -1))
        k, v = kv[i]
        if k is not None and k.shape[2] != packing.prefix:  # the prefix grew (InsertedTokens)
            packing = packing.with_prefix(k.shape[2])
        if recompute:
            h = checkpoint(block.forward_packed, h, packing, k, v, i == last, use_reentrant=False)
        else:
            h = block.forward_packed(h, packing, k, v, last=i == last)
    return text._project(h)  # h: (G, N, W) at each row's [EOS]


def _pack(text, eos: torch.Tensor, start: int, g: int) -> Packing:
    """The packed layout of rows of tokens start..`TextTransformer._ends` (and CoCa's class token,
    which sees itself only when the text fills the context: open_clip's mask)."""
    blind = eos < text.cfg.context_length - 1 if text.cls_emb is not None else None
    return pack(text.row_lengths(eos) - start, start, g, blind=blind)


def _unshare_prefix(text, h, packing: Packing, eos, start: int, in_prefix: int, g: int):
    """Re-pack rows that shared [SOS][v1..vh] (or [v1..vh]) so that only [SOS] (or nothing) stays
    shared. Returns (G, T', W) packed tokens lead..eos of every row (lead 1 or 0; the old own
    tokens moved, the h slot positions zero: the caller replaces them), the new packing, lead.
    """
    lead = start - in_prefix
    if lead not in (0, 1):
        raise ValueError(f"a shared prefix of {start} tokens must be [SOS] and {in_prefix} context slots")
    packed = _pack(text, eos, lead, g)  # rows of their own tokens after [SOS] (or all of them)
    moved = packed.offsets[packing.row] + packing.pos + start - lead  # (T,) old token -> new index
    out = h.new_zeros(g, len(packed.row), h.shape[-1]).index_copy(1, moved, h)  # (G, T', W)
    return out, packed, lead

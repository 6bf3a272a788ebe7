"""Packed rows: every prompt's own tokens in one sequence, so each block runs as one matrix multiply.

N prompts that follow a shared prefix of P tokens (`TextTransformer.prefix_keys_values`) still
compute S_n = eos_n + 1 - P tokens each, and the S_n differ from class to class. Instead of one pass
per length, the rows' own tokens are concatenated into one packed sequence of T = sum(S_n) tokens:

    packed:  [row 0: S_0 tokens][row 1: S_1 tokens] ... [row N-1]            (G, T, W)

Layer norms, the q|k|v projection, the output projection and the MLP act on each token alone, so
they run on the packed (G, T, W) tensor as single matrix multiplies, with no padding.

Attention is the only step that mixes tokens: a token at position t of row n sees the P prefix
keys and row n's keys at positions <= t, nothing of any other row. It runs in chunks of whole
rows: rows are laid, in order, into chunks of `size` slots (a row never straddles two chunks, so
`size` >= the longest row; the slots a row leaves free stay empty), and each chunk is one batch
entry of `F.scaled_dot_product_attention` with keys [prefix (P) | the chunk's slots (size)] and a
boolean mask:

    mask[chunk, query slot, key] = True  for the P prefix keys,
                                   True  for a slot of the same row at a position <= the query's.

Masked keys get probability exactly 0, so every token sees what it sees in the full-77 reference
(the prefix, then its own earlier tokens) and the same softmax over them: the computation is the
reference's up to the order of floating-point sums. Empty slots hold copies of token 0; they are
masked for every real query, and their own outputs are never read, so they receive zero gradient.
A chunk computes size + P scores per query, a little more than the reference's average
(P + S) / 2 per row, but without padding the linear layers and without a copy of the prefix per
row: keys and values of the prefix are repeated once per chunk. The same layout serves G groups
(CoCoOp: one prefix per image, the same rows after each): group g's chunks attend to prefix g.

`size` is chosen from the lengths (`chunk_size`): the chunk layout's q, k, v and attention output
are kept for the backward pass, so empty slots cost memory; 32 slots hold a single row of ~20
tokens. On a CPU, long sequences are cut into class tiles (`tiles`), each packed on its own and
run through the whole tower (`coop.model.text_packed.encode_packed`): the same arithmetic per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

CHUNK = 32  # the measured default chunk (docs/text_speed.md); `chunk_size` stays within its scores
# Packed tokens (times groups) per class tile: each tile's rows run through the whole tower in one
# packing. A tile keeps every per-token tensor small (the MLP's (T, 4W) input: 8 MiB at W = 512),
# so the CPU allocator reuses freed memory instead of mapping fresh pages that the kernel must
# zero on first touch: at 1,000 classes an untiled step spent a quarter of its time in those page
# faults (docs/text_speed.md). 100 ImageNet classes take one or two tiles (450 to 2,020 tokens).
TILE = 1024


@dataclass(frozen=True)
class Packing:
    """Index tensors of one packed layout (built by `pack`).

    Attributes:
        row: (T,) the row of each packed token.
        pos: (T,) its position among the row's own tokens, 0..S_n-1.
        last: (N,) the packed index of each row's last token ([EOS]).
        offsets: (N,) the packed index of each row's first token.
        slot: (T,) the chunk slot (0..chunks*size-1) of each packed token.
        source: (chunks*size,) the packed token held by each slot (empty slots: token 0).
        mask: (G*chunks, 1, size, P+size) which keys each slot's query sees.
        size: slots per chunk.
        chunks: chunks per group.
    """

    row: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor
    offsets: torch.Tensor
    slot: torch.Tensor
    source: torch.Tensor
    mask: torch.Tensor
    size: int
    chunks: int

    @property
    def prefix(self) -> int:
        """P, the prefix keys every query sees."""
        return self.mask.shape[-1] - self.size

    def with_prefix(self, prefix: int) -> Packing:
        """The same rows after a prefix of `prefix` tokens (MMRL: [SOS] gains K tokens at a block)."""
        own = self.mask[..., self.prefix :]  # (G n, 1, C, C)
        return replace(self, mask=torch.cat([own.new_ones(*own.shape[:-1], prefix), own], -1))

    def attention(
        self,
        qkv: torch.Tensor,
        heads: int,
        k_prefix: torch.Tensor | None = None,
        v_prefix: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of packed tokens to the prefix and to their own row's earlier tokens.

        Args:
            qkv: (G, T, 3W) packed q | k | v projections (OpenCLIP's layout).
            heads: attention heads H.
            k_prefix, v_prefix: (G, H, P, Dh) keys and values of the prefix of each group, or
                None for P = 0.
            out: packed indices whose outputs are wanted (default: every token).
        Returns:
            (G, T or len(out), W) attention outputs before the output projection.
        """
        g, _, width3 = qkv.shape
        n, c, width = self.chunks, self.size, width3 // 3
        dh = width // heads
        # Queries apart from keys/values: the attention keeps q for its backward pass, and with a
        # prefix the chunk layout's own k, v are copied into [prefix | own] and can be freed.
        q = qkv[:, self.source, :width].view(g, n, c, heads, dh).transpose(2, 3)  # (G, n, H, C, Dh)
        kv = qkv[:, self.source, width:].view(g, n, c, 2, heads, dh)  # (G, n, C, 2, H, Dh), chunk layout
        k, v = kv.permute(3, 0, 1, 4, 2, 5).unbind(0)  # each (G, n, H, C, Dh)
        if k_prefix is not None:
            k = torch.cat([k_prefix.unsqueeze(1).expand(-1, n, -1, -1, -1), k], 3)  # (G, n, H, P+C, Dh)
            v = torch.cat([v_prefix.unsqueeze(1).expand(-1, n, -1, -1, -1), v], 3)
        keys = k.shape[3]
        y = F.scaled_dot_product_attention(
            q.reshape(g * n, heads, c, dh),
            k.reshape(g * n, heads, keys, dh),
            v.reshape(g * n, heads, keys, dh),
            attn_mask=self.mask,
        )  # (G n, H, C, Dh)
        y = y.view(g, n, heads, c, dh).transpose(2, 3).reshape(g, n * c, heads * dh)  # (G, n C, W)
        return y[:, self.slot if out is None else self.slot[out]]  # back to packed order


def _fill(sizes: list[int], size: int) -> tuple[list[int], list[int]]:
    """Rows in order into chunks of `size` slots (a new chunk when a row does not fit): each row's
    chunk and first slot in it."""
    chunk_of, start_of = [], []
    current, used = -1, size
    for s in sizes:
        if used + s > size:
            current, used = current + 1, 0
        chunk_of.append(current)
        start_of.append(used)
        used += s
    return chunk_of, start_of


def chunk_size(sizes: list[int], prefix: int) -> int:
    """Slots per chunk for rows of `sizes` tokens: the least memory, at no more attention scores
    than chunks of `CHUNK` slots.

    A chunk of C slots holds C queries and P + C keys and values, all kept for the backward pass
    (half of a block's saved tensors at 1,000 classes), so its memory is chunks * (2C + P); its
    scores are chunks * C * (P + C). Rows of ~20 tokens (M = 16, class at the front) leave 12 of
    32 slots empty; 43 slots hold two of them. Sizes from the longest row to 2 * CHUNK are tried.
    """
    base = max(CHUNK, max(sizes))

    def cost(size: int) -> tuple[int, int]:  # (memory, scores) of the layout
        chunks = _fill(sizes, size)[0][-1] + 1
        return chunks * (2 * size + prefix), chunks * size * (prefix + size)

    costs = {c: cost(c) for c in range(max(sizes), 2 * base + 1)}
    return min((memory, c) for c, (memory, scores) in costs.items() if scores <= costs[base][1])[1]


def tiles(lengths: torch.Tensor, groups: int = 1, size: int | None = None) -> list[slice]:
    """Consecutive rows in tiles of at most `size` packed tokens times `groups`.

    A tile holds at least one row; one tile when everything fits (the usual case below ~100 classes).

    Args:
        lengths: (N,) own tokens per row, on the device they run on.
        groups: G, how many times each row is computed (one per prefix).
        size: tokens per tile; default `TILE` on a CPU and one tile elsewhere (CUDA's caching
            allocator reuses its blocks, and there small tiles would only add kernel launches).
    """
    if size is None and lengths.device.type != "cpu":
        return [slice(0, len(lengths))]
    budget = (size or TILE) // groups
    out, start, used = [], 0, 0
    for n, s in enumerate(lengths.tolist()):
        if used and used + s > budget:
            out.append(slice(start, n))
            start, used = n, 0
        used += s
    return out + [slice(start, len(lengths))]


def pack(
    lengths: torch.Tensor,
    prefix: int,
    groups: int = 1,
    chunk: int | None = None,
    blind: torch.Tensor | None = None,
) -> Packing:
    """The packed layout of N rows of `lengths` own tokens after a `prefix`-token prefix.

    Args:
        lengths: (N,) own tokens per row (>= 1), on the device the layout is for.
        prefix: P, the prefix keys every query sees (0: none).
        groups: G, how many times the rows repeat, each after its own prefix.
        chunk: slots per attention chunk, raised to the longest row when shorter; default: chosen
            from the lengths (`chunk_size`).
        blind: (N,) bool, rows whose last token does not see itself (CoCa's class token, whose
            own key open_clip's mask hides unless the text fills the context).

    The layout depends on these values only, and a forward at the same prompts asks for the same
    one each time (every step of a run, every image of TPT): the last layouts are kept
    (`_layout`), read-only, so that each is built once (~8 ms at 200 classes on a CPU).
    """
    key = tuple(lengths.tolist()), int(prefix), int(groups), chunk
    return _layout(*key, None if blind is None else tuple(blind.tolist()), lengths.device)


@functools.lru_cache(maxsize=16)
def _layout(sizes: tuple, prefix: int, groups: int, chunk, blind, device) -> Packing:
    """`pack` for hashable arguments: sizes (N lengths), blind (N bools) or None. Never built as
    inference tensors, which a later forward with a graph could not save."""
    with torch.inference_mode(False):
        return _build(sizes, prefix, groups, chunk, blind, device)


def _build(sizes: tuple, prefix: int, groups: int, chunk, blind, device) -> Packing:
    lengths = torch.tensor(sizes, device=device)
    blind = None if blind is None else torch.tensor(blind, device=device)
    sizes = list(sizes)
    size = max(chunk, max(sizes)) if chunk else chunk_size(sizes, prefix)
    chunk_of, start_of = _fill(sizes, size)
    chunks = chunk_of[-1] + 1
    offsets = torch.cumsum(lengths, 0) - lengths  # (N,)
    row = torch.repeat_interleave(torch.arange(len(sizes), device=device), lengths)  # (T,)
    pos = torch.arange(len(row), device=device) - offsets[row]  # (T,)
    first_slot = torch.tensor(chunk_of, device=device) * size + torch.tensor(start_of, device=device)
    slot = first_slot[row] + pos  # (T,)
    source = torch.zeros(chunks * size, dtype=torch.long, device=device)
    source[slot] = torch.arange(len(row), device=device)
    row_at = torch.full((chunks * size,), -1, device=device)  # empty slots: row -1
    row_at[slot] = row
    pos_at = torch.zeros(chunks * size, dtype=torch.long, device=device)
    pos_at[slot] = pos
    r, p = row_at.view(chunks, size), pos_at.view(chunks, size)
    own = (r[:, :, None] == r[:, None, :]) & (p[:, None, :] <= p[:, :, None])  # (n, C, C), query x key
    if blind is not None:
        hidden = slot[(offsets + lengths - 1)[blind]]  # the blind rows' last slots
        own.view(-1, size)[hidden, hidden % size] = False  # (n C, C): each one's own key
    mask = torch.cat([own.new_ones(chunks, size, prefix), own], 2).unsqueeze(1)  # (n, 1, C, P+C)
    return Packing(
        row=row,
        pos=pos,
        last=offsets + lengths - 1,
        offsets=offsets,
        slot=slot,
        source=source,
        mask=mask.repeat(groups, 1, 1, 1),  # (G n, 1, C, P+C)
        size=size,
        chunks=chunks,
    )

"""open_clip's text Transformer (`TextTransformer`), re-implemented so that prompts can enter anywhere.

The module mirrors open_clip's text tower parameter for parameter (the state-dict keys are
identical), but it is our own forward code:

    x = token_embedding(ids) + positional_embedding          # (N, L, W)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))     (causal mask or none)
    feats = ln_final(x)[arange(N), pooled] @ text_projection  # (N, E)

What varies between open_clip's text towers is read off the model into `TextConfig`
(`coop.model.text_support`): the causal mask or none, the pooled token (`pool_positions`: the
highest id, the first [EOS] id, the last or the first position), CoCa's class token appended after
the text (pooled, with open_clip's padding mask), the activation, the LayerNorm eps and the
projection (a matrix, a linear layer with or without bias, or none).

Causal towers pooled at [EOS] or at CoCa's class token (`cuts`: CLIP's, EVA, PE-Core, MetaCLIP 2,
MobileCLIP-B, CoCa) run prompts through one packed pass (`coop.model.text_packed`, laid out by
`coop.model.packing`), exact, with three savings:
  * positions after a row's [EOS] never influence its [EOS] under a causal mask, so each row
    computes `eos + 1` tokens instead of 77 (CoCa: through the padding token after [EOS], which
    its mask shows the class token, then the class token: `cut_length`, `row_lengths`);
  * a prefix that every row shares ([SOS], or [SOS][v1..] with shared context) is computed once
    (`prefix_keys_values`) and only attended to;
  * the rows' own tokens are packed into one sequence, so every block is one matrix multiply
    per weight, whatever the mix of class-name lengths; attention runs in chunks of whole rows
    with a mask that shows each token the prefix and its own row's earlier tokens.

Deep prompts: before block i (1 <= i < J) the hidden states at the context slots are replaced
by fresh learnable tokens; no positional embedding is added to them. They come as a tensor
(J-1, N or 1, M, W) for blocks 1..J-1, or keyed by block index ({i: (N or 1, M, W)}: TCP's
class-aware tokens enter one block). Per-row tokens at slots inside a shared prefix end the
sharing there: from that block on only [SOS] stays shared, nothing for a tokenizer without [SOS]
(`coop.model.text_packed`).

Inserted tokens (`InsertedTokens`, MMRL's representation tokens): K tokens enter after [SOS] (at
position 0 for a tokenizer without [SOS]) at one block and are replaced at later ones. They are
the same for every class, so from that block on [SOS][r1..rK] ([r1..rK]) is the shared prefix
(`prefix_keys_values`); each row keeps its positions.

Attention runs through `F.scaled_dot_product_attention`, which returns no weights. Tools that
need them (`coop.results.attention_maps`) call `encode_with_attention`: the full-sequence blocks, with each
attention module asked (`need_weights=True`) to form softmax(q k^T / sqrt(Dh) + causal mask)
explicitly. Only that call pays for the explicit (L, L) matrices.

Towers without the causal mask (SigLIP, CLIPA, MobileCLIP-S*) see every token, padding included,
so every row runs the whole context through the full-sequence blocks (`coop.model.text_full`),
with the same deep prompts and inserted tokens; a shared prefix is not computed once there (its
tokens see the rows), and `prefix_keys_values` refuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coop.model.blocks import Resblocks
from coop.model.inserted import InsertedTokens
from coop.model.text_full import deep_by_block, encode_full
from coop.model.text_packed import encode_packed
from coop.model.text_support import POOLS, TextConfig


class TextTransformer(nn.Module):
    """open_clip's text encoder; `state_dict()` keys equal open_clip's text-tower keys."""

    def __init__(self, cfg: TextConfig, name: str | None = None):
        super().__init__()
        self.name = name  # the model's, for messages
        if cfg.pool not in POOLS:
            raise ValueError(f"text pooling must be one of {POOLS}, got '{cfg.pool}'")
        self.cfg = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)
        # CoCa's class token takes the position after the context
        self.cls_emb = nn.Parameter(torch.empty(cfg.width)) if cfg.embed_cls else None
        self.positional_embedding = nn.Parameter(torch.empty(cfg.context_length + cfg.embed_cls, cfg.width))
        self.transformer = Resblocks(cfg, causal=cfg.causal)
        self.ln_final = nn.LayerNorm(cfg.width, eps=cfg.ln_eps)
        if not cfg.projection:
            self.text_projection = None
        elif cfg.proj_bias is None:
            self.text_projection = nn.Parameter(torch.empty(cfg.width, cfg.embed_dim))
        else:
            self.text_projection = nn.Linear(cfg.width, cfg.embed_dim, bias=cfg.proj_bias)
        self.grad_checkpointing = False

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.resblocks

    @property
    def cuts(self) -> bool:
        """Whether the exact fast paths hold: the cut after each row's pooled token, the prefix
        computed once and the packed pass. They need a causal mask (no token sees a later one) and
        pooling at an [EOS] (argmax or eos_id) or at CoCa's class token, which sees the text
        through the token after [EOS] (`_ends`)."""
        return self.cfg.causal and (self.cfg.pool in ("argmax", "eos") or self.cfg.embed_cls)

    def cut_length(self, eos: torch.Tensor, length: int) -> int:
        """How many leading tokens of rows whose pooled positions are `eos` (N,) the tower reads,
        out of `length`: through the last one the pooled token sees (`_ends`) where it `cuts`,
        else all of them."""
        return min(int(self._ends(eos).max()) + 1, length) if self.cuts else length

    def row_lengths(self, eos: torch.Tensor) -> torch.Tensor:
        """(N,) tokens each row computes from its pooled positions `eos`: through the pooled token
        where the tower cuts (CoCa's class token included), else the whole context."""
        if not self.cuts:
            return torch.full_like(eos, self.cfg.context_length + self.cfg.embed_cls)
        return self._ends(eos) + 1 + self.cfg.embed_cls

    def _ends(self, eos: torch.Tensor) -> torch.Tensor:
        """(N,) each row's last text token that its pooled token sees: the [EOS]; with CoCa's
        class token the token after it (open_clip's mask is one place to the right:
        `coop.model.text_full.coca_mask`)."""
        return (eos + 1).clamp(max=self.cfg.context_length - 1) if self.cfg.embed_cls else eos

    def pool_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Each row's pooled position, (N,), from its token ids (N, L), as open_clip pools.

        argmax: the highest id ([EOS] in CLIP's vocabulary); eos: the first `eos_id` (0 if none);
        last: L - 1; first: 0. With CoCa's class token (pooled after the text) this is the [EOS]
        (argmax), which bounds the keys that token sees (`coop.model.text_full.coca_mask`).
        """
        n, length = ids.shape
        if self.cfg.pool == "argmax" or self.cfg.embed_cls:
            return ids.argmax(dim=-1)
        if self.cfg.pool == "eos":
            return (ids == self.cfg.eos_id).int().argmax(dim=-1)
        at = length - 1 if self.cfg.pool == "last" else 0
        return torch.full((n,), at, dtype=torch.long, device=ids.device)

    def pooled_index(self, eos: torch.Tensor, length: int, inserted=None) -> torch.Tensor:
        """(N,) the pooled token's index in a full-sequence pass over `length` text positions
        (`coop.model.text_full.encode_full`, `encode_with_attention`): the pooled position `eos`
        (`pool_positions`), moved by `inserted.shift` when tokens were inserted (`InsertedTokens`,
        already in the sequence), so that it stays the same token; CoCa's class token, appended
        after the text (and the inserted tokens), at the end."""
        if self.cls_emb is not None:
            k = 0 if inserted is None else inserted.tokens[0].shape[0]
            return torch.full_like(eos, length + k)
        return eos if inserted is None else inserted.shift(eos)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Encode token ids (N, L) (L: the context length) into unnormalised text features (N, E)."""
        eos = self.pool_positions(ids)
        text = torch.arange(ids.shape[1], device=ids.device) <= eos[:, None]  # (N, L) up to [EOS]
        if not self.cuts or (self.cfg.embed_cls and bool((text & (ids == self.cfg.pad_id)).any())):
            # CoCa hides its padding id wherever it is, in the text too: such a batch runs in full
            return encode_full(self, self.token_embedding(ids), eos, keys=ids != self.cfg.pad_id)
        x = self.token_embedding(ids[:, : self.cut_length(eos, ids.shape[1])])  # (N, L', W)
        return self.encode_embeddings(x, eos)

    def encode_embeddings(
        self,
        x: torch.Tensor,
        eos: torch.Tensor,
        deep_prompts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run token embeddings (without positions) through the Transformer, packed.

        Args:
            x: token embeddings, (N, L, W) with L > max(eos); rows past a row's [EOS] are ignored.
                A tower without the cut (`cuts` False) needs the whole context, L = context length.
            eos: (N,) each row's pooled position (`pool_positions`), its [EOS] in a causal tower.
            deep_prompts: optional (J-1, N or 1, M, W) tokens that replace the hidden states at
                `slots` before blocks 1..J-1, or {block: (N or 1, M, W)} (`deep_by_block`).
            slots: (N, M) positions of the context slots; required with `deep_prompts`.
        Returns:
            (N, E) projected [EOS] features, in row order.
        """
        if not self.cuts:
            return encode_full(self, self._whole(x), eos, deep_prompts, slots)
        return encode_packed(self, None, x.unsqueeze(0), eos, 0, deep_prompts, slots, self._recompute())[0]

    def encode_with_shared_prefix(
        self,
        prefix: torch.Tensor,
        x: torch.Tensor,
        eos: torch.Tensor,
        deep_prompts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        inserted: InsertedTokens | None = None,
    ) -> torch.Tensor:
        """Like `encode_embeddings` for rows that all start with the same P tokens (exact).

        Under the causal mask the prefix's hidden states never depend on what follows, so they
        (and their keys/values) are computed once instead of once per row. With shared context,
        `[SOS][v1..vM]` (class at the end) or `[SOS][v1..vM/2]` (class in the middle) is such a
        prefix. Exact for a forward that draws nothing at random: a draw per token (CLIP-LoRA's
        dropout masks) would be shared by all rows (`coop.model.lora.LoRAAdapters.draws_masks`).

        Args:
            prefix: (1, P, W) token embeddings of positions 0..P-1, shared by all rows.
            x: (N, L, W) token embeddings of positions P.., with L > max(eos) - P.
            eos: (N,) absolute index of each row's [EOS] (>= P).
            deep_prompts: optional (J-1, 1, M, W) shared deep tokens for the context slots, or
                {block: (1 or N, M, W)}: per-row tokens (TCP's) at slots inside the prefix end
                its sharing at their block, after which only [SOS] is shared (nothing without it).
            slots: (N, M) absolute slot positions; those < P: the prefix's last h in every row.
            inserted: tokens that join the prefix at a block (`prefix_keys_values`).

        Blocks are recomputed in the backward pass under `grad_checkpointing`. A tower without
        the cut (`cuts` False) runs every row, prefix included, in full (`coop.model.text_full`).
        """
        if not self.cuts:
            x = torch.cat([prefix.expand(len(x), -1, -1), x], dim=1)  # (N, L, W)
            return encode_full(self, self._whole(x), eos, deep_prompts, slots, inserted)
        kv = self.prefix_keys_values(prefix, deep_prompts, slots, inserted)
        start = prefix.shape[1]
        return encode_packed(self, kv, x.unsqueeze(0), eos, start, deep_prompts, slots, self._recompute())[0]

    def prefix_keys_values(
        self,
        prefix: torch.Tensor,
        deep_prompts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        inserted: InsertedTokens | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of G prefixes at every block, for `encode_after_prefixes`.

        Args:
            prefix: (G, P, W) token embeddings of positions 0..P-1, one prefix per group (CoCoOp:
                one `[SOS][ctx_b]` per image).
            deep_prompts: optional (J-1, 1, M, W) deep tokens, the same for every group.
            slots: (N, M) absolute slot positions; those < P must be the prefix's last h positions
                in every row (1..h after [SOS], 0..h-1 without it).
            inserted: K tokens inserted after [SOS] (at 0 without it) at a block, replaced at later
                ones: they see only [SOS] and each other, so they are prefix too: P grows to P+K.
        Returns:
            Per block, the prefix's (keys, values), each (G, H, P, Dh) (P+K from the insertion on).
        Raises:
            ValueError: the tower has no exact cut (`cuts`): its prefix sees the rows after it.
        """
        if not self.cuts:
            raise ValueError(
                f"{self.describe()}: a prefix computed once needs a causal text tower pooled at [EOS]"
            )
        start = prefix.shape[1]
        deep = deep_by_block(deep_prompts)
        in_prefix = int((slots[0] < start).sum()) if deep else 0  # h slots sit in the prefix
        lead = start - in_prefix  # before them: [SOS], or nothing
        p = prefix + self.positional_embedding[:start]  # (G, P, W)
        kv = []
        for i, block in enumerate(self.blocks):
            # per-row tokens end the sharing at their block; only [SOS]'s keys are read after it
            if i in deep and in_prefix and len(deep[i]) == 1:
                tokens = deep[i][:, :in_prefix].to(p.dtype).expand(len(p), -1, -1)  # (G, h, W)
                p = torch.cat([p[:, :lead], tokens, p[:, start:]], dim=1)
            if inserted is not None:
                p = inserted.before(i, p)  # (G, P+K, W) from the first listed block on
            q, k, v = block.attn.qkv(block.ln_1(p))  # (G, H, P, Dh) each; P may be 0 (no [SOS])
            kv.append((k, v))
            if i + 1 < len(self.blocks) and p.shape[1]:  # the last block's prefix output is never read
                p = p + block.attn.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True))
                p = p + block.mlp(block.ln_2(p))
        return kv

    def encode_after_prefixes(
        self,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        x: torch.Tensor,
        eos: torch.Tensor,
        deep_prompts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode N rows after each of G prefixes (`prefix_keys_values`), packed.

        Row n of group g attends to prefix g and then to its own tokens, so G x N prompts run
        while every prefix is computed once. Nothing is recomputed here: callers that want
        checkpointing wrap the call (CoCoOp checkpoints blocks of prompts).

        Args:
            kv: per block, (G, H, P, Dh) keys and values of the prefixes.
            x: (G or 1, N, L, W) token embeddings of positions P.. (1: the same for every group),
                with L > max(eos) - P.
            eos: (N,) absolute index of each row's [EOS] (>= P).
            deep_prompts: optional (J-1, 1 or N, M, W) deep tokens, shared by all rows or one set
                per row (then none may sit in the prefix); the same in every group.
            slots: (N, M) absolute slot positions; those < P: the prefix's last h in every row.
        Returns:
            (G, N, E) projected [EOS] features.
        """
        return encode_packed(self, kv, x, eos, kv[0][0].shape[2], deep_prompts, slots, recompute=False)

    def encode_with_attention(
        self,
        x: torch.Tensor,
        eos: torch.Tensor,
        deep_prompts: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode_embeddings` that also returns every layer's attention probabilities.

        All rows run at one length through the full-sequence blocks: max(eos) + 1 where the tower
        cuts (under the causal mask a row's [EOS] never sees the tokens after it, so the features
        equal those of the packed pass), the whole context otherwise.

        Args:
            x, eos, deep_prompts, slots: as in `encode_embeddings`.
        Returns:
            (N, E) features and (layers, N, H, L, L) weights: [l, n, h, t, s] is the probability
            that query t puts on key s in head h of block l (0 for a key the query does not see).
            With CoCa's class token, L counts it (the last); the feature is read at the row
            `pooled_index(eos, L - cfg.embed_cls)`.
        """
        x = x[:, : self.cut_length(eos, x.shape[1])] if self.cuts else self._whole(x)
        return encode_full(self, x, eos, deep_prompts, slots, need_weights=True)

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, L, W) unchanged, once L is checked to be the whole context (towers without the cut)."""
        if x.shape[1] != self.cfg.context_length:
            raise ValueError(
                f"{self.describe()} sees every token: prompts must hold all {self.cfg.context_length} "
                f"positions, got {x.shape[1]}"
            )
        return x

    def describe(self) -> str:
        """The tower in words, for messages: "model X's text tower (not causal, pooled at last)"."""
        cfg = self.cfg
        mask = "causal" if cfg.causal else "not causal"
        pooled = "CoCa's class token" if cfg.embed_cls else cfg.pool
        owner = f"model {self.name}'s " if self.name else ""
        return f"{owner}text tower ({mask}, pooled at {pooled})"

    def _project(self, pooled: torch.Tensor) -> torch.Tensor:
        """(..., W) hidden states at the pooled token -> (..., E) features."""
        pooled = self.ln_final(pooled)
        if self.text_projection is None:
            return pooled
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(pooled)
        return pooled @ self.text_projection

    def _recompute(self) -> bool:
        return self.grad_checkpointing and torch.is_grad_enabled()

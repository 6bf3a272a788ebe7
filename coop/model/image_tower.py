"""The anatomy of a ViT image tower that takes vision prompts, shared by its two back ends.

One forward, whatever computes the stages: `coop.model.image_encoder.ImageTransformer` (open_clip's
ViT, our own modules under open_clip's keys) and `coop.model.image_timm.TimmImageTower` (the timm
trunks open_clip builds: `VisionTransformer` for SigLIP/SigLIP2 and MobileCLIP-B, `Eva` for EVA and
PE-Core, timm's own modules doing the arithmetic). A back end supplies five stages:

    x, rope = embed(images)              # (B, N+P, W): N prefix tokens (class, registers), P patches,
                                         #   positions added; rope: rotary angles for the P patches or None
    x = pre(x)                           # ln_pre / norm_pre (identity where the tower has none)
    x = run_block(i, x, rope)            # block i (rope only where the tower rotates)
    f = pool(x)                          # (B, E): final norm, pooling (class token, average, attention
                                         #   pool), head and projection, on the tokens it is given
    t = final_tokens(x)                  # (B, T, W): every token after the final norm, unprojected;
    project(t)                           #   (B, T, E): what the head does to a pooled token

and this class places the tokens methods add:

    vision prompts (VPT, IVLP, MaPLe):   x = [prefix; patches; prompts[0]]   before pre; prompts[i]
                                         replaces the last M hidden states before block i (1 <= i < J)
    inserted tokens (MMRL):              x = [prefix; K tokens; patches]      at block `layers[0]`;
                                         replaced at the later listed blocks

Neither kind carries a position: on rotary towers (EVA02, PE-Core) they get the identity rotation
(sin 0, cos 1), which is what timm gives its prefix tokens, so a prompt is a prefix token in all
but its index. The pool sees the tower's own tokens (prefix and patches) and not the added ones,
as a class-token tower's pool reads [CLS] alone: prompts act on the features through attention in
the blocks. `pool_prompts=True` hands the attention or average pool the added tokens too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from coop.model.inserted import InsertedTokens


class ImageTower(nn.Module):
    """A ViT image tower that takes vision prompts and inserted tokens; subclasses are back ends.

    Attributes a back end sets: `n_prefix` (tokens before the patches), `image_size` (H, W),
    `preprocess_cfg`, and `pool_prompts` (False: the pool sees the tower's own tokens only).
    """

    n_prefix: int = 1
    pool_prompts: bool = False

    # The back end's stages (see the module docstring).
    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def width(self) -> int:
        raise NotImplementedError

    @property
    def output_dim(self) -> int:
        raise NotImplementedError

    def embed(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def run_block(self, i: int, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def final_tokens(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def token_refusal(self) -> str | None:
        """Why the tower's tokens have no features of their own after `final_tokens` (the end of a
        phrase after "the image tower"), or None: they have (what FedOTP and MMRL read)."""
        return None

    def project(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def layers(self) -> int:
        return len(self.blocks)

    def forward(
        self,
        images: torch.Tensor,
        prompts: Sequence[torch.Tensor] | None = None,
        grad_checkpointing: bool = False,
        tokens: bool = False,
    ) -> torch.Tensor:
        """Encode images (B, 3, H, W) into unnormalised image features (B, E).

        Args:
            images: (B, 3, H, W) normalised pixels at the tower's image size.
            prompts: None (the plain tower) or J tensors, one per prompted layer, each (M, W) shared
                by all images or (B, M, W) per image: `prompts[0]` is appended after the positions,
                `prompts[i]` replaces the last M hidden states before block i (i < J).
            grad_checkpointing: recompute each block in the backward pass instead of storing its
                activations (when gradients are enabled).
            tokens: return every token after the final norm, projected: (B, N+P(+M), E), the prefix
                tokens first (FedOTP's patch features).
        """
        depth, m = self._check_prompts(prompts)
        x, rope = self.embed(images)  # (B, N+P, W)
        b = len(x)
        if depth:
            x = torch.cat([x, _per_image(prompts[0], b, x.dtype)], dim=1)  # (B, N+P+M, W)
        x = self.pre(x)
        rope = identity_rows(rope, 0, m)
        for i in range(self.layers):
            if 1 <= i < depth:
                x = torch.cat([x[:, :-m], _per_image(prompts[i], b, x.dtype)], dim=1)  # replace the last M
            x = self._run(i, x, rope, grad_checkpointing)
        if tokens:
            return self.project(self.final_tokens(x))  # (B, T, E)
        return self.pool(x if self.pool_prompts or not m else x[:, :-m])  # (B, E)

    def encode_with_inserted(
        self,
        images: torch.Tensor,
        inserted: InsertedTokens,
        frozen: bool = False,
        grad_checkpointing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """MMRL's image tower: K tokens inserted after the prefix tokens ([CLS] and registers;
        first where there are none) at block `inserted.layers[0]`, replaced at the later listed blocks.

        Args:
            images: (B, 3, H, W) normalised pixels.
            inserted: the tokens, each (K, W), and their 0-based blocks; its `after` is ignored
                (the tower knows where its patches begin).
            frozen: also return the plain tower's features of the same images; the blocks before
                the insertion are the same computation for both, so they run once.
            grad_checkpointing: as in `forward`.
        Returns:
            (features (B, E) pooled from the tower's own tokens (all of them with `pool_prompts`),
            the K tokens' final hidden states after the final norm (B, K, W), the frozen tower's
            features (B, E) without gradients or None).
        """
        first, k, n = inserted.layers[0], inserted.tokens[0].shape[0], self.n_prefix
        at = InsertedTokens(inserted.tokens, inserted.layers, after=n)
        x, rope = self.embed(images)
        x = self.pre(x)  # (B, N+P, W)
        for i in range(first):
            x = self._run(i, x, rope, grad_checkpointing)
        plain = None
        if frozen:
            with torch.no_grad():
                z = x
                for i in range(first, self.layers):
                    z = self.run_block(i, z, rope)
                plain = self.pool(z)  # (B, E)
        rope = identity_rows(rope, k, 0)
        for i in range(first, self.layers):
            x = self._run(i, at.before(i, x), rope, grad_checkpointing)  # (B, N+K+P, W)
        own = x if self.pool_prompts else torch.cat([x[:, :n], x[:, n + k :]], dim=1)
        return self.pool(own), self.final_tokens(x[:, n : n + k]), plain

    def _run(
        self, i: int, x: torch.Tensor, rope: torch.Tensor | None, grad_checkpointing: bool
    ) -> torch.Tensor:
        """Block i, recomputed in the backward pass under `grad_checkpointing` (with gradients on)."""
        if grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(self.run_block, i, x, rope, use_reentrant=False)
        return self.run_block(i, x, rope)

    def _check_prompts(self, prompts) -> tuple[int, int]:
        """(J, M) of the prompts, (0, 0) for none; one-line errors for shapes that cannot work."""
        if prompts is None:
            return 0, 0
        depth = len(prompts)
        if depth < 1:
            raise ValueError("vision prompts: got an empty list (pass None for no prompts)")
        if depth > self.layers:
            raise ValueError(f"vision prompt depth {depth} exceeds the image tower's {self.layers} layers")
        m = prompts[0].shape[-2]
        if m < 1:
            raise ValueError("vision prompts need at least 1 token per layer (vision.n_ctx >= 1)")
        for i, p in enumerate(prompts):
            if p.dim() not in (2, 3) or p.shape[-2:] != (m, self.width):
                raise ValueError(
                    f"vision prompts[{i}] has shape {tuple(p.shape)}; expected ({m}, {self.width}) or (B, {m}, {self.width})"
                )
        return depth, m


def identity_rows(rope: torch.Tensor | None, before: int, after: int) -> torch.Tensor | None:
    """Rotary angles (..., P, 2D) as [sin | cos] for the patches -> (..., before+P+after, 2D), the
    added rows the identity rotation (sin 0, cos 1): tokens without a position. None stays None."""
    if rope is None or not (before or after):
        return rope
    half = rope.shape[-1] // 2
    row = torch.cat([rope.new_zeros(half), rope.new_ones(half)])  # sin 0 | cos 1

    def rows(count: int) -> torch.Tensor:
        return row.expand(*rope.shape[:-2], count, 2 * half)

    return torch.cat([rows(before), rope, rows(after)], dim=-2)


def _per_image(p: torch.Tensor, b: int, dtype: torch.dtype) -> torch.Tensor:
    """(M, W) shared tokens or (B, M, W) per-image tokens -> (B, M, W) in the stream's dtype."""
    return p.to(dtype).expand(b, -1, -1)

"""Low-rank adapters (LoRA) on the packed q|k|v projection of our attention, as CLIP-LoRA uses them.

For a block of width d whose frozen projection is `qkv = x W^T + b`, W = [W_q; W_k; W_v] of shape
(3d, d), each adapted target t in q, k, v adds s * B_t A_t to its slice of W:

    qkv_t = x W_t^T + b_t + s * drop_t(x) A_t^T B_t^T       A_t (r, d), B_t (d, r), s = alpha / sqrt(r)

computed as two thin products (2 r d multiply-adds per token and target), never as the (d, d)
matrix B_t A_t, and never written into W: the frozen weight is not copied and cannot drift.
drop_t is a dropout of its own per target (p = `dropout`, in training mode only) on the input of
the low-rank branch; the frozen branch sees x itself. Every token of every row gets its own mask,
so a row computed once for all rows (a shared text prefix) is exact only while no masks are drawn
(`LoRAAdapters.draws_masks`). A starts kaiming_uniform(a=sqrt(5)) and B at zero, so an untrained
adapter leaves the model unchanged. s = alpha / sqrt(r) is the rank-stabilised scale that
CLIP-LoRA's code uses (not LoRA's alpha / r).

    adapters = LoRAAdapters(clip, towers=("text", "vision"), targets="qkv", layers="all")
    adapters.attach()      # each adapted block's attention adds its update (`qkv_delta`)
    adapters.detach()      # the frozen CLIP again

The adapters belong to whoever builds them (a method); the attention modules only hold a
reference to their forward (`CausalSelfAttention.qkv_delta`), so CLIP's own state dict, dtype and
weights stay as loaded. While attached, every forward of that CLIP is the adapted one: a CLIP
carries one set of adapters at a time (`attach` replaces any other).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("q", "k", "v")
TOWERS = ("text", "vision")
LAYER_SETS = ("all", "half-up", "half-bottom")


class LoRAError(ValueError):
    """LoRA settings that cannot work (a tower, target or layer that does not exist)."""


class QKVLoRA(nn.Module):
    """The low-rank updates of one attention's packed q|k|v projection.

    Args:
        width: the attention's width d.
        targets: which of "q", "k", "v" get an update.
        rank: r.
        alpha: the scale numerator; s = alpha / sqrt(r).
        dropout: dropout probability on the low-rank branch's input (training mode only).
    """

    def __init__(self, width: int, targets: Sequence[str], rank: int, alpha: float, dropout: float):
        super().__init__()
        self.width, self.rank, self.dropout = width, rank, dropout
        self.targets = tuple(t for t in TARGETS if t in targets)
        self.scale = alpha / math.sqrt(rank)
        for t in self.targets:
            a = nn.Parameter(torch.empty(rank, width))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            setattr(self, f"{t}_A", a)
            setattr(self, f"{t}_B", nn.Parameter(torch.zeros(width, rank)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d) normalised hidden states -> (..., 3d) update of q|k|v (zeros where not adapted)."""
        parts = []
        for t in TARGETS:
            if t not in self.targets:
                parts.append(x.new_zeros(*x.shape[:-1], self.width))
                continue
            a, b = getattr(self, f"{t}_A"), getattr(self, f"{t}_B")
            h = F.dropout(x, self.dropout, self.training)  # a mask of its own per target
            low = F.linear(h, a.to(x.dtype))  # (..., r)
            parts.append(F.linear(low, b.to(x.dtype)) * self.scale)  # (..., d)
        return torch.cat(parts, dim=-1)  # (..., 3d)

    def delta_weight(self) -> torch.Tensor:
        """The (3d, d) matrix [s B_q A_q; s B_k A_k; s B_v A_v] (zeros where not adapted) that
        merging adds to the packed weight."""
        zeros = next(self.parameters()).new_zeros(self.width, self.width)
        rows = [
            self.scale * getattr(self, f"{t}_B") @ getattr(self, f"{t}_A") if t in self.targets else zeros
            for t in TARGETS
        ]
        return torch.cat(rows, dim=0)


def resolve_layers(spec, n_layers: int, tower: str) -> list[int]:
    """0-based block indices of `lora.layers` for a tower of `n_layers` blocks.

    Args:
        spec: "all", "half-up" (the upper half), "half-bottom" (the lower half), or a list of
            0-based block indices (the same list for every adapted tower).
        n_layers: the tower's block count.
        tower: "text" or "vision", for messages.
    """
    if isinstance(spec, str):
        if spec not in LAYER_SETS:
            raise LoRAError(
                f"lora.layers={spec!r} is not one of {', '.join(LAYER_SETS)} or a list of block indices"
            )
        half = n_layers // 2
        return {
            "all": list(range(n_layers)),
            "half-up": list(range(half, n_layers)),
            "half-bottom": list(range(half)),
        }[spec]
    layers = [int(i) for i in spec]
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad or not layers or len(set(layers)) != len(layers):
        raise LoRAError(
            f"lora.layers={list(spec)} must be distinct 0-based block indices of the {tower} tower's "
            f"{n_layers} blocks (0..{n_layers - 1})"
        )
    return sorted(layers)


class LoRAAdapters(nn.Module):
    """CLIP-LoRA's adapters on a CLIP's towers: one `QKVLoRA` per adapted block.

    Parameters are named `{tower}.{block}.{target}_{A|B}`, e.g. `text.0.q_A`, `vision.11.v_B`
    (block indices 0-based, as in `transformer.resblocks.{i}`); text blocks are built first, then
    vision, each in block order and q, k, v, as the original code builds them.

    Args:
        clip: a `coop.CLIP` (the vision tower must be our `ImageTransformer` when adapted).
        towers: a subset of ("text", "vision").
        targets: a subset of ("q", "k", "v").
        layers: see `resolve_layers`.
        rank, alpha, dropout: as `QKVLoRA`.
    """

    def __init__(
        self, clip, towers, targets, layers, rank: int = 2, alpha: float = 1.0, dropout: float = 0.25
    ):
        super().__init__()
        towers, targets = list(towers), list(targets)
        for what, values, allowed in (("towers", towers, TOWERS), ("targets", targets, TARGETS)):
            if not values or any(v not in allowed for v in values) or len(set(values)) != len(values):
                raise LoRAError(f"lora.{what}={values} must be distinct values of {', '.join(allowed)}")
        if rank < 1:
            raise LoRAError(f"lora.rank must be an integer >= 1, got {rank}")
        if not 0 <= dropout < 1:
            raise LoRAError(f"lora.dropout must be in [0, 1), got {dropout}")
        self.towers = [t for t in TOWERS if t in towers]
        self.scale = alpha / math.sqrt(rank)  # s of every adapter
        self.modules_of = nn.ModuleDict()
        # tower -> that tower's blocks, every tower of ours (a plain dict: CLIP's, not registered here)
        self._blocks = {"text": clip.text.blocks}
        if hasattr(clip.visual, "blocks"):
            self._blocks["vision"] = clip.visual.blocks
        for tower in self.towers:
            if tower not in self._blocks:
                raise LoRAError(
                    f"the image tower {type(clip.visual).__name__} is not our ViT; it takes no adapters"
                )
            blocks = self._blocks[tower]
            width = blocks[0].attn.in_proj_weight.shape[1]
            chosen = resolve_layers(layers, len(blocks), tower)
            self.modules_of[tower] = nn.ModuleDict(
                {str(i): QKVLoRA(width, targets, rank, alpha, dropout) for i in chosen}
            )

    def named_adapters(self):
        """((tower, block index, QKVLoRA), ...) in build order."""
        for tower in self.towers:
            for i, module in self.modules_of[tower].items():
                yield tower, int(i), module

    def tensors(self) -> dict[str, nn.Parameter]:
        """Every A and B by name (`{tower}.{block}.{target}_{A|B}`)."""
        return {
            f"{tower}.{i}.{name}": p
            for tower, i, module in self.named_adapters()
            for name, p in module.named_parameters()
        }

    def draws_masks(self, tower: str) -> bool:
        """Whether a forward of `tower` draws dropout masks now (dropout > 0, in training mode).
        Then no computation may be shared between rows: a row computed once for all would share
        its masks, where the original draws a mask for every token of every row."""
        adapted = self.modules_of[tower].values() if tower in self.modules_of else ()
        return any(m.training and m.dropout > 0 for m in adapted)

    def attach(self) -> None:
        """Make every adapted block's attention add its update, and every other block of both
        towers the frozen projection (replacing adapters that another method attached before)."""
        for tower, blocks in self._blocks.items():
            adapted = self.modules_of[tower] if tower in self.modules_of else {}
            for i, block in enumerate(blocks):
                block.attn.qkv_delta = adapted[str(i)].forward if str(i) in adapted else None

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The adapted blocks' packed weights with the updates merged, W + s B A, under OpenCLIP's
        state-dict keys (`transformer.resblocks.{i}.attn.in_proj_weight`, `visual.` for the image
        tower): new tensors, for exporting or for `load_state_dict(strict=False)` into an OpenCLIP
        model. CLIP's own weights are not touched."""
        out = {}
        for tower, i, module in self.named_adapters():
            prefix = "" if tower == "text" else "visual."
            weight = self._blocks[tower][i].attn.in_proj_weight
            out[f"{prefix}transformer.resblocks.{i}.attn.in_proj_weight"] = weight + module.delta_weight().to(
                weight.dtype
            )
        return out

    def detach(self) -> None:
        """Remove the updates from the CLIP's attention modules (the frozen model again)."""
        for blocks in self._blocks.values():
            for block in blocks:
                block.attn.qkv_delta = None

"""Low-rank adapters (LoRA) on the q, k and v projections of a tower's attention, as CLIP-LoRA uses them.

For a block whose frozen projection of target t in q, k, v is `y_t = x W_t^T + b_t` (W_t of shape
(d_t, d)), each adapted target adds s * B_t A_t to W_t:

    y_t = x W_t^T + b_t + s * drop_t(x) A_t^T B_t^T       A_t (r, d), B_t (d_t, r), s = alpha / sqrt(r)

computed as two thin products (r (d + d_t) multiply-adds per token and target), never as the
(d_t, d) matrix B_t A_t, and never written into W: the frozen weight is not copied and cannot drift.
The update goes on the projection's output, before the head split, the q/k norms and the rotary
embedding, as the original's `PlainMultiheadAttentionLoRA` adds it. drop_t is a dropout of its own
per target (p = `dropout`, in training mode only) on the input of the low-rank branch; the frozen
branch sees x itself. Every token of every row gets its own mask, so a row computed once for all
rows (a shared text prefix) is exact only while no masks are drawn (`LoRAAdapters.draws_masks`).
A starts kaiming_uniform(a=sqrt(5)) and B at zero, so an untrained adapter leaves the model
unchanged. s = alpha / sqrt(r) is the rank-stabilised scale that CLIP-LoRA's code uses (not LoRA's
alpha / r).

    adapters = LoRAAdapters(clip, towers=("text", "vision"), targets="qkv", layers="all")
    adapters.attach()      # each adapted block's attention adds its update
    adapters.detach()      # the frozen CLIP again

Where the update is added (`projections`, one rule for every tower): our attention
(`coop.model.blocks.CausalSelfAttention`, both towers of open_clip's CLIP) computes a packed q|k|v
and consults its `qkv_delta`; timm's attention (SigLIP, EVA, PE-Core, ... image towers) computes
q|k|v with one fused `qkv` Linear or with three `q_proj`/`k_proj`/`v_proj` Linears, and each gets a
forward hook that adds its targets' updates to the Linear's output; so do the three Linears of
transformers' attention in the Hugging Face text towers (`coop.model.text_hf`: RoBERTa's
`query`/`key`/`value`, T5's `q`/`k`/`v`, NLLB's `q_proj`/`k_proj`/`v_proj`; `attention_of` finds
them inside each encoder layer). timm's EVA attention with a
fused weight and separate q/v biases applies the weight through `F.linear` without calling the
Linear; while adapted it runs its own `qkv_bias_separate` branch (the Linear, then the biases), the
same sum in another order. The adapters belong to whoever builds them (a method); the modules hold
only a reference or a hook, removed by `detach`, so CLIP's own state dict, dtype and weights stay as
loaded. While attached, every forward of that CLIP is the adapted one: an attention module carries
one set of adapters at a time (`attach` replaces any other).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("q", "k", "v")
# the names of separate q, k and v Linears: timm's and NLLB's (M2M100), RoBERTa's and XLM-R's, T5's
SEPARATE = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))
TOWERS = ("text", "vision")
LAYER_SETS = ("all", "half-up", "half-bottom")


class LoRAError(ValueError):
    """LoRA settings that cannot work (a tower, target or layer that does not exist)."""


class QKVLoRA(nn.Module):
    """The low-rank updates of one attention's q, k and v projections.

    Args:
        width: the projections' input width d.
        targets: which of "q", "k", "v" get an update.
        rank: r.
        alpha: the scale numerator; s = alpha / sqrt(r).
        dropout: dropout probability on the low-rank branch's input (training mode only).
        out_widths: (d_q, d_k, d_v), the projections' output widths; (d, d, d) when None.
    """

    def __init__(
        self,
        width: int,
        targets: Sequence[str],
        rank: int,
        alpha: float,
        dropout: float,
        out_widths: Sequence[int] | None = None,
    ):
        super().__init__()
        self.width, self.rank, self.dropout = width, rank, dropout
        self.out_widths = dict(zip(TARGETS, out_widths or (width,) * 3, strict=True))
        self.targets = tuple(t for t in TARGETS if t in targets)
        self.scale = alpha / math.sqrt(rank)
        for t in self.targets:
            a = nn.Parameter(torch.empty(rank, width))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            setattr(self, f"{t}_A", a)
            setattr(self, f"{t}_B", nn.Parameter(torch.zeros(self.out_widths[t], rank)))

    def forward(self, x: torch.Tensor, targets: Sequence[str] = TARGETS) -> torch.Tensor:
        """(..., d) normalised hidden states -> (..., sum of d_t) update of the packed `targets`
        (zeros where not adapted): (..., 3d) for q|k|v."""
        parts = []
        for t in targets:
            if t not in self.targets:
                parts.append(x.new_zeros(*x.shape[:-1], self.out_widths[t]))
                continue
            a, b = getattr(self, f"{t}_A"), getattr(self, f"{t}_B")
            h = F.dropout(x, self.dropout, self.training)  # a mask of its own per target
            low = F.linear(h, a.to(x.dtype))  # (..., r)
            parts.append(F.linear(low, b.to(x.dtype)) * self.scale)  # (..., d_t)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def delta_weight(self, targets: Sequence[str] = TARGETS) -> torch.Tensor:
        """The (sum of d_t, d) matrix [s B_q A_q; s B_k A_k; s B_v A_v] of the packed `targets`
        (zeros where not adapted) that merging adds to their weight."""
        rows = [
            self.scale * getattr(self, f"{t}_B") @ getattr(self, f"{t}_A")
            if t in self.targets
            else next(self.parameters()).new_zeros(self.out_widths[t], self.width)
            for t in targets
        ]
        return torch.cat(rows, dim=0)


def projections(attn: nn.Module) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """Where the attention module `attn` computes q, k and v: (targets, weight) per projection,
    the weight's rows packed in the targets' order (q|k|v for a fused projection).

    Ours (`CausalSelfAttention`): its packed `in_proj_weight`. timm's (`Attention`, `EvaAttention`,
    `AttentionRope`): its fused `qkv` Linear, or its `q_proj`, `k_proj` and `v_proj` Linears;
    transformers' (RoBERTa's `query`/`key`/`value`, T5's `q`/`k`/`v`, NLLB's `q_proj`/...): its
    three Linears. A LoRAError names any other attention.
    """
    if hasattr(attn, "qkv_delta"):
        return [(TARGETS, attn.in_proj_weight)]
    if isinstance(getattr(attn, "qkv", None), nn.Linear):
        return [(TARGETS, attn.qkv.weight)]
    linears = _separate(attn)
    if linears:
        return [((t,), linear.weight) for t, linear in zip(TARGETS, linears, strict=True)]
    raise LoRAError(
        f"attention {type(attn).__name__} has neither a packed q|k|v projection (qkv) nor "
        "separate q, k and v Linears: CLIP-LoRA cannot adapt it"
    )


def _separate(attn: nn.Module) -> list[nn.Linear] | None:
    """The q, k and v Linears of an attention that has them separately (`SEPARATE`), else None."""
    for names in SEPARATE:
        linears = [getattr(attn, n, None) for n in names]
        if all(isinstance(m, nn.Linear) for m in linears):
            return linears
    return None


def attention_of(block: nn.Module) -> nn.Module:
    """A block's self-attention: `attn` (ours, timm's), else the first module inside the block with
    separate q, k and v Linears (transformers' layers: RoBERTa's `attention.self`, T5's
    `layer[0].SelfAttention`, NLLB's `self_attn`)."""
    if hasattr(block, "attn"):
        return block.attn
    found = next((m for m in block.modules() if _separate(m)), None)
    if found is None:
        raise LoRAError(f"block {type(block).__name__} has no attention with q, k and v projections")
    return found


def _widths(attn: nn.Module) -> tuple[int, list[int]]:
    """(d, [d_q, d_k, d_v]) of the attention's projections."""
    widths = []
    for targets, weight in projections(attn):
        widths += [weight.shape[0] // len(targets)] * len(targets)
    return weight.shape[1], widths


# timm attention module -> how to remove the hooks attached to it (one set per module at a time)
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attach_update(attn: nn.Module, update: QKVLoRA | None) -> None:
    """Make the attention module `attn` add `update` to its q, k and v projections' outputs
    (None: the frozen projections), replacing any update attached before. Neither its state dict
    nor its dtypes change: ours gets a reference in `qkv_delta`, timm's Linears a forward hook."""
    if hasattr(attn, "qkv_delta"):  # ours: one slot, which the packed projection consults
        attn.qkv_delta = None if update is None else update.forward
        return
    undo = _ATTACHED.pop(attn, None)
    if undo is not None:
        undo()
    if update is None:
        return
    handles = []
    separate = dict(zip(TARGETS, _separate(attn) or (), strict=False))
    for targets, _ in projections(attn):
        if not any(t in update.targets for t in targets):
            continue  # a separate projection left frozen
        linear = attn.qkv if targets == TARGETS else separate[targets[0]]

        def add(module, args, out, targets=targets):
            return out + update(args[0], targets)  # (B, T, 3d) fused q|k|v or (B, T, d_t), updated

        handles.append(linear.register_forward_hook(add))
    # EVA's fused weight with q/v biases: F.linear(x, qkv.weight, q|k|v bias) never calls the Linear;
    # its own other branch does (the Linear, then the biases)
    flipped = getattr(attn, "q_bias", None) is not None and getattr(attn, "qkv_bias_separate", True) is False
    if flipped:
        attn.qkv_bias_separate = True

    owner = weakref.ref(attn)  # the registry's values must not keep its keys alive

    def remove():
        for handle in handles:
            handle.remove()
        if flipped and owner() is not None:
            owner().qkv_bias_separate = False

    _ATTACHED[attn] = remove


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
    (block indices 0-based, as in `transformer.resblocks.{i}` or timm's `trunk.blocks.{i}`); text
    blocks are built first, then vision, each in block order and q, k, v, as the original code
    builds them. Widths are read off each block's projections (`projections`).

    Args:
        clip: a `coop.CLIP` (the vision tower must be one of our `ImageTower`s when adapted).
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
        # tower -> that tower's module, every tower with blocks (a plain dict: CLIP's, not registered here)
        self._towers = {"text": clip.text}
        if hasattr(clip.visual, "blocks"):
            self._towers["vision"] = clip.visual
        for tower in self.towers:
            if tower not in self._towers:
                raise LoRAError(
                    f"the image tower {type(clip.visual).__name__} is not a ViT of ours; it takes no adapters"
                )
            blocks = self._towers[tower].blocks
            chosen = resolve_layers(layers, len(blocks), tower)
            adapters = {}
            for i in chosen:
                width, out_widths = _widths(attention_of(blocks[i]))
                adapters[str(i)] = QKVLoRA(width, targets, rank, alpha, dropout, out_widths)
            self.modules_of[tower] = nn.ModuleDict(adapters)

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
        for tower, module in self._towers.items():
            adapted = self.modules_of[tower] if tower in self.modules_of else {}
            for i, block in enumerate(module.blocks):
                attach_update(attention_of(block), adapted[str(i)] if str(i) in adapted else None)

    @torch.no_grad()
    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The adapted projections' weights with the updates merged, W + s B A, under OpenCLIP's
        state-dict keys (`transformer.resblocks.{i}.attn.in_proj_weight` of the text tower;
        `visual.` and the image tower's own key: `visual.transformer.resblocks.{i}.attn.in_proj_weight`,
        `visual.trunk.blocks.{i}.attn.qkv.weight`, `visual.trunk.blocks.{i}.attn.q_proj.weight`):
        new tensors, for exporting or for `load_state_dict(strict=False)` into an OpenCLIP model.
        CLIP's own weights are not touched."""
        out = {}
        for tower in self.towers:
            module = self._towers[tower]
            prefix = "" if tower == "text" else "visual."
            keys = {id(p): key for key, p in module.named_parameters()}
            for i, lora in self.modules_of[tower].items():
                for targets, weight in projections(attention_of(module.blocks[int(i)])):
                    if any(t in lora.targets for t in targets):
                        delta = lora.delta_weight(targets).to(weight.dtype)
                        out[prefix + keys[id(weight)]] = weight + delta
        return out

    def detach(self) -> None:
        """Remove the updates from the CLIP's attention modules (the frozen model again)."""
        for module in self._towers.values():
            for block in module.blocks:
                attach_update(attention_of(block), None)

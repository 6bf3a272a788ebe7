"""Read a checkpoint written by an original codebase (Dassl's `torch.save` dict), tensors only.

The originals (CoOp, CoCoOp, KgCoOp, the MaPLe and PromptSRC repositories) save Dassl checkpoints,
`<output>/<module>/model.pth.tar-<epoch>`:

    {"state_dict": {name: Tensor}, "epoch": int, "optimizer": dict, "scheduler": dict | None,
     "val_result": float | None}

`read_state_dict` loads them with `torch.load(..., weights_only=True)`: tensors and plain data,
never code. Dassl's warm-up schedulers keep their successor (a torch LR scheduler holding the
optimizer) as an object inside `scheduler`; such an object, and only the optimizer and scheduler
classes Dassl builds, is read as an inert placeholder (`Inert`), without calling any of its code,
so the released checkpoints load. Anything else that needs arbitrary unpickling is refused in one
line. A bare state dict (a plain `{name: Tensor}`) is read too.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import torch

from coop.io import refused_unpickling

# The classes Dassl's build_optimizer / build_lr_scheduler pickle into a checkpoint's scheduler.
DASSL_OBJECTS = (
    "torch.optim.lr_scheduler.CosineAnnealingLR",
    "torch.optim.lr_scheduler.StepLR",
    "torch.optim.lr_scheduler.MultiStepLR",
    "torch.optim.sgd.SGD",
    "torch.optim.adam.Adam",
    "torch.optim.adamw.AdamW",
    "torch.optim.rmsprop.RMSprop",
)


class InteropError(ValueError):
    """Prompts cannot be imported, exported or loaded; the message names the file, key or tensor."""


class OriginalCheckpointError(InteropError):
    """An original codebase's checkpoint cannot be read; the one-line message names the file."""


class Inert:
    """Stands for an optimizer or LR scheduler object pickled into a Dassl checkpoint: its pickled
    state is kept as plain data (`state`) and none of its code runs."""

    def __new__(cls, *args):
        return super().__new__(cls)

    def __setstate__(self, state) -> None:
        self.state = state


def _plain_dict(*factory) -> dict:
    """`collections.defaultdict(factory)` (an optimizer's `state`) read as a plain dict."""
    return {}


def _inert_globals() -> list:
    return [(Inert, name) for name in DASSL_OBJECTS] + [
        (_plain_dict, "collections.defaultdict"),
        (dict, "builtins.dict"),
    ]


def load_original(path: str | os.PathLike) -> dict:
    """The object a Dassl checkpoint file holds, loaded with `weights_only=True`.

    Raises:
        OriginalCheckpointError: the file is missing, not a torch.save file, or needs arbitrary
            unpickling (the message says which global it asked for).
    """
    path = Path(path)
    if not path.is_file():
        raise OriginalCheckpointError(f"checkpoint not found: {path}")
    try:
        with torch.serialization.safe_globals(_inert_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types: each becomes one line naming the file
        refused = refused_unpickling(path, e)
        if refused:
            raise OriginalCheckpointError(refused) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OriginalCheckpointError(f"cannot read {path}: {first}") from None


def read_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int | None]:
    """(state dict, epoch) of a Dassl checkpoint or a bare state dict; "module." prefixes dropped.

    Args:
        path: e.g. `output/.../prompt_learner/model.pth.tar-50`.
    """
    obj = load_original(path)
    if isinstance(obj, dict) and "state_dict" in obj:
        state, epoch = obj["state_dict"], obj.get("epoch")
    else:
        state, epoch = obj, None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise OriginalCheckpointError(
            f"{path} is neither a Dassl checkpoint (a dict with 'state_dict') nor a state dict of tensors"
        )
    state = collections.OrderedDict((k.removeprefix("module."), t) for k, t in state.items())
    return state, (int(epoch) if isinstance(epoch, int) else None)

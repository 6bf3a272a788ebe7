"""Checkpoints that hold only prompt tensors (+ training state), written atomically.

A `checkpoint.pt` is a plain dict that loads with `torch.load(path, weights_only=True)`:

    prompt      {"ctx": Tensor, "deep_ctx": Tensor (only when depth > 1)}
    optimizer   optimizer.state_dict()          scheduler   scheduler.state_dict()
    epoch       completed epochs                finished    bool
    rng         {"torch": ByteTensor, "python": tuple}   (epochs also reseed from (seed, epoch))
    history     [{"epoch", "loss", "train_acc", "lr", "time_s"}, ...]
    config      the resolved run config (plain dict)
    classnames  list[str]                       n_ctx       int (resolved M)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from coop.io import atomic_write
from coop.model import CLIP, load_clip
from coop.prompt import PromptLearner


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """Load a checkpoint safely (`weights_only=True`); a clear error for a missing/corrupt file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path}: {str(e).splitlines()[0]}") from None


def learner_from_checkpoint(clip: CLIP, ckpt: dict, classnames: list[str] | None = None) -> PromptLearner:
    """Rebuild the PromptLearner of a checkpoint (optionally for other class names) and load its tensors.

    Other class names work only for shared context (csc=False): the same context is reused.
    """
    p = ckpt["config"]["prompt"]
    names = list(ckpt["classnames"]) if classnames is None else list(classnames)
    if p["csc"] and names != list(ckpt["classnames"]):
        raise ValueError("class-specific context (csc=true) cannot be transferred to other classes")
    learner = PromptLearner(
        clip, names, n_ctx=int(ckpt["n_ctx"]), position=p["position"], csc=p["csc"], depth=p["depth"]
    )
    learner.ctx_init = p.get("ctx_init")
    with torch.no_grad():
        for name, tensor in ckpt["prompt"].items():
            getattr(learner, name).copy_(tensor)
    return learner


def load_trained(
    path: str | os.PathLike, device: str | torch.device = "cpu", pretrained: str | None = "config"
) -> tuple[CLIP, PromptLearner, dict]:
    """CLIP + trained PromptLearner + checkpoint dict from a `checkpoint.pt`.

    Args:
        path: the checkpoint file.
        device: where to build the model.
        pretrained: "config" to use the run's `model.pretrained`, or an override (tag/file/None).
    """
    ckpt = load_checkpoint(path, device)
    model = ckpt["config"]["model"]
    weights = model["pretrained"] if pretrained == "config" else pretrained
    clip = load_clip(model["name"], pretrained=weights, device=device)
    return clip, learner_from_checkpoint(clip, ckpt), ckpt

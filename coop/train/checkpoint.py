"""Checkpoints that hold only what a method learned (+ training state), written atomically.

A `checkpoint.pt` is a plain dict that loads with `torch.load(path, weights_only=True)`:

    prompt       the method's learned tensors (`Method.learnable()`): for CoOp {"ctx": Tensor,
                 "deep_ctx": Tensor (only when depth > 1)}, for the linear probe {"weight",
                 "bias", "C"}, for zero-shot {}
    method_state what `Method.training_state()` returns (e.g. PromptSRC's running GPA sum; {} for most)
    optimizer    optimizer.state_dict()         lr_schedule  the schedule's name (coop.train.schedule)
    epoch        completed epochs               finished     bool
    rng          {"torch": ByteTensor, "python": tuple}   (epochs also reseed from (seed, epoch))
    history      [{"epoch", "loss", "train_acc", "lr", "time_s"}, ...]
    config       the resolved run config (plain dict)
    classnames   list[str]
    ...          the method's `describe()` fields (e.g. n_ctx, position; the linear probe's C)
    imported     only in a run imported from an original codebase (`coop.interop`):
                 {"from": method, "file": path, "epoch": Dassl epoch}; it has no optimizer or RNG state

`load_checkpoint` turns every unusable file (missing, not a torch.save file, truncated, a
torch.save of something else, or one that needs arbitrary unpickling: the global it asks for is
named) into a one-line `CheckpointError` that names the file.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from coop.io import atomic_write, refused_unpickling
from coop.methods import METHODS
from coop.methods.coop import build_learner, require_transferable
from coop.model.clip import CLIP
from coop.model.prompt import PromptLearner
from coop.model.weights import load_clip

# What evaluation needs, and what resuming a run needs on top of it.
REQUIRED_KEYS = ("prompt", "config", "classnames")
TRAINING_KEYS = ("optimizer", "epoch", "history", "rng")
CONFIG_SECTIONS = ("model", "prompt", "data", "train")
# The `format` of a federated run's checkpoint (`coop.federated.server`): the global tensors, the
# strategy's state and the round; `prompt`, `config` and `classnames` as above.
FEDERATED_FORMAT = "coop-federated-1"


class CheckpointError(ValueError):
    """A checkpoint file cannot be used; the one-line message names the file and what is wrong."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(
    path: str | os.PathLike, device: str | torch.device = "cpu", training_state: bool = False
) -> dict:
    """Load a checkpoint safely (`weights_only=True`) and check that it is a coop checkpoint.

    Args:
        path: the `checkpoint.pt`.
        device: where its tensors go.
        training_state: also require what resuming needs (optimizer, epoch, history, RNG state).

    Raises:
        CheckpointError: (CheckpointNotFoundError for a missing file) naming `path`.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:
        refused = refused_unpickling(path, e)  # never torch's advice to turn the safety off
        raise CheckpointError(refused or f"cannot read checkpoint {path}: {_load_failure(path, e)}") from None
    check_checkpoint(ckpt, path, training_state)
    return ckpt


def _load_failure(path: Path, error: Exception) -> str:
    """Why torch.load failed, in words: empty, truncated, not a torch.save file, or refused."""
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        return "the file is empty"
    if head == b"PK\x03\x04":  # torch.save writes a zip archive
        if not zipfile.is_zipfile(path):
            return "the torch.save file is truncated or corrupt"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"not a loadable torch.save file ({reason})"
    return "not a torch.save file"


def check_checkpoint(ckpt, path: str | os.PathLike, training_state: bool = False) -> None:
    """Raise CheckpointError unless `ckpt` has the entries of a coop checkpoint (see module doc)."""
    if not isinstance(ckpt, dict):
        raise CheckpointError(
            f"{path} is not a coop checkpoint: it holds a {type(ckpt).__name__}, not a dict"
        )
    required = REQUIRED_KEYS + (TRAINING_KEYS if training_state else ())
    missing = [k for k in required if k not in ckpt]
    if missing:
        names = ", ".join(repr(k) for k in missing)
        raise CheckpointError(f"{path} is not a coop checkpoint: missing keys {names}")
    prompt, config = ckpt["prompt"], ckpt["config"]
    if not isinstance(prompt, dict) or not all(isinstance(t, torch.Tensor) for t in prompt.values()):
        raise CheckpointError(f"{path} is not a coop checkpoint: 'prompt' is not a dict of tensors")
    if not isinstance(config, dict) or not all(isinstance(config.get(k), dict) for k in CONFIG_SECTIONS):
        raise CheckpointError(
            f"{path} is not a coop checkpoint: 'config' lacks sections {', '.join(CONFIG_SECTIONS)}"
        )


def learner_from_checkpoint(clip: CLIP, ckpt: dict, classnames: list[str] | None = None) -> PromptLearner:
    """Rebuild the PromptLearner of a checkpoint (optionally for other class names) and load its tensors.

    Other class names work only for shared context (csc=False): the same context is reused.
    """
    method = ckpt["config"].get("method", "coop")
    if "ctx" not in ckpt["prompt"]:
        raise CheckpointError(f"a method={method} checkpoint holds no prompt (ctx) to rebuild")
    cfg = OmegaConf.create(ckpt["config"])
    names = list(ckpt["classnames"]) if classnames is None else list(classnames)
    require_transferable(cfg.prompt.csc, ckpt["classnames"], names)
    rule = getattr(METHODS.get(method), "phrase_max_ctx", None)  # IVLP's and MaPLe's n_ctx <= 4 rule
    learner = build_learner(clip, cfg, names, phrase_max_ctx=rule)
    with torch.no_grad():
        for name, tensor in ckpt["prompt"].items():
            if name in ("ctx", "deep_ctx"):  # the prompt itself; e.g. CoCoOp's meta-net is not part of it
                getattr(learner, name).copy_(tensor)
    return learner


def load_trained(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    pretrained: str | None = "config",
    tokenizer: str | None = None,
) -> tuple[CLIP, PromptLearner, dict]:
    """CLIP + trained PromptLearner + checkpoint dict from a `checkpoint.pt`.

    Args:
        path: the checkpoint file.
        device: where to build the model.
        pretrained: "config" to use the run's `model.pretrained`, or an override (tag/file/None).
        tokenizer: a saved Hugging Face tokenizer's directory in place of the run's `model.tokenizer`
            (a run made on another machine records that machine's); None: the run's.
    """
    ckpt = load_checkpoint(path, device)
    model = ckpt["config"]["model"]
    weights = model["pretrained"] if pretrained == "config" else pretrained
    clip = load_clip(
        model["name"], weights, device, model.get("tokenizer") if tokenizer is None else tokenizer
    )
    return clip, learner_from_checkpoint(clip, ckpt), ckpt

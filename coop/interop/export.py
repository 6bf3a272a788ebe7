"""Exported prompts: a run's learned tensors as a safetensors file with a metadata card.

    export_run("runs/dtd/.../seed1", "prompts.safetensors")
    tensors, card = read_export("prompts.safetensors")

The file holds the tensors of the run's `checkpoint.pt` (`prompt`: e.g. `ctx`, `deep_ctx`,
`vision_ctx`, `meta_net.*`), under the same names, and in its header (safetensors metadata,
strings only) the card:

    format          "coop.prompts"          format_version  "1"
    method          e.g. "maple"
    model.name      the open_clip model name     model.pretrained   its pretrained tag or file
    classnames      JSON list of the class names, in label order
    config          JSON of the run's resolved config (every key)

Any safetensors reader sees the tensors and the card; `coop.load_classifier` rebuilds the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from coop.checkpoint import load_checkpoint
from coop.interop.dassl import InteropError
from coop.io import atomic_write

FORMAT, FORMAT_VERSION = "coop.prompts", "1"


class ExportError(InteropError):
    """A run cannot be exported or an exported file cannot be read; names the file."""


def run_checkpoint(path: str | os.PathLike) -> Path:
    """The `checkpoint.pt` of a run folder (or the file itself)."""
    path = Path(path)
    return path / "checkpoint.pt" if path.is_dir() else path


def card_of(ckpt: dict) -> dict[str, str]:
    """The metadata card (all strings) of a coop checkpoint dict."""
    config = ckpt["config"]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": str(config.get("method", "coop")),
        "model.name": str(config["model"]["name"]),
        "model.pretrained": str(config["model"]["pretrained"]),
        "classnames": json.dumps(list(ckpt["classnames"])),
        "config": json.dumps(config, sort_keys=True),
    }


def export_run(run: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the learned tensors of `run` (a run folder or its checkpoint.pt) to safetensors `out`.

    Raises:
        CheckpointError: the run's checkpoint is missing or not a coop checkpoint.
        ExportError: the run has not finished (its tensors are not the final ones).
    """
    path = run_checkpoint(run)
    ckpt = load_checkpoint(path)
    if not ckpt.get("finished", False):
        raise ExportError(f"{path} is not finished (epoch {ckpt.get('epoch')}): export a finished run")
    tensors = {k: t.detach().cpu().contiguous() for k, t in ckpt["prompt"].items()}
    out = Path(out)
    atomic_write(out, lambda tmp: save_file(tensors, str(tmp), metadata=card_of(ckpt)))
    return out


def read_export(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, card) of an exported file; the card's `classnames` and `config` decoded from JSON.

    Raises:
        ExportError: missing, not a safetensors file, or not one written by `export_run`.
    """
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"exported prompts not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            card = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    except (SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"cannot read {path} as safetensors: {str(e).splitlines()[0]}") from None
    if card.get("format") != FORMAT:
        raise ExportError(
            f"{path} has no coop metadata card (format={card.get('format')!r}): not from tools/export.py"
        )
    if card.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            f"{path} has format_version {card.get('format_version')!r}; this coop reads {FORMAT_VERSION}"
        )
    card["classnames"], card["config"] = json.loads(card["classnames"]), json.loads(card["config"])
    return tensors, card

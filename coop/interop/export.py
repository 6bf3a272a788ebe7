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
    federated       a federated run's fl.method ("" for other runs)
    model           which of a federated run's models: "global", or "client <k>" ("" for others)
    tokenizer       JSON of the run's tokenizer (vocabulary size, start/end/padding ids, the
                    vocabulary's SHA-256), which `coop.load_classifier` compares with the one it loads
                    ("" for a run made before coop recorded it)

Files given by a path (a model-config JSON as model.name, a weights file as model.pretrained) are
recorded by absolute path, so the export works from any directory of the machine.
A federated run exports its global model, or with `client=k` client k's personalised one
(FedOTP, FedPGP; `coop.interop.federated`).

Any safetensors reader sees the tensors and the card; `coop.load_classifier` rebuilds the model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from coop.interop.dassl import InteropError
from coop.interop.federated import federated_method, run_model
from coop.io import atomic_write, require_writable
from coop.model.weights import absolute_model_files
from coop.train.checkpoint import load_checkpoint

FORMAT, FORMAT_VERSION = "coop.prompts", "1"
CARD_KEYS = ("method", "model.name", "model.pretrained", "classnames", "config")  # what a reader needs


class ExportError(InteropError):
    """A run cannot be exported or an exported file cannot be read; names the file."""


def run_checkpoint(path: str | os.PathLike) -> Path:
    """The `checkpoint.pt` of a run folder (or the file itself)."""
    path = Path(path)
    return path / "checkpoint.pt" if path.is_dir() else path


def card_of(ckpt: dict, model: str | None = None) -> dict[str, str]:
    """The metadata card (all strings) of a coop checkpoint dict; `model`: a federated run's model."""
    config = json.loads(json.dumps(ckpt["config"]))  # a copy
    name, pretrained = absolute_model_files(str(config["model"]["name"]), config["model"]["pretrained"])
    config["model"].update(name=name, pretrained=pretrained)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "method": str(config.get("method", "coop")),
        "model.name": name,
        "model.pretrained": str(pretrained),
        "classnames": json.dumps(list(ckpt["classnames"])),
        "config": json.dumps(config, sort_keys=True),
        "federated": federated_method(ckpt) or "",
        "model": model or "",
        "tokenizer": json.dumps(ckpt["tokenizer"], sort_keys=True) if ckpt.get("tokenizer") else "",
    }


def export_run(run: str | os.PathLike, out: str | os.PathLike, client: int | None = None) -> Path:
    """Write the learned tensors of `run` (a run folder or its checkpoint.pt) to safetensors `out`.

    Args:
        run: the run folder or its checkpoint.
        out: the file to write.
        client: a federated FedOTP or FedPGP run's client whose personalised model to export
            (default: the global model).

    Raises:
        OutputError: `out` cannot be written (checked first).
        CheckpointError: the run's checkpoint is missing or not a coop checkpoint.
        ExportError: the run has not finished (its tensors are not the final ones), or has no
            model for `client`.
    """
    out = require_writable(out)
    path = run_checkpoint(run)
    ckpt = load_checkpoint(path)
    if not ckpt.get("finished", False):
        done = f"round {ckpt.get('round')}" if "round" in ckpt else f"epoch {ckpt.get('epoch')}"
        raise ExportError(f"{path} is not finished ({done}): export a finished run")
    prompt, model = run_model(path.parent, ckpt, client)
    tensors = {k: t.detach().cpu().contiguous() for k, t in prompt.items()}
    atomic_write(out, lambda tmp: save_file(tensors, str(tmp), metadata=card_of(ckpt, model)))
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
    missing = [k for k in CARD_KEYS if k not in card]
    if missing:
        raise ExportError(
            f"{path}'s metadata card lacks {', '.join(missing)}: not a complete tools/export.py file"
        )
    try:
        card["classnames"], card["config"] = json.loads(card["classnames"]), json.loads(card["config"])
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}'s metadata card is damaged (classnames or config: {e})") from None
    if not isinstance(card["classnames"], list) or not isinstance(card["config"], dict):
        raise ExportError(f"{path}'s metadata card is damaged: classnames is not a list or config not a dict")
    card["federated"], card["model"] = card.get("federated") or None, card.get("model") or None
    try:
        card["tokenizer"] = json.loads(card["tokenizer"]) if card.get("tokenizer") else None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}'s metadata card is damaged (tokenizer: {e})") from None
    return tensors, card

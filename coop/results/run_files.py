"""Reading one run folder's files: config.yaml (or the checkpoint's config), metrics and history.

    from coop.results.run_files import read_config, read_history, read_metrics
    config = read_config(Path("runs/x/seed1"))            # {"data.shots": 16, ...}
    history = read_history(Path("runs/x/seed1"))          # history.csv as a DataFrame, or None

The tables of `coop.results.tables` and the figures of `coop.results.plots` read run folders through these.
A file that cannot be read is logged and treated as absent, so one damaged run never stops a table.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from coop.config.load import flatten
from coop.config.schema import CHOICES
from coop.io import refused_unpickling

log = logging.getLogger(__name__)

# eval_<dataset>_<half>.json belongs to the base-to-new protocol, not to transfer targets.
SUBSAMPLE_SUFFIXES = tuple(f"_{c}" for c in CHOICES["data.subsample_classes"] if c != "all")


def read_config(folder: Path) -> dict:
    """The run's config as a flat {dotted key: value} dict; from config.yaml, else the checkpoint."""
    path = folder / "config.yaml"
    if path.is_file():
        try:
            return flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
        except Exception as e:  # yaml errors are multi-line
            log.warning("cannot read %s: %s", path, str(e).splitlines()[0])
            return {}
    ckpt = folder / "checkpoint.pt"
    if ckpt.is_file():
        import torch

        try:
            return flatten(torch.load(ckpt, map_location="cpu", weights_only=True).get("config") or {})
        except Exception as e:
            log.warning(
                "cannot read the config of %s: %s",
                ckpt,
                refused_unpickling(ckpt, e) or str(e).splitlines()[0],
            )
    return {}


def read_metrics(path: Path) -> dict | None:
    """The scalar entries of a metrics JSON file; None if unreadable.

    Lists and dicts (per-class and per-domain accuracy, a federated run's `fl` settings) are
    dropped: a table cell holds one number, and the settings come from config.yaml.
    """
    try:
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(values, dict):
        return None
    return {k: v for k, v in values.items() if not isinstance(v, dict | list)}


def eval_targets(folder: Path) -> dict[str, dict]:
    """{dataset: metrics} of the run's `eval_<dataset>.json` files (transfer evaluations)."""
    out = {}
    for path in sorted(folder.glob("eval_*.json")):
        name = path.stem[len("eval_") :]
        if not name or name.endswith(SUBSAMPLE_SUFFIXES):
            continue
        values = read_metrics(path)
        if values is None:
            log.warning("unreadable %s: left out", path)
            continue
        out[name] = values
    return out


def read_history(folder: Path) -> pd.DataFrame | None:
    """The run's `history.csv` (one row per epoch, or per round for a federated run); None if absent.

    Args:
        folder: the run folder.
    Returns:
        The rows as written (columns `epoch` or `round`, `accuracy`, `train_loss`, ...), or None
        when the file is missing, empty or unreadable.
    """
    path = folder / "history.csv"
    if not path.is_file():
        return None
    try:
        history = pd.read_csv(path)
    except (OSError, ValueError) as e:  # pandas' EmptyDataError and ParserError are ValueErrors
        log.warning("cannot read %s: %s", path, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None
    return history if len(history) else None

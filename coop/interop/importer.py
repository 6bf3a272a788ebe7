"""Import a checkpoint of an original codebase as an ordinary coop run folder.

    from coop.interop import import_checkpoint
    folder = import_checkpoint("maple", "output/.../MultiModalPromptLearner/model.pth.tar-5",
                               "runs/imported/maple_dtd", ["data.name=dtd", "data.root=/data"])

The folder gets `config.yaml` (the method's recipe, plus what the tensors imply: `prompt.n_ctx`,
`prompt.csc`, `prompt.depth`, `vision.n_ctx`, `vision.depth`; then the caller's overrides) and a
finished `checkpoint.pt` holding our names of the learned tensors (`coop.interop.names`), so
`tools/eval.py`, `eval.targets`, `tools/collect.py` and `tools/export.py` read it as any run.
With `evaluate=True` (the default of `tools/import_checkpoint.py`) it is also evaluated on its
test split (`metrics.json`) and on every `eval.targets` entry.

The class names come from the dataset (`data.name`, `data.root`, `data.subsample_classes`): a
Dassl file does not store them, nor the class-token position (`prompt.position`, default end).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from coop.config.load import load_config, to_yaml
from coop.config.run_names import model_tag
from coop.data import build_dataset, subsample_classes
from coop.interop.dassl import InteropError, read_state_dict
from coop.interop.names import implied_overrides, map_names
from coop.io import atomic_write, write_json
from coop.methods import build_method
from coop.model.clip import CLIP
from coop.model.tokenizer import prompt_tokenizer
from coop.model.weights import absolute_model_files, absolute_tokenizer_dir, load_clip
from coop.train.checkpoint import save_checkpoint
from coop.train.evaluation import evaluate_on, evaluate_targets
from coop.train.lock import require_run_folder, run_lock

log = logging.getLogger(__name__)

# What an axis of a learned tensor measures, to say why a shape is wrong: (our name, axis).
TEXT, IMAGE, CLASSES = "text width", "image width", "classes"
AXIS_MEANING = {
    ("ctx", -1): TEXT,
    ("ctx", -3): CLASSES,  # class-specific context
    ("deep_ctx", -1): TEXT,
    ("vision_ctx", -1): IMAGE,
    ("vision_deep_ctx", -1): IMAGE,
    ("proj.weight", 0): IMAGE,
    ("proj.weight", 1): TEXT,
    ("proj.bias", 0): IMAGE,
    ("compound_prompt_projections.weight", 0): IMAGE,
    ("compound_prompt_projections.weight", 1): TEXT,
    ("compound_prompt_projections.bias", 0): IMAGE,
    ("meta_net.linear1.weight", 1): "image-feature dimension",
    ("meta_net.linear2.weight", 0): TEXT,
    ("meta_net.linear2.bias", 0): TEXT,
}


class ImportShapeError(InteropError):
    """The imported tensors do not fit the model named in the config; one line per mismatch."""


def _meaning(name: str, axis: int, ndim: int) -> str | None:
    base = ".".join(p for p in name.split(".") if not p.isdigit())  # projections.{i}.weight -> one key
    return AXIS_MEANING.get((base, axis)) or AXIS_MEANING.get((base, axis - ndim))


def shape_problems(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], origin: dict[str, str], model: str
) -> list[str]:
    """One line per tensor that is missing, extra, or of another shape than `expected` (ours).

    Args:
        tensors: the imported tensors by our name.
        expected: the method's own `learnable()` for the config, by our name.
        origin: our name -> the original name(s), for the messages.
        model: the open_clip model name, for the messages.
    """
    lines = []
    for name in sorted(set(expected) - set(tensors)):
        lines.append(f"the file has no tensor for {name}, which this config's model needs")
    for name in sorted(set(tensors) - set(expected)):
        lines.append(f"{origin[name]} has no place in this config's model (it has no {name})")
    for name in sorted(set(tensors) & set(expected)):
        got, want = tuple(tensors[name].shape), tuple(expected[name].shape)
        if got == want:
            continue
        what = origin[name].split(", ")[0] if name.endswith("deep_ctx") else origin[name]
        if name.endswith("deep_ctx") and got[1:] != want[1:]:
            got, want = got[1:], want[1:]  # one layer's prompt
        axes = [i for i in range(len(want)) if len(got) == len(want) and got[i] != want[i]]
        meaning = _meaning(name, axes[0], len(want)) if axes else None
        if meaning == CLASSES:
            lines.append(
                f"{what} is {got}: class-specific context for {got[0]} classes, the config has {want[0]}"
            )
        elif meaning:
            lines.append(f"{what} is {got}, {model}'s {meaning} is {want[axes[0]]}")
        else:
            lines.append(f"{what} is {got}; this config's model needs {want}")
    return lines


def import_checkpoint(
    method: str,
    path: str | os.PathLike,
    out: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    evaluate: bool = True,
    clip: CLIP | None = None,
) -> Path:
    """Write the run folder `out` from an original `--from method` checkpoint file.

    Args:
        method: the original trainer: coop, cocoop, kgcoop, vpt, ivlp, maple or promptsrc.
        path: the Dassl checkpoint (`model.pth.tar-<epoch>`, or `model-best.pth.tar`).
        out: the run folder to create (refused if it already holds a checkpoint).
        overrides: `key=value` settings (data.name, data.root, model.name, prompt.position, ...).
        evaluate: also evaluate on the test split and `eval.targets` (needs the model's weights).
        clip: an already loaded CLIP of the config's model to use.

    Raises:
        OriginalCheckpointError, MappingError, ImportShapeError, ConfigError, DataError: one line
        (a shape error: one line per mismatch) naming the file, key or tensor.
        OutputError, NotARunFolderError: `out` cannot be written, or holds files that are not a
            run's (checked first, `coop.train.lock.require_run_folder`).
    """
    path, folder = Path(path), require_run_folder(out)  # writable, and not a folder of other files
    state, epoch = read_state_dict(path)
    tensors, origin = map_names(method, state, str(path))
    cfg = load_config(None, [f"method={method}", *implied_overrides(tensors), *overrides])
    cfg.output_dir = str(folder)
    cfg.model.name, cfg.model.pretrained = absolute_model_files(cfg.model.name, cfg.model.pretrained)
    cfg.model.tokenizer = absolute_tokenizer_dir(cfg.model.tokenizer)
    if (folder / "checkpoint.pt").is_file():
        raise InteropError(f"{folder} already holds a run (checkpoint.pt); use another --out")
    data = cfg.data
    dataset = build_dataset(data.name, data.root, shots=0, seed=int(data.seed), split_file=data.split_file)
    classnames = list(subsample_classes(dataset, data.subsample_classes).classnames)
    if clip is None:
        clip = load_clip(
            cfg.model.name, cfg.model.pretrained if evaluate else None, tokenizer=cfg.model.tokenizer
        )
    with torch.random.fork_rng(devices=[]):  # the method's own initialisation is thrown away
        expected = build_method(clip.float(), classnames, cfg).learnable()
    problems = shape_problems(tensors, expected, origin, model_tag(cfg.model.name))
    if problems:
        raise ImportShapeError(
            f"{path} does not fit method={method} on {cfg.model.name}:\n" + "\n".join(problems)
        )
    config = OmegaConf.to_container(cfg, resolve=True)
    ckpt = {
        "prompt": tensors,
        "method_state": {},
        "config": config,
        "classnames": classnames,
        "tokenizer": prompt_tokenizer(clip.tokenizer).identity(),
        "epoch": int(epoch or 0),
        "finished": True,
        "history": [],
        "imported": {"from": method, "file": str(path.resolve()), "epoch": epoch},
    }
    with run_lock(folder):
        atomic_write(folder / "config.yaml", lambda tmp: Path(tmp).write_text(to_yaml(cfg)))
        save_checkpoint(folder / "checkpoint.pt", ckpt)
        log.info("imported %d tensors of %s (%s) into %s", len(tensors), path, method, folder)
        if evaluate:
            _evaluate(cfg, config, ckpt, folder, clip)
    return folder


def _evaluate(cfg, config: dict, ckpt: dict, folder: Path, clip: CLIP) -> None:
    """metrics.json on the run's own test split, then `eval.targets` (as a finished training run)."""
    metrics, clip = evaluate_on(config, ckpt, cfg.data.name, cfg.data.subsample_classes, clip)
    metrics["imported"] = ckpt["imported"]
    write_json(folder / "metrics.json", metrics)
    log.info("%s: accuracy %.2f%% on %d images", cfg.data.name, metrics["accuracy"], metrics["n_test"])
    evaluate_targets(cfg, ckpt, folder, clip)

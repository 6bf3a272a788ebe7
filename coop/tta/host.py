"""The classifier a test-time method adapts (its host), and the config of a test-time pass.

    cfg = tta_config("configs/tta/zero.yaml", ["data.name=dtd", "tta.init=output/dtd/.../seed1"])
    host = build_host(cfg, classnames, device)      # Host(method, transform, precision)

Without `tta.init` the host is built from the config, untrained: zero-shot CLIP with the config's
hand-written prompt (`method=zeroshot` and its `zeroshot.templates`, as configs/tta/zero.yaml sets),
or CoOp's prompt initialised from a phrase (`method=coop` with `prompt.ctx_init`, where TPT starts).
With `tta.init` (a run folder, its checkpoint.pt, or a `.safetensors` export), the host is that
run's method with its learned tensors, loaded as `coop.load_classifier` loads it, for the classes of
the test dataset. Its config is the run's: the test-time config file's keys, then the run's (its
method, model, prompt and method sections, precision; not its data), then the command line. A
`method` or `model.*` on the command line that disagrees with the run's is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from coop.config.load import flatten, load_config
from coop.interop.classifier import load_classifier, read_prompts
from coop.methods import Method, build_method
from coop.model.weights import absolute_model_files, load_clip
from coop.train.engine import clip_transforms, use_fp16
from coop.train.precision import resolve_precision
from coop.tta.base import TestTimeError

# what a run config brings to a test-time pass: everything but where its data and output were
NOT_FROM_INIT = ("data", "output_dir", "device", "eval", "tta")
UNTRAINED_HOSTS = "method=zeroshot, or method=coop with prompt.ctx_init (the hand-written prompt)"


@dataclass
class Host:
    method: Method  # frozen, in eval mode, on the device
    transform: object  # the test transform: PIL image -> (3, H, W)
    precision: str  # what runs on the device (`coop.train.precision.resolve_precision`)


def init_kind(path: str) -> str:
    """ "run" (a run folder or its checkpoint.pt) or "export" (a .safetensors file); a one-line
    TestTimeError for anything else."""
    p = Path(path)
    if p.is_dir() and (p / "checkpoint.pt").is_file() or p.is_file() and p.suffix == ".pt":
        return "run"
    if p.is_file() and p.suffix == ".safetensors":
        return "export"
    raise TestTimeError(
        f"tta.init={path} is neither a run folder (with checkpoint.pt) nor an export "
        "(.safetensors from tools/export.py)"
    )


def tta_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config of a test-time pass (module docstring): the file and the overrides, with the run
    of `tta.init` beneath the command line."""
    cfg = load_config(path, overrides)
    if cfg.tta.init is None:
        return cfg
    init_kind(cfg.tta.init)
    run = read_prompts(cfg.tta.init)[1]
    layers = [OmegaConf.load(path)] if path else []
    layers.append({k: v for k, v in run.items() if k not in NOT_FROM_INIT})
    cfg = load_config(None, overrides, base=OmegaConf.to_container(OmegaConf.merge(*layers)))
    check_same_host(cfg, run)
    return cfg


def check_same_host(cfg: DictConfig, run: dict) -> None:
    """TestTimeError unless `cfg`'s method and model are those of `run` (the init's config)."""
    given, saved = flatten(OmegaConf.to_container(cfg)), flatten(run)
    given["model.name"], given["model.pretrained"] = absolute_model_files(
        given["model.name"], given["model.pretrained"]
    )
    saved["model.name"], saved["model.pretrained"] = absolute_model_files(
        saved["model.name"], saved["model.pretrained"]
    )
    for key in ("method", "model.name", "model.pretrained"):
        if given[key] != saved.get(key, given[key]):
            raise TestTimeError(
                f"{key}={given[key]} disagrees with tta.init={cfg.tta.init}, a run of {key}={saved[key]}: "
                f"the host is the init's; drop {key}"
            )


def check_untrained_host(cfg: DictConfig) -> None:
    """Without tta.init, a one-line TestTimeError unless the config's method needs no training."""
    if cfg.method == "zeroshot" or cfg.method == "coop" and cfg.prompt.ctx_init:
        return
    raise TestTimeError(
        f"tta.init is not set, and method={cfg.method} without prompt.ctx_init has nothing learned to "
        f"start from: give a run folder or export as tta.init, or use {UNTRAINED_HOSTS}"
    )


def build_host(cfg: DictConfig, classnames: list[str], device: torch.device) -> Host:
    """The host for `classnames` on `device` (module docstring)."""
    if cfg.tta.init is not None:
        clf = load_classifier(cfg.tta.init, device, classnames, tokenizer=cfg.model.tokenizer)
        return Host(clf.method, clf.transform, clf.precision)
    check_untrained_host(cfg)
    clip = load_clip(cfg.model.name, cfg.model.pretrained, device, cfg.model.tokenizer)
    torch.manual_seed(int(cfg.data.seed))  # as a run's untrained tensors start
    method = build_method(clip.float(), classnames, cfg)
    precision = resolve_precision(cfg.train.precision, device)
    if precision == "fp16":
        use_fp16(clip, method)
    return Host(method.to(device).eval(), clip_transforms(clip)[1], precision)

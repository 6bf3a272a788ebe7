"""The checks of each config section beyond the choices and core keys (`coop.config.validate`):
training keys of `coop.schedule`, the image-tower prompts, and each method's own section. Each
raises a one-line ConfigError that names the key and the value.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key or file."""


def validate_sections(cfg: DictConfig) -> None:
    """Every method section's keys (a method that is not chosen keeps valid defaults too)."""
    validate_vision(cfg)
    validate_lora(cfg)
    validate_method_weights(cfg)
    validate_tip(cfg)
    validate_mmrl(cfg)
    validate_tcp_dept(cfg)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def pair(value) -> list | None:
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else None
    return items if items is not None and len(items) == 2 and all(map(is_number, items)) else None


def validate_optimizer(cfg: DictConfig) -> None:
    """The optimizer, schedule and augmentation keys of `train` (`coop.schedule`)."""
    t = cfg.train
    betas = pair(t.betas)
    if betas is None or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas!r}")
    if not is_number(t.eps) or not t.eps > 0:
        raise ConfigError(f"train.eps must be a number > 0, got {t.eps!r}")
    if not is_number(t.min_lr) or not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr must be a number in [0, train.lr={t.lr}], got {t.min_lr!r}")
    for key in ("iterations", "iterations_per_shot"):
        value = t[key]
        if value is not None and (not is_int(value) or value < 1):
            raise ConfigError(f"train.{key} must be an integer >= 1 or null, got {value!r}")
    if t.iterations is not None and t.iterations_per_shot is not None:
        raise ConfigError(
            f"train.iterations={t.iterations} and train.iterations_per_shot={t.iterations_per_shot} "
            "both set the run's length; set one of them to null"
        )
    if (t.iterations is not None or t.iterations_per_shot is not None) and t.epochs is not None:
        raise ConfigError(
            f"train.epochs={t.epochs} and train.iterations{'' if t.iterations else '_per_shot'} both set "
            "the run's length; set train.epochs=null"
        )
    if not isinstance(t.augment, bool):
        raise ConfigError(f"train.augment must be true or false, got {t.augment!r}")
    if not isinstance(t.drop_last, bool):
        raise ConfigError(f"train.drop_last must be true or false, got {t.drop_last!r}")
    scale = pair(t.crop_scale)
    if scale is None or not 0 < scale[0] <= scale[1] <= 1:
        raise ConfigError(
            f"train.crop_scale must be [min, max] with 0 < min <= max <= 1, got {t.crop_scale!r}"
        )


def validate_vision(cfg: DictConfig) -> None:
    """`vision.n_ctx` / `vision.depth`: null or an integer >= 1; maple takes both from `prompt.*`,
    so a `vision.*` value that differs from them is an error."""
    for key in ("vision.n_ctx", "vision.depth"):
        value = OmegaConf.select(cfg, key)
        if value is not None and (not is_int(value) or value < 1):
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    if cfg.method == "maple":
        for key in ("n_ctx", "depth"):
            value, text = cfg.vision[key], cfg.prompt[key]
            if value is not None and value != text:
                raise ConfigError(
                    f"vision.{key}={value} conflicts with prompt.{key}={text}: maple couples its vision "
                    f"prompts to the text prompts and takes their count and depth from prompt.{key}"
                )


def validate_method_weights(cfg: DictConfig) -> None:
    """CoCoOp's chunk size, KgCoOp's weight and PromptSRC's loss weights and GPA."""
    chunk = cfg.cocoop.chunk_prompts
    if not is_int(chunk) or chunk < 1:
        raise ConfigError(f"cocoop.chunk_prompts must be an integer >= 1, got {chunk!r}")
    weight = cfg.kgcoop.weight
    if not is_number(weight) or not weight >= 0:
        raise ConfigError(f"kgcoop.weight must be a number >= 0, got {weight!r}")
    for key in ("text_weight", "image_weight", "kl_weight"):
        value = cfg.promptsrc[key]
        if not is_number(value) or not value >= 0:
            raise ConfigError(f"promptsrc.{key} must be a number >= 0, got {value!r}")
    mean, std = cfg.promptsrc.gpa_mean, cfg.promptsrc.gpa_std
    if not is_number(mean) or not math.isfinite(mean):
        raise ConfigError(f"promptsrc.gpa_mean must be a finite number (an epoch), got {mean!r}")
    if not is_number(std) or not 0 < std < math.inf:
        raise ConfigError(f"promptsrc.gpa_std must be a finite number > 0 (epochs), got {std!r}")


def validate_tip(cfg: DictConfig) -> None:
    """The `tip.*` keys (Tip-Adapter's cache model and its alpha/beta search)."""
    tip = cfg.tip
    if not is_int(tip.augment_epochs) or tip.augment_epochs < 1:
        raise ConfigError(f"tip.augment_epochs must be an integer >= 1, got {tip.augment_epochs!r}")
    for key in ("init_alpha", "init_beta"):
        if not is_number(tip[key]) or not tip[key] >= 0:
            raise ConfigError(f"tip.{key} must be a number >= 0, got {tip[key]!r}")
    scale, steps = pair(tip.search_scale), pair(tip.search_step)
    if scale is None or not all(v > 0 for v in scale):
        raise ConfigError(
            f"tip.search_scale must be two numbers > 0 ([beta, alpha]), got {tip.search_scale!r}"
        )
    if steps is None or not all(is_int(v) and v >= 1 for v in steps):
        raise ConfigError(
            f"tip.search_step must be two integers >= 1 ([beta, alpha]), got {tip.search_step!r}"
        )
    if not isinstance(tip.search, bool):
        raise ConfigError(f"tip.search must be true or false, got {tip.search!r}")


def validate_lora(cfg: DictConfig) -> None:
    """`lora.*` (coop.lora): rank >= 1, alpha > 0, dropout in [0, 1), towers/targets from their sets,
    layers "all" | "half-up" | "half-bottom" | a list of 0-based block indices (checked against
    each tower's block count when the method is built)."""
    lora = cfg.lora
    if not is_int(lora.rank) or lora.rank < 1:
        raise ConfigError(f"lora.rank must be an integer >= 1, got {lora.rank!r}")
    if not is_number(lora.alpha) or not lora.alpha > 0:
        raise ConfigError(f"lora.alpha must be a number > 0, got {lora.alpha!r}")
    if not is_number(lora.dropout) or not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout must be a number in [0, 1), got {lora.dropout!r}")
    for key, allowed in (("towers", ("text", "vision")), ("targets", ("q", "k", "v"))):
        value = lora[key]
        items = list(value) if OmegaConf.is_list(value) else None
        if not items or any(v not in allowed for v in items) or len(set(items)) != len(items):
            raise ConfigError(
                f"lora.{key} must be a list of distinct values of {', '.join(allowed)}, got {value!r}"
            )
    layers = lora.layers
    if OmegaConf.is_list(layers):
        if not layers or not all(is_int(i) and i >= 0 for i in layers):
            raise ConfigError(
                f"lora.layers must be a non-empty list of 0-based block indices, got {layers!r}"
            )
    elif layers not in ("all", "half-up", "half-bottom"):
        raise ConfigError(
            f"lora.layers={layers!r} is not one of all, half-up, half-bottom or a list of block indices"
        )


def validate_mmrl(cfg: DictConfig) -> None:
    """`mmrl.*`: sizes >= 1, alpha in [0, 1], lambda >= 0, layer lists null or increasing 1-based
    block numbers (checked against the towers' depths when the method is built)."""
    m = cfg.mmrl
    for key in ("n_tokens", "rep_dim"):
        if not is_int(m[key]) or m[key] < 1:
            raise ConfigError(f"mmrl.{key} must be an integer >= 1, got {m[key]!r}")
    if not is_number(m.alpha) or not 0 <= m.alpha <= 1:
        raise ConfigError(f"mmrl.alpha must be a number in [0, 1], got {m.alpha!r}")
    if not is_number(m.reg_weight) or not 0 <= m.reg_weight < math.inf:
        raise ConfigError(f"mmrl.reg_weight must be a finite number >= 0, got {m.reg_weight!r}")
    for key in ("layers", "vision_layers"):
        value = m[key]
        if value is None:
            continue
        items = list(value) if OmegaConf.is_list(value) else None
        if not items or not all(is_int(i) and i >= 1 for i in items) or items != sorted(set(items)):
            raise ConfigError(
                f"mmrl.{key} must be null or a non-empty increasing list of 1-based block numbers, got {value!r}"
            )


DEPT_HOSTS = ("coop", "cocoop", "kgcoop", "maple")  # coop.methods.dept


def validate_tcp_dept(cfg: DictConfig) -> None:
    """`tcp.*` and `dept.*`: numbers in range; DePT only on the hosts it wraps."""
    layer = cfg.tcp.layer
    if not is_int(layer) or layer < 1:
        raise ConfigError(f"tcp.layer must be an integer >= 1 (a text block), got {layer!r}")
    for key in ("tcp.weight", "dept.lr_scale"):
        value = OmegaConf.select(cfg, key)
        if not is_number(value) or not value >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {value!r}")
    if not is_number(cfg.dept.weight) or not 0 <= cfg.dept.weight <= 1:
        raise ConfigError(f"dept.weight must be a number in [0, 1], got {cfg.dept.weight!r}")
    if not isinstance(cfg.dept.enabled, bool):
        raise ConfigError(f"dept.enabled must be true or false, got {cfg.dept.enabled!r}")
    if cfg.dept.enabled and cfg.method not in DEPT_HOSTS:
        raise ConfigError(f"dept.enabled=true wraps method={'|'.join(DEPT_HOSTS)}, got method={cfg.method}")

"""Checks of a run config against its model's towers, before anything is built or written.

    check_model_limits(cfg)   # ConfigError: prompt.depth above the text tower's layers, ...

The towers' block counts come from OpenCLIP's model config (a name, or a model-config .json),
so no weights are loaded: `coop.runner.train_run` calls this before it creates the run folder,
`coop.federated.task.check_config` before a simulation, and `coop.sweep.plan` (and so
`tools/sweep.py --dry-run`) for every point. The methods check the same limits when they are
built (`coop.prompt`, `coop.methods.vpt`, `coop.methods.maple`, `coop.methods.tcp`, and the
shared `coop.methods.mmrl.block_indices` and `coop.lora.resolve_layers`); this runs them early.
"""

from __future__ import annotations

import functools

import open_clip
from omegaconf import DictConfig, OmegaConf

from coop.config import ConfigError
from coop.config_checks import PROMPT_CSC_IGNORED
from coop.lora import LoRAError, resolve_layers
from coop.methods.mmrl import block_indices
from coop.weights import resolve_model_name

VISION_PROMPTS = ("vpt", "ivlp", "promptsrc")  # methods that read vision.depth


@functools.cache
def tower_layers(model: str) -> tuple[int, int | None]:
    """(text blocks, image blocks) of an OpenCLIP model name or config .json; image blocks is
    None for a tower that is not a ViT (RN50's stages). ModelError for an unknown model."""
    config = open_clip.get_model_config(resolve_model_name(model)) or {}
    vision = config.get("vision_cfg", {}).get("layers")
    return int(config.get("text_cfg", {}).get("layers", 0)), vision if isinstance(vision, int) else None


def check_model_limits(cfg: DictConfig) -> None:
    """A one-line ConfigError for a key beyond the model's towers: prompt.depth, vision.depth,
    tcp.layer, mmrl.layers / mmrl.vision_layers and lora.layers, for the methods that read them."""
    text, vision = tower_layers(str(cfg.model.name))
    method, depth = cfg.method, cfg.prompt.depth
    if not text:
        return  # not a tower we can read: building the model reports it
    if method not in PROMPT_CSC_IGNORED and depth > text:
        raise ConfigError(f"prompt.depth must be in 1..{text} (the text tower's layers), got {depth}")
    if vision is not None and method == "maple" and depth > vision:
        raise ConfigError(
            f"prompt.depth={depth} is above the image tower's {vision} layers "
            "(maple prompts both towers to the same depth)"
        )
    vdepth = cfg.vision.depth
    if vision is not None and method in VISION_PROMPTS and vdepth is not None and vdepth > vision:
        raise ConfigError(f"vision.depth must be in 1..{vision} (the image tower's layers), got {vdepth}")
    if method == "tcp" and not cfg.tcp.layer < text:
        raise ConfigError(
            f"tcp.layer must be in 1..{text - 1} (the text tower's blocks), got {cfg.tcp.layer}"
        )
    if method == "mmrl":
        block_indices(cfg.mmrl.layers, text, "mmrl.layers")
        if vision is not None:
            block_indices(cfg.mmrl.vision_layers, vision, "mmrl.vision_layers")
    if method == "clip_lora":
        layers = cfg.lora.layers
        spec = OmegaConf.to_object(layers) if OmegaConf.is_list(layers) else layers
        for tower in cfg.lora.towers:
            n = text if tower == "text" else vision
            try:
                if n is not None:
                    resolve_layers(spec, n, tower)
            except LoRAError as e:
                raise ConfigError(str(e)) from None

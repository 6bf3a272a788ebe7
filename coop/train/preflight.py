"""Checks of a run config against its method and model, before anything is built or written.

    check_model_limits(cfg)   # ConfigError: prompt.depth above the text tower's layers, ...;
                              # ModelError: vision prompts for a tower without tokens (RN50),
                              # image tokens from CoCa's attention pool (MMRL, FedOTP)
    check_base_to_new(cfg)    # ConfigError: class-specific context cannot score new classes

The towers' block counts come from OpenCLIP's model config (a name, or a model-config .json) and
the image tower built on the meta device, so no weights are loaded: `coop.train.runner.train_run`
calls this before it creates the run folder, `coop.federated.task.check_config` before a
simulation (with `fl.method`'s class), and `coop.train.sweep.plan` (and so `tools/sweep.py
--dry-run`) for every point. What is checked is the method's own `Method.check_config` (the kinds
of tower it can use, its keys bounded by the towers, its template set), which the method runs
again on the built model when it is built.
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig

from coop.config.checks import ConfigError
from coop.methods import METHODS
from coop.methods.base import Method, TowerLayers


@functools.cache
def tower_layers(model: str) -> TowerLayers | None:
    """The towers of an OpenCLIP model name or config .json, once per process
    (`TowerLayers.of_model`: built on the meta device, no weights); None if the config names no
    text tower layers. ModelError for an unknown model."""
    return TowerLayers.of_model(model)


def check_model_limits(cfg: DictConfig, method: type[Method] | None = None) -> None:
    """A one-line ModelError, naming the method and the model, for towers of a kind the method cannot
    use (vision prompts on a CNN, image tokens on CoCa's attention pool), and a one-line ConfigError
    for a key that its model's towers cannot take (prompt.depth, vision.depth, tcp.layer,
    mmrl.layers, lora.layers, ...) or an unknown template set: `Method.check_config` of `method`
    (`cfg.method`'s when None; federated runs pass `fl.method`'s). With dept.enabled, the host's
    (DePT adds no such key)."""
    towers = tower_layers(str(cfg.model.name))
    if towers is None:
        return  # not a tower we can read: building the model reports it
    (method or METHODS[cfg.method]).check_config(cfg, towers)


def check_base_to_new(cfg: DictConfig) -> None:
    """ConfigError, naming both keys, for a base-to-new run whose learned tensors cannot score the
    new classes that it evaluates after training (`data.subsample_classes=base`): the method says
    why (`Method.own_classes_only`: the linear probe's rows, class-specific context)."""
    what = METHODS[cfg.method].own_classes_only(cfg)
    if cfg.data.subsample_classes != "base" or what is None:
        return
    raise ConfigError(
        f"{what} and cannot score the new classes that data.subsample_classes=base evaluates after "
        "training; use shared context (prompt.csc=false)"
    )

"""Checks of a run config against its method and model, before anything is built or written.

    check_model_files(cfg)    # ModelError: unknown or refused model, not a tag of it; TokenizerError:
                              # no tokenizer here, or one that does not fit the model;
                              # WeightsUnavailableError, FileNotFoundError: no weights here
    check_run_model(cfg, recorded, run)  # the same, and the tokenizer is the one the run recorded
    check_model_limits(cfg)   # ConfigError: prompt.depth above the text tower's layers, ...;
                              # ModelError: vision prompts for a tower without tokens (RN50),
                              # image tokens from CoCa's attention pool (MMRL, FedOTP)
    check_base_to_new(cfg)    # ConfigError: class-specific context cannot score new classes
    check_data_files(cfg)     # DataError: a 2SFS split file (data.fewshot_source=jsonl) missing or
                              # with an entry that does not resolve in the DATA folder; a class
                              # without sentences in data.descriptions

The towers come from OpenCLIP's model config (a name, or a model-config .json) and the towers
built on the meta device, so no weights are loaded or downloaded (the tokenizer is loaded: it is
small, and only loading it shows that it is here and fits): `coop.train.runner.train_run` calls
these before it creates the run folder, `coop.federated.task.check_config` (the model limits, with
`fl.method`'s class) and `tools/federated.py` (the model files) before a simulation,
`coop.train.sweep.plan` (and so `tools/sweep.py --dry-run`) for every point, and `check_run_model`
eval (`coop.train.evaluation`) and `coop.load_classifier` (predict). What `check_model_limits`
checks is the method's own `Method.check_config` (the kinds of tower it can use, its keys bounded by
the towers, its template set), which the method runs
again on the built model when it is built.
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig

from coop.config.checks import ConfigError
from coop.data import build_dataset, subsample_classes
from coop.data.descriptions import load_descriptions
from coop.methods import METHODS
from coop.methods.base import Method, TowerLayers
from coop.model.text_support import TextConfig, text_config
from coop.model.tokenizer import (
    PromptTokenizer,
    check_fits,
    check_same_tokenizer,
    clip_bpe,
    hub_reachable,
    hub_tokenizer_name,
    load_tokenizer,
    prompt_tokenizer,
)
from coop.model.weights import require_weights, resolve_model_name, tokenizer_source


@functools.cache
def tower_layers(model: str) -> TowerLayers | None:
    """The towers of an OpenCLIP model name or config .json, once per process
    (`TowerLayers.of_model`: built on the meta device, no weights); None if the config names no
    text tower layers. ModelError for an unknown model."""
    return TowerLayers.of_model(model)


@functools.cache
def model_text(model: str) -> tuple[str, TextConfig]:
    """The registered name and the text tower's `TextConfig` of an OpenCLIP model name or config
    .json (`text_config`, on the meta device); ModelError for an unknown or refused model. Cached
    per name, as `tower_layers` is: a sweep asks it for every point."""
    name = resolve_model_name(model)
    return name, text_config(name, hub_reachable)


@functools.cache
def _clip_bpe() -> PromptTokenizer:
    """open_clip's CLIP BPE, which ships with it: one vocabulary for every model that uses it (only
    the context length differs, which `check_fits` does not read); read once, not per sweep point."""
    return prompt_tokenizer(clip_bpe())


def check_model_files(cfg: DictConfig) -> PromptTokenizer:
    """Everything `coop.model.weights.load_clip` would refuse about `cfg.model`, without building the
    model or reading its weights: the model (a name, or a config .json that exists), its text tower
    (`text_config`: e.g. a Hugging Face tower), the tokenizer (`model.tokenizer` or the model's own:
    loaded here, and `check_fits` the tower) and the weights (a file that exists, or a tag of the model
    that is cached or downloadable). Returns the tokenizer."""
    name, text = model_text(str(cfg.model.name))
    directory = cfg.model.tokenizer
    if directory is None and hub_tokenizer_name(name) is None:
        tok = _clip_bpe()
    else:
        tok = prompt_tokenizer(load_tokenizer(name, directory))
    check_fits(tok, text, name, tokenizer_source(name, directory))
    require_weights(name, cfg.model.pretrained)
    return tok


def check_run_model(cfg: DictConfig, recorded: dict | None, run: str) -> None:
    """`check_model_files` for a saved run or export rebuilt with `cfg` (eval, predict,
    `coop.load_classifier`), and its tokenizer is the one the run recorded at training
    (`check_same_tokenizer`; a warning for a run that recorded none)."""
    check_same_tokenizer(check_model_files(cfg).identity(), recorded, run)


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


def check_data_files(cfg: DictConfig) -> None:
    """The data files a run reads besides the dataset, read as the run will read them, each refusal
    a DataError in one line: with data.fewshot_source=jsonl, 2SFS's split files for (data.shots,
    data.seed) (`coop.data.jsonl_splits`: the file, the line and the path of an entry that does not
    resolve in the DATA folder); with data.descriptions, the description file against the classes
    the run trains on, or, for a method that scores with the sentences
    (`Method.scores_with_descriptions`: HiCroPL), every class the run scores: the dataset's, new
    classes included, and each of `eval.targets` (`coop.data.descriptions.load_descriptions`: the
    file and the first class without sentences). Nothing is read for a run that has neither."""
    jsonl = cfg.data.fewshot_source == "jsonl"
    if not jsonl and cfg.data.descriptions is None:
        return
    ds = build_dataset(
        cfg.data.name,
        cfg.data.root,
        shots=int(cfg.data.shots) if jsonl else 0,  # 0: the classes only, no draw and no cache
        seed=int(cfg.data.seed),
        split_file=cfg.data.split_file,
        fewshot_source=cfg.data.fewshot_source if jsonl else "sample",
    )
    if cfg.data.descriptions is None:
        return
    if not METHODS[cfg.method].scores_with_descriptions:  # the sentences serve training only
        load_descriptions(cfg.data.descriptions, subsample_classes(ds, cfg.data.subsample_classes).classnames)
        return
    load_descriptions(cfg.data.descriptions, ds.classnames)  # a base run scores the new classes too
    for target in cfg.eval.targets:
        load_descriptions(cfg.data.descriptions, build_dataset(target, cfg.data.root, shots=0).classnames)

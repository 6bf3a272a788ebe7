"""Run configuration: CoOp's recipe as defaults, YAML files and `key=value` overrides (OmegaConf).

    cfg = load_config("configs/coop/vit_b16.yaml", ["data.shots=4", "prompt.position=middle"])

Unknown keys are errors that name the key, and invalid values are errors that name the key and
the value. `train.epochs: null` applies CoOp's epoch-by-shots rule (`epochs_for_shots`).

Each method starts from its own paper's recipe where it differs from CoOp's (`METHOD_DEFAULTS`):
those values replace the defaults for every key that no file, override or saved config sets.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from coop.config.checks import ConfigError, check_rules
from coop.config.recipes import DATASET_RECIPES, METHOD_DEFAULTS, YIELDS_TO
from coop.config.schema import DEFAULTS, SPECS, RunConfig
from coop.config.spec import check_layer, check_values, shown

SCHEMA = OmegaConf.structured(RunConfig)  # the typed defaults that every config starts from
_SCHEMA_BYTES = pickle.dumps(SCHEMA)  # unpickling a fresh copy is ~6x faster than copy.deepcopy
# Keys whose `key=` on the command line (which OmegaConf reads as null) is refused: null there means
# something else than the empty path that was likely meant.
NOT_EMPTY = {
    "model.tokenizer": "give a saved Hugging Face tokenizer's directory, or model.tokenizer=null for the "
    "model's own tokenizer",
    "model.pretrained": "give an open_clip tag or a weights file, or model.pretrained=none for random weights",
}

# Keys that cannot change a run's results: a run may be resumed with other values, and result
# tables never split seeds into separate rows by them.
RESULT_FREE_KEYS = frozenset(
    {
        "device",
        "output_dir",
        "model.tokenizer",  # where the model's own tokenizer is read from (a local copy of the hub's)
        "data.root",
        "data.num_workers",
        "train.eval_batch_size",
        "train.cache_features",
        "train.grad_checkpointing",  # recomputes activations: the same gradients, less memory
        "eval.targets",  # adds eval_<dataset>.json files; a finished run evaluates new ones
        "cocoop.chunk_prompts",  # how many prompts run at once: the same results, other memory
        "train.tensorboard",  # extra event files beside history.csv
        "train.dist_backend",  # how the ranks of a torchrun run talk (coop.distributed)
        "tta.chunk",  # how often a test-time pass writes its outputs: the same outputs
    }
)


def load_config(
    path: str | None = None, overrides: list[str] | tuple[str, ...] = (), base: dict | None = None
) -> DictConfig:
    """Defaults <- method defaults <- `base` <- YAML file <- `key=value` overrides; validated.

    The method defaults (`METHOD_DEFAULTS[method]`) fill only keys that no later layer sets. The
    result is typed by the schema (`coop.config.schema.RunConfig`): a value of another type, or
    out of its key's set or range, is a one-line ConfigError naming the key and the value.

    Args:
        path: optional YAML file whose keys are a subset of `DEFAULTS`.
        overrides: dotted `key=value` strings, e.g. "data.shots=4".
        base: optional config dict applied before the file (e.g. a checkpoint's run config).
    """
    cfg = pickle.loads(_SCHEMA_BYTES)  # our own copy: faster than building it from the dataclasses again
    layers = [] if base is None else [("the saved run config", OmegaConf.create(base))]
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            layers.append((str(p), OmegaConf.load(p)))
        except Exception as e:  # yaml errors carry multi-line context
            raise ConfigError(f"cannot parse config file {p}: {str(e).splitlines()[0]}") from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, _, value = item.partition("=")
        if key.strip() in NOT_EMPTY and not value.strip():  # OmegaConf reads `key=` as null
            raise ConfigError(f"{key.strip()}= is empty: {NOT_EMPTY[key.strip()]}")
    if overrides:
        try:
            layers.append(("command line", OmegaConf.from_dotlist(list(overrides))))
        except OmegaConfBaseException as e:
            raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    for key, value in method_defaults(layers).items():
        OmegaConf.update(cfg, key, value)
    for where, layer in layers:
        tree = OmegaConf.to_container(layer, resolve=False)
        problem = check_layer(tree, SPECS) if isinstance(tree, dict) else None
        if problem:
            raise ConfigError(f"{problem} in {where}")
        try:  # into our own copy of the schema: OmegaConf.merge would copy cfg and the layer again
            cfg = OmegaConf.unsafe_merge(cfg, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(merge_error(e, where)) from None
    validate(cfg)
    return cfg


def merge_error(e: OmegaConfBaseException, where: str) -> str:
    """One line for OmegaConf's refusal to merge a layer: the key and the value it refused."""
    full_key = getattr(e, "full_key", None) or _key_from_message(str(e))
    if not full_key:  # e.g. a section given a number: "Merge error: int is not a subclass of ..."
        return f"cannot merge {where}: {str(e).splitlines()[0]}"
    key = re.sub(r"\[\d+\]", "", str(full_key))  # train.betas[1] -> train.betas
    if isinstance(e, ValidationError) and key in SPECS:
        at = "" if key == full_key else f" at {full_key}"
        return f"{key} must be {SPECS[key].describe()}, got {shown(e.value)!r}{at} in {where}"
    return f"unknown or invalid config key '{full_key}' in {where}"


def method_defaults(layers: list[tuple[str, DictConfig]]) -> dict:
    """The `METHOD_DEFAULTS` entries of the method the layers choose (its "+dept" recipe with
    `dept.enabled`), updated by its `DATASET_RECIPES` entries for the dataset they choose, that
    none of them sets."""
    method, given, trees, dept = DEFAULTS["method"], set(), [], False
    for _, layer in layers:
        tree = OmegaConf.to_container(layer, resolve=False)
        if not isinstance(tree, dict):
            continue  # merging reports it
        method = tree.get("method", method)
        keys = flatten(tree)
        dept = keys.get("dept.enabled", dept)
        given |= set(keys)
        trees.append(tree)
    if not isinstance(method, str):
        return {}  # not a method's name: the schema reports it
    dataset = next(
        (d for d in reversed([flatten(t).get("data.name") for t in trees]) if isinstance(d, str)),
        DEFAULTS["data"]["name"],
    )
    if dept is True and isinstance(method, str):
        method = f"{method}+dept"  # DePT on a host has its own recipe ("coop+dept", ...)
    defaults = METHOD_DEFAULTS.get(method, {}) if isinstance(method, str) else {}
    defaults = {**defaults, **DATASET_RECIPES.get(method, {}).get(dataset, {})}
    yields = {**LENGTH_YIELDS, **(YIELDS_TO.get(method, {}) if isinstance(method, str) else {})}

    def yielded(key: str) -> bool:
        other = yields.get(key, ())
        return any(o in given for o in ((other,) if isinstance(other, str) else other))

    return {k: v for k, v in defaults.items() if k not in given and not yielded(k)}


# A recipe's run length yields to a length that a layer sets in the other unit.
LENGTH_YIELDS = {
    "train.epochs": ("train.iterations", "train.iterations_per_shot"),
    "train.iterations": ("train.epochs", "train.iterations_per_shot"),
    "train.iterations_per_shot": ("train.epochs", "train.iterations"),
}


def _key_from_message(message: str) -> str:
    m = re.search(r"full_key: (\S+)", message) or re.search(r"Key '([^']+)'", message)
    return m.group(1) if m else ""


def validate(cfg: DictConfig) -> None:
    """Raise a one-line ConfigError, naming the key and its value, for a config that cannot run:
    each key's type, set and range (`coop.config.schema`), then the rules between keys
    (`coop.config.checks`)."""
    problem = check_values(cfg, SPECS)
    if problem:
        raise ConfigError(problem)
    check_rules(cfg)


def flatten(cfg: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}, e.g. {"data.shots": 16}."""
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)

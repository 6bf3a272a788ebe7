"""Run configuration: CoOp's recipe as defaults, YAML files and `key=value` overrides (OmegaConf).

    cfg = load_config("configs/coop/vit_b16.yaml", ["data.shots=4", "prompt.position=middle"])

Unknown keys are errors that name the key, and invalid values are errors that name the key and
the value. `train.epochs: null` applies CoOp's epoch-by-shots rule (`epochs_for_shots`).

Each method starts from its own paper's recipe where it differs from CoOp's (`METHOD_DEFAULTS`):
those values replace the defaults for every key that no file, override or saved config sets.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

METHODS = (
    "coop",
    "cocoop",
    "kgcoop",
    "zeroshot",
    "linear_probe",
    "vpt",
    "ivlp",
    "maple",
    "promptsrc",
)  # see coop.methods

DEFAULTS = {
    "method": "coop",
    "model": {"name": "ViT-B-16", "pretrained": "openai"},
    "prompt": {"n_ctx": None, "ctx_init": None, "position": "end", "csc": False, "depth": 1},
    "vision": {"n_ctx": None, "depth": None},  # image-tower prompts (vpt, ivlp); null: unset
    "data": {
        "name": "textile",
        "root": None,
        "shots": 16,
        "seed": 1,
        "skip_corrupt": False,
        "subsample_classes": "all",
        "num_workers": 2,
        "target_domain": None,
        "split_file": None,  # imagefolder: a CoOp split JSON (tools/make_split.py); see coop.data.datasets
    },
    "train": {
        "epochs": None,
        "batch_size": 32,
        "lr": 0.002,
        "momentum": 0.9,
        "weight_decay": 5e-4,
        "warmup_epochs": 1,
        "warmup_lr": 1e-5,
        "precision": "amp",
        "aug_views": 0,
        "eval_batch_size": 100,
        "cache_features": True,
        "grad_checkpointing": False,
        "tensorboard": True,  # TensorBoard events in <run>/tb/ when tensorboard is installed
    },
    "zeroshot": {"templates": "coop"},
    "cocoop": {"chunk_prompts": 1024},  # prompts (images x classes) per recomputed block; coop.methods.cocoop
    "kgcoop": {"weight": 8.0, "templates": "kgcoop"},  # KgCoOp's own templates (coop.methods.zeroshot)
    "promptsrc": {  # coop.methods.promptsrc; GPA: coop.gpa
        "text_weight": 25.0,
        "image_weight": 10.0,
        "kl_weight": 1.0,
        "templates": "promptsrc",
        "gpa_mean": 15.0,
        "gpa_std": 1.0,
    },
    "eval": {"targets": []},
    "fl": {
        "method": "promptfl",
        "clients": 10,
        "rounds": 20,
        "local_epochs": 1,
        "fraction": 1.0,
        "partition": "iid",
        "iid": False,  # fl.partition=promptfl: every client holds every class
        "repeat_rate": 0.0,  # fl.partition=promptfl: share of the classes common to several clients
        "alpha": 0.5,
        "classes_per_client": 2,
        "aggregation": "fedavg",
        "mu": 0.01,
        "domains": 3,
        "beta": 0.5,
        "ensemble_weight": 0.5,
        "on_client_failure": "continue",
        "lr_schedule": "cosine",  # per round: cosine over the rounds, or constant (FedOTP, FedPGP)
    },
    # fl.method=fedotp (coop.federated.fedotp): entropic OT between patch tokens and the prompts
    "fedotp": {"eps": 0.1, "gamma": 0.8, "ot": "cot", "max_iter": 100, "thresh": 1e-3},
    # fl.method=fedpgp (coop.federated.fedpgp): rank of U V, weight and temperature of the pull
    "fedpgp": {"rank": 8, "mu": 0.5, "temp": 0.5},
    "output_dir": None,
    "device": "auto",
}

# The recipes of the original code, applied where no layer sets the key:
# CoCoOp's vit_b16_c4_ep10_batch1_ctxv1 and KgCoOp's vit_b16_ep100_ctxv1 (both SGD lr 0.002 with
# CoOp's schedule, as in DEFAULTS); the MaPLe repository's VPT vit_b16_c2_ep5_batch4_4, IVLP
# vit_b16_c2_ep5_batch4_2+2ctx and MaPLe vit_b16_c2_ep5_batch4_2ctx, and the PromptSRC repository's
# vit_b16_c2_ep20_batch4_4+4ctx (the same SGD, warm-up and cosine; their PREC=fp16 is
# `train.precision=fp16`, the default here stays amp).
METHOD_DEFAULTS = {
    "cocoop": {"prompt.ctx_init": "a photo of a", "train.epochs": 10, "train.batch_size": 1},
    "kgcoop": {"prompt.ctx_init": "a photo of a", "train.epochs": 100, "train.batch_size": 128},
    "vpt": {
        "vision.n_ctx": 8,
        "vision.depth": 12,
        "train.lr": 0.0025,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
    "ivlp": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 12,
        "vision.n_ctx": 2,
        "vision.depth": 12,
        "train.lr": 0.0035,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
    "promptsrc": {
        "prompt.n_ctx": 4,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "vision.n_ctx": 4,
        "vision.depth": 9,
        "train.lr": 0.0025,
        "train.epochs": 20,
        "train.batch_size": 4,
    },
    "maple": {
        "prompt.n_ctx": 2,
        "prompt.ctx_init": "a photo of a",
        "prompt.depth": 9,
        "train.lr": 0.0035,
        "train.epochs": 5,
        "train.batch_size": 4,
    },
}
# A method default not applied when the other key is set: a default context phrase fixes M in
# CoCoOp and KgCoOp, so it yields to an explicit prompt.n_ctx (CoCoOp's c4/c8/c16 configs: M
# random vectors). IVLP and MaPLe set both, as their configs do (the phrase applies for n_ctx <= 4).
YIELDS_TO = {
    "cocoop": {"prompt.ctx_init": "prompt.n_ctx"},
    "kgcoop": {"prompt.ctx_init": "prompt.n_ctx"},
}

CHOICES = {
    "method": METHODS,
    "prompt.position": ("end", "middle", "mid", "front"),
    "train.precision": ("amp", "fp32", "fp16"),
    "data.subsample_classes": ("all", "base", "new"),
    "fl.method": ("promptfl", "latent_domains", "fedotp", "fedpgp"),
    "fl.partition": (
        "iid",
        "dirichlet",
        "pathological",
        "domain",
        "promptfl",
        "pathological_fedotp",
        "dirichlet_labeldir",
        "dirichlet_labeldir100",
    ),
    "fl.lr_schedule": ("cosine", "constant"),
    "fedotp.ot": ("cot", "sinkhorn"),
    "fl.aggregation": ("fedavg", "uniform", "fedprox", "last_client"),
    "fl.on_client_failure": ("continue", "stop"),
}


# Keys that cannot change a run's results: a run may be resumed with other values, and result
# tables never split seeds into separate rows by them.
RESULT_FREE_KEYS = frozenset(
    {
        "device",
        "output_dir",
        "data.root",
        "data.num_workers",
        "train.eval_batch_size",
        "train.cache_features",
        "train.grad_checkpointing",  # recomputes activations: the same gradients, less memory
        "eval.targets",  # adds eval_<dataset>.json files; a finished run evaluates new ones
        "cocoop.chunk_prompts",  # how many prompts run at once: the same results, other memory
        "train.tensorboard",  # extra event files beside history.csv
    }
)


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key or file."""


def epochs_for_shots(shots: int, dataset: str) -> int:
    """CoOp's schedule: 50 epochs for 1 shot, 100 for 2-4, 200 for 8-16 (and all data); ImageNet 50."""
    if dataset == "imagenet":
        return 50
    if shots == 1:
        return 50
    if 2 <= shots <= 4:
        return 100
    return 200


def load_config(
    path: str | None = None, overrides: list[str] | tuple[str, ...] = (), base: dict | None = None
) -> DictConfig:
    """Defaults <- method defaults <- `base` <- YAML file <- `key=value` overrides; validated.

    The method defaults (`METHOD_DEFAULTS[method]`) fill only keys that no later layer sets.

    Args:
        path: optional YAML file whose keys are a subset of `DEFAULTS`.
        overrides: dotted `key=value` strings, e.g. "data.shots=4".
        base: optional config dict applied before the file (e.g. a checkpoint's run config).
    """
    cfg = OmegaConf.create(DEFAULTS)
    OmegaConf.set_struct(cfg, True)
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
    if overrides:
        try:
            layers.append(("command line", OmegaConf.from_dotlist(list(overrides))))
        except OmegaConfBaseException as e:
            raise ConfigError(f"bad override: {str(e).splitlines()[0]}") from None
    for key, value in method_defaults(layers).items():
        OmegaConf.update(cfg, key, value)
    for where, layer in layers:
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or _key_from_message(str(e))
            raise ConfigError(f"unknown or invalid config key '{key}' in {where}") from None
    validate(cfg)
    return cfg


def method_defaults(layers: list[tuple[str, DictConfig]]) -> dict:
    """The `METHOD_DEFAULTS` entries of the method the layers choose that none of them sets."""
    method, given = DEFAULTS["method"], set()
    for _, layer in layers:
        tree = OmegaConf.to_container(layer, resolve=False)
        if not isinstance(tree, dict):
            continue  # merging reports it
        method = tree.get("method", method)
        given |= set(flatten(tree))
    defaults = METHOD_DEFAULTS.get(method, {}) if isinstance(method, str) else {}
    yields = YIELDS_TO.get(method, {}) if isinstance(method, str) else {}
    return {k: v for k, v in defaults.items() if k not in given and yields.get(k) not in given}


def _key_from_message(message: str) -> str:
    m = re.search(r"full_key: (\S+)", message) or re.search(r"Key '([^']+)'", message)
    return m.group(1) if m else message.splitlines()[0]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate(cfg: DictConfig) -> None:
    """Raise a one-line ConfigError, naming the key and its value, for a config that cannot run."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in ("data.shots", "train.aug_views", "prompt.depth", "train.warmup_epochs", "data.num_workers"):
        value = OmegaConf.select(cfg, key)
        if not _is_int(value) or value < 0:
            raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
    for key in ("train.batch_size", "train.eval_batch_size"):
        value = OmegaConf.select(cfg, key)
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    lr, warmup_lr = cfg.train.lr, cfg.train.warmup_lr
    if not _is_number(lr) or not lr > 0:  # `not >` also rejects NaN
        raise ConfigError(f"train.lr must be a number > 0, got {lr!r}")
    if not _is_number(warmup_lr) or not warmup_lr >= 0:
        raise ConfigError(f"train.warmup_lr must be a number >= 0, got {warmup_lr!r}")
    epochs = cfg.train.epochs
    if epochs is not None and (not _is_int(epochs) or epochs < 0):
        raise ConfigError(f"train.epochs must be a non-negative integer or null, got {epochs!r}")
    if epochs == 0 and cfg.method in ("coop", "kgcoop") and not cfg.prompt.ctx_init:
        raise ConfigError(
            "train.epochs=0 evaluates untrained prompts: set prompt.ctx_init (e.g. 'a photo of a')"
        )
    validate_vision(cfg)
    chunk = cfg.cocoop.chunk_prompts
    if not _is_int(chunk) or chunk < 1:
        raise ConfigError(f"cocoop.chunk_prompts must be an integer >= 1, got {chunk!r}")
    weight = cfg.kgcoop.weight
    if not _is_number(weight) or not weight >= 0:
        raise ConfigError(f"kgcoop.weight must be a number >= 0, got {weight!r}")
    if not isinstance(cfg.train.tensorboard, bool):
        raise ConfigError(f"train.tensorboard must be true or false, got {cfg.train.tensorboard!r}")
    split_file = cfg.data.split_file
    if split_file is not None and (not isinstance(split_file, str) or cfg.data.name != "imagefolder"):
        raise ConfigError(
            f"data.split_file={split_file!r} is read by data.name=imagefolder only (got {cfg.data.name!r}); "
            "set data.split_file=null for other datasets"
        )
    for key in ("text_weight", "image_weight", "kl_weight"):
        value = cfg.promptsrc[key]
        if not _is_number(value) or not value >= 0:
            raise ConfigError(f"promptsrc.{key} must be a number >= 0, got {value!r}")
    mean, std = cfg.promptsrc.gpa_mean, cfg.promptsrc.gpa_std
    if not _is_number(mean) or not math.isfinite(mean):
        raise ConfigError(f"promptsrc.gpa_mean must be a finite number (an epoch), got {mean!r}")
    if not _is_number(std) or not 0 < std < math.inf:
        raise ConfigError(f"promptsrc.gpa_std must be a finite number > 0 (epochs), got {std!r}")
    targets = cfg.eval.targets
    if not OmegaConf.is_list(targets) or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"eval.targets must be a list of dataset names, got {targets!r}")
    epochs, warmup = resolved_epochs(cfg), cfg.train.warmup_epochs
    if epochs > 0 and warmup >= epochs:
        raise ConfigError(
            f"train.warmup_epochs={warmup} must be less than the {epochs} training epochs "
            f"(train.epochs={cfg.train.epochs}), or the cosine schedule never starts"
        )


PROMPT_CSC_IGNORED = ("zeroshot", "linear_probe", "vpt")  # methods without learned text context


def check_base_to_new(cfg: DictConfig) -> None:
    """ConfigError, naming both keys, for a base-to-new run whose learned tensors cannot score the
    new classes that it evaluates after training (`data.subsample_classes=base`): the linear
    probe's classifier rows and class-specific context belong to their own classes."""
    if cfg.data.subsample_classes != "base":
        return
    if cfg.method == "linear_probe":
        what = "method=linear_probe learns one classifier row per base class"
    elif cfg.prompt.csc and cfg.method not in PROMPT_CSC_IGNORED:
        what = "prompt.csc=true learns context for the base classes only"
    else:
        return
    raise ConfigError(
        f"{what} and cannot score the new classes that data.subsample_classes=base evaluates after "
        "training; use shared context (prompt.csc=false)"
    )


def validate_vision(cfg: DictConfig) -> None:
    """`vision.n_ctx` / `vision.depth`: null or an integer >= 1; maple takes both from `prompt.*`,
    so a `vision.*` value that differs from them is an error."""
    for key in ("vision.n_ctx", "vision.depth"):
        value = OmegaConf.select(cfg, key)
        if value is not None and (not _is_int(value) or value < 1):
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    if cfg.method == "maple":
        for key in ("n_ctx", "depth"):
            value, text = cfg.vision[key], cfg.prompt[key]
            if value is not None and value != text:
                raise ConfigError(
                    f"vision.{key}={value} conflicts with prompt.{key}={text}: maple couples its vision "
                    f"prompts to the text prompts and takes their count and depth from prompt.{key}"
                )


def flatten(cfg: dict, prefix: str = "") -> dict:
    """A nested config dict as {dotted key: value}, e.g. {"data.shots": 16}."""
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def resolved_epochs(cfg: DictConfig) -> int:
    if cfg.train.epochs is not None:
        return int(cfg.train.epochs)
    return epochs_for_shots(int(cfg.data.shots), cfg.data.name)


def model_tag(name: str) -> str:
    """A folder-safe model name: "ViT-B/16" -> "ViT-B-16", "cfg/tiny.json" -> "tiny"."""
    if name.endswith(".json"):
        name = Path(name).stem
    return name.replace("/", "-")


def method_settings(cfg: DictConfig) -> str:
    """The settings part of a run name: what the method's results depend on.

    coop: nctx<M>_csc<C>_pos<P>_depth<J>; cocoop, kgcoop, ivlp, maple and promptsrc: the same
    after "<method>_" (M is "init" when the context starts from prompt.ctx_init), ivlp and promptsrc followed by
    _vctx<N>_vdepth<K> (`vision.*`); vpt: vpt_vctx<N>_vdepth<K>; zeroshot: zeroshot_<templates>
    (a literal template by its hash); linear_probe: linear_probe.
    """
    if cfg.method == "zeroshot":
        templates = str(cfg.zeroshot.templates)
        if templates not in ("coop", "kgcoop", "coop_ensemble", "ensemble"):
            templates = "template-" + hashlib.sha1(templates.encode()).hexdigest()[:8]
        return f"zeroshot_{templates}"
    if cfg.method == "linear_probe":
        return "linear_probe"
    vision = f"vctx{cfg.vision.n_ctx}_vdepth{cfg.vision.depth}"
    if cfg.method == "vpt":
        return f"vpt_{vision}"
    p = cfg.prompt
    n_ctx = p.n_ctx if p.n_ctx is not None else ("init" if p.ctx_init else 4)
    pos = "middle" if p.position == "mid" else p.position
    prefix = "" if cfg.method == "coop" else f"{cfg.method}_"
    text = f"{prefix}nctx{n_ctx}_csc{str(bool(p.csc)).lower()}_pos{pos}_depth{p.depth}"
    return f"{text}_{vision}" if cfg.method in ("ivlp", "promptsrc") else text


def run_name(cfg: DictConfig) -> str:
    """CoOp-style run folder: <dataset>/<model>/shots<K>/<settings>/seed<S>.

    The settings part is `method_settings` (for CoOp nctx<M>_csc<C>_pos<P>_depth<J>); base-to-new
    runs (data.subsample_classes base/new) add "_base"/"_new" to it.
    """
    classes = "" if cfg.data.subsample_classes == "all" else f"_{cfg.data.subsample_classes}"
    return (
        f"{cfg.data.name}/{model_tag(cfg.model.name)}/shots{cfg.data.shots}/"
        f"{method_settings(cfg)}{classes}/seed{cfg.data.seed}"
    )


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)

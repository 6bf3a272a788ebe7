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

from coop.recipes import DATASET_RECIPES, METHOD_DEFAULTS, YIELDS_TO

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
    "tip_adapter",
    "tip_adapter_f",
    "clip_lora",
    "mmrl",
    "tcp",
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
        "optimizer": "sgd",  # sgd | adam | adamw (coop.schedule)
        "momentum": 0.9,  # sgd
        "betas": [0.9, 0.999],  # adam, adamw
        "eps": 1e-8,  # adam, adamw
        "weight_decay": 5e-4,
        "schedule": "cosine",  # cosine (Dassl's, per epoch) | cosine_iter (per iteration) | constant
        "min_lr": 0.0,  # where the cosine ends
        "warmup_epochs": 1,
        "warmup_lr": 1e-5,
        "iterations": None,  # total optimizer steps instead of epochs (the last epoch is cut short)
        "iterations_per_shot": None,  # ... or this many steps per shot (CLIP-LoRA: 500)
        "augment": True,  # false: train on the test transform (no random crop or flip)
        "crop_scale": [0.08, 1.0],  # the train crop's RandomResizedCrop scale
        "drop_last": True,  # an epoch's last, smaller batch is dropped (Dassl); false: Tip-Adapter-F
        "precision": "amp",
        "aug_views": 0,
        "eval_batch_size": 100,
        "cache_features": True,
        "grad_checkpointing": False,
        "tensorboard": True,  # TensorBoard events in <run>/tb/ when tensorboard is installed
        "dist_backend": "auto",  # under torchrun: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
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
    "tip": {  # tip_adapter, tip_adapter_f (coop.methods.tip_adapter); per dataset: coop.recipes
        "augment_epochs": 10,  # augmented views averaged into each cache key
        "init_alpha": 1.17,  # the residual ratio Tip-Adapter-F trains at (and the start without search)
        "init_beta": 1.0,  # the sharpness Tip-Adapter-F trains at
        "search": True,  # grid-search alpha and beta on the val split
        "search_scale": [7, 3],  # [beta, alpha]: the grids' upper ends (excluded)
        "search_step": [200, 20],  # [beta, alpha]: the grids' sizes
        "templates": "tip",  # Tip-Adapter's: CoOp's per dataset, its 7-template ensemble for ImageNet
    },
    "lora": {  # coop.lora, coop.methods.clip_lora; layers: all | half-up | half-bottom | [0-based blocks]
        "rank": 2,
        "alpha": 1.0,
        "dropout": 0.25,
        "towers": ["text", "vision"],
        "targets": ["q", "k", "v"],
        "layers": "all",
    },
    "mmrl": {  # coop.methods.mmrl; per-dataset reg_weight / rep_dim: coop.recipes.DATASET_RECIPES
        "n_tokens": 5,  # K representation tokens
        "rep_dim": 512,  # d_r
        "layers": None,  # 1-based text blocks that take the tokens; null: L/2..L (6..12 of 12)
        "vision_layers": None,  # 1-based image blocks; null: L/2..L of the image tower
        "alpha": 0.7,  # fusion = alpha * logits + (1 - alpha) * logits_rep, and the CE weights
        "reg_weight": 1.0,  # lambda of both cosine regularisers
    },
    "tcp": {"layer": 8, "weight": 8.0},  # coop.methods.tcp: the block of the class-aware tokens
    "dept": {"enabled": False, "weight": 0.7, "lr_scale": 6.5},  # coop.methods.dept: a head on any host
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

CHOICES = {
    "method": METHODS,
    "prompt.position": ("end", "middle", "mid", "front"),
    "train.precision": ("amp", "fp32", "fp16"),
    "train.optimizer": ("sgd", "adam", "adamw"),
    "train.schedule": ("cosine", "cosine_iter", "constant"),
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
    "train.dist_backend": ("auto", "gloo", "nccl"),
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
        "train.dist_backend",  # how the ranks of a torchrun run talk (coop.distributed)
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
    validate_optimizer(cfg)
    if epochs == 0 and cfg.method in ("coop", "kgcoop") and not cfg.prompt.ctx_init:
        raise ConfigError(
            "train.epochs=0 evaluates untrained prompts: set prompt.ctx_init (e.g. 'a photo of a')"
        )
    validate_vision(cfg)
    validate_lora(cfg)
    chunk = cfg.cocoop.chunk_prompts
    if not _is_int(chunk) or chunk < 1:
        raise ConfigError(f"cocoop.chunk_prompts must be an integer >= 1, got {chunk!r}")
    weight = cfg.kgcoop.weight
    if not _is_number(weight) or not weight >= 0:
        raise ConfigError(f"kgcoop.weight must be a number >= 0, got {weight!r}")
    validate_tip(cfg)
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
    validate_mmrl(cfg)
    validate_tcp_dept(cfg)
    targets = cfg.eval.targets
    if not OmegaConf.is_list(targets) or not all(isinstance(t, str) and t for t in targets):
        raise ConfigError(f"eval.targets must be a list of dataset names, got {targets!r}")
    epochs, warmup = resolved_epochs(cfg), cfg.train.warmup_epochs
    iterations = cfg.train.iterations is not None or cfg.train.iterations_per_shot is not None
    if epochs > 0 and warmup >= epochs and not iterations:  # with iterations: coop.schedule.plan_schedule
        raise ConfigError(
            f"train.warmup_epochs={warmup} must be less than the {epochs} training epochs "
            f"(train.epochs={cfg.train.epochs}), or the cosine schedule never starts"
        )


def validate_tip(cfg: DictConfig) -> None:
    """The `tip.*` keys (Tip-Adapter's cache model and its alpha/beta search)."""
    tip = cfg.tip
    if not _is_int(tip.augment_epochs) or tip.augment_epochs < 1:
        raise ConfigError(f"tip.augment_epochs must be an integer >= 1, got {tip.augment_epochs!r}")
    for key in ("init_alpha", "init_beta"):
        if not _is_number(tip[key]) or not tip[key] >= 0:
            raise ConfigError(f"tip.{key} must be a number >= 0, got {tip[key]!r}")
    scale, steps = _pair(tip.search_scale), _pair(tip.search_step)
    if scale is None or not all(v > 0 for v in scale):
        raise ConfigError(
            f"tip.search_scale must be two numbers > 0 ([beta, alpha]), got {tip.search_scale!r}"
        )
    if steps is None or not all(_is_int(v) and v >= 1 for v in steps):
        raise ConfigError(
            f"tip.search_step must be two integers >= 1 ([beta, alpha]), got {tip.search_step!r}"
        )
    if not isinstance(tip.search, bool):
        raise ConfigError(f"tip.search must be true or false, got {tip.search!r}")


def _pair(value) -> list | None:
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else None
    return items if items is not None and len(items) == 2 and all(map(_is_number, items)) else None


def validate_optimizer(cfg: DictConfig) -> None:
    """The optimizer, schedule and augmentation keys of `train` (`coop.schedule`)."""
    t = cfg.train
    betas = _pair(t.betas)
    if betas is None or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"train.betas must be two numbers in [0, 1), got {t.betas!r}")
    if not _is_number(t.eps) or not t.eps > 0:
        raise ConfigError(f"train.eps must be a number > 0, got {t.eps!r}")
    if not _is_number(t.min_lr) or not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr must be a number in [0, train.lr={t.lr}], got {t.min_lr!r}")
    for key in ("iterations", "iterations_per_shot"):
        value = t[key]
        if value is not None and (not _is_int(value) or value < 1):
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
    scale = _pair(t.crop_scale)
    if scale is None or not 0 < scale[0] <= scale[1] <= 1:
        raise ConfigError(
            f"train.crop_scale must be [min, max] with 0 < min <= max <= 1, got {t.crop_scale!r}"
        )


def validate_lora(cfg: DictConfig) -> None:
    """`lora.*` (coop.lora): rank >= 1, alpha > 0, dropout in [0, 1), towers/targets from their sets,
    layers "all" | "half-up" | "half-bottom" | a list of 0-based block indices (checked against
    each tower's block count when the method is built)."""
    lora = cfg.lora
    if not _is_int(lora.rank) or lora.rank < 1:
        raise ConfigError(f"lora.rank must be an integer >= 1, got {lora.rank!r}")
    if not _is_number(lora.alpha) or not lora.alpha > 0:
        raise ConfigError(f"lora.alpha must be a number > 0, got {lora.alpha!r}")
    if not _is_number(lora.dropout) or not 0 <= lora.dropout < 1:
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
        if not layers or not all(_is_int(i) and i >= 0 for i in layers):
            raise ConfigError(
                f"lora.layers must be a non-empty list of 0-based block indices, got {layers!r}"
            )
    elif layers not in ("all", "half-up", "half-bottom"):
        raise ConfigError(
            f"lora.layers={layers!r} is not one of all, half-up, half-bottom or a list of block indices"
        )


# methods without learned text context
PROMPT_CSC_IGNORED = ("zeroshot", "linear_probe", "vpt", "tip_adapter", "tip_adapter_f", "clip_lora", "mmrl")


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


DEPT_HOSTS = ("coop", "cocoop", "kgcoop", "maple")  # coop.methods.dept


def validate_tcp_dept(cfg: DictConfig) -> None:
    """`tcp.*` and `dept.*`: numbers in range; DePT only on the hosts it wraps."""
    layer = cfg.tcp.layer
    if not _is_int(layer) or layer < 1:
        raise ConfigError(f"tcp.layer must be an integer >= 1 (a text block), got {layer!r}")
    for key in ("tcp.weight", "dept.lr_scale"):
        value = OmegaConf.select(cfg, key)
        if not _is_number(value) or not value >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {value!r}")
    if not _is_number(cfg.dept.weight) or not 0 <= cfg.dept.weight <= 1:
        raise ConfigError(f"dept.weight must be a number in [0, 1], got {cfg.dept.weight!r}")
    if not isinstance(cfg.dept.enabled, bool):
        raise ConfigError(f"dept.enabled must be true or false, got {cfg.dept.enabled!r}")
    if cfg.dept.enabled and cfg.method not in DEPT_HOSTS:
        raise ConfigError(f"dept.enabled=true wraps method={'|'.join(DEPT_HOSTS)}, got method={cfg.method}")


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


def validate_mmrl(cfg: DictConfig) -> None:
    """`mmrl.*`: sizes >= 1, alpha in [0, 1], lambda >= 0, layer lists null or increasing 1-based
    block numbers (checked against the towers' depths when the method is built)."""
    m = cfg.mmrl
    for key in ("n_tokens", "rep_dim"):
        if not _is_int(m[key]) or m[key] < 1:
            raise ConfigError(f"mmrl.{key} must be an integer >= 1, got {m[key]!r}")
    if not _is_number(m.alpha) or not 0 <= m.alpha <= 1:
        raise ConfigError(f"mmrl.alpha must be a number in [0, 1], got {m.alpha!r}")
    if not _is_number(m.reg_weight) or not 0 <= m.reg_weight < math.inf:
        raise ConfigError(f"mmrl.reg_weight must be a finite number >= 0, got {m.reg_weight!r}")
    for key in ("layers", "vision_layers"):
        value = m[key]
        if value is None:
            continue
        items = list(value) if OmegaConf.is_list(value) else None
        if not items or not all(_is_int(i) and i >= 1 for i in items) or items != sorted(set(items)):
            raise ConfigError(
                f"mmrl.{key} must be null or a non-empty increasing list of 1-based block numbers, got {value!r}"
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

    coop: nctx<M>_csc<C>_pos<P>_depth<J>; cocoop, kgcoop, ivlp, maple, promptsrc and tcp: the same
    after "<method>_" (M is "init" when the context starts from prompt.ctx_init), ivlp and promptsrc followed by
    _vctx<N>_vdepth<K> (`vision.*`); vpt: vpt_vctx<N>_vdepth<K>; zeroshot: zeroshot_<templates>
    (a literal template by its hash); linear_probe: linear_probe; tip_adapter and tip_adapter_f:
    <method>_views<tip.augment_epochs>; mmrl: mmrl_k<K>_dr<d_r>_l<layers>_vl<vision layers>_a<alpha>_lam<lambda>.
    DePT (`dept.enabled`) adds "_dept".
    """
    if cfg.method == "zeroshot":
        templates = str(cfg.zeroshot.templates)
        if templates not in ("coop", "kgcoop", "coop_ensemble", "ensemble"):
            templates = "template-" + hashlib.sha1(templates.encode()).hexdigest()[:8]
        return f"zeroshot_{templates}"
    if cfg.method == "linear_probe":
        return "linear_probe"
    if cfg.method in ("tip_adapter", "tip_adapter_f"):
        return f"{cfg.method}_views{cfg.tip.augment_epochs}"
    if cfg.method == "clip_lora":
        lora = cfg.lora
        layers = lora.layers if isinstance(lora.layers, str) else "-".join(str(i) for i in lora.layers)
        towers, targets = "+".join(lora.towers), "".join(lora.targets)
        return f"clip_lora_r{lora.rank}_a{lora.alpha:g}_drop{lora.dropout:g}_{towers}_{targets}_{layers}"
    if cfg.method == "mmrl":
        m = cfg.mmrl
        layers = "-".join(map(str, m.layers)) if m.layers is not None else "auto"
        vision_layers = "-".join(map(str, m.vision_layers)) if m.vision_layers is not None else "auto"
        return f"mmrl_k{m.n_tokens}_dr{m.rep_dim}_l{layers}_vl{vision_layers}_a{m.alpha}_lam{m.reg_weight}"
    vision = f"vctx{cfg.vision.n_ctx}_vdepth{cfg.vision.depth}"
    if cfg.method == "vpt":
        return f"vpt_{vision}"
    p = cfg.prompt
    n_ctx = p.n_ctx if p.n_ctx is not None else ("init" if p.ctx_init else 4)
    pos = "middle" if p.position == "mid" else p.position
    prefix = "" if cfg.method == "coop" else f"{cfg.method}_"
    text = f"{prefix}nctx{n_ctx}_csc{str(bool(p.csc)).lower()}_pos{pos}_depth{p.depth}"
    text = f"{text}_{vision}" if cfg.method in ("ivlp", "promptsrc") else text
    return f"{text}_dept" if cfg.dept.enabled else text


def run_name(cfg: DictConfig) -> str:
    """CoOp-style run folder: <dataset>/<model>/shots<K>/<settings>/seed<S>.

    The settings part is `method_settings` (for CoOp nctx<M>_csc<C>_pos<P>_depth<J>); runs without
    augmentation (train.augment=false) add "_noaug", base-to-new runs (data.subsample_classes
    base/new) "_base"/"_new".
    """
    classes = "" if cfg.data.subsample_classes == "all" else f"_{cfg.data.subsample_classes}"
    augment = "" if cfg.train.augment else "_noaug"  # never one folder for both
    return (
        f"{cfg.data.name}/{model_tag(cfg.model.name)}/shots{cfg.data.shots}/"
        f"{method_settings(cfg)}{augment}{classes}/seed{cfg.data.seed}"
    )


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)

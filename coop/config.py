"""Run configuration: CoOp's recipe as defaults, YAML files and `key=value` overrides (OmegaConf).

    cfg = load_config("configs/coop/vit_b16.yaml", ["data.shots=4", "prompt.position=middle"])

Unknown keys are errors that name the key, and invalid values are errors that name the key and
the value. `train.epochs: null` applies CoOp's epoch-by-shots rule (`epochs_for_shots`).

Each method starts from its own paper's recipe where it differs from CoOp's (`METHOD_DEFAULTS`):
those values replace the defaults for every key that no file, override or saved config sets.
"""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from coop.config_checks import ConfigError, is_int, is_number, validate_optimizer, validate_sections
from coop.recipes import DATASET_RECIPES, METHOD_DEFAULTS, YIELDS_TO
from coop.run_names import method_settings, model_tag, run_name  # noqa: F401 (coop.config's API)

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


def validate(cfg: DictConfig) -> None:
    """Raise a one-line ConfigError, naming the key and its value, for a config that cannot run."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    for key in ("data.shots", "train.aug_views", "prompt.depth", "train.warmup_epochs", "data.num_workers"):
        value = OmegaConf.select(cfg, key)
        if not is_int(value) or value < 0:
            raise ConfigError(f"{key} must be a non-negative integer, got {value!r}")
    for key in ("train.batch_size", "train.eval_batch_size"):
        value = OmegaConf.select(cfg, key)
        if not is_int(value) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    lr, warmup_lr = cfg.train.lr, cfg.train.warmup_lr
    if not is_number(lr) or not lr > 0:  # `not >` also rejects NaN
        raise ConfigError(f"train.lr must be a number > 0, got {lr!r}")
    if not is_number(warmup_lr) or not warmup_lr >= 0:
        raise ConfigError(f"train.warmup_lr must be a number >= 0, got {warmup_lr!r}")
    epochs = cfg.train.epochs
    if epochs is not None and (not is_int(epochs) or epochs < 0):
        raise ConfigError(f"train.epochs must be a non-negative integer or null, got {epochs!r}")
    validate_optimizer(cfg)
    if epochs == 0 and cfg.method in ("coop", "kgcoop") and not cfg.prompt.ctx_init:
        raise ConfigError(
            "train.epochs=0 evaluates untrained prompts: set prompt.ctx_init (e.g. 'a photo of a')"
        )
    validate_sections(cfg)
    if not isinstance(cfg.train.tensorboard, bool):
        raise ConfigError(f"train.tensorboard must be true or false, got {cfg.train.tensorboard!r}")
    split_file = cfg.data.split_file
    if split_file is not None and (not isinstance(split_file, str) or cfg.data.name != "imagefolder"):
        raise ConfigError(
            f"data.split_file={split_file!r} is read by data.name=imagefolder only (got {cfg.data.name!r}); "
            "set data.split_file=null for other datasets"
        )
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


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)

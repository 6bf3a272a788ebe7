"""What server and clients share: config checks, data, partition, features, methods, evaluation.

Nothing here imports Flower. Both sides call the same functions with the same config, so a
client computes exactly the partition and features the server expects (`Partition.digest`).

    promptfl        `coop.methods.CoOp`: CoOp's prompt (any position, csc, depth), aggregated
    latent_domains  `coop.federated.latent_domains.LatentDomains`: G + D_1..D_K + queries
    fedotp          `coop.federated.fedotp.FedOTP`: global + local prompt, OT on patch tokens
    fedpgp          `coop.federated.fedpgp.FedPGP`: global sigma + personal U V

The last two are personalised: their `personal_keys` stay per client (`is_personal`).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from coop.config.checks import ConfigError
from coop.config.run_names import model_tag, run_name
from coop.data import CLIP_MEAN, CLIP_STD, build_dataset, build_transforms, subsample_classes
from coop.data.images import derive_seed
from coop.data.multidomain import build_multidomain, domain_of
from coop.federated.fedotp import FedOTP
from coop.federated.fedpgp import FedPGP
from coop.federated.latent_domains import LatentDomains
from coop.federated.partition import Partition, partition
from coop.federated.personal_data import (
    fedotp_partition,
    fewshot_first,
    labeldir100_partition,
    labeldir_partition,
)
from coop.federated.promptfl_data import promptfl_partition
from coop.methods import CoOp, Method
from coop.model.clip import CLIP
from coop.train.engine import use_fp16
from coop.train.features import cached_features
from coop.train.precision import resolve_precision
from coop.train.preflight import check_model_limits

log = logging.getLogger(__name__)

FL_METHODS: dict[str, type[Method]] = {
    "promptfl": CoOp,
    "latent_domains": LatentDomains,
    "fedotp": FedOTP,
    "fedpgp": FedPGP,
}
FULL_SPLIT_PARTITIONS = ("promptfl", "pathological_fedotp")  # draw data.shots per client from full splits


def is_personal(cfg: DictConfig) -> bool:
    """Whether `fl.method` keeps a personal part per client (FedOTP, FedPGP)."""
    return bool(getattr(FL_METHODS[cfg.fl.method], "personal_keys", ()))


# Defaults of federated runs that differ from tools/train.py's (a `base` for `load_config`):
# clients train on cached features, one view per image unless the config asks for more.
FEDERATED_BASE = {"train": {"aug_views": 1}}


def check_config(cfg: DictConfig) -> None:
    """One-line ConfigError, naming the keys, for `fl.*` settings that cannot run with the rest of
    the config (each key's own type and range: `coop.config.schema`, checked by `load_config`), and
    a one-line ModelError for a model whose towers `fl.method` cannot use (FedOTP: patch tokens with
    features of their own), from the towers built on the meta device: no weights are loaded."""
    fl = cfg.fl
    check_model_limits(cfg, FL_METHODS[fl.method])  # e.g. FedOTP on a tower without patch tokens
    if int(cfg.train.aug_views) == 0:
        raise ConfigError(
            "train.aug_views=0 re-encodes images every step; federated clients train on cached "
            "features: set train.aug_views=1 (or K > 1 augmented views)"
        )
    if cfg.get("method", "coop") != "coop":
        raise ConfigError(
            f"method={cfg.method}: federated runs choose their method with fl.method; leave method=coop"
        )
    if cfg.data.target_domain is not None and cfg.data.name != "multidomain":
        raise ConfigError(f"data.target_domain needs data.name=multidomain, not {cfg.data.name}")
    if cfg.fl.partition == "domain" and cfg.data.name != "multidomain":
        raise ConfigError("fl.partition=domain needs data.name=multidomain")
    if fl.aggregation == "last_client" and fl.method != "promptfl":
        raise ConfigError(
            "fl.aggregation=last_client is PromptFL's official rule: it needs fl.method=promptfl, "
            f"not {fl.method}"
        )
    _check_personal(cfg)
    if fl.partition == "promptfl":
        if cfg.data.name == "multidomain":
            raise ConfigError(
                "fl.partition=promptfl reads one dataset's train split: not data.name=multidomain"
            )
        if int(cfg.data.shots) < 1:
            raise ConfigError(
                "fl.partition=promptfl draws data.shots images per class per client: set data.shots >= 1"
            )
        if cfg.data.subsample_classes != "all":
            raise ConfigError(
                f"fl.partition=promptfl draws from every class: data.subsample_classes={cfg.data.subsample_classes} "
                "is not supported"
            )


def _check_personal(cfg: DictConfig) -> None:
    fl = cfg.fl
    if fl.partition == "pathological_fedotp":
        if cfg.data.name == "multidomain" or int(cfg.data.shots) < 1:
            raise ConfigError(
                "fl.partition=pathological_fedotp draws data.shots >= 1 images per class from one dataset's "
                "train split (not data.name=multidomain)"
            )
        if cfg.data.subsample_classes == "new":
            raise ConfigError("fl.partition=pathological_fedotp trains on all or the base classes, not new")
    if fl.partition == "dirichlet_labeldir100" and (cfg.data.name != "cifar100" or int(cfg.data.shots) != 0):
        raise ConfigError(
            "fl.partition=dirichlet_labeldir100 is CIFAR-100's split: data.name=cifar100 data.shots=0"
        )
    if not is_personal(cfg):
        return
    if fl.aggregation not in ("fedavg", "uniform"):
        raise ConfigError(f"fl.method={fl.method} averages its global part: fl.aggregation=fedavg or uniform")
    if cfg.prompt.csc or int(cfg.prompt.depth) != 1:
        raise ConfigError(
            f"fl.method={fl.method} learns shared context at the input: prompt.csc=false, prompt.depth=1"
        )


def fl_run_name(cfg: DictConfig) -> str:
    """federated/<method>/<run_name with the partition, aggregation and round settings>."""
    fl = cfg.fl
    head, _, seed = run_name(cfg).rpartition("/")
    dataset, _, rest = head.partition("/")
    if cfg.data.target_domain is not None:
        dataset += f"-to-{cfg.data.target_domain}"
    promptfl = (
        "promptfl-" + ("iid" if fl.iid else "noniid") + (f"-repeat{fl.repeat_rate}" if fl.repeat_rate else "")
    )
    part = {
        "dirichlet": f"dirichlet{fl.alpha}",
        "pathological": f"pathological{fl.classes_per_client}",
        "promptfl": promptfl,
        "pathological_fedotp": "fedotp-pathological",
        "dirichlet_labeldir": f"labeldir{fl.alpha}",
        "dirichlet_labeldir100": f"labeldir100-{fl.alpha}",
    }
    agg = f"fedprox{fl.mu}" if fl.aggregation == "fedprox" else fl.aggregation
    extra = f"_{part.get(fl.partition, fl.partition)}_{agg}_c{fl.clients}_r{fl.rounds}_e{fl.local_epochs}"
    if fl.fraction != 1.0:
        extra += f"_f{fl.fraction}"
    if fl.method == "latent_domains":
        extra += f"_k{fl.domains}_b{fl.beta}_w{fl.ensemble_weight}"
    if fl.method == "fedotp":
        o = cfg.fedotp
        extra += f"_{o.ot}_g{o.gamma}_eps{o.eps}"
    if fl.method == "fedpgp":
        extra += f"_r{cfg.fedpgp.rank}_mu{cfg.fedpgp.mu}_t{cfg.fedpgp.temp}"
    if fl.lr_schedule != "cosine":
        extra += f"_lr{fl.lr_schedule}"
    return f"federated/{fl.method}/{dataset}/{rest}{extra}/{seed}"


def run_precision(cfg: DictConfig, device) -> str:
    """The precision server and clients run for `train.precision` on `device`, as tools/train.py
    runs it (`coop.train.precision.resolve_precision`): amp = bf16 autocast with fp32 prompts, fp16 =
    CoOp's half-precision CLIP and prompts; fp32 where the device lacks them, said in the log."""
    precision = resolve_precision(cfg.train.precision, torch.device(device))
    if precision != cfg.train.precision:
        log.info(
            "train.precision=%s is not available on %s; running %s", cfg.train.precision, device, precision
        )
    return precision


def prepare_precision(clip: CLIP, method: Method, precision: str) -> None:
    """Cast CLIP and the method to half precision for fp16 (`coop.train.engine.use_fp16`); else nothing."""
    if precision == "fp16":
        use_fp16(clip, method)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_data(cfg: DictConfig):
    """The run's few-shot dataset; multi-domain data honour `data.target_domain`.

    With fl.partition=promptfl or pathological_fedotp the full splits (of data.subsample_classes):
    every client draws data.shots per class from them; but FedPGP's base-to-novel on the datasets
    of `fewshot_first` draws from the few-shot subset, as its readers do.
    """
    fewshot = fewshot_first(cfg.fl.partition, cfg.data.name, cfg.data.subsample_classes)
    if cfg.fl.partition in FULL_SPLIT_PARTITIONS and not fewshot:
        ds = build_dataset(cfg.data.name, cfg.data.root, shots=0, seed=int(cfg.data.seed))
        return subsample_classes(ds, cfg.data.subsample_classes)
    if cfg.data.name == "multidomain":
        ds = build_multidomain(cfg.data.root, cfg.data.target_domain, int(cfg.data.shots), int(cfg.data.seed))
    else:
        ds = build_dataset(
            cfg.data.name,
            cfg.data.root,
            int(cfg.data.shots),
            int(cfg.data.seed),
            cfg.data.split_file,
            cfg.data.fewshot_source,
        )
    return subsample_classes(ds, cfg.data.subsample_classes)


def item_domains(ds, items) -> list[str] | None:
    return [domain_of(d, ds.image_dir) for d in items] if ds.name == "multidomain" else None


def client_partition(cfg: DictConfig, ds) -> Partition:
    """The partition of `ds.train` among `fl.clients` clients (deterministic in the config)."""
    fl = cfg.fl
    keys = [f"{os.path.relpath(d.path, ds.image_dir)}\t{d.label}" for d in ds.train]
    if fl.partition == "pathological_fedotp":
        return fedotp_partition(
            [d.label for d in ds.train], [d.label for d in ds.test], shots=int(cfg.data.shots),
            clients=int(fl.clients), item_keys=keys,
        )  # fmt: skip
    if fl.partition == "dirichlet_labeldir":
        return labeldir_partition(
            [d.label for d in ds.train], [d.label for d in ds.test], beta=float(fl.alpha),
            clients=int(fl.clients), seed=int(cfg.data.seed), item_keys=keys,
        )  # fmt: skip
    if fl.partition == "dirichlet_labeldir100":
        return labeldir100_partition(
            [d.label for d in ds.train], [d.label for d in ds.test], beta=float(fl.alpha),
            clients=int(fl.clients), seed=int(cfg.data.seed), item_keys=keys,
        )  # fmt: skip
    if fl.partition == "promptfl":
        return promptfl_partition(
            ds.train,
            ds.val,
            shots=int(cfg.data.shots),
            clients=int(fl.clients),
            iid=bool(fl.iid),
            repeat_rate=float(fl.repeat_rate),
            seed=int(cfg.data.seed),
            item_keys=keys,
        )
    return partition(
        [d.label for d in ds.train],
        item_domains(ds, ds.train),
        scheme=fl.partition,
        clients=int(fl.clients),
        seed=int(cfg.data.seed),
        alpha=float(fl.alpha),
        classes_per_client=int(fl.classes_per_client),
        item_keys=keys,
    )


def transforms(clip: CLIP):
    """CoOp's (train, test) transforms at the image tower's size and normalisation."""
    pre = clip.preprocess_cfg
    return build_transforms(
        pre.get("size", clip.image_size), pre.get("mean", CLIP_MEAN), pre.get("std", CLIP_STD)
    )


def features(cfg: DictConfig, clip: CLIP, items, device, *, train: bool, what: str, tokens: bool = False):
    """Image features ((V, N, E), labels) of `items`: V = train.aug_views for training, else 1.

    Computed at the run's precision (`run_precision`), in CLIP's dtype (half after fp16's cast).
    With `tokens` (a method's `image_tokens`, FedOTP) every projected token: (V, N, n_prefix+P, E).
    """
    device = torch.device(device)
    train_tf, test_tf = transforms(clip)
    views = int(cfg.train.aug_views) if train else 1
    tf, seed = (train_tf, int(cfg.data.seed)) if train and views > 1 else (test_tf, None)
    return cached_features(
        clip,
        items,
        tf,
        views=views,
        seed=seed,
        device=device,
        precision=resolve_precision(cfg.train.precision, device),
        skip_corrupt=bool(cfg.data.skip_corrupt),
        use_disk=bool(cfg.train.cache_features),
        batch_size=int(cfg.train.eval_batch_size),
        num_workers=int(cfg.data.num_workers),
        desc=what,
        what=what,
        tokens=tokens,
    )


def build_method(clip: CLIP, classnames: list[str], cfg: DictConfig) -> Method:
    """The `fl.method`'s model, its learnable tensors drawn from `data.seed` (the server's start)."""
    torch.manual_seed(int(cfg.data.seed))
    return FL_METHODS[cfg.fl.method](clip, classnames, cfg)


def round_lr(rnd: int, rounds: int, lr: float, schedule: str = "cosine") -> float:
    """Round r (1-based) trains at lr * (1 + cos(pi (r - 1) / rounds)) / 2: a cosine over rounds;
    `constant`: lr every round (FedOTP's and FedPGP's single_step schedule with gamma 1)."""
    if schedule == "constant":
        return lr
    return lr * 0.5 * (1 + math.cos(math.pi * (rnd - 1) / rounds))


def local_seed(seed: int, rnd: int, client: int) -> int:
    """The seed of client `client`'s batches in round `rnd`: the same in every process and run."""
    return derive_seed(seed, rnd, client)


def run_fields(cfg: DictConfig, method: Method) -> dict:
    """The metrics.json fields that describe the run (as tools/train.py writes them, plus fl.*)."""
    return {
        "shots": int(cfg.data.shots),
        "seed": int(cfg.data.seed),
        "dataset": cfg.data.name,
        "target_domain": cfg.data.target_domain,
        "model": model_tag(cfg.model.name),
        "pretrained": cfg.model.pretrained,
        **method.describe(),
        "method": cfg.fl.method,
        "fl": OmegaConf.to_container(cfg.fl, resolve=True),
    }


def absolute_paths(cfg: DictConfig) -> DictConfig:
    """A copy whose data.root, data.split_file, model config path and output_dir (the clients' default
    state dir, `coop.federated.client_state`) are absolute (clients may run elsewhere)."""
    out = cfg.copy()
    for key in ("root", "split_file"):
        if out.data[key] is not None:
            out.data[key] = str(Path(str(out.data[key])).expanduser().resolve())
    if out.output_dir is not None:
        out.output_dir = str(Path(str(out.output_dir)).expanduser().resolve())
    name = str(out.model.name)
    if name.endswith(".json") and Path(name).is_file():
        out.model.name = str(Path(name).resolve())
    return out

"""The run configuration as a typed schema: one dataclass per section, every key with its type,
default and, where it has one, its allowed set or range.

    cfg = OmegaConf.structured(RunConfig)   # what `coop.config.load_config` starts from

OmegaConf types each key from its annotation (bool, int, float, str, `| None`, `list[...]`) and
refuses a value of another type itself (`prompt.csc=maybe`, `data.seed=abc`); `check_values`
then checks the ranges and sets declared next to each key (`key(default, ">= 0")`). Rules that
involve several keys live in `coop.config_checks`.

Ranges are written as `"> 0"`, `">= 1"`, `"in [0, 1)"` or `"finite"`; on a list they hold for each
item. `lora.layers` is "all" | "half-up" | "half-bottom" | a list of block indices, and OmegaConf
has no union of a string and a list, so it is typed `Any` and its items' type is declared
(`items="int"`) and checked here.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

# see coop.methods
METHODS = tuple(
    "coop cocoop kgcoop zeroshot linear_probe vpt ivlp maple promptsrc tip_adapter tip_adapter_f clip_lora "
    "mmrl tcp".split()
)


def key(default, rule: str = "", *, choices: tuple = (), **constraints):
    """A config key: its default, range (`rule`), allowed values (`choices`; on a list, of each
    item) and list constraints: `length`, `distinct`, `nonempty`, `order` ("sorted" or
    "increasing"), `items` (the item type of an `Any` key)."""
    meta = {"rule": rule, "choices": tuple(choices), **constraints}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    name: str = "ViT-B-16"  # an OpenCLIP model name or a model-config .json
    pretrained: str | None = "openai"  # an OpenCLIP tag, a weights file, or none


@dataclass
class PromptConfig:
    n_ctx: int | None = key(None, ">= 1")  # null: 4, or the phrase's tokens with ctx_init
    ctx_init: str | None = None
    position: str = key("end", choices=("end", "middle", "mid", "front"))
    csc: bool = False
    depth: int = key(1, ">= 1")


@dataclass
class VisionConfig:  # image-tower prompts (vpt, ivlp, promptsrc); null: unset
    n_ctx: int | None = key(None, ">= 1")
    depth: int | None = key(None, ">= 1")


@dataclass
class DataConfig:
    name: str = "textile"
    root: str | None = None
    shots: int = key(16, ">= 0")
    seed: int = key(1, ">= 0")
    skip_corrupt: bool = False
    subsample_classes: str = key("all", choices=("all", "base", "new"))
    num_workers: int = key(2, ">= 0")
    target_domain: str | None = None
    split_file: str | None = (
        None  # imagefolder: a CoOp split JSON (tools/make_split.py); see coop.data.datasets
    )


@dataclass
class TrainConfig:
    epochs: int | None = key(None, ">= 0")  # null: CoOp's epochs for the shots (epochs_for_shots)
    batch_size: int = key(32, ">= 1")
    lr: float = key(0.002, "> 0")
    optimizer: str = key("sgd", choices=("sgd", "adam", "adamw"))  # coop.schedule
    momentum: float = key(0.9, ">= 0")  # sgd
    betas: list[float] = key([0.9, 0.999], "in [0, 1)", length=2)  # adam, adamw
    eps: float = key(1e-8, "> 0")  # adam, adamw
    weight_decay: float = key(5e-4, ">= 0")
    # cosine (Dassl's, per epoch) | cosine_iter (per iteration) | constant
    schedule: str = key("cosine", choices=("cosine", "cosine_iter", "constant"))
    min_lr: float = key(0.0, ">= 0")  # where the cosine ends
    warmup_epochs: int = key(1, ">= 0")
    warmup_lr: float = key(1e-5, ">= 0")
    # total optimizer steps instead of epochs (the last epoch is cut short) ...
    iterations: int | None = key(None, ">= 1")
    iterations_per_shot: int | None = key(None, ">= 1")  # ... or this many steps per shot (CLIP-LoRA: 500)
    augment: bool = True  # false: train on the test transform (no random crop or flip)
    # the train crop's RandomResizedCrop scale [min, max]
    crop_scale: list[float] = key([0.08, 1.0], "in (0, 1]", length=2, order="sorted")
    drop_last: bool = True  # an epoch's last, smaller batch is dropped (Dassl); false: Tip-Adapter-F
    precision: str = key("amp", choices=("amp", "fp32", "fp16"))
    aug_views: int = key(0, ">= 0")
    eval_batch_size: int = key(100, ">= 1")
    cache_features: bool = True
    grad_checkpointing: bool = False
    tensorboard: bool = True  # TensorBoard events in <run>/tb/ when tensorboard is installed
    # under torchrun: auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    dist_backend: str = key("auto", choices=("auto", "gloo", "nccl"))


@dataclass
class ZeroshotConfig:
    templates: str = "coop"  # a name or a template containing {} (coop.methods.zeroshot)


@dataclass
class CocoopConfig:  # prompts (images x classes) per recomputed block; coop.methods.cocoop
    chunk_prompts: int = key(1024, ">= 1")


@dataclass
class KgcoopConfig:
    weight: float = key(8.0, ">= 0")
    templates: str = "kgcoop"  # KgCoOp's own templates (coop.methods.zeroshot)


@dataclass
class PromptsrcConfig:  # coop.methods.promptsrc; GPA: coop.gpa
    text_weight: float = key(25.0, ">= 0")
    image_weight: float = key(10.0, ">= 0")
    kl_weight: float = key(1.0, ">= 0")
    templates: str = "promptsrc"
    gpa_mean: float = key(15.0, "finite")  # an epoch
    gpa_std: float = key(1.0, "in (0, inf)")  # epochs


@dataclass
class TipConfig:  # tip_adapter, tip_adapter_f (coop.methods.tip_adapter); per dataset: coop.recipes
    augment_epochs: int = key(10, ">= 1")  # augmented views averaged into each cache key
    init_alpha: float = key(
        1.17, ">= 0"
    )  # the residual ratio Tip-Adapter-F trains at (and the start without search)
    init_beta: float = key(1.0, ">= 0")  # the sharpness Tip-Adapter-F trains at
    search: bool = True  # grid-search alpha and beta on the val split
    search_scale: list[float] = key(
        [7.0, 3.0], "> 0", length=2
    )  # [beta, alpha]: the grids' upper ends (excluded)
    search_step: list[int] = key([200, 20], ">= 1", length=2)  # [beta, alpha]: the grids' sizes
    templates: str = "tip"  # Tip-Adapter's: CoOp's per dataset, its 7-template ensemble for ImageNet


@dataclass
class LoraConfig:  # coop.lora, coop.methods.clip_lora
    rank: int = key(2, ">= 1")
    alpha: float = key(1.0, "> 0")
    dropout: float = key(0.25, "in [0, 1)")
    towers: list[str] = key(["text", "vision"], choices=("text", "vision"), distinct=True, nonempty=True)
    targets: list[str] = key(["q", "k", "v"], choices=("q", "k", "v"), distinct=True, nonempty=True)
    # all | half-up | half-bottom | [0-based blocks] (checked against each tower when built)
    layers: Any = key(
        "all", ">= 0", choices=("all", "half-up", "half-bottom"), items="int", distinct=True, nonempty=True
    )


@dataclass
class MmrlConfig:  # coop.methods.mmrl; per-dataset reg_weight / rep_dim: coop.recipes.DATASET_RECIPES
    n_tokens: int = key(5, ">= 1")  # K representation tokens
    rep_dim: int = key(512, ">= 1")  # d_r
    # 1-based text blocks that take the tokens; null: L/2..L (6..12 of 12)
    layers: list[int] | None = key(None, ">= 1", order="increasing", nonempty=True)
    # 1-based image blocks; null: L/2..L of the image tower
    vision_layers: list[int] | None = key(None, ">= 1", order="increasing", nonempty=True)
    alpha: float = key(
        0.7, "in [0, 1]"
    )  # fusion = alpha * logits + (1 - alpha) * logits_rep, and the CE weights
    reg_weight: float = key(1.0, "in [0, inf)")  # lambda of both cosine regularisers


@dataclass
class TcpConfig:  # coop.methods.tcp: the block of the class-aware tokens
    layer: int = key(8, ">= 1")
    weight: float = key(8.0, ">= 0")


@dataclass
class DeptConfig:  # coop.methods.dept: a head on any host
    enabled: bool = False
    weight: float = key(0.7, "in [0, 1]")
    lr_scale: float = key(6.5, ">= 0")


@dataclass
class EvalConfig:
    targets: list[str] = key([], nonempty_items=True)  # datasets evaluated after training


PARTITIONS = tuple(  # coop.federated.partition, coop.federated.personal_data
    "iid dirichlet pathological domain promptfl pathological_fedotp dirichlet_labeldir dirichlet_labeldir100".split()
)


@dataclass
class FlConfig:  # coop.federated
    method: str = key("promptfl", choices=("promptfl", "latent_domains", "fedotp", "fedpgp"))
    clients: int = key(10, ">= 1")
    rounds: int = key(20, ">= 1")
    local_epochs: int = key(1, ">= 1")
    fraction: float = key(1.0, "in (0, 1]")
    partition: str = key("iid", choices=PARTITIONS)
    iid: bool = False  # fl.partition=promptfl: every client holds every class
    repeat_rate: float = key(
        0.0, "in [0, 1)"
    )  # fl.partition=promptfl: share of the classes common to several clients
    alpha: float = key(0.5, "> 0")
    classes_per_client: int = key(2, ">= 1")
    aggregation: str = key("fedavg", choices=("fedavg", "uniform", "fedprox", "last_client"))
    mu: float = key(0.01, ">= 0")
    domains: int = key(3, ">= 1")
    beta: float = key(0.5, "in [0, 1]")
    ensemble_weight: float = key(0.5, "in [0, 1]")
    on_client_failure: str = key("continue", choices=("continue", "stop"))
    # per round: cosine over the rounds, or constant (FedOTP, FedPGP)
    lr_schedule: str = key("cosine", choices=("cosine", "constant"))


@dataclass
class FedotpConfig:  # fl.method=fedotp (coop.federated.fedotp): entropic OT between patch tokens and the prompts
    eps: float = key(0.1, "> 0")
    gamma: float = key(0.8, "in (0, 1]")
    ot: str = key("cot", choices=("cot", "sinkhorn"))
    max_iter: int = key(100, ">= 1")
    thresh: float = key(1e-3, "> 0")


@dataclass
class FedpgpConfig:  # fl.method=fedpgp (coop.federated.fedpgp): rank of U V, weight and temperature of the pull
    rank: int = key(8, ">= 1")
    mu: float = key(0.5, ">= 0")
    temp: float = key(0.5, "> 0")


def section(cls):
    return field(default_factory=cls)


@dataclass
class RunConfig:
    method: str = key("coop", choices=METHODS)
    model: ModelConfig = section(ModelConfig)
    prompt: PromptConfig = section(PromptConfig)
    vision: VisionConfig = section(VisionConfig)
    data: DataConfig = section(DataConfig)
    train: TrainConfig = section(TrainConfig)
    zeroshot: ZeroshotConfig = section(ZeroshotConfig)
    cocoop: CocoopConfig = section(CocoopConfig)
    kgcoop: KgcoopConfig = section(KgcoopConfig)
    promptsrc: PromptsrcConfig = section(PromptsrcConfig)
    tip: TipConfig = section(TipConfig)
    lora: LoraConfig = section(LoraConfig)
    mmrl: MmrlConfig = section(MmrlConfig)
    tcp: TcpConfig = section(TcpConfig)
    dept: DeptConfig = section(DeptConfig)
    eval: EvalConfig = section(EvalConfig)
    fl: FlConfig = section(FlConfig)
    fedotp: FedotpConfig = section(FedotpConfig)
    fedpgp: FedpgpConfig = section(FedpgpConfig)
    output_dir: str | None = None
    device: str = "auto"


@dataclass(frozen=True)
class Spec:
    """One key's declaration: `kind` bool | int | float | str | list | any, `item` the kind of a
    list's items, and the constraints of `key`."""

    kind: str
    item: str | None = None
    optional: bool = False
    rule: str = ""
    choices: tuple = ()
    length: int | None = None
    distinct: bool = False
    nonempty: bool = False
    nonempty_items: bool = False
    order: str = ""

    def describe(self) -> str:
        """What the key takes, e.g. "an integer >= 1 or null", "a list of 2 numbers in [0, 1)"."""
        if self.kind == "list":
            text = self._list()
        elif self.kind == "any":  # a name or a list (lora.layers)
            text = f"one of {', '.join(self.choices)} or {self._list()}"
        else:
            text = _scalar(self.kind, self.rule, self.choices)
        return f"{text} or null" if self.optional else text

    def _list(self) -> str:
        noun = {"int": "integers", "float": "numbers", "str": "strings", "bool": "booleans"}[self.item]
        if self.choices and self.kind == "list":
            noun = f"values of {', '.join(self.choices)}"
        elif self.item == "str" and self.nonempty_items:
            noun = "non-empty strings"
        rule = f" {self.rule}" if self.rule and self.item in ("int", "float") else ""
        words = [
            "a",
            "non-empty" if self.nonempty else "",
            {"sorted": "non-decreasing", "increasing": "increasing"}.get(self.order, ""),
            "list of",
            str(self.length) if self.length else "",
            "distinct" if self.distinct else "",
            f"{noun}{rule}",
        ]
        return " ".join(w for w in words if w)

    def accepts(self, value) -> bool:
        if value is None:
            return self.optional
        if self.kind == "any" and isinstance(value, str):
            return value in self.choices
        if self.kind in ("list", "any"):
            if not (OmegaConf.is_list(value) or isinstance(value, list | tuple)):
                return False
            items = list(value)
            return (
                all(_holds(self.item, self.rule, self.choices, v, self.nonempty_items) for v in items)
                and (self.length is None or len(items) == self.length)
                and (not self.nonempty or bool(items))
                and (not self.distinct or len(set(items)) == len(items))
                and (self.order != "sorted" or items == sorted(items))
                and (self.order != "increasing" or items == sorted(set(items)))
            )
        return _holds(self.kind, self.rule, self.choices, value)


def _scalar(kind: str, rule: str, choices: tuple) -> str:
    if kind == "bool":
        return "true or false"
    if choices:
        return f"one of {', '.join(choices)}"
    noun = {"int": "an integer", "float": "a number", "str": "a string"}[kind]
    if rule == "finite":
        return "a finite number"
    return f"{noun} {rule}" if rule else noun


def _bounds(rule: str) -> tuple[float, float, bool, bool]:
    """(low, high, low inclusive, high inclusive) of a rule such as "> 0" or "in [0, 1)"."""
    if rule == "finite":
        return -math.inf, math.inf, False, False
    if rule.startswith(">="):
        return float(rule[2:]), math.inf, True, True
    if rule.startswith(">"):
        return float(rule[1:]), math.inf, False, True
    if rule.startswith("in "):
        low, high = rule[4:-1].split(",")
        return float(low), float(high), rule[3] == "[", rule[-1] == "]"
    raise ValueError(f"unknown range {rule!r}")


def _holds(kind: str, rule: str, choices: tuple, value, nonempty: bool = False) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str) and (value in choices if choices else not nonempty or bool(value))
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or (kind == "int" and not isinstance(value, int)):
        return False
    if not rule:
        return True
    low, high, low_in, high_in = _bounds(rule)
    above = value >= low if low_in else value > low  # comparisons with NaN fail
    below = value <= high if high_in else value < high
    return above and below


def _kind(annotation) -> tuple[str, str | None, bool]:
    """(kind, item kind, optional) of a field's annotation."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    if annotation is Any:
        return "any", None, optional
    if typing.get_origin(annotation) is list:
        return "list", typing.get_args(annotation)[0].__name__, optional
    return annotation.__name__, None, optional


def _specs(cls, prefix: str = "") -> dict[str, Spec]:
    out = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        annotation = hints[f.name]
        if is_dataclass(annotation):
            out.update(_specs(annotation, f"{prefix}{f.name}."))
            continue
        kind, item, optional = _kind(annotation)
        meta = dict(f.metadata)
        item = meta.pop("items", item)
        out[f"{prefix}{f.name}"] = Spec(kind, item, optional, **meta)
    return out


SPECS: dict[str, Spec] = _specs(RunConfig)  # dotted key -> declaration
DEFAULTS: dict = OmegaConf.to_container(OmegaConf.structured(RunConfig))  # the schema's defaults as a dict
CHOICES = {
    k: s.choices for k, s in SPECS.items() if s.choices and s.kind == "str"
}  # keys with a set of names


def check_values(cfg: DictConfig) -> str | None:
    """The first key whose value is out of its declared type, set or range, as a one-line message
    ("train.momentum must be a number >= 0, got -5.0"); None when every key is within."""
    for name, spec in SPECS.items():
        value = OmegaConf.select(cfg, name)
        if not spec.accepts(value):
            return f"{name} must be {spec.describe()}, got {shown(value)!r}"
    return None


BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")  # the strings OmegaConf reads as booleans


def check_layer(tree: dict, prefix: str = "") -> str | None:
    """A message for what OmegaConf would misread or fail on in a layer (file, overrides, saved
    config): a boolean key set to a number (OmegaConf reads any non-zero number as true:
    `fl.iid=2`), or a key that takes a value set to a mapping; None when there is none."""
    for name, value in tree.items():
        full = f"{prefix}{name}"
        spec = SPECS.get(full)
        if isinstance(value, dict) and spec is None:
            problem = check_layer(value, f"{full}.")
            if problem:
                return problem
            continue
        word = isinstance(value, str) and (value.lower() in BOOL_WORDS or value.startswith("${"))
        mapping = isinstance(value, dict)
        if spec is not None and (mapping or spec.kind == "bool" and not (isinstance(value, bool) or word)):
            return f"{full} must be {spec.describe()}, got {value!r}"
    return None


def shown(value):
    """A config value as plain Python, for messages."""
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

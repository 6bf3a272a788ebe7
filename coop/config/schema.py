"""The run configuration as a typed schema: one dataclass per section, every key with its type,
default and, where it has one, its allowed set or range.

    cfg = OmegaConf.structured(RunConfig)   # what `coop.config.load.load_config` starts from

OmegaConf types each key from its annotation (bool, int, float, str, `| None`, `list[...]`) and
refuses a value of another type itself (`prompt.csc=maybe`, `data.seed=abc`);
`coop.config.spec.check_values` then checks the ranges and sets declared next to each key
(`key(default, ">= 0")`). Rules that involve several keys live in `coop.config.checks`; keys
bounded by the model's towers in `coop.train.preflight`.

Ranges are written as `"> 0"`, `">= 1"`, `"in [0, 1)"` or `"finite"`; on a list they hold for each
item. `lora.layers` is "all" | "half-up" | "half-bottom" | a list of block indices, and OmegaConf
has no union of a string and a list, so it is typed `Any` and its items' type is declared
(`items="int"`) and checked by `check_values`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf

from coop.config.spec import Spec, key, specs

# see coop.methods
METHODS = tuple(
    "coop cocoop kgcoop zeroshot linear_probe vpt ivlp maple promptsrc tip_adapter tip_adapter_f clip_lora "
    "mmrl tcp hicropl 2sfs coprompt".split()
)


@dataclass
class ModelConfig:
    name: str = "ViT-B-16"  # an OpenCLIP model name or a model-config .json
    pretrained: str | None = "openai"  # an OpenCLIP tag, a weights file, or none
    tokenizer: str | None = None  # a saved Hugging Face tokenizer's directory, instead of the hub's


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
    pool_prompts: bool = False  # an average or attention pool also reads the added tokens (vpt..mmrl)


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
    # sample: CoOp's seeded draw (coop.data.fewshot); jsonl: 2SFS's released split files (coop.data.jsonl_splits)
    fewshot_source: str = key("sample", choices=("sample", "jsonl"))
    descriptions: str | None = None  # class -> sentences JSON (coop.data.descriptions); hicropl, coprompt


@dataclass
class TrainConfig:
    epochs: int | None = key(None, ">= 0")  # null: CoOp's epochs for the shots (epochs_for_shots)
    batch_size: int = key(32, ">= 1")
    lr: float = key(0.002, "> 0")
    optimizer: str = key("sgd", choices=("sgd", "adam", "adamw"))  # coop.train.schedule
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
    # the train transform: coop (random resized crop, flip) | randaugment (Dassl's: CoPrompt's)
    transform: str = key("coop", choices=("coop", "randaugment"))
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
class PromptsrcConfig:  # coop.methods.promptsrc; GPA: coop.methods.gpa
    text_weight: float = key(25.0, ">= 0")
    image_weight: float = key(10.0, ">= 0")
    kl_weight: float = key(1.0, ">= 0")
    templates: str = "promptsrc"
    gpa_mean: float = key(15.0, "finite")  # an epoch
    gpa_std: float = key(1.0, "in (0, inf)")  # epochs


@dataclass
class HicroplConfig:  # coop.methods.hicropl
    cross_layer: int = key(6, ">= 1")  # text -> image in layers 0..L-1, image -> text from L on
    weight: float = key(12.0, ">= 0")  # lambda: the two consistency terms' weight (the original's LAMBD)


@dataclass
class CopromptConfig:  # coop.methods.coprompt; per dataset: coop.config.recipes
    weight: float = key(1.0, ">= 0")  # TRAINER.W: on the sum of the two distillation terms
    distill: str = key("cosine", choices=("cosine", "mse"))  # TRAINER.DISTILL
    image_ratio: float = key(0.1, "in [0, 1]")  # the image adapter's residual share
    text_ratio: float = key(0.2, "in [0, 1]")  # the text adapter's
    reduction: int = key(4, ">= 1")  # the adapters' bottleneck: E // reduction


@dataclass
class TipConfig:  # tip_adapter, tip_adapter_f (coop.methods.tip_adapter); per dataset: coop.config.recipes
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
class LoraConfig:  # coop.model.lora, coop.methods.clip_lora
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
class TwosfsConfig:  # method=2sfs (coop.methods.twosfs); a key may not start with a digit
    peft: str = key("ln", choices=("ln", "lora", "bitfit"))  # stage one: LayerNorms, LoRA (lora.*), biases
    towers: list[str] = key(["text", "vision"], choices=("text", "vision"), distinct=True, nonempty=True)
    stage_one: float = key(0.6, "in (0, 1)")  # alpha: stage one's share of the iterations
    text_start: int = key(0, ">= 0")  # the first text block whose LayerNorms train (0-based)
    vision_start: int = key(0, ">= 0")  # the first image block whose LayerNorms train


@dataclass
class MmrlConfig:  # coop.methods.mmrl; per-dataset reg_weight / rep_dim: coop.config.recipes.DATASET_RECIPES
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


TTA_METHODS = ("tpt", "ctpt", "zero", "tda", "dpe", "boostadapter")  # see coop.tta
VIEW_AUGMENTS = ("tpt", "augmix", "crop_flip")  # see coop.tta.views


@dataclass
class TtaConfig:  # coop.tta: the test-time pass (tools/tta.py)
    method: str = key("zero", choices=TTA_METHODS)
    # per test image: the image itself and views - 1 augmented ones; null: the method's original's
    # number for the dataset (TDA: the image alone on the cross-dataset sets), else 64
    views: int | None = key(64, ">= 1")
    init: str | None = None  # a run folder or an export to start from; null: the hand-written prompt
    # the augmented views: TPT's rule (crop + flip for the ImageNet sets, AugMix for the others),
    # AugMix or crop + flip everywhere; null: the method's own (`TestTimeMethod.augment`)
    augment: str | None = key(None, choices=VIEW_AUGMENTS)
    chunk: int = key(64, ">= 1")  # images per atomically written chunk of outputs (and checkpoint)


@dataclass
class ZeroConfig:  # coop.tta.zero: the fraction of views, most confident first, that vote
    gamma: float = key(0.3, "in (0, 1]")


@dataclass
class TdaConfig:  # tta.method=tda (coop.tta.tda); null: the original's value for data.name (TDA_SETTINGS)
    fraction: float = key(0.1, "in (0, 1]")  # of the views, the most confident kept
    scale: float | None = key(100.0, "> 0")  # TDA's fixed logit scale; null: the model's logit_scale
    pos_enabled: bool = True
    pos_capacity: int = key(3, ">= 1")  # entries per class
    pos_alpha: float | None = key(None, ">= 0")
    pos_beta: float | None = key(None, ">= 0")
    neg_enabled: bool = True
    neg_capacity: int = key(2, ">= 1")
    neg_alpha: float = key(0.117, ">= 0")
    neg_beta: float = key(1.0, ">= 0")
    neg_entropy: list[float] = key([0.2, 0.5], "finite", length=2)  # the gate on entropy / log2(classes)
    neg_mask: list[float] = key([0.03, 1.0], "finite", length=2)  # the probabilities a negative entry marks


@dataclass
class BoostadapterConfig(TdaConfig):  # tta.method=boostadapter (coop.tta.boostadapter): BOOST_SETTINGS
    delta: int | None = key(None, ">= 0")  # the boosting samples' extra entries per class
    image_only: bool | None = None  # the image itself (true) or the confident views' mean as the image


@dataclass
class DpeConfig:  # tta.method=dpe (coop.tta.dpe); null: the original's value for data.name (DPE_SETTINGS)
    fraction: float = key(0.1, "in (0, 1]")
    scale: float | None = key(100.0, "> 0")  # DPE's fixed logit scale; null: the model's logit_scale
    capacity: int = key(3, ">= 1")  # cached features per class
    alpha: float | None = key(None, ">= 0")
    beta: float | None = key(None, ">= 0")
    lr_text: float | None = key(None, ">= 0")  # the textual residual's AdamW step
    lr_image: float | None = key(None, ">= 0")  # the visual residual's
    align: float | None = key(None, ">= 0")  # the InfoNCE weight
    eps: float = key(1e-3, "> 0")  # AdamW
    weight_decay: float = key(0.1, ">= 0")  # AdamW
    update_entropy: float = key(0.1, ">= 0")  # T evolves below this entropy / log2(classes)
    infer_all_views: bool | None = None  # predict from the confident views (ImageNet-A) or the image


def section(cls):
    return field(default_factory=cls)


@dataclass
class TptConfig:  # coop.tta.tpt: TPT's settings (tpt_classification.py's defaults)
    lr: float = key(5e-3, "> 0")  # AdamW, its state reset before every image
    steps: int = key(1, ">= 1")  # AdamW steps per image (--tta_steps)
    selection: float = key(0.1, "in (0, 1]")  # the confident views kept: int(views * selection), >= 1
    weight_decay: float = key(0.01, ">= 0")  # torch's AdamW default, which TPT keeps
    ctx_init: str = "a photo of a"  # a zero-shot host's learnable context (--ctx_init a_photo_of_a)
    grad_checkpointing: bool = False  # recompute the text blocks in each backward: less memory


@dataclass
class CtptConfig:  # coop.tta.tpt.CTPT
    lambda_term: float | None = key(None, ">= 0")  # null: C-TPT's scripts' (20 natural shifts, 50 else)


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
    hicropl: HicroplConfig = section(HicroplConfig)
    coprompt: CopromptConfig = section(CopromptConfig)
    tip: TipConfig = section(TipConfig)
    lora: LoraConfig = section(LoraConfig)
    twosfs: TwosfsConfig = section(TwosfsConfig)
    mmrl: MmrlConfig = section(MmrlConfig)
    tcp: TcpConfig = section(TcpConfig)
    dept: DeptConfig = section(DeptConfig)
    eval: EvalConfig = section(EvalConfig)
    fl: FlConfig = section(FlConfig)
    fedotp: FedotpConfig = section(FedotpConfig)
    fedpgp: FedpgpConfig = section(FedpgpConfig)
    tta: TtaConfig = section(TtaConfig)
    zero: ZeroConfig = section(ZeroConfig)
    tpt: TptConfig = section(TptConfig)
    ctpt: CtptConfig = section(CtptConfig)
    tda: TdaConfig = section(TdaConfig)
    dpe: DpeConfig = section(DpeConfig)
    boostadapter: BoostadapterConfig = section(BoostadapterConfig)
    output_dir: str | None = None
    device: str = "auto"


SPECS: dict[str, Spec] = specs(RunConfig)  # dotted key -> declaration
DEFAULTS: dict = OmegaConf.to_container(OmegaConf.structured(RunConfig))  # the schema's defaults as a dict
CHOICES = {
    k: s.choices for k, s in SPECS.items() if s.choices and s.kind == "str"
}  # keys with a set of names

"""The one interface every method implements, so the runner never branches on the method.

    method = build_method(clip, classnames, cfg)     # cfg.method names the module
    prepared = method.prepare()                      # per-evaluation state, e.g. text features
    logits = method.logits(image_features, prepared) # (B, n_cls)

How a method learns is up to three steps, each optional, which the runner runs in this order:

    fit(train)        a closed-form step on the training features that the method asks for
                      (`fit_request`: how many views, augmented or not), before any SGD step;
                      e.g. Tip-Adapter's cache model
    SGD epochs        `trainer == "sgd"`: learnable tensors trained by the runner's epoch loop
                      through `loss` ("none": no SGD, e.g. zero-shot CLIP)
    tune(train, val)  `tunes_on_val`: hyper-parameters chosen on the val split's features, after
                      SGD or as the whole fit (the linear probe's C, Tip-Adapter's alpha and beta);
                      never on test

What a method consumes is one of two kinds (`Method.input`):

    "features"  image-tower features (B, E): frozen, so the engine may cache them
    "pixels"    image batches (B, 3, H, W): the method runs the (prompted) image tower itself, so
                `logits(images, prepared)` and `loss(images, labels)` take images

A checkpoint stores `method.learnable()` only (plain tensors, `weights_only=True`), and
`load_trained(tensors, classnames)` restores them into a method built for the same classes or,
where the method allows it, for other classes (evaluation on another dataset). The method then
knows whether it scores the classes it was trained on (`on_training_classes`): a head with one
row per training class (DePT) or logits fused for the training classes (MMRL) exist only then.

`towers(x)` returns a batch's logits with the unnormalised text and image features behind them,
and `extra_loss(towers)` a method's terms beyond cross-entropy: a plug-in (DePT) wraps a method
through these two without knowing which one it is.

`check_config(cfg, towers)` refuses, in one line, towers of a kind the method cannot use
(`check_towers`: vision prompts on a CNN, image tokens on CoCa's attention pool) and a key the method
reads that cannot work: one beyond the model's towers (`TowerLayers`: prompt.depth above the text
tower's layers) or an unknown template set. `coop.train.preflight` runs it before a run folder
exists, on the towers of the model's config built on the meta device (`TowerLayers.of_model`);
every method runs it again when it is built, on the built model's.

SGD methods hand their tensors to the optimizer in `param_groups()`, each group with its own
`lr_scale` (and optionally `weight_decay`); `train.optimizer` and `train.schedule` pick the
optimizer and the schedule (`coop.train.schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from coop.config.checks import ConfigError, check_depth
from coop.model.clip import CLIP
from coop.model.errors import ModelError
from coop.model.support import TowerLayers


@dataclass(frozen=True)
class FeatureRequest:
    """The training features a method's `fit` (and `tune`) takes: ((views, N, E), labels).

    Args:
        views: passes over the few-shot train split.
        augment: each pass through the train transform (`train.crop_scale`, flip), seeded per
            image and pass; False: the test transform (then views is 1).
    """

    views: int = 1
    augment: bool = False


@dataclass
class Towers:
    """What a method's logits are made of (`Method.towers`), for plug-ins that add a head on the
    towers' outputs (DePT).

    Attributes:
        logits: (B, n_cls) the method's logits.
        text: unnormalised class text features, (n_cls, E), or (B, n_cls, E) when they depend on
            the image (CoCoOp).
        image: (B, E) unnormalised image features (the cached ones, or the prompted tower's).
    """

    logits: torch.Tensor
    text: torch.Tensor
    image: torch.Tensor


class TransferError(ValueError):
    """Learned tensors cannot be used for the requested classes (e.g. class-specific context)."""


class Method(nn.Module):
    """Base class: a frozen CLIP plus whatever the method learns.

    Args:
        clip: a `coop.CLIP`; it stays frozen and in eval mode.
        classnames: the classes to score, `classnames[label]`.
        cfg: the run config (each method reads its own keys).
    """

    name = "method"
    trainer = "none"
    input = "features"
    tunes_on_val = False  # whether the runner calls `tune` with the val split's features
    fit_request: FeatureRequest | None = None  # the training features `fit` and `tune` take
    phrase_max_ctx: int | None = None  # `PromptLearner`'s ctx_init rule (IVLP, MaPLe: 4)
    image_tokens = False  # True: "features" are every projected token (B, n_prefix+P, E) (FedOTP)
    adds_image_tokens = False  # True: puts tokens into the image tower (`vision.pool_prompts` applies)
    text_prompt = False  # True: a learned text context, `prompt.*` (`coop.model.prompt.PromptLearner`)
    token_features = False  # True: reads image tokens after the final norm (`ImageTower.final_tokens`)
    inserts_text_tokens = False  # True: inserts tokens at the text tower's layers (MMRL's)
    scores_with_descriptions = False  # True: every class scored needs data.descriptions (HiCroPL)
    # a pixel method's augmented views of each training image: `loss` then takes (B, V, 3, H, W),
    # V independent draws of the train transform (Dassl's K_TRANSFORMS; CoPrompt's second view)
    train_views = 1
    config_key = "method"  # the key that selects it ("fl.method" for the federated methods)

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__()
        type(self).check_config(cfg, TowerLayers.of(clip))
        self.clip = clip.requires_grad_(False).eval()
        self.classnames = list(classnames)
        self.trained_classnames = list(classnames)  # replaced by `load_trained`

    @classmethod
    def image_tower_use(cls, cfg: DictConfig) -> str | None:
        """What this method does to the image tower with `cfg` that needs one of our `ImageTower`s
        (a phrase: "prompts the image tower"), or None: it reads the pooled features only."""
        return None

    @classmethod
    def check_towers(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """A one-line ModelError naming the method and the model when the method cannot run on these
        kinds of tower whatever its sizes: an image tower that is not an `ImageTower` for a method
        that uses one (`image_tower_use`), one whose tokens have no features of their own for a
        method that reads them (`token_features`). The first part of `check_config`; docs/models.md
        lists its verdicts per method and model."""
        use = cls.image_tower_use(cfg)
        method = f"{cls.config_key}={cls.name}"
        if use is not None and towers.image_refusal is not None:
            raise ModelError(f"{method} {use}, and {towers.image_refusal}")
        if cls.token_features and towers.token_refusal is not None:
            raise ModelError(
                f"{method} reads features of the image tower's tokens, and {towers.token_refusal}"
            )
        if cls.inserts_text_tokens and towers.text_refusal is not None:
            raise ModelError(f"{method} inserts tokens at the text tower's layers, and {towers.text_refusal}")

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """A one-line ModelError for towers this method cannot use (`check_towers`), and a one-line
        ConfigError for a key this method reads that cannot work with `towers` (or at all);
        subclasses add their own keys. Here: `prompt.depth` within the text tower, and
        `vision.pool_prompts` only for a method that adds tokens to the image tower."""
        cls.check_towers(cfg, towers)
        if cls.text_prompt:
            check_depth("prompt.depth", int(cfg.prompt.depth), towers.text, "text")
        if OmegaConf.select(cfg, "vision.pool_prompts", default=False) and not cls.adds_image_tokens:
            raise ConfigError(
                f"vision.pool_prompts=true lets the image tower's pool read the tokens that vpt, ivlp, maple, "
                f"promptsrc and mmrl add to it; method={cls.name} adds none"
            )

    @classmethod
    def own_classes_only(cls, cfg: DictConfig) -> str | None:
        """Why what this method learns with `cfg` scores only the classes it was trained on (so a
        base-to-new run cannot evaluate its new classes), or None. Here: class-specific context."""
        if cls.text_prompt and cfg.prompt.csc:
            return "prompt.csc=true learns context for the base classes only"
        return None

    @property
    def n_cls(self) -> int:
        return len(self.classnames)

    @property
    def trained_class_index(self) -> torch.Tensor | None:
        """For each class scored, its index among the classes the method was trained on, or None
        if some class scored is not one of them (base-to-new's new classes, another dataset).

        The training classes in another order or a subset of them (ImageNet-A's and -R's 200 of
        ImageNet's 1,000) map to their rows; a training dataset's own list maps to arange(C).
        """
        where = {name: i for i, name in enumerate(self.trained_classnames)}
        if any(name not in where for name in self.classnames):
            return None
        return torch.tensor([where[name] for name in self.classnames], dtype=torch.long)

    @property
    def on_training_classes(self) -> bool:
        """Whether every class scored is one the method was trained on (`trained_class_index`)."""
        return self.trained_class_index is not None

    def learnable(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint stores, by name (parameters train with SGD, buffers are fitted)."""
        return {}

    def param_groups(self) -> list[dict]:
        """The trained tensors as optimizer parameter groups: dicts with "params" and optionally
        "lr_scale" (times the schedule's rate) and "weight_decay". By default one group holds
        every learnable tensor that requires grad."""
        return [{"params": [p for p in self.learnable().values() if p.requires_grad]}]

    def load_trained(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """Restore tensors learned for `classnames` (a checkpoint's classes) into this method,
        which may score other classes; remembers the training classes (`on_training_classes`)
        before `load_learnable` runs, so that it can consult them."""
        self.trained_classnames = list(classnames)
        self.load_learnable(tensors, classnames)

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """Copy saved tensors (learned for `classnames`) into this method's own classes."""
        own = self.learnable()
        if set(tensors) != set(own):
            raise TransferError(
                f"{self.name} expects tensors {sorted(own)}, the checkpoint has {sorted(tensors)}"
            )
        with torch.no_grad():
            for key, t in tensors.items():
                if own[key].shape != t.shape:
                    raise TransferError(
                        f"{self.name}: saved {key} has shape {tuple(t.shape)}, expected {tuple(own[key].shape)}"
                    )
                own[key].copy_(t)

    def prepare(self):
        """State computed once per evaluation and passed to `logits` (default: nothing)."""
        return None

    def logits(self, image_features: torch.Tensor, prepared=None) -> torch.Tensor:
        """Logits (B, n_cls) from image-tower features (B, E)."""
        raise NotImplementedError

    def loss(self, image_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits) of one training batch; cross-entropy on fp32 logits by default."""
        logits = self.logits(image_features)
        return F.cross_entropy(logits.float(), labels), logits

    def towers(self, x: torch.Tensor, prepared=None) -> Towers:
        """The logits of a batch with the text and image features they come from; `prepared` as
        for `logits`. Methods that a plug-in (DePT) can wrap implement it."""
        raise NotImplementedError(f"method={self.name} does not expose its text and image features")

    def extra_loss(self, towers: Towers) -> torch.Tensor | float:
        """The loss terms a method adds to cross-entropy, from its `towers` (KgCoOp's regulariser);
        a plug-in that replaces the cross-entropy keeps them. By default none."""
        return 0.0

    def fit(self, train: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """A closed-form step on the training features of `fit_request` ((V, N, E), labels), run
        before the optimizer is built (also when a run resumes: the checkpoint's tensors then
        replace what it set); returns extra metrics. By default nothing."""
        return {}

    def tune(
        self, train: tuple[torch.Tensor, torch.Tensor] | None, val: tuple[torch.Tensor, torch.Tensor]
    ) -> dict:
        """Choose hyper-parameters on the val split's features (N, E) and labels (`tunes_on_val`),
        after SGD training; `train` is what `fit` got (None without `fit_request`). Returns the
        choice for metrics.json (`describe` should report it too)."""
        raise NotImplementedError

    def to_half(self) -> None:
        """`train.precision=fp16` (CoOp's PREC=fp16): CLIP and, by default, every tensor of the method
        in half precision; a method whose original keeps some tensors in fp32 overrides this."""
        self.half()

    def describe(self) -> dict:
        """Method-specific fields for metrics.json (e.g. n_ctx, position; the chosen C)."""
        return {}

    def restart_step(self, total: int) -> int:
        """The step of a run of `total` optimizer steps at which a per-iteration cosine restarts
        (`coop.train.schedule.Schedule.restart`), called before training starts or resumes; 0:
        never. 2SFS starts its second stage there."""
        return 0

    def start_step(self, epoch: int, step: int) -> None:
        """Called by the runner before training step `step` (0-based) of epoch `epoch` (0-based): a
        method that draws randomness per step seeds it from (seed, epoch, step) here (CoPrompt's
        sampled description), so that a resumed run replays it; by default nothing."""

    def end_epoch(self, epoch: int, epochs: int) -> None:
        """Called by the runner after SGD epoch `epoch` (1-based) of `epochs`, before its checkpoint
        (e.g. PromptSRC's prompt aggregation); by default nothing."""

    def training_state(self) -> dict:
        """Extra state a resumable checkpoint keeps (`weights_only`-safe: tensors, numbers, dicts),
        e.g. a running aggregate; restored by `load_training_state`. By default none."""
        return {}

    def load_training_state(self, state: dict) -> None:
        """Restore what `training_state` returned (an empty dict for checkpoints without it)."""

    def train(self, mode: bool = True) -> Method:
        super().train(mode)
        self.clip.eval()  # CLIP is frozen: no dropout, fixed normalisation statistics
        return self

"""The one interface every method implements, so the runner never branches on the method.

    method = build_method(clip, classnames, cfg)     # cfg.method names the module
    prepared = method.prepare()                      # per-evaluation state, e.g. text features
    logits = method.logits(image_features, prepared) # (B, n_cls)

How a method learns is one of three kinds (`Method.trainer`):

    "sgd"   learnable tensors trained by the runner's epoch loop through `loss`
    "fit"   a closed-form fit on cached features (`fit`), e.g. the linear probe
    "none"  nothing to learn (zero-shot CLIP)

What a method consumes is one of two kinds (`Method.input`):

    "features"  image-tower features (B, E): frozen, so the engine may cache them
    "pixels"    image batches (B, 3, H, W): the method runs the (prompted) image tower itself, so
                `logits(images, prepared)` and `loss(images, labels)` take images

A checkpoint stores `method.learnable()` only (plain tensors, `weights_only=True`), and
`load_learnable(tensors, classnames)` restores them into a method built for the same classes or,
where the method allows it, for other classes (evaluation on another dataset).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.model import CLIP


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
    phrase_max_ctx: int | None = None  # `PromptLearner`'s ctx_init rule (IVLP, MaPLe: 4)
    image_tokens = False  # True: "features" are every projected token (B, 1+P, E) (FedOTP)

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__()
        self.clip = clip.requires_grad_(False).eval()
        self.classnames = list(classnames)

    @property
    def n_cls(self) -> int:
        return len(self.classnames)

    def learnable(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint stores, by name (parameters train with SGD, buffers are fitted)."""
        return {}

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

    def fit(self, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """Closed-form fit on (features, labels) pairs; returns extra metrics (trainer == "fit")."""
        raise NotImplementedError

    def to_half(self) -> None:
        """`train.precision=fp16` (CoOp's PREC=fp16): CLIP and, by default, every tensor of the method
        in half precision; a method whose original keeps some tensors in fp32 overrides this."""
        self.half()

    def describe(self) -> dict:
        """Method-specific fields for metrics.json (e.g. n_ctx, position; the chosen C)."""
        return {}

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

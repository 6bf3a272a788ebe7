"""DePT as a plug-in: a channel-adjusted head beside any host method (Zhang et al., CVPR 2024; the
DePT repository's `trainers/elp_{coop,cocoop,kgcoop,maple}.py`), `dept.enabled=true`.

The host (CoOp, CoCoOp, KgCoOp, MaPLe) is kept as it is; DePT adds, on the host's **unnormalised**
tower outputs (`Method.towers`):

    FiLM_t(f) = s_t * f + b_t,  FiLM_i(f) = s_i * f + b_i      s = ones(E), b = zeros(E)
    head      = Linear(E, C_train) with bias, default init    one row per training class

    train:  sim = the host's logits
            loss = (1 - w) CE(sim, y) + w CE(head(cat(FiLM_t(text[y]), FiLM_i(img))), cat(y, y))
                   + the host's own terms (KgCoOp's regulariser, at DePT's W = 2.0)
    test, on the training classes:  (1 - w) sim + w head(FiLM_i(img))
    test, on other classes:         sim (the head is dropped, with a log line)

with w = `dept.weight` (0.7). The batch's own text features (text[y]: the class feature of each
image's label, per image for CoCoOp) are extra training points of the head. The FiLM modules and
the head train at `dept.lr_scale` (6.5) times the host's rate (`Method.param_groups`).

"The training classes" are decided by the class names (`Method.on_training_classes`), not, as
in the original, by the dataset's name containing "ImageNet": base classes, the training dataset
itself, ImageNet-V2/-Sketch, and ImageNet-A/-R with the head's rows of their 200 classes.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.config.checks import ConfigError
from coop.methods.base import Method, Towers, TransferError

log = logging.getLogger(__name__)
PREFIX = "dept."  # checkpoint names of DePT's own tensors


class FiLM(nn.Module):
    """Channel-wise scale and shift, `scale * x + bias`, kept in fp32 and cast to x's dtype."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale.to(x.dtype) * x + self.bias.to(x.dtype)


class DePT(Method):
    """A host method plus DePT's FiLM modules and linear head; the runner sees one method.

    Args:
        host: the method DePT wraps (built for the same classes); it must implement `towers`.
        cfg: reads `dept.weight` and `dept.lr_scale`.
    """

    trainer = "sgd"

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__(host.clip, host.classnames, cfg)
        if host.trainer != "sgd":
            raise ConfigError(f"dept.enabled=true needs a method trained by SGD, not method={host.name}")
        self.host = host
        self.name = f"{host.name}+dept"
        self.input = host.input
        self.weight = float(cfg.dept.weight)
        self.lr_scale = float(cfg.dept.lr_scale)
        dim, device = host.clip.embed_dim, host.clip.logit_scale.device
        self.film_image = FiLM(dim).to(device)
        self.film_text = FiLM(dim).to(device)
        self.head = nn.Linear(dim, host.n_cls).to(device)
        self.use_head = True  # False once restored for classes other than the training classes

    def own(self) -> dict[str, torch.Tensor]:
        """DePT's own tensors by checkpoint name."""
        modules = {"film_image": self.film_image, "film_text": self.film_text, "head": self.head}
        return {f"{PREFIX}{m}.{k}": t for m, module in modules.items() for k, t in module.named_parameters()}

    def learnable(self) -> dict[str, torch.Tensor]:
        return {**self.host.learnable(), **self.own()}

    def param_groups(self) -> list[dict]:
        return [*self.host.param_groups(), {"params": list(self.own().values()), "lr_scale": self.lr_scale}]

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        """The host's tensors go to the host; the head keeps the rows of the evaluated classes, or is
        dropped when some evaluated class is not a training class."""
        own = self.own()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise TransferError(f"{self.name} expects tensors {missing} in the checkpoint (a DePT run's)")
        self.host.load_trained({k: t for k, t in tensors.items() if k not in own}, classnames)
        index = self.trained_class_index
        with torch.no_grad():
            for key, t in own.items():
                saved = tensors[key]
                if key.startswith(f"{PREFIX}head."):
                    if index is None:
                        continue
                    saved = saved[index.to(saved.device)]  # rows of the evaluated classes
                if saved.shape != t.shape:
                    raise TransferError(
                        f"{self.name}: saved {key} has shape {tuple(saved.shape)}, expected {tuple(t.shape)}"
                    )
                t.copy_(saved)
        self.use_head = index is not None
        if not self.use_head:
            log.info(
                "dept: the %d classes evaluated are not all among the %d training classes: the head (one row "
                "per training class) is dropped and the logits are %s's",
                self.n_cls,
                len(classnames),
                self.host.name,
            )

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:
        """head(features) (N, C) in fp32; in the head's own dtype (half under fp16, as DePT's)."""
        with torch.autocast(features.device.type, enabled=False):
            return self.head(features.to(self.head.weight.dtype)).float()

    def prepare(self):
        return self.host.prepare()

    def towers(self, x: torch.Tensor, prepared=None) -> Towers:
        return self.host.towers(x, prepared)

    def logits(self, x: torch.Tensor, prepared=None) -> torch.Tensor:
        t = self.host.towers(x, prepared)
        if not self.use_head:
            return t.logits
        return (1 - self.weight) * t.logits.float() + self.weight * self.head_logits(self.film_image(t.image))

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.host.towers(x)
        rows = torch.arange(len(labels), device=labels.device)
        text = t.text[labels] if t.text.dim() == 2 else t.text[rows, labels]  # (B, E): each label's class
        points = torch.cat([self.film_text(text), self.film_image(t.image).to(text.dtype)])  # (2B, E)
        head = self.head_logits(points)  # (2B, C)
        sim_loss = F.cross_entropy(t.logits.float(), labels)
        head_loss = F.cross_entropy(head, torch.cat([labels, labels]))
        loss = (1 - self.weight) * sim_loss + self.weight * head_loss + self.host.extra_loss(t)
        fused = (1 - self.weight) * t.logits.float() + self.weight * head[len(labels) :]
        return loss, fused.detach()

    def to_half(self) -> None:
        """The originals' fp16: the host's own fp16 rule; the head is half (`.type(dtype)`), FiLM fp32."""
        self.host.to_half()
        self.head.half()

    def describe(self) -> dict:
        return {**self.host.describe(), "dept": True, "dept_weight": self.weight, "dept_head": self.use_head}

    def end_epoch(self, epoch: int, epochs: int) -> None:
        self.host.end_epoch(epoch, epochs)

    def training_state(self) -> dict:
        return self.host.training_state()

    def load_training_state(self, state: dict) -> None:
        self.host.load_training_state(state)

"""PromptSRC: IVLP prompts trained with self-regulating constraints and Gaussian prompt aggregation.

As in PromptSRC (Khattak et al., ICCV 2023; `trainers/promptsrc.py` of muzairkhattak/PromptSRC), one
training step computes, for a batch of augmented images with labels y:

    loss = CE(logits, y)
         + text_weight  * L1(t, t0)                      (25)
         + image_weight * L1(v, v0)                      (10)
         + kl_weight    * KL(zs_logits || logits)        (1)

    t          (n_cls, E) L2-normalised text features under the learned prompts
    t0         (n_cls, E) the frozen CLIP's text features of every class, averaged over
               PromptSRC's templates BEFORE normalisation, then normalised; fp32 (also under
               `train.precision=fp16`, as the official `.float()` teacher CLIP), once per run
    v, v0      (B, E) L2-normalised image features under the vision prompts / of the frozen tower
               on the same augmented images
    logits     logit_scale * v @ t.T;  zs_logits = logit_scale * v0 @ t0.T
    L1         F.l1_loss(..., reduction="mean")
    KL         kl_div(log_softmax(logits), log_softmax(zs_logits), reduction="sum",
               log_target=True) / logits.numel()

`promptsrc.templates` names the template set: "promptsrc" (the 60 templates the official
repository ships, `PROMPTSRC_TEMPLATES`), or as `zeroshot.templates` does: "ensemble" (CLIP's 80),
"coop" (CoOp's template for the dataset) or a literal "...{}...".

Prompts are IVLP's (`coop.methods.ivlp`): recipe 4 text + 4 vision tokens, depth 9 + 9, context
from "a photo of a", SGD lr 0.0025, batch 4, 20 epochs. After every epoch the learned tensors go
into a Gaussian-weighted running sum (`coop.methods.gpa`, `promptsrc.gpa_mean` / `promptsrc.gpa_std`),
kept in the checkpoint (`training_state`); after the last epoch the sum replaces them, so the
final checkpoint holds, and evaluation uses, the aggregate.

v0 comes from the frozen image tower on the very batch the prompted tower sees, at every step:
pixel methods train without cached views (`train.aug_views=0`), so no cached feature is ever the
same augmented image (the log says so once per run).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.config.checks import ConfigError, resolved_epochs
from coop.methods.base import TowerLayers
from coop.methods.gpa import GaussianAggregate, gpa_weights
from coop.methods.ivlp import IVLP
from coop.methods.zeroshot import resolve_templates
from coop.model.clip import CLIP

log = logging.getLogger(__name__)

TEXT_WEIGHT, IMAGE_WEIGHT, KL_WEIGHT = 25.0, 10.0, 1.0

# The official repository's `trainers/imagenet_templates.py` IMAGENET_TEMPLATES, in its order: 60
# of CLIP's 80 ImageNet templates.
PROMPTSRC_TEMPLATES = (
    "a photo of a {}.",
    "a bad photo of a {}.",
    "a photo of many {}.",
    "a sculpture of a {}.",
    "a photo of the hard to see {}.",
    "a low resolution photo of the {}.",
    "a rendering of a {}.",
    "graffiti of a {}.",
    "a bad photo of the {}.",
    "a cropped photo of the {}.",
    "a tattoo of a {}.",
    "the embroidered {}.",
    "a photo of a hard to see {}.",
    "a bright photo of a {}.",
    "a photo of a clean {}.",
    "a photo of a dirty {}.",
    "a dark photo of the {}.",
    "a drawing of a {}.",
    "a photo of my {}.",
    "the plastic {}.",
    "a photo of the cool {}.",
    "a close-up photo of a {}.",
    "a black and white photo of the {}.",
    "a painting of the {}.",
    "a painting of a {}.",
    "a pixelated photo of the {}.",
    "a sculpture of the {}.",
    "a bright photo of the {}.",
    "a cropped photo of a {}.",
    "a plastic {}.",
    "a photo of the dirty {}.",
    "a jpeg corrupted photo of a {}.",
    "a blurry photo of the {}.",
    "a photo of the {}.",
    "a good photo of the {}.",
    "a rendering of the {}.",
    "a {} in a video game.",
    "a photo of one {}.",
    "a doodle of a {}.",
    "a close-up photo of the {}.",
    "the origami {}.",
    "the {} in a video game.",
    "a sketch of a {}.",
    "a doodle of the {}.",
    "a origami {}.",
    "a low resolution photo of a {}.",
    "the toy {}.",
    "a rendition of the {}.",
    "a photo of the clean {}.",
    "a photo of a large {}.",
    "a rendition of a {}.",
    "a photo of a nice {}.",
    "a photo of a weird {}.",
    "a blurry photo of a {}.",
    "a cartoon {}.",
    "art of a {}.",
    "a sketch of the {}.",
    "a embroidered {}.",
    "a pixelated photo of a {}.",
    "itap of the {}.",
)


def resolve_promptsrc_templates(choice: str, dataset: str) -> list[str]:
    """The templates of `promptsrc.templates=choice`: "promptsrc" or any `zeroshot.templates` value.

    Args:
        choice: "promptsrc", "ensemble", "coop" or a literal template containing "{}".
        dataset: `data.name` (picks CoOp's template for "coop").
    """
    if choice == "promptsrc":
        return list(PROMPTSRC_TEMPLATES)
    try:
        return resolve_templates(choice, dataset)
    except ConfigError:
        raise ConfigError(
            f"promptsrc.templates={choice!r} is not 'promptsrc', 'ensemble', 'coop' or a template "
            "containing '{}'"
        ) from None


@torch.no_grad()
def frozen_text_features(
    clip: CLIP, classnames: list[str], templates: list[str], *, own_precision: bool = False
) -> torch.Tensor:
    """t0 (n_cls, E): the mean of the frozen, UNnormalised text features over `templates`, then
    L2-normalised, with autocast off; returned in fp32.

    Args:
        clip: the frozen CLIP.
        classnames: the classes; "_" reads as a space.
        templates: strings with one "{}" for the class name.
        own_precision: False (PromptSRC): computed in fp32, on an fp32 copy of a half text tower,
            as PromptSRC's `.float()` teacher CLIP under every PREC. True (MMRL): encoded, averaged
            and normalised in the tower's own dtype, as MMRL's zero-shot CLIP, which stays half
            under PREC=fp16; then cast to fp32 (exactly).
    """
    names = [c.replace("_", " ") for c in classnames]
    device = clip.logit_scale.device
    text = clip.text
    if not own_precision and text.token_embedding.weight.dtype != torch.float32:
        text = copy.deepcopy(text).float()
    total = 0
    with torch.autocast(device.type, enabled=False):
        for template in templates:
            ids = clip.tokenize([template.replace("{}", c) for c in names]).to(device)  # (n_cls, 77)
            total = total + text(ids)  # (n_cls, E), the tower's dtype
        return F.normalize(total / len(templates), dim=-1).float()


def zero_shot_logits(v0: torch.Tensor, t0: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """logit_scale.exp() * v0 @ t0.T (B, n_cls) in fp32, from normalised frozen features."""
    with torch.autocast(v0.device.type, enabled=False):
        return logit_scale.float().exp() * v0.float() @ t0.float().t()


def kl_to_zero_shot(logits: torch.Tensor, zs_logits: torch.Tensor) -> torch.Tensor:
    """PromptSRC's logit term: KL(softmax(zs_logits) || softmax(logits)) summed, / logits.numel()."""
    return (
        F.kl_div(
            F.log_softmax(logits, dim=1),
            F.log_softmax(zs_logits, dim=1),
            reduction="sum",
            log_target=True,
        )
        / logits.numel()
    )


def promptsrc_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    t: torch.Tensor,
    t0: torch.Tensor,
    v: torch.Tensor,
    v0: torch.Tensor,
    zs_logits: torch.Tensor,
    *,
    text_weight: float = TEXT_WEIGHT,
    image_weight: float = IMAGE_WEIGHT,
    kl_weight: float = KL_WEIGHT,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PromptSRC's training loss and its unweighted terms {"ce", "text", "image", "kl"}, in fp32.

    Args:
        logits, labels: the prompted logits (B, n_cls) and the labels (B,).
        t, t0: normalised learned and frozen text features (n_cls, E).
        v, v0: normalised prompted and frozen image features of the same images (B, E).
        zs_logits: the frozen model's logits (B, n_cls), `zero_shot_logits(v0, t0, ...)`.
        text_weight, image_weight, kl_weight: the weights of the three regularisers.
    """
    with torch.autocast(logits.device.type, enabled=False):
        logits = logits.float()
        terms = {
            "ce": F.cross_entropy(logits, labels),
            "text": F.l1_loss(t.float(), t0.float(), reduction="mean"),
            "image": F.l1_loss(v.float(), v0.float(), reduction="mean"),
            "kl": kl_to_zero_shot(logits, zs_logits.float()),
        }
        # the official sum: CE + (KL + text + image)
        scl = kl_weight * terms["kl"] + text_weight * terms["text"] + image_weight * terms["image"]
        return terms["ce"] + scl, terms


class PromptSRC(IVLP):
    """IVLP prompts trained on CE + self-regulating L1/KL terms, aggregated over epochs by GPA.

    Args:
        clip, classnames: as for every method.
        cfg: reads IVLP's keys (`prompt.*`, `vision.*`), `promptsrc.*`, `data.name` (for
            `promptsrc.templates=coop`) and the epochs (`train.epochs`, for the GPA weights).
    """

    name = "promptsrc"

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        resolve_promptsrc_templates(str(cfg.promptsrc.templates), cfg.data.name)  # a known name or a template

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        p = cfg.promptsrc
        self.weights = {
            "text_weight": float(p.text_weight),
            "image_weight": float(p.image_weight),
            "kl_weight": float(p.kl_weight),
        }
        self.template_choice = str(p.templates)
        self.templates = resolve_promptsrc_templates(self.template_choice, cfg.data.name)
        self.gpa_mean, self.gpa_std = float(p.gpa_mean), float(p.gpa_std)
        self.gpa = GaussianAggregate(gpa_weights(resolved_epochs(cfg), self.gpa_mean, self.gpa_std))
        self._t0: torch.Tensor | None = None  # (n_cls, E), once per run, never checkpointed
        self.last_terms: dict[str, torch.Tensor] = {}  # unweighted terms of the last step

    def frozen_text(self) -> torch.Tensor:
        """t0 (n_cls, E), normalised fp32, computed on first use."""
        if self._t0 is None:
            self._t0 = frozen_text_features(self.clip, self.classnames, self.templates)
            log.info(
                "PromptSRC: t0 from %d templates (%s); v0 from the frozen image tower on every "
                "step's augmented batch (no cached view is the same augmented image)",
                len(self.templates),
                self.template_choice,
            )
        return self._t0

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.text_features()  # (n_cls, E), unnormalised
        image = self.image_features(images)  # (B, E), prompted
        logits = self.cosine(image, text)  # (B, n_cls), fp32
        t0 = self.frozen_text()
        with torch.autocast(images.device.type, enabled=False):
            v0 = F.normalize(self.frozen_image_features(images).float(), dim=-1)  # (B, E)
            t, v = F.normalize(text.float(), dim=-1), F.normalize(image.float(), dim=-1)
        zs_logits = zero_shot_logits(v0, t0, self.clip.logit_scale)
        total, terms = promptsrc_loss(logits, labels, t, t0, v, v0, zs_logits, **self.weights)
        self.last_terms = {k: x.detach() for k, x in terms.items()}
        return total, logits

    def end_epoch(self, epoch: int, epochs: int) -> None:
        """GPA: add this epoch's weighted tensors; after the last epoch the aggregate replaces them."""
        if epochs != self.gpa.epochs:
            raise ValueError(
                f"PromptSRC's GPA weights are for {self.gpa.epochs} epochs, the run has {epochs}"
            )
        tensors = self.learnable()
        self.gpa.add(epoch, tensors)
        if self.gpa.complete:
            with torch.no_grad():
                for name, t in tensors.items():
                    t.copy_(self.gpa.sum[name])
            log.info("PromptSRC: the GPA aggregate of epochs 1..%d replaces the learned prompts", epochs)

    def training_state(self) -> dict:
        return {"gpa": self.gpa.state_dict()}

    def load_training_state(self, state: dict) -> None:
        if "gpa" in state:
            self.gpa.load_state_dict(state["gpa"], self.device)

    def describe(self) -> dict:
        return {
            **super().describe(),
            **{f"promptsrc_{k}": v for k, v in self.weights.items()},
            "promptsrc_templates": self.template_choice,
            "gpa_mean": self.gpa_mean,
            "gpa_std": self.gpa_std,
        }

"""Zero-shot CLIP with hand-crafted prompts: the frozen model, nothing learned.

`zeroshot.templates` chooses the prompts:

    coop           CoOp's template for the dataset ("{} texture." for DTD, ...), "a photo of a {}." else
    kgcoop         KgCoOp's templates: CoOp's, but "a photo of a {}, a type of texture." for DTD
    coop_ensemble  CoOp's own ensemble baseline (ZeroshotCLIP2 in its trainers/zsclip.py): the 7
                   IMAGENET_TEMPLATES_SELECT templates plus the dataset's CoOp template (not added
                   for ImageNet, where it is "a photo of a {}.")
    ensemble       CLIP's 80 ImageNet templates
    "...{}..."     any literal template containing "{}"

Several templates: each one's class features L2-normalised, averaged, renormalised.
"""

from __future__ import annotations

import open_clip
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.config.checks import ConfigError
from coop.methods.base import Method, TowerLayers
from coop.model.clip import CLIP, cosine_logits

DEFAULT_TEMPLATE = "a photo of a {}."

# CoOp's hand-crafted prompt per dataset (its zero-shot baseline), by our dataset names.
COOP_TEMPLATES = {
    "oxford_pets": "a photo of a {}, a type of pet.",
    "oxford_flowers": "a photo of a {}, a type of flower.",
    "fgvc_aircraft": "a photo of a {}, a type of aircraft.",
    "dtd": "{} texture.",
    "eurosat": "a centered satellite photo of {}.",
    "stanford_cars": "a photo of a {}.",
    "food101": "a photo of {}, a type of food.",
    "sun397": "a photo of a {}.",
    "caltech101": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
    "imagenet": "a photo of a {}.",
    "imagenet_sketch": "a photo of a {}.",
    "imagenetv2": "a photo of a {}.",
    "imagenet_a": "a photo of a {}.",
    "imagenet_r": "a photo of a {}.",
}

# KgCoOp's CUSTOM_TEMPLATES (trainers/kgcoop.py): CoOp's, except for DTD.
KGCOOP_TEMPLATES = {**COOP_TEMPLATES, "dtd": "a photo of a {}, a type of texture."}

# CoOp's IMAGENET_TEMPLATES_SELECT (trainers/imagenet_templates.py), in its order.
IMAGENET_TEMPLATES_SELECT = (
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
)

NAMED_TEMPLATES = ("coop", "kgcoop", "coop_ensemble", "ensemble")


def resolve_templates(choice: str, dataset: str, key: str = "zeroshot.templates") -> list[str]:
    """The template strings for `zeroshot.templates=choice` (or `kgcoop.templates`) on `dataset`.

    Args:
        choice: one of `NAMED_TEMPLATES` or a literal template containing "{}".
        dataset: the dataset name (`data.name`), which picks the dataset's own template.
        key: the config key, for the error message.
    """
    if choice == "coop":
        return [COOP_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)]
    if choice == "kgcoop":
        return [KGCOOP_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)]
    if choice == "coop_ensemble":
        own = [] if dataset == "imagenet" else [COOP_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)]
        return [*IMAGENET_TEMPLATES_SELECT, *own]
    if choice == "ensemble":
        return [t("{}") for t in open_clip.OPENAI_IMAGENET_TEMPLATES]
    if "{}" not in str(choice):
        names = ", ".join(repr(n) for n in NAMED_TEMPLATES)
        raise ConfigError(f"{key}={choice!r} is not one of {names} or a template containing '{{}}'")
    return [str(choice)]


@torch.no_grad()
def template_features(clip: CLIP, classnames: list[str], templates: list[str]) -> torch.Tensor:
    """Normalised class features (n_cls, E): per template normalised, averaged, renormalised."""
    names = [c.replace("_", " ") for c in classnames]
    total = 0
    for template in templates:
        ids = clip.tokenize([template.format(c) for c in names]).to(clip.logit_scale.device)
        total = total + F.normalize(clip.encode_text(ids).float(), dim=-1)
    return F.normalize(total / len(templates), dim=-1)


class ZeroShot(Method):
    """Frozen CLIP scored against templated class names; `learnable()` is empty."""

    name = "zeroshot"
    trainer = "none"

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        resolve_templates(str(cfg.zeroshot.templates), cfg.data.name)  # a known name or a template

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.template_choice = str(cfg.zeroshot.templates)
        self.templates = resolve_templates(self.template_choice, cfg.data.name)

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        pass  # nothing learned: any class list works

    def prepare(self) -> torch.Tensor:
        return template_features(self.clip, self.classnames, self.templates)

    def logits(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> torch.Tensor:
        text = self.prepare() if prepared is None else prepared
        return cosine_logits(image_features, text, self.clip.logit_scale)

    def describe(self) -> dict:
        shown = self.templates[0] if len(self.templates) == 1 else f"{len(self.templates)} templates"
        return {"templates": self.template_choice, "template": shown}

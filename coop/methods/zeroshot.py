"""Zero-shot CLIP with hand-crafted prompts: the frozen model, nothing learned.

`zeroshot.templates` chooses the prompts:

    coop      CoOp's template for the dataset ("{} texture." for DTD, ...), "a photo of a {}." else
    ensemble  CLIP's 80 ImageNet templates: features L2-normalised, averaged, renormalised
    "...{}..."  any literal template containing "{}"
"""

from __future__ import annotations

import open_clip
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.config import ConfigError
from coop.methods.base import Method
from coop.model import CLIP, cosine_logits

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


def resolve_templates(choice: str, dataset: str) -> list[str]:
    """The template strings for `zeroshot.templates=choice` on `dataset`.

    Args:
        choice: "coop", "ensemble" or a literal template containing "{}".
        dataset: the dataset name (`data.name`), which picks CoOp's template.
    """
    if choice == "coop":
        return [COOP_TEMPLATES.get(dataset, DEFAULT_TEMPLATE)]
    if choice == "ensemble":
        return [t("{}") for t in open_clip.OPENAI_IMAGENET_TEMPLATES]
    if "{}" not in str(choice):
        raise ConfigError(
            f"zeroshot.templates={choice!r} is not 'coop', 'ensemble' or a template containing '{{}}'"
        )
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

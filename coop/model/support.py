"""Which of open_clip's models take prompts in which tower, judged by the code that builds the towers.

    row = model_support("ViT-B-16")   # family, text / image refusal (None: prompts enter), tokenizer, tags,
                                      # towers (TowerLayers: what the methods' checks read)
    towers = TowerLayers.of_model("configs/models/coca-tiny.json")   # as preflight reads them
    rows = support_table()            # every model open_clip ships, in open_clip's order
    rows = support_table("SigLIP")    # one family

Text: `coop.model.text_support.text_support`, the rule loading applies to the text tower, on the
tower built on the meta device (a Hugging Face tower, `coop.model.text_hf`, from its config alone). Vision: open_clip builds the model's image tower on the meta device
and `coop.model.clip._image_tower` (what `CLIP.from_openclip` runs) turns it into our
`ImageTower` (over open_clip's ViT, or over timm's ViT and EVA trunks), key by key and shape by
shape, or keeps open_clip's module with the reason it takes no vision prompts. Nothing downloads
and no tensor holds a value. The tokenizer is the one
open_clip's `get_tokenizer` picks from the config. `coop.results.model_table` turns the rows into
tables (`tools/models.py`, docs/models.md).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import open_clip
import torch
from open_clip.model import _build_vision_tower

from coop.model.clip import CLIP, _image_tower
from coop.model.errors import ModelError
from coop.model.text_hf import HFTextTower, hf_inserted_refusal, hf_tower_config
from coop.model.text_support import NoValues, text_support
from coop.model.tokenizer import hub_reachable, hub_tokenizer_name
from coop.model.weights import resolve_model_name
from coop.versions import untested

log = logging.getLogger(__name__)

# The configs open_clip ships (a config added with `open_clip.add_model_config` is not one of them).
OPENCLIP_CONFIGS = Path(open_clip.__file__).parent / "model_configs"
CLIP_BPE = "CLIP BPE"  # open_clip's SimpleTokenizer, shipped with open_clip


@dataclass(frozen=True)
class Family:
    """A family of open_clip models, recognised by a regex on the name or a key its config sets."""

    name: str
    what: str
    pattern: str | None = None  # re.search on the model name
    key: str | None = None  # "section.key" of the model config that is set (non-empty)


# A model belongs to the first family whose rule matches, and to CLIP (the one without a rule) when none
# does. The order matters where rules overlap: CoCa and the Hugging Face text towers before the
# image-tower families (coca_roberta-ViT-B-32, nllb-clip-base-siglip), SigLIP2 before SigLIP, and
# "other timm" after every named timm family.
FAMILIES = (
    Family(
        "CLIP", "OpenAI-shaped: open_clip's own ViT or ModifiedResNet (RN*) image tower, CLIP's text tower"
    ),
    Family(
        "CoCa", "contrastive captioners: a text decoder beside the two towers", key="multimodal_cfg.layers"
    ),
    Family(
        "HF text",
        "a Hugging Face `transformers` text tower: RoBERTa, XLM-R, mT5, NLLB",
        key="text_cfg.hf_model_name",
    ),
    Family("SigLIP2", "Google's SigLIP 2: timm image tower, Gemma tokenizer", pattern=r"SigLIP2"),
    Family("SigLIP", "Google's SigLIP: timm image tower, sigmoid loss", pattern=r"SigLIP"),
    Family("CLIPA", "CLIPA: average-pooled ViT without ln_pre, BERT tokenizer", pattern=r"-CLIPA"),
    Family("MetaCLIP 2 worldwide", "MetaCLIP 2's multilingual models", pattern=r"-worldwide"),
    Family("EVA", "EVA01 and EVA02: timm image towers", pattern=r"^EVA0"),
    Family(
        "PE-Core", "Meta's Perception Encoder: timm image tower, 32- or 72-token text", pattern=r"^PE-Core"
    ),
    Family("ViTamin", "ViTamin: timm hybrid conv-ViT image tower", pattern=r"^ViTamin"),
    Family("MobileCLIP", "Apple's MobileCLIP and MobileCLIP2: timm image towers", pattern=r"^MobileCLIP"),
    Family("ConvNeXt", "timm ConvNeXt image towers", pattern=r"^convnext_"),
    Family("other timm", "any other timm image tower (Swin, timm ViTs)", key="vision_cfg.timm_model_name"),
)
FAMILY_NAMES = tuple(f.name for f in FAMILIES)


@dataclass(frozen=True)
class TowerLayers:
    """What a model's towers are, for the checks of a method against them (`Method.check_config`):
    the kinds of tower it can use, and the block counts that bound the keys naming blocks or depths.

    Attributes:
        text: the text tower's blocks.
        image: the image tower's blocks; None for a tower that takes no prompts (RN50's stages).
        image_refusal: why the image tower takes no prompts, one line naming the model (None: it does).
        token_refusal: why the image tower's tokens have no features of their own after its final
            norm (CoCa's attention pool), one line naming the model (None: they have, or no prompts).
        text_refusal: why no tokens can be inserted at the text tower's layers (MMRL's; a Hugging
            Face encoder), one line naming the model (None: they can).
    """

    text: int | None  # None: a Hugging Face tower whose transformers config is not here (the table)
    image: int | None
    image_refusal: str | None = None
    token_refusal: str | None = None
    text_refusal: str | None = None

    @classmethod
    def of(cls, clip: CLIP) -> TowerLayers:
        """The towers of a built model."""
        towers = cls.of_tower(clip.text.cfg.layers, clip.visual, clip.vision_refusal, clip.name)
        if isinstance(clip.text, HFTextTower):
            return replace(towers, text_refusal=clip.text.inserted_refusal())
        return towers

    @classmethod
    def of_model(cls, model: str) -> TowerLayers | None:
        """The towers of an OpenCLIP model name or config .json, none of them loaded: the text tower's
        blocks from the config, the image tower's from the tower built on the meta device
        (`meta_image_tower`: timm trunks name no layers in the config). None if the config names no
        text tower layers; a ModelError for an unknown model, a missing file, or a text tower that
        does not load (`text_support`: then no method runs)."""
        name = resolve_model_name(model)
        refusal = text_support(name)
        if refusal is not None:
            raise ModelError(refusal)
        if _hf_text_cfg(name) is not None:  # its layers from its transformers config (ModelError: not here)
            text = hf_tower_config(name, hub_reachable).layers
            return replace(cls.of_tower(text, *meta_image_tower(name), name), text_refusal=_hf_refusal(name))
        text = _text_layers(name)
        return cls.of_tower(text, *meta_image_tower(name), name) if text else None

    @classmethod
    def of_tower(
        cls, text: int | None, tower: torch.nn.Module, refusal: str | None, name: str
    ) -> TowerLayers:
        """From the text tower's blocks and the image tower with its refusal (`meta_image_tower`)."""
        if refusal is not None:  # not an `ImageTower`: RN50's stages, ConvNeXt, FastViT
            return cls(text, None, refusal)
        tokens = tower.token_refusal
        return cls(text, int(tower.layers), None, tokens and f"model {name}'s image tower {tokens}")


@dataclass(frozen=True)
class ModelSupport:
    """One model: its family, whether prompts enter each tower (None) or why not, its tokenizer and
    tags, and its towers as the methods' checks read them."""

    name: str
    family: str
    text: str | None  # None: text prompts enter the text tower; else its refusal, one line
    image: str | None  # None: vision prompts enter the image tower; else its refusal, one line
    tokenizer: str  # CLIP_BPE, or the Hugging Face tokenizer's name
    pretrained: tuple[str, ...]  # open_clip's pretrained tags
    towers: TowerLayers | None = None  # None: the config names no text tower layers

    @property
    def vision(self) -> str | None:
        """None if the model takes vision prompts: it loads (its text tower is ours) and its image
        tower takes them; else why not, one line."""
        if self.image is None and self.text is not None:
            return (
                f"model {self.name} does not load (its text tower is refused); "
                "its image tower would take vision prompts"
            )
        return self.image


def family_of(name: str, cfg: dict) -> str:
    """The family of model `name` with config `cfg` (the first rule of FAMILIES that matches)."""
    for family in FAMILIES:
        if family.pattern and re.search(family.pattern, name):
            return family.name
        if family.key:
            section, key = family.key.split(".")
            if cfg.get(section, {}).get(key):
                return family.name
    return next(f.name for f in FAMILIES if f.pattern is None and f.key is None)


def vision_support(name: str) -> str | None:
    """Whether vision prompts enter model `name`'s image tower: None if so, else the reason in one line."""
    if open_clip.get_model_config(name) is None:
        return f"unknown open_clip model '{name}'"
    return meta_image_tower(name)[1]


def _text_layers(name: str) -> int:
    return int((open_clip.get_model_config(name) or {}).get("text_cfg", {}).get("layers", 0))


def _hf_text_cfg(name: str) -> dict | None:
    """Model `name`'s `text_cfg` when its text tower is a Hugging Face encoder, else None."""
    text_cfg = (open_clip.get_model_config(name) or {}).get("text_cfg", {})
    return text_cfg if text_cfg.get("hf_model_name") else None


def _hf_refusal(name: str) -> str:
    """Why no tokens are inserted into model `name`'s Hugging Face text tower, from its config alone."""
    return hf_inserted_refusal(
        f"model {name}'s text tower (Hugging Face '{_hf_text_cfg(name)['hf_model_name']}')"
    )


def meta_image_tower(name: str) -> tuple[torch.nn.Module, str | None]:
    """(image tower, None) when vision prompts enter model `name`'s image tower (our `ImageTower`,
    whose `layers` are its blocks), else (open_clip's module, the reason in one line).

    Builds the tower open_clip builds for the config (fp32), on the meta device, and applies
    `CLIP.from_openclip`'s step (`coop.model.clip._image_tower`) to it: milliseconds, no values.
    """
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ModelError(f"unknown open_clip model '{name}' (see open_clip.list_models())")
    with torch.device("meta"), NoValues():
        visual = _build_vision_tower(
            cfg["embed_dim"], cfg["vision_cfg"], quick_gelu=cfg.get("quick_gelu", False)
        )
        return _image_tower(visual, name)


def model_support(model: str) -> ModelSupport:
    """The support row of an open_clip model name, or of a model config .json (registered under its
    file stem); a one-line ModelError for an unknown name or a missing file."""
    name = resolve_model_name(model)
    cfg = open_clip.get_model_config(name)
    tower, image = meta_image_tower(name)  # built once for both verdicts
    text_layers, hf = _text_layers(name), _hf_text_cfg(name) is not None
    towers = TowerLayers.of_tower(text_layers, tower, image, name) if text_layers else None
    if hf:  # the kinds of tower from the config alone: its transformers config may not be here
        towers = replace(TowerLayers.of_tower(None, tower, image, name), text_refusal=_hf_refusal(name))
    return ModelSupport(
        name=name,
        family=family_of(name, cfg),
        text=text_support(name),
        image=image,
        tokenizer=hub_tokenizer_name(name) or CLIP_BPE,
        pretrained=tuple(open_clip.list_pretrained_tags_by_model(name)),
        towers=towers,
    )


def openclip_models() -> list[str]:
    """The models open_clip ships, in `open_clip.list_models()`'s order. Under an open_clip release
    outside the tested range, a warning first: the list, and the towers open_clip's private
    builders make, may differ from those of docs/models.md."""
    problem = untested("open_clip_torch")
    if problem:
        log.warning("%s: its model list may differ from docs/models.md's", problem)
    return [n for n in open_clip.list_models() if (OPENCLIP_CONFIGS / f"{n}.json").is_file()]


def support_table(family: str | None = None) -> list[ModelSupport]:
    """The support row of every model open_clip ships, or of one family's (a ModelError for an
    unknown family)."""
    if family is not None and family not in FAMILY_NAMES:
        raise ModelError(f"family {family!r} is not one of {', '.join(FAMILY_NAMES)}")
    names = openclip_models()
    if family is not None:
        names = [n for n in names if family_of(n, open_clip.get_model_config(n)) == family]
    return [model_support(n) for n in names]

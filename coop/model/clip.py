"""CLIP for prompt learning: our own text Transformer and (for ViT towers) our own image forward.

    clip = coop.load_clip("ViT-B-16", pretrained="openai")      # or pretrained=None / a file
    clip = coop.CLIP.from_openclip(open_clip_model)              # wrap an already-built model

`from_openclip` copies the text-tower weights into `coop.model.text_encoder.TextTransformer` (a
Hugging Face text tower into `coop.model.text_hf.HFTextTower`, transformers' modules) and the
image tower into a `coop.model.image_tower.ImageTower`: open_clip's ViT into our
`coop.model.image_encoder.ImageTransformer` (same state-dict keys, checked one by one), a timm ViT or
EVA trunk into `coop.model.image_timm.TimmImageTower` (timm's modules, taken over without a copy and
walked by our forward). Both
sides then run one forward of ours, with or without prompts. Towers without tokens (ResNets,
ConvNeXt, FastViT, ...) keep open_clip's module; they serve the feature-based methods exactly as
before and refuse vision prompts (`ModelError`).

`coop.model.weights.load_clip` builds the model by name and loads its weights (an OpenCLIP tag or a
local file).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from open_clip.hf_model import HFTextEncoder
from open_clip.modified_resnet import ModifiedResNet
from open_clip.timm_model import TimmModel
from torch import nn

from coop.model.blocks import load_checked
from coop.model.errors import ModelError
from coop.model.image_encoder import ImageTransformer, vision_config_from_openclip
from coop.model.image_timm import TimmImageTower, timm_config_refusal
from coop.model.image_tower import ImageTower
from coop.model.text_encoder import TextTransformer
from coop.model.text_hf import HFTextTower
from coop.model.text_support import text_config_from_openclip
from coop.model.tokenizer import clip_bpe

log = logging.getLogger(__name__)


class CLIP(nn.Module):
    """A frozen CLIP model whose text side runs through `TextTransformer` and whose image side runs
    through an `ImageTower` for ViTs (open_clip's own module otherwise).

    Args:
        visual: an `ImageTower`, or open_clip's image tower.
        text: the text encoder.
        logit_scale: CLIP's learned temperature (log scale).
        tokenizer: texts -> (N, 77) ids.
        name: the model's name, for messages.
        vision_refusal: why `visual` cannot take vision prompts (None for an `ImageTower`).
    """

    def __init__(
        self,
        visual: nn.Module,
        text: TextTransformer | HFTextTower,
        logit_scale: torch.Tensor,
        tokenizer,
        name: str | None = None,
        vision_refusal: str | None = None,
    ):
        super().__init__()
        self.visual = visual
        self.text = text
        self.logit_scale = nn.Parameter(logit_scale.detach().clone().reshape(()), requires_grad=False)
        self.tokenizer = tokenizer
        self.name = name or "CLIP"
        self.vision_refusal = None
        if not isinstance(visual, ImageTower):
            default = f"model {self.name}'s image tower {type(visual).__name__} takes no vision prompts"
            self.vision_refusal = vision_refusal or default
        self.requires_grad_(False)
        self.eval()

    @property
    def width(self) -> int:
        return self.text.cfg.width

    @property
    def embed_dim(self) -> int:
        return self.text.cfg.embed_dim

    @property
    def context_length(self) -> int:
        return self.text.cfg.context_length

    @property
    def supports_vision_prompts(self) -> bool:
        """Whether the image side is one of our `ImageTower`s (a ViT), which take prompts."""
        return isinstance(self.visual, ImageTower)

    @property
    def image_forward(self) -> str:
        """Which code computes image features: "coop" (`ImageTransformer`), "coop-timm"
        (`TimmImageTower`) or "open_clip" (open_clip's module)."""
        if isinstance(self.visual, TimmImageTower):
            return "coop-timm"
        return "coop" if self.supports_vision_prompts else "open_clip"

    def require_vision_prompts(self) -> None:
        """Raise a one-line ModelError naming the model unless its image tower takes vision prompts."""
        if not self.supports_vision_prompts:
            raise ModelError(self.vision_refusal)

    @property
    def image_size(self) -> int:
        size = self.visual.image_size
        return size if isinstance(size, int) else size[0]

    @property
    def preprocess_cfg(self) -> dict:
        """Image size, mean and std the image tower expects (OpenCLIP's preprocess config)."""
        return dict(getattr(self.visual, "preprocess_cfg", {}) or {})

    @classmethod
    def from_openclip(cls, model: nn.Module, tokenizer=None, name: str | None = None) -> CLIP:
        """Wrap an open_clip `CLIP`, `CustomTextCLIP` or `CoCa` (any weights). Its text tower, which
        must be one `coop.model.text_support` accepts (ModelError), and an open_clip ViT image tower
        are copied into ours; a timm image tower's trunk and head (`TimmImageTower`) and an image
        tower kept as open_clip's module are taken over, shared with `model` and not copied, so
        that the largest towers are held once. The wrapper freezes them (and a method may hook
        them): copy `model` first where it must stay independent.

        Args:
            model: an open_clip model.
            tokenizer: texts -> ids; OpenCLIP's `SimpleTokenizer` when None (a Hugging Face text
                tower's tokenizer must be given: its context length is the tokenizer's).
            name: the model's name (e.g. "ViT-B-16"), used in messages; the class name when None.
        """
        name = name or type(model).__name__
        if isinstance(getattr(model, "text", None), HFTextEncoder):  # its tokenizer: the model's, given
            text = HFTextTower(model.text, name, getattr(tokenizer, "context_length", None))
        else:
            cfg, src = text_config_from_openclip(model, name)
            with torch.device("meta"):  # not initialised: every tensor of it is in `src`, loaded next
                text = TextTransformer(cfg, name)
            text.to_empty(device=next(model.parameters()).device)
            load_checked(text, src, "text")
            if tokenizer is None:
                tokenizer = clip_bpe(cfg.context_length)
        visual, refusal = _image_tower(model.visual, name)
        return cls(visual, text, model.logit_scale, tokenizer, name=name, vision_refusal=refusal)

    def tokenize(self, texts: str | list[str]) -> torch.Tensor:
        """Texts -> token ids (N, 77); longer texts are truncated and end with [EOS]."""
        return self.tokenizer([texts] if isinstance(texts, str) else list(texts))

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (N, 77) -> unnormalised text features (N, E), through our Transformer."""
        return self.text(ids.to(self.logit_scale.device))

    def encode_image(
        self, images: torch.Tensor, prompts=None, grad_checkpointing: bool = False, tokens: bool = False
    ) -> torch.Tensor:
        """Images (N, 3, H, W) -> unnormalised image features (N, E).

        Args:
            images: (N, 3, H, W) normalised pixels.
            prompts: None, or J vision-prompt tensors (see `ImageTower.forward`); a ModelError
                naming the model when the image tower takes none.
            grad_checkpointing: recompute the image tower's blocks in the backward pass (ViTs).
            tokens: every token after the final norm, projected, (N, T, E) (see `ImageTower.forward`).
        """
        if not self.supports_vision_prompts:
            if prompts is not None or tokens:
                self.require_vision_prompts()
            out = self.visual(images)
            return out[0] if isinstance(out, tuple) else out  # CoCa's tower: (pooled, tokens)
        return self.visual(images, prompts, grad_checkpointing, tokens)

    def train(self, mode: bool = True) -> CLIP:
        # CLIP is frozen: BatchNorm (RN50) and dropout stay in inference mode.
        return super().train(False)


def _image_tower(visual: nn.Module, name: str) -> tuple[nn.Module, str | None]:
    """Our `ImageTower` over the image tower (open_clip's ViT: `ImageTransformer`; timm's ViT and EVA
    trunks: `TimmImageTower`), else open_clip's module and the reason."""
    if isinstance(visual, TimmModel):
        refusal = timm_config_refusal(visual, name)
        return (visual, refusal) if refusal else (TimmImageTower.from_openclip(visual, name), None)
    try:
        vision_config_from_openclip(visual, name)
    except ModelError as e:
        return visual, _cnn_refusal(visual, name) or str(e)
    return ImageTransformer.from_openclip(visual, name), None


def _cnn_refusal(visual: nn.Module, name: str) -> str | None:
    """The one line for open_clip's ResNet towers, which have no tokens at all."""
    if isinstance(visual, ModifiedResNet):
        return (
            f"model {name}'s image tower is a ResNet (a CNN): it has no tokens, so it takes no vision "
            "prompts (CLIP-LoRA runs with lora.towers=[text])"
        )
    return None


def cosine_logits(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor):
    """logit_scale.exp() * normalize(img) @ normalize(txt).T  -> (B, n_cls), always in fp32.

    Under bf16 autocast the features arrive in bf16; normalising and multiplying them in bf16 would
    round logits near CLIP's 50..100 to steps of 0.25-0.5 and tie close classes, so this runs in
    fp32 with autocast off (on the features' own values, upcast exactly).
    """
    with torch.autocast(image_features.device.type, enabled=False):
        img = F.normalize(image_features.float(), dim=-1)  # (B, E)
        txt = F.normalize(text_features.float(), dim=-1)  # (n_cls, E)
        return logit_scale.float().exp() * img @ txt.t()

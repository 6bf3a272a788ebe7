"""CLIP for prompt learning: our own text Transformer and (for standard ViTs) our own image tower.

    clip = coop.load_clip("ViT-B-16", pretrained="openai")      # or pretrained=None / a file
    clip = coop.CLIP.from_openclip(open_clip_model)              # wrap an already-built model

`from_openclip` copies the text-tower weights into `coop.text_encoder.TextTransformer` and, for a
standard OpenCLIP ViT, the image-tower weights into `coop.image_encoder.ImageTransformer` (same
state-dict keys, checked one by one), so both sides run one forward of ours, with or without
prompts. Other image towers (ResNets, attentional pooling, ...) keep open_clip's module; they
serve the feature-based methods exactly as before and refuse vision prompts (`ModelError`).

Weights come from an OpenCLIP tag (cached, else downloaded) or a local file: an OpenCLIP state dict
(.bin / .pt / .safetensors), or OpenAI's original TorchScript archive (the `ViT-B-16.pt` that
OpenAI's `clip` package keeps in ~/.cache/clip), which always gets QuickGELU.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import warnings
import zipfile
from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F
from huggingface_hub import try_to_load_from_cache
from open_clip.tokenizer import SimpleTokenizer
from open_clip.transformer import QuickGELU as OpenClipQuickGELU
from open_clip.transformer import ResidualAttentionBlock
from torch import nn

from coop.image_encoder import ImageTransformer, ModelError, vision_config_from_openclip
from coop.text_encoder import TextConfig, TextTransformer

log = logging.getLogger(__name__)

TEXT_KEYS = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection")
HUB_HOST = "huggingface.co"
NO_WEIGHTS = (None, "", "none", "None")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
# Entries of OpenAI's TorchScript state dict that are sizes, not weights (OpenAI's build_model drops them).
OPENAI_NON_WEIGHTS = ("input_resolution", "context_length", "vocab_size")


class WeightsUnavailableError(RuntimeError):
    """A pretrained tag's weights are neither in the local cache nor downloadable (offline)."""


class CLIP(nn.Module):
    """A frozen CLIP model whose text side runs through `TextTransformer` and whose image side runs
    through `ImageTransformer` for standard ViTs (open_clip's own module otherwise).

    Args:
        visual: an `ImageTransformer`, or open_clip's image tower.
        text: the text encoder.
        logit_scale: CLIP's learned temperature (log scale).
        tokenizer: texts -> (N, 77) ids.
        name: the model's name, for messages.
        vision_refusal: why `visual` cannot take vision prompts (None for an `ImageTransformer`).
    """

    def __init__(
        self,
        visual: nn.Module,
        text: TextTransformer,
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
        if not isinstance(visual, ImageTransformer):
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
        """Whether the image side is our `ImageTransformer` (a standard ViT), which takes prompts."""
        return isinstance(self.visual, ImageTransformer)

    @property
    def image_forward(self) -> str:
        """Which code computes image features: "coop" (`ImageTransformer`) or "open_clip"."""
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
        """Wrap an OpenCLIP `CLIP` model (any weights). The given model is not modified.

        Args:
            model: an OpenCLIP `CLIP`.
            tokenizer: texts -> ids; OpenCLIP's `SimpleTokenizer` when None.
            name: the model's name (e.g. "ViT-B-16"), used in messages; the class name when None.
        """
        name = name or type(model).__name__
        cfg = text_config_from_openclip(model)
        text = TextTransformer(cfg)
        src = {k: v for k, v in model.state_dict().items() if k.startswith(TEXT_KEYS)}
        dst = text.state_dict()
        if set(src) != set(dst):
            missing, extra = sorted(set(dst) - set(src)), sorted(set(src) - set(dst))
            raise ValueError(
                f"text-tower keys differ from OpenCLIP's: missing {missing[:3]}, extra {extra[:3]}"
            )
        for key, value in src.items():
            if value.shape != dst[key].shape:
                raise ValueError(f"shape mismatch for {key}: {tuple(value.shape)} vs {tuple(dst[key].shape)}")
        text.load_state_dict({k: v.float() for k, v in src.items()})
        text.to(next(model.parameters()).device)
        if tokenizer is None:
            tokenizer = SimpleTokenizer(context_length=cfg.context_length)
        visual, refusal = _image_tower(model.visual, name)
        return cls(visual, text, model.logit_scale, tokenizer, name=name, vision_refusal=refusal)

    def tokenize(self, texts: str | list[str]) -> torch.Tensor:
        """Texts -> token ids (N, 77); longer texts are truncated and end with [EOS]."""
        return self.tokenizer([texts] if isinstance(texts, str) else list(texts))

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (N, 77) -> unnormalised text features (N, E), through our Transformer."""
        return self.text(ids.to(self.logit_scale.device))

    def encode_image(
        self, images: torch.Tensor, prompts=None, grad_checkpointing: bool = False
    ) -> torch.Tensor:
        """Images (N, 3, H, W) -> unnormalised image features (N, E).

        Args:
            images: (N, 3, H, W) normalised pixels.
            prompts: None, or J vision-prompt tensors (see `ImageTransformer.forward`); a
                ModelError naming the model when the image tower is not a standard ViT.
            grad_checkpointing: recompute the image tower's blocks in the backward pass (ViTs).
        """
        if not self.supports_vision_prompts:
            if prompts is not None:
                self.require_vision_prompts()
            return self.visual(images)
        return self.visual(images, prompts, grad_checkpointing)

    def train(self, mode: bool = True) -> CLIP:
        # CLIP is frozen: BatchNorm (RN50) and dropout stay in inference mode.
        return super().train(False)


def _image_tower(visual: nn.Module, name: str) -> tuple[nn.Module, str | None]:
    """Our `ImageTransformer` copy of a standard ViT tower, else open_clip's module and the reason."""
    try:
        vision_config_from_openclip(visual, name)
    except ModelError as e:
        return visual, str(e)
    return ImageTransformer.from_openclip(visual, name), None


def text_config_from_openclip(model: nn.Module) -> TextConfig:
    """Read the text-tower sizes off an OpenCLIP model; reject towers we do not implement."""
    name = type(model).__name__
    if not isinstance(model, open_clip.CLIP) or not hasattr(model, "transformer"):
        raise ModelError(
            f"{name} has no standard causal CLIP text tower (HF text towers, CoCa and custom-text models "
            "are not supported); use an OpenCLIP CLIP model such as RN50, ViT-B-32, ViT-B-16 or ViT-L-14"
        )
    blocks = model.transformer.resblocks
    problems = []
    if getattr(model, "attn_mask", None) is None:
        problems.append("no causal mask")
    if getattr(model, "text_pool_type", "argmax") != "argmax":
        problems.append(f"pooling '{model.text_pool_type}' instead of [EOS]/argmax")
    if model.text_projection is None:
        problems.append("no text projection")
    for block in blocks:
        if type(block) is not ResidualAttentionBlock:
            problems.append(f"custom block {type(block).__name__}")
            break
        if not (isinstance(block.ls_1, nn.Identity) and isinstance(block.ls_2, nn.Identity)):
            problems.append("layer scale")
            break
    if problems:
        raise ModelError(
            f"{name}'s text tower is not a standard causal CLIP text Transformer: {', '.join(problems)}"
        )
    act = blocks[0].mlp.gelu
    quick = isinstance(act, OpenClipQuickGELU)
    if not quick and not isinstance(act, nn.GELU):
        raise ModelError(f"unsupported text MLP activation {type(act).__name__}")
    proj = model.text_projection
    width = model.token_embedding.weight.shape[1]
    return TextConfig(
        vocab_size=model.token_embedding.weight.shape[0],
        context_length=model.positional_embedding.shape[0],
        width=width,
        heads=blocks[0].attn.num_heads,
        layers=len(blocks),
        mlp_width=blocks[0].mlp.c_fc.out_features,
        embed_dim=proj.out_features if isinstance(proj, nn.Linear) else proj.shape[1],
        quick_gelu=quick,
        gelu_approximate="none" if quick else act.approximate,
        ln_eps=model.ln_final.eps,
        proj_bias=(proj.bias is not None) if isinstance(proj, nn.Linear) else None,
    )


def resolve_model_name(name: str) -> str:
    """An OpenCLIP model name, or a path to a model-config JSON (registered under its file stem)."""
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ModelError(f"model config file not found: {path}")
        open_clip.add_model_config(path)
        return path.stem
    if name not in open_clip.list_models():
        raise ModelError(
            f"unknown open_clip model '{name}' (see open_clip.list_models(), or pass a config .json)"
        )
    return name


def load_clip(name: str, pretrained: str | None = None, device: str | torch.device = "cpu") -> CLIP:
    """Build a CLIP by OpenCLIP model name (or config JSON path) and wrap it.

    Args:
        name: OpenCLIP model name such as "ViT-B-16", or a path to an OpenCLIP model-config JSON.
        pretrained: None / "none" for random weights, an OpenCLIP tag (e.g. "openai"), or a local
            weights file: an OpenCLIP state dict, or OpenAI's original TorchScript `.pt` (loading it
            runs TorchScript code, so use files you trust). Tags whose weights were trained with
            QuickGELU (all OpenAI ones) and OpenAI's TorchScript files get QuickGELU; a plain state
            dict gets the activation of `name` (`-quickgelu` names have QuickGELU), and when `name`
            has a `-quickgelu` twin a log line says which one is in use.
            Random weights are drawn with seed 0, so every process builds the same model.
        device: where the model lives.

    Raises:
        ModelError: unknown model name or tag, weights that do not fit the model, an unsupported tower.
        FileNotFoundError: `pretrained` names a file that does not exist.
        WeightsUnavailableError: a tag's weights are not cached and cannot be downloaded.
    """
    model_name = resolve_model_name(name)
    kwargs, weights, local = {}, None, False
    if pretrained in NO_WEIGHTS:
        pass
    elif _is_path(pretrained):
        weights, local = _existing_file(pretrained), True
        log.info("loading weights from file %s", weights)
    else:
        tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
        if not tag_cfg:
            tags = open_clip.list_pretrained_tags_by_model(model_name)
            raise ModelError(
                f"pretrained '{pretrained}' is neither a file nor an open_clip tag of {model_name} (tags: {tags})"
            )
        if tag_cfg.get("quick_gelu", False):
            kwargs["force_quick_gelu"] = True
        kwargs["force_preprocess_cfg"] = {k: tag_cfg[k] for k in ("mean", "std") if k in tag_cfg}
        weights = _cached_or_download(model_name, pretrained, tag_cfg)
    openai_archive = weights is not None and is_torchscript(weights)
    if openai_archive:
        kwargs["force_quick_gelu"] = True  # OpenAI trained every CLIP with QuickGELU
    quiet = _RandomInitNotice() if weights is not None else logging.Filter()  # the weights follow
    root = logging.getLogger()
    root.addFilter(quiet)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # random weights (pretrained=None) are the same in every process
            model = open_clip.create_model(model_name, pretrained=None, device=device, **kwargs)
    finally:
        root.removeFilter(quiet)
    if weights is not None:
        _load_weights(model, weights, model_name, openai_archive)
    tokenizer = open_clip.get_tokenizer(model_name)
    clip = CLIP.from_openclip(model, tokenizer=tokenizer, name=model_name).to(device)
    if local and not openai_archive:
        _say_activation(clip, model_name)
    return clip


def pretrained_available(name: str, pretrained: str | None) -> bool:
    """Whether `load_clip(name, pretrained)` can get its weights here (file, cache or reachable hub).

    A file path that does not exist is an error (FileNotFoundError), not unavailable weights.
    """
    if pretrained in NO_WEIGHTS:
        return True
    if _is_path(pretrained):
        _existing_file(pretrained)
        return True
    tag_cfg = open_clip.get_pretrained_cfg(resolve_model_name(name), pretrained)
    return bool(tag_cfg) and (_cached_path(tag_cfg) is not None or _hub_reachable())


def _is_path(pretrained: str) -> bool:
    """A file path rather than an OpenCLIP tag (tags have no slashes and no file suffix)."""
    text = str(pretrained)
    return os.path.isfile(text) or "/" in text or os.sep in text or text.endswith(WEIGHT_SUFFIXES)


def _existing_file(pretrained: str) -> str:
    path = os.path.expanduser(str(pretrained))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    return path


def is_torchscript(path: str | os.PathLike) -> bool:
    """Whether `path` is a TorchScript archive (OpenAI's original CLIP files) rather than a state dict.

    Both are zip files; only TorchScript ones hold `constants.pkl` and a `code/` folder.
    """
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.split("/")[1:2] in (["constants.pkl"], ["code"]) for n in archive.namelist())


def openai_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The weights of an OpenAI TorchScript CLIP file, under OpenAI's keys (= OpenCLIP's CLIP keys)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated, yet reads these files
        state = torch.jit.load(str(path), map_location="cpu").state_dict()
    return {k: v for k, v in state.items() if k not in OPENAI_NON_WEIGHTS}


def _load_weights(model: nn.Module, path: str, model_name: str, openai_archive: bool) -> None:
    """Load a weights file into `model`, strictly; weights of another architecture are a ModelError."""
    try:
        if openai_archive:
            model.load_state_dict(openai_state_dict(path))  # fp16 values into fp32 parameters
        else:
            open_clip.load_checkpoint(model, path)
    except (RuntimeError, KeyError, pickle.UnpicklingError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0]
        if len(detail) > 300:
            detail = detail[:300] + " ..."
        raise ModelError(f"cannot load the weights in {path} into model {model_name}: {detail}") from e


class _RandomInitNotice(logging.Filter):
    """Drops open_clip's "initialized randomly" warning for a model whose weights are loaded next."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded")


def _say_activation(clip: CLIP, model_name: str) -> None:
    """A plain state dict does not say which activation it was trained with: name the one in use."""
    twin = f"{model_name}-quickgelu"
    if clip.text.cfg.quick_gelu or twin not in open_clip.list_models():
        return
    log.info(
        "model %s runs these weights with GELU; weights trained with QuickGELU (all of OpenAI's) need "
        "the %s config: model.name=%s",
        model_name,
        twin,
        twin,
    )


def _cached_path(tag_cfg: dict) -> str | None:
    hub = tag_cfg.get("hf_hub", "")
    if not hub:
        return None
    repo, filename = (hub.rstrip("/"), "") if hub.endswith("/") else os.path.split(hub)
    names = [filename] if filename else ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]
    for fname in names:
        path = try_to_load_from_cache(repo, fname)
        if isinstance(path, str) and os.path.isfile(path):
            return path
    return None


def _cached_or_download(model_name: str, tag: str, tag_cfg: dict) -> str:
    """Path of the tag's checkpoint: from the local cache, else downloaded; clear error offline."""
    cached = _cached_path(tag_cfg)
    if cached is not None:
        return cached
    if not _hub_reachable():
        raise WeightsUnavailableError(
            f"open_clip weights '{tag}' for {model_name} are not in the local cache and the hub cannot be "
            f"reached (offline?). Download them once where there is internet, or pass a local weights file: "
            f"model.pretrained=/path/to/open_clip_pytorch_model.bin (with a '-quickgelu' model name for "
            f"OpenAI weights), or OpenAI's original file, e.g. model.pretrained=~/.cache/clip/ViT-B-16.pt"
        )
    path = open_clip.pretrained.download_pretrained(tag_cfg)
    if not path:
        raise WeightsUnavailableError(f"could not download open_clip weights '{tag}' for {model_name}")
    return path


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


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

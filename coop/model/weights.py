"""Build a CLIP by name and load its weights: `load_clip(name, pretrained)`.

    clip = coop.load_clip("ViT-B-16", pretrained="openai")      # or pretrained=None / a file

Weights come from an OpenCLIP tag (cached, else downloaded) or a local file: an OpenCLIP state dict
(.bin / .pt / .safetensors), or OpenAI's original TorchScript archive (the `ViT-B-16.pt` that
OpenAI's `clip` package keeps in ~/.cache/clip), which always gets QuickGELU. Offline, a tag whose
weights are not cached is a `WeightsUnavailableError` that says what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import warnings
import zipfile
from pathlib import Path

import open_clip
import torch
from huggingface_hub import try_to_load_from_cache
from safetensors import SafetensorError
from torch import nn

from coop.io import refused_unpickling
from coop.model.clip import CLIP
from coop.model.errors import ModelError
from coop.model.text_hf import building_with, hf_text_config, openclip_text_cfg
from coop.model.text_support import text_config
from coop.model.tokenizer import check_fits, hub_tokenizer_name, load_tokenizer, prompt_tokenizer
from coop.model.tokenizer import hub_reachable as _hub_reachable

log = logging.getLogger(__name__)

NO_WEIGHTS = (None, "", "none", "None")
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
# Entries of OpenAI's TorchScript state dict that are sizes, not weights (OpenAI's build_model drops them).
OPENAI_NON_WEIGHTS = ("input_resolution", "context_length", "vocab_size")


class WeightsUnavailableError(RuntimeError):
    """A pretrained tag's weights are neither in the local cache nor downloadable (offline)."""


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


def absolute_model_files(name: str, pretrained: str | None) -> tuple[str, str | None]:
    """`model.name` and `model.pretrained` with a file (a model-config JSON, a weights file) given
    by an absolute path: a run folder or an export records them so, since it is used from other
    working directories (predict, eval, resume). Tags and names that are not files stay as given."""
    if name.endswith(".json") and os.path.isfile(os.path.expanduser(name)):
        name = str(Path(name).expanduser().resolve())
    if pretrained is not None and os.path.isfile(os.path.expanduser(str(pretrained))):
        pretrained = str(Path(str(pretrained)).expanduser().resolve())
    return name, pretrained


def absolute_tokenizer_dir(directory: str | None) -> str | None:
    """`model.tokenizer` as an absolute path when it names an existing directory (recorded so, as
    `absolute_model_files` records the model's files); anything else stays as given."""
    if directory is not None and os.path.isdir(os.path.expanduser(str(directory))):
        return str(Path(str(directory)).expanduser().resolve())
    return directory


def load_clip(
    name: str, pretrained: str | None = None, device: str | torch.device = "cpu", tokenizer: str | None = None
) -> CLIP:
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
        tokenizer: a saved Hugging Face tokenizer's directory for a model whose tokenizer is one
            (`model.tokenizer`); None: open_clip's (from the Hugging Face cache or hub for those).

    Raises:
        ModelError: unknown model name or tag, weights that do not fit the model, an unsupported tower.
        FileNotFoundError: `pretrained` names a file that does not exist.
        WeightsUnavailableError: a tag's weights are not cached and cannot be downloaded.
        TokenizerError: the tokenizer cannot be loaded here (`coop.model.tokenizer.load_tokenizer`),
            or does not fit the model (`coop.model.tokenizer.check_fits`).
    """
    model_name = resolve_model_name(name)
    text_cfg = text_config(
        model_name, _hub_reachable
    )  # before anything is built or downloaded: a refused tower
    text_tokenizer = load_tokenizer(model_name, tokenizer)  # before the weights: a quick refusal
    check_fits(
        prompt_tokenizer(text_tokenizer), text_cfg, model_name, tokenizer_source(model_name, tokenizer)
    )
    kwargs, weights, local = {}, None, False
    building = hf_text_building(model_name, kwargs)  # its transformers config, before the weights
    if pretrained in NO_WEIGHTS:
        pass
    elif _is_path(pretrained):
        weights, local = _existing_file(pretrained), True
        log.info("loading weights from file %s", weights)
    else:
        tag_cfg = _tag_config(model_name, pretrained)
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
            with building:
                model = open_clip.create_model(model_name, pretrained=None, device=device, **kwargs)
    finally:
        root.removeFilter(quiet)
    if weights is not None:
        _load_weights(model, weights, model_name, openai_archive)
    clip = CLIP.from_openclip(model, tokenizer=text_tokenizer, name=model_name).to(device)
    if local and not openai_archive:
        _say_activation(clip, model_name)
    return clip


def hf_text_building(model_name: str, kwargs: dict):
    """For a Hugging Face text tower: its transformers config (inline, a local directory, the
    cache or the hub: `coop.model.text_hf.hf_text_config`) for open_clip to build it from, and
    `create_model` options that never fetch the tower's own weights (they come with the CLIP's, or
    stay random). A context that builds with that config; for other towers one that does nothing."""
    text_cfg = (open_clip.get_model_config(model_name) or {}).get("text_cfg", {})
    if not text_cfg.get("hf_model_name"):
        return contextlib.nullcontext()
    config = hf_text_config(model_name, text_cfg, _hub_reachable)
    kwargs.update(text_cfg=openclip_text_cfg(text_cfg), pretrained_text=False)
    return building_with(config)


def require_weights(name: str, pretrained: str | None) -> None:
    """What `load_clip(name, pretrained)` would refuse about its weights, without reading or
    downloading them: FileNotFoundError (a missing file), ModelError (not a tag of the model),
    WeightsUnavailableError (a tag neither cached nor downloadable here)."""
    if pretrained in NO_WEIGHTS:
        return
    if _is_path(pretrained):
        _existing_file(pretrained)
        return
    model_name = resolve_model_name(name)
    if _cached_path(_tag_config(model_name, pretrained)) is None and not _hub_reachable():
        raise WeightsUnavailableError(_unavailable_weights(model_name, pretrained))


def pretrained_available(name: str, pretrained: str | None) -> bool:
    """Whether `load_clip(name, pretrained)` can get its weights here (file, cache or reachable hub).

    A file path that does not exist is an error (FileNotFoundError), not unavailable weights; so is
    a tag that the model does not have (ModelError).
    """
    try:
        require_weights(name, pretrained)
    except WeightsUnavailableError:
        return False
    return True


def tokenizer_source(model_name: str, directory: str | None) -> str:
    """Where `load_tokenizer(model_name, directory)` reads the tokenizer from, for messages."""
    if directory is not None:
        return f"model.tokenizer={directory}"
    return f"the tokenizer '{hub_tokenizer_name(model_name) or 'CLIP BPE'}'"


def _tag_config(model_name: str, pretrained: str) -> dict:
    tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
    if not tag_cfg:
        tags = open_clip.list_pretrained_tags_by_model(model_name)
        raise ModelError(
            f"pretrained '{pretrained}' is neither a file nor an open_clip tag of {model_name} (tags: {tags})"
        )
    return tag_cfg


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
    except (RuntimeError, KeyError, pickle.UnpicklingError, SafetensorError, StopIteration) as e:
        refused = refused_unpickling(path, e)  # never torch's advice to turn the safety off
        if refused:
            raise ModelError(f"cannot load the weights for model {model_name}: {refused}") from None
        if isinstance(e, SafetensorError):  # truncated or not a safetensors file at all
            raise ModelError(f"cannot read the weights file {path} as safetensors: {e}") from None
        if isinstance(e, StopIteration):  # open_clip reads the first key of an empty state dict
            raise ModelError(f"the weights file {path} holds no weights") from None
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
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


def _unavailable_weights(model_name: str, tag: str) -> str:
    return (
        f"open_clip weights '{tag}' for {model_name} are not in the local cache and the hub cannot be "
        f"reached (offline?). Download them once where there is internet, or pass a local weights file: "
        f"model.pretrained=/path/to/open_clip_pytorch_model.bin (with a '-quickgelu' model name for "
        f"OpenAI weights), or OpenAI's original file, e.g. model.pretrained=~/.cache/clip/ViT-B-16.pt"
    )


def _cached_or_download(model_name: str, tag: str, tag_cfg: dict) -> str:
    """Path of the tag's checkpoint: from the local cache, else downloaded; clear error offline."""
    cached = _cached_path(tag_cfg)
    if cached is not None:
        return cached
    if not _hub_reachable():
        raise WeightsUnavailableError(_unavailable_weights(model_name, tag))
    path = open_clip.pretrained.download_pretrained(tag_cfg)
    if not path:
        raise WeightsUnavailableError(f"could not download open_clip weights '{tag}' for {model_name}")
    return path

"""Which open_clip text towers our `TextTransformer` reproduces, read off the model or its config.

    cfg, tower = text_config_from_openclip(model, name)   # a built open_clip model -> TextConfig
    text_support("ViT-B-16-SigLIP")                       # None: supported; else the reason, one line
    text_config("ViT-B-16-SigLIP")                        # its TextConfig, without weights (or ModelError)

open_clip builds every text tower that is not a Hugging Face model with its `TextTransformer`
(`open_clip.model._build_text_tower`). `open_clip.CLIP` copies its parts onto the model itself
(`model.transformer`, `model.token_embedding`, ...; pooling `text_pool_type`), `CustomTextCLIP` and
`CoCa` keep it as `model.text`. Both read the same way (`_view`), and one rule (`_config`) turns
the tower into a `TextConfig` or refuses it, naming the model and what we do not reproduce. A
model name is judged by building its text tower on the meta device (no memory, no weights), so
`text_support` applies exactly the rule that loading the model applies.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from types import SimpleNamespace

import open_clip
import torch
from open_clip.hf_model import HFTextEncoder
from open_clip.model import _build_text_tower
from open_clip.transformer import QuickGELU, ResidualAttentionBlock, TextTransformer
from torch import nn
from torch.overrides import TorchFunctionMode

from coop.model.errors import ModelError
from coop.model.text_hf import HFTextConfig, hf_config_refusal, hf_tower_config

POOLS = ("argmax", "eos", "last", "first")  # open_clip's `pool_type`s that give one token


@dataclass(frozen=True)
class TextConfig:
    """The text tower's sizes and what varies between open_clip's towers (defaults: CLIP's)."""

    vocab_size: int = 49408
    context_length: int = 77
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_width: int = 2048
    embed_dim: int = 512
    quick_gelu: bool = False
    gelu_approximate: str = "none"
    ln_eps: float = 1e-5
    proj_bias: bool | None = None  # None: projection is a (W, E) matrix; bool: an nn.Linear
    projection: bool = True  # False: no projection, the features are the pooled (W,) states
    causal: bool = True  # False: every token sees every token (SigLIP, CLIPA, MobileCLIP-S*)
    pool: str = "argmax"  # one of POOLS: the highest id, the first `eos_id`, the last or first position
    eos_id: int | None = None  # the id `pool="eos"` looks for (MetaCLIP 2 worldwide)
    embed_cls: bool = False  # CoCa: a class token after the text is pooled, ln_final after pooling
    pad_id: int = 0  # with `embed_cls`: padding keys are hidden (open_clip's mask, see `_keys`)

    @property
    def masks_padding(self) -> bool:
        """Whether the tower hides the keys of `pad_id` tokens (CoCa's): the tokenizer must pad with it."""
        return self.embed_cls


# State-dict keys of open_clip's text tower (on `open_clip.CLIP` they sit at the model's root).
TEXT_KEYS = (
    "token_embedding.",
    "positional_embedding",
    "transformer.",
    "ln_final.",
    "text_projection",
    "cls_emb",
)


def hf_refusal(name: str, text_cfg: dict) -> str | None:
    """Why model `name`'s Hugging Face text tower (`text_cfg.hf_model_name`, run by
    `coop.model.text_hf.HFTextTower`) cannot take prompts, one line, else None; from the config."""
    return hf_config_refusal(name, text_cfg)


def text_config_from_openclip(model: nn.Module, name: str | None = None) -> tuple[TextConfig, dict]:
    """Read the text tower of a built open_clip model (`CLIP`, `CustomTextCLIP`, `CoCa`).

    Args:
        model: the open_clip model.
        name: the model's name for messages (its class name when None).
    Returns:
        The tower's `TextConfig` and its state dict under our (open_clip's tower) key names.
    Raises:
        ModelError: a tower we do not reproduce exactly; one line naming the model and why.
    """
    name = name or type(model).__name__
    tower = getattr(model, "text", None)
    if isinstance(model, open_clip.CLIP) and hasattr(model, "transformer"):
        view = _view(model, inline=True)
        state = {k: v for k, v in model.state_dict().items() if k.startswith(TEXT_KEYS)}
    elif isinstance(tower, TextTransformer):
        view = _view(tower, inline=False)
        state = {k: v for k, v in tower.state_dict().items() if k.startswith(TEXT_KEYS)}
    elif isinstance(tower, HFTextEncoder):
        raise ModelError(f"model {name}'s text tower is a Hugging Face one: coop.model.text_hf reads it")
    else:
        raise ModelError(
            f"model {name} ({type(model).__name__}) has no open_clip TextTransformer text tower; "
            "use an open_clip CLIP, CustomTextCLIP or CoCa model"
        )
    return _config(view, name), state


class NoValues(TorchFunctionMode):
    """In-place ops that only set values return their tensor unchanged when it is on the meta device.

    Building a tower on the meta device still runs every initialiser, and timm's trunc_normal_ takes
    a slow Python path for `clamp_` on meta tensors (milliseconds a call, thousands of calls): most of
    the time of judging a model. A meta tensor holds no values, so skipping these ops changes no shape
    or dtype. torch.nn.init's overridable initialisers (kaiming_uniform_, ...) come here whole, with
    their tensor as the keyword `tensor`: the ops they call inside would not (a mode is off while it
    handles a call).
    """

    OPS = frozenset(
        "uniform_ normal_ erfinv_ mul_ add_ sub_ div_ clamp_ fill_ zero_ copy_ kaiming_uniform_ constant_".split()
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in self.OPS:
            tensor = args[0] if args else kwargs.get("tensor")
            if getattr(tensor, "is_meta", False):
                return tensor
        return func(*args, **kwargs)


def text_support(name: str) -> str | None:
    """Whether prompts enter model `name`'s text tower: None if so, else the reason in one line.

    Reads the model config (`open_clip.get_model_config`): a Hugging Face tower from the config alone
    (`hf_refusal`: its transformers config may be fetched when it loads), any other by building only
    its text tower on the meta device (`text_config`, the rule of `text_config_from_openclip`).
    """
    cfg = open_clip.get_model_config(name)
    if cfg is not None and cfg.get("text_cfg", {}).get("hf_model_name"):
        return hf_refusal(name, dict(cfg["text_cfg"]))
    try:
        text_config(name)
    except ModelError as e:
        return str(e)
    return None


def text_config(name: str, reachable=lambda: False) -> TextConfig | HFTextConfig:
    """The config of model `name`'s text tower, read off the tower built on the meta device (no
    memory, no weights): a `TextConfig`, or an `HFTextConfig` for a Hugging Face tower, whose
    transformers config must be inline, local, cached or, when `reachable()`, on the hub. ModelError,
    in one line, for an unknown model or a tower we do not reproduce."""
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ModelError(f"unknown open_clip model '{name}'")
    if cfg.get("text_cfg", {}).get("hf_model_name"):
        return hf_tower_config(name, reachable)
    return _tower_config(name, json.dumps(cfg, sort_keys=True, default=str))


@functools.lru_cache(maxsize=32)
def _tower_config(name: str, config: str) -> TextConfig:
    """`text_config` of an open_clip text tower, read once per model config (`config`, its JSON: a
    config registered again under the name is read again): building the tower, even on the meta
    device, takes ~0.1 s, and every model a process builds asks."""
    cfg = open_clip.get_model_config(name)
    with torch.device("meta"), NoValues():
        tower = _build_text_tower(
            cfg["embed_dim"], dict(cfg["text_cfg"]), quick_gelu=cfg.get("quick_gelu", False)
        )
    custom = cfg.get("custom_text", False) or "multimodal_cfg" in cfg  # open_clip's choice of class
    return _config(_view(tower, inline=not custom), name)


def _view(tower: nn.Module, inline: bool) -> SimpleNamespace:
    """The text tower's parts and settings; `inline`: as `open_clip.CLIP` holds them, which keeps
    no class token and no padding mask (its `encode_text` uses neither)."""
    if inline:
        pool = getattr(tower, "text_pool_type", None) or getattr(tower, "pool_type", "argmax")
        eos_id = getattr(tower, "text_eos_id", None) if hasattr(tower, "text_eos_id") else tower.eos_id
        return SimpleNamespace(
            tower=tower,
            pool=pool,
            eos_id=eos_id,
            cls_emb=None,
            pad_mask=False,
            correct_cls_mask=False,
            pad_id=0,
        )
    return SimpleNamespace(
        tower=tower,
        pool=tower.pool_type,
        eos_id=tower.eos_id,
        cls_emb=tower.cls_emb,
        pad_mask=tower.use_pad_mask,
        correct_cls_mask=tower.correct_cls_mask,
        pad_id=tower.pad_id,
    )


def _config(view: SimpleNamespace, name: str) -> TextConfig:
    """The one rule: a `TextConfig` for the tower, or a ModelError naming what we do not reproduce."""
    t = view.tower
    blocks = t.transformer.resblocks
    problems = []
    if view.cls_emb is None and view.pool not in POOLS:
        problems.append(f"pooling '{view.pool}' (we pool one token: {', '.join(POOLS)})")
    if view.pad_mask:
        problems.append("a padding mask without a class token")
    if view.cls_emb is not None and view.correct_cls_mask:
        problems.append("CoCa's corrected class-token mask (open_clip's CoCa weights use the legacy one)")
    if view.cls_emb is not None and t.attn_mask is None:
        problems.append("a class token without the causal mask")
    for block in blocks:
        if type(block) is not ResidualAttentionBlock:
            problems.append(
                f"custom attention block {type(block).__name__} (qk norm, cosine attention, head scales)"
            )
            break
        if not (isinstance(block.ls_1, nn.Identity) and isinstance(block.ls_2, nn.Identity)):
            problems.append("layer scale")
            break
    act = blocks[0].mlp.gelu if blocks and hasattr(blocks[0].mlp, "gelu") else None
    if not isinstance(act, (QuickGELU, nn.GELU)):
        problems.append(f"MLP activation {type(act).__name__}")
    norms = [t.ln_final, *(m for b in blocks for m in (b.ln_1, b.ln_2))]
    if not all(isinstance(m, nn.LayerNorm) for m in norms) or len({m.eps for m in norms}) != 1:
        problems.append("norm layers other than one LayerNorm eps")
    if problems:
        raise ModelError(f"model {name}'s text tower is not reproduced here: {'; '.join(problems)}")
    proj = t.text_projection
    width = t.token_embedding.weight.shape[1]
    quick = isinstance(act, QuickGELU)
    return TextConfig(
        vocab_size=t.token_embedding.weight.shape[0],
        context_length=t.positional_embedding.shape[0] - (view.cls_emb is not None),
        width=width,
        heads=blocks[0].attn.num_heads,
        layers=len(blocks),
        mlp_width=blocks[0].mlp.c_fc.out_features,
        embed_dim=width
        if proj is None
        else proj.out_features
        if isinstance(proj, nn.Linear)
        else proj.shape[1],
        quick_gelu=quick,
        gelu_approximate="none" if quick else act.approximate,
        ln_eps=t.ln_final.eps,
        proj_bias=(proj.bias is not None) if isinstance(proj, nn.Linear) else None,
        projection=proj is not None,
        causal=t.attn_mask is not None,
        pool="argmax" if view.cls_emb is not None else view.pool,
        eos_id=view.eos_id if view.pool == "eos" else None,
        embed_cls=view.cls_emb is not None,
        pad_id=view.pad_id if view.cls_emb is not None else 0,
    )

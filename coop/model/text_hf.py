"""open_clip's Hugging Face text towers (`HFTextEncoder`: RoBERTa, XLM-R, mT5, NLLB), run through
transformers' own modules, with prompts placed by hooks.

    text = HFTextTower(open_clip_model.text, name)      # the tower's modules, same state-dict keys
    text(ids)                                           # open_clip's encode_text
    text.encode_embeddings(prompts, eos, deep, slots)   # prompts (N, L, W) from token embeddings

open_clip's `HFTextEncoder` holds a transformers encoder (`transformer`: RobertaModel,
XLMRobertaModel, the encoder stack of MT5Model or of NLLB's M2M100Model), one of its poolers
(`pooler`) and a projection (`proj`: linear, MLP or none); its forward is

    mask = ids != pad_token_id
    feats = proj(pooler(transformer(input_ids=ids, attention_mask=mask), mask))

This tower takes those three modules over (the same modules under open_clip's keys, not copies: the
weights are held once at load, as for the timm image towers) and runs the same lines. A
prompt enters as `inputs_embeds` (the encoder adds its own positions: RoBERTa's and NLLB's start
at padding_idx + 1, mT5 has relative position biases) with the mask over the prompt's tokens,
[SOS]/language code through [EOS]. Deep prompts replace the hidden states at the context slots
before layer i (1 <= i < J) through a forward pre-hook on the encoder's layer i. Pooling and
projection are open_clip's modules themselves (mean over the mask, the first token, ...).

Unlike CLIP's causal tower every token sees every other unmasked token, so nothing is shared
between rows (no prefix computed once, no packed pass); the padding after [EOS] is masked, so a
batch of prompts is cut to its longest row (`cut_length`), which changes no feature.
"""

from __future__ import annotations

import functools
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import open_clip
import torch
from open_clip.hf_model import HFTextEncoder
from open_clip.tokenizer import DEFAULT_CONTEXT_LENGTH
from torch import nn
from torch.utils.checkpoint import checkpoint

from coop.model.errors import ModelError
from coop.model.text_full import deep_by_block

INLINE_KEY = "hf_config"  # text_cfg key of a model JSON that holds the transformers config inline


@dataclass(frozen=True)
class HFTextConfig:
    """The sizes of a Hugging Face text tower and how it pools and projects (read off the tower)."""

    vocab_size: int
    context_length: int
    width: int
    layers: int
    embed_dim: int
    pad_id: int
    pool: str  # open_clip's pooler, e.g. "mean_pooler", "cls_pooler"
    projection: str  # "linear", "mlp" or "none"
    architecture: str  # the transformers class, e.g. "RobertaModel"
    causal: bool = False
    embed_cls: bool = False
    quick_gelu: bool = False
    masks_padding: bool = True  # open_clip's HFTextEncoder masks exactly the ids equal to `pad_id`


class HFTextTower(nn.Module):
    """open_clip's `HFTextEncoder` as a prompt-taking text tower; `state_dict()` keys equal its keys.

    Args:
        encoder: open_clip's `HFTextEncoder`; its transformer, pooler and projection become this
            tower's modules (shared with `encoder`, not copied), so whatever changes one (dtype,
            device, requires_grad, hooks, LoRA) changes the other. Copy `encoder` first to keep an
            independent one.
        name: the model's name, for messages.
        context_length: ids per row of the model's tokenizer (open_clip's default, 77).
    """

    def __init__(self, encoder: HFTextEncoder, name: str | None = None, context_length: int | None = None):
        super().__init__()
        self.name = name
        refusal = hf_tower_refusal(encoder, name)
        if refusal:
            raise ModelError(refusal)
        self.transformer = encoder.transformer
        self.pooler = encoder.pooler
        self.proj = encoder.proj
        config = encoder.config
        width = self.token_embedding.weight.shape[1]
        self.cfg = HFTextConfig(
            vocab_size=self.token_embedding.weight.shape[0],
            context_length=int(context_length or DEFAULT_CONTEXT_LENGTH),
            width=width,
            layers=len(self.blocks),
            embed_dim=int(encoder.output_dim),
            pad_id=int(config.pad_token_id),
            pool=_snake(type(self.pooler).__name__),
            projection=_projection(self.proj),
            architecture=type(self.transformer).__name__,
        )
        self._checkpointing = False

    @property
    def token_embedding(self) -> nn.Module:
        """The encoder's word embedding (NLLB's scales by sqrt(width) in its forward)."""
        return self.transformer.get_input_embeddings()

    @property
    def blocks(self) -> nn.ModuleList:
        """The encoder's layers: the first ModuleList in it (`encoder.layer`, `block`, `layers`)."""
        return _layers(self.transformer)

    @property
    def cuts(self) -> bool:
        """No exact cut per row, no shared prefix: every unmasked token sees every other."""
        return False

    def cut_length(self, eos: torch.Tensor, length: int) -> int:
        """Rows of `length` tokens whose last text tokens are `eos` (N,) need max(eos) + 1 of them:
        the padding after [EOS] is masked, never seen and never pooled."""
        return min(int(eos.max()) + 1, length)

    def pool_positions(self, ids: torch.Tensor) -> torch.Tensor:
        """(N,) each row's last token before the padding ([EOS]): the mask of a prompt row is its
        tokens 0..eos (the pooler reads the mask: the mean over it, or its first token)."""
        text = (ids != self.cfg.pad_id).int()  # (N, L)
        return ids.shape[1] - 1 - text.flip(1).argmax(dim=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (N, L) -> (N, E) features: open_clip's `HFTextEncoder` forward."""
        return self._run({"input_ids": ids}, ids != self.cfg.pad_id)

    def encode_embeddings(
        self,
        x: torch.Tensor,
        eos: torch.Tensor,
        deep_prompts: torch.Tensor | dict | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings (N, L, W), without positions, through the encoder.

        Args:
            x: prompt embeddings; L > max(eos): row n's tokens are 0..eos[n], the rest is masked.
            eos: (N,) each row's last token (`pool_positions`).
            deep_prompts: optional (J-1, N or 1, M, W) tokens that replace the hidden states at
                `slots` before layers 1..J-1, or {layer: (N or 1, M, W)}.
            slots: (N, M) positions of the context slots; required with `deep_prompts`.
        Returns:
            (N, E) features.
        """
        mask = torch.arange(x.shape[1], device=x.device) <= eos[:, None]  # (N, L)
        return self._run({"inputs_embeds": x}, mask, deep_prompts, slots)

    def encode_with_shared_prefix(self, prefix, x, eos, deep_prompts=None, slots=None, inserted=None):
        """`encode_embeddings` of the rows `prefix` (1, P, W) + `x` (N, L-P, W): nothing is computed
        once here (every token sees the rows after the prefix)."""
        if inserted is not None:
            raise ValueError(self.inserted_refusal())
        x = torch.cat([prefix.expand(len(x), -1, -1), x], dim=1)  # (N, L, W)
        return self.encode_embeddings(x, eos, deep_prompts, slots)

    def prefix_keys_values(self, *args, **kwargs):
        raise ValueError(
            f"{self.describe()}: a prefix computed once needs a causal text tower pooled at [EOS]"
        )

    def encode_with_attention(self, *args, **kwargs):
        raise ValueError(f"{self.describe()}: attention maps are read from open_clip's own text blocks only")

    def inserted_refusal(self) -> str:
        """Why tokens cannot be inserted at a layer (MMRL's), one line."""
        return hf_inserted_refusal(self.describe())

    def describe(self) -> str:
        """The tower in words, for messages."""
        owner = f"model {self.name}'s " if self.name else ""
        return f"{owner}text tower (Hugging Face {self.cfg.architecture}, pooled by {self.cfg.pool})"

    @property
    def grad_checkpointing(self) -> bool:
        return self._checkpointing

    @grad_checkpointing.setter
    def grad_checkpointing(self, enable: bool) -> None:
        """Recompute each layer in the backward pass. transformers checkpoints its layers only in
        training mode, and CLIP stays in eval mode (no dropout): each layer's forward is wrapped
        instead (its hooks, the deep prompts', stay outside the recomputation)."""
        self._checkpointing = bool(enable)
        for layer in self.blocks:
            layer.__dict__.pop("forward", None)
            if enable:
                layer.forward = functools.partial(_recomputed, type(layer).forward.__get__(layer))

    def _run(self, inputs: dict, mask: torch.Tensor, deep_prompts=None, slots=None) -> torch.Tensor:
        """The encoder on `inputs` (input_ids or inputs_embeds) under `mask` (N, L), deep tokens
        written at `slots` before their layers, then open_clip's pooler and projection."""
        mask = mask.long()  # as open_clip passes it (its poolers multiply by it)
        handles = [
            self.blocks[i].register_forward_pre_hook(
                functools.partial(_write_slots, tokens=tokens, slots=slots), with_kwargs=True
            )
            for i, tokens in deep_by_block(deep_prompts).items()
        ]
        try:
            out = self.transformer(**inputs, attention_mask=mask)
        finally:
            for handle in handles:
                handle.remove()
        return self.proj(self.pooler(out, mask))


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _write_slots(module, args, kwargs, tokens, slots):
    """Forward pre-hook: the layer's input hidden states (N, L, W) with `tokens` (N or 1, M, W) at
    `slots` (N, M)."""
    x = args[0] if args else kwargs["hidden_states"]
    n, _, width = x.shape
    index = slots.unsqueeze(-1).expand(-1, -1, width)  # (N, M, W)
    x = x.scatter(1, index, tokens.to(x.dtype).expand(n, -1, -1))
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _layers(transformer: nn.Module) -> nn.ModuleList:
    return next(m for m in transformer.modules() if isinstance(m, nn.ModuleList))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # open_clip's pooler names


def _projection(proj: nn.Module) -> str:
    if isinstance(proj, nn.Identity):
        return "none"
    return "linear" if isinstance(proj, nn.Linear) else "mlp"


# open_clip's MaxPooler masks with its own integer mask, which masked_fill refuses
MAX_POOLER = "pools with open_clip's MaxPooler, which fails on its own mask"


def hf_tower_refusal(encoder: nn.Module, name: str | None = None) -> str | None:
    """Why a built `HFTextEncoder` cannot take prompts here (one line naming the model), else None."""
    name = name or type(encoder).__name__
    pooler = type(encoder.pooler).__name__
    if pooler == "MaxPooler":  # masked_fill with open_clip's integer mask raises
        return f"model {name}'s text tower {MAX_POOLER}"
    if not hasattr(encoder, "proj"):  # open_clip sets none for proj_type None at another width
        return f"model {name}'s text tower has no projection from its width to the embedding size"
    config = encoder.config
    if getattr(config, "is_decoder", False):
        return f"model {name}'s Hugging Face text tower is a decoder (causal), not an encoder"
    if not any(isinstance(m, nn.ModuleList) for m in encoder.transformer.modules()):
        return (
            f"model {name}'s Hugging Face text tower {type(encoder.transformer).__name__} has no layer list"
        )
    return None


def hf_inserted_refusal(tower: str) -> str:
    """Why no tokens can be inserted at a layer (MMRL's) of the Hugging Face text `tower` (in words)."""
    return (
        f"{tower} takes no inserted tokens (MMRL's): transformers' encoder fixes the sequence and its "
        "mask before its first layer"
    )


def hf_config_refusal(name: str, text_cfg: dict) -> str | None:
    """Why model `name`'s Hugging Face text tower (its open_clip `text_cfg`) cannot take prompts, else
    None: read from the config alone, nothing built or downloaded."""
    pooler = text_cfg.get("hf_pooler_type", "mean_pooler")  # open_clip's CLIPTextCfg default
    if pooler == "max_pooler":
        return f"model {name}'s text tower {MAX_POOLER}"
    if pooler not in open_clip.hf_model._POOLERS:
        return f"model {name}'s text tower names pooler '{pooler}', which open_clip does not have"
    return None


def hf_tower_config(name: str, reachable=lambda: False) -> HFTextConfig:
    """The `HFTextConfig` of registered model `name`'s Hugging Face text tower, read off the tower
    open_clip builds, on the meta device (no memory, no weights), as loading reads it. Its
    transformers config must be here (inline, a local directory, the cache) or `reachable()`;
    ModelError, in one line, otherwise or for a tower we cannot run."""
    cfg = open_clip.get_model_config(name)
    text_cfg = cfg["text_cfg"]
    refusal = hf_config_refusal(name, text_cfg)
    if refusal:
        raise ModelError(refusal)
    config = hf_text_config(name, text_cfg, reachable)
    with torch.device("meta"), building_with(config):
        encoder = open_clip.model._build_text_tower(cfg["embed_dim"], openclip_text_cfg(text_cfg))
    return HFTextTower(encoder, name, text_cfg.get("context_length")).cfg


def hf_text_config(name: str, text_cfg: dict, reachable):
    """The transformers config of model `name`'s text tower: inline (`text_cfg.hf_config`, a dict
    with `model_type`), a local directory (`hf_model_name`), or the hub's (cached, else downloaded
    when `reachable()`). A one-line ModelError when it cannot be had."""
    from transformers import AutoConfig

    inline = text_cfg.get(INLINE_KEY)
    hub_name = text_cfg["hf_model_name"]
    if inline is not None:
        inline = dict(inline)
        if "model_type" not in inline:
            raise ModelError(f"model {name}: text_cfg.{INLINE_KEY} needs a 'model_type' (e.g. 'roberta')")
        try:
            return AutoConfig.for_model(**inline)
        except (ValueError, TypeError) as e:
            raise ModelError(
                f"model {name}: text_cfg.{INLINE_KEY} is not a transformers config ({e})"
            ) from None
    if os.path.isdir(os.path.expanduser(hub_name)):
        return AutoConfig.from_pretrained(os.path.expanduser(hub_name))
    try:
        return AutoConfig.from_pretrained(hub_name, local_files_only=True)
    except OSError:
        if reachable():
            return AutoConfig.from_pretrained(hub_name)
        raise ModelError(
            f"model {name}'s text tower is the Hugging Face model '{hub_name}', whose config is not in the "
            "Hugging Face cache and the hub cannot be reached (offline?): run once where there is network, "
            "or copy that machine's Hugging Face cache (HF_HOME)"
        ) from None


@contextmanager
def building_with(config):
    """While open_clip builds a model, its `HFTextEncoder` gets `config` for its
    `AutoConfig.from_pretrained(hf_model_name)` (an inline or offline config), and then builds the
    encoder from it exactly as it does for a hub name (`AutoModel.from_config`, the encoder stack of
    an encoder-decoder model)."""
    given = SimpleNamespace(from_pretrained=lambda *args, **kwargs: config)
    with mock.patch.object(open_clip.hf_model, "AutoConfig", given):
        yield


def openclip_text_cfg(text_cfg: dict) -> dict:
    """`text_cfg` as open_clip's `CLIPTextCfg` takes it: without the inline config, and with the
    Hugging Face weights never fetched (they come with the CLIP's weights, or stay random)."""
    return {**{k: v for k, v in text_cfg.items() if k != INLINE_KEY}, "hf_model_pretrained": False}

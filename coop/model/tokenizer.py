"""A model's tokenizer as prompt assembly sees it, and loading it offline.

    tok = load_tokenizer("ViT-B-16-SigLIP", directory="/data/siglip-tokenizer")  # open_clip's own object
    pt = PromptTokenizer(tok)
    pt.encode("a photo of a")        # ids without specials, cleaned as `tok` cleans a text
    pt.sos_id, pt.eos_id, pt.pad_id  # None where the tokenizer has no such token
    pt.wrap(ids)                     # one row of `context_length` ids, exactly as `tok` would give it
    pt(["a photo of a dog."])        # (N, context_length): `tok` itself

open_clip picks the tokenizer from the model config (`open_clip.get_tokenizer`): CLIP's BPE
(`SimpleTokenizer`, shipped with open_clip) unless `text_cfg.hf_tokenizer_name` names a Hugging Face
tokenizer (`HFTokenizer`). A row is `lead + text + trail`, padded on the right to the context length:

    CLIP BPE (CLIP, EVA, PE-Core, MobileCLIP, CoCa)   [SOS] text [EOS] 0 0 ..
    T5 / mT5 SentencePiece (SigLIP, MetaCLIP 2 mT5)   text </s> <pad> ..      no [SOS]
    Gemma (SigLIP2)                                   text <eos> <pad> ..     no [SOS]
    BERT WordPiece (CLIPA, strip_sep_token)           [CLS] text 0 0 ..       [SEP] replaced by 0

A Hugging Face tokenizer comes from the local Hugging Face cache, the hub, or a directory given
as `model.tokenizer` (made with `save_pretrained` where there is network); offline and uncached it
is a one-line `TokenizerError` that says so. Nothing here downloads when the hub is unreachable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
import weakref
from pathlib import Path

import open_clip
import torch
from open_clip.tokenizer import DEFAULT_CONTEXT_LENGTH, SimpleTokenizer, basic_clean, canonicalize_text

from coop.model.text_hf import HFTextConfig
from coop.model.text_support import TextConfig

log = logging.getLogger(__name__)

HUB_HOST = "huggingface.co"
# What `save_pretrained` writes that transformers reads a tokenizer from (a fast tokenizer's file, or
# the config beside a slow tokenizer's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HF_EXTRA = "pip install 'coop[hf]'"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded here (offline, transformers missing) or used for prompts."""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (never, under HF_HUB_OFFLINE=1)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_tokenizer_name(model_name: str) -> str | None:
    """The Hugging Face tokenizer open_clip uses for `model_name`, or None (CLIP's BPE)."""
    text_cfg = (open_clip.get_model_config(model_name) or {}).get("text_cfg", {})
    return text_cfg.get("hf_tokenizer_name") or None


@functools.cache
def clip_bpe(context_length: int = DEFAULT_CONTEXT_LENGTH) -> SimpleTokenizer:
    """CLIP's BPE (open_clip's `SimpleTokenizer`) with `context_length`, built once per length and
    shared: reading its 49k merges takes ~0.2 s, and it keeps no state but a cache of words' BPE."""
    return SimpleTokenizer(context_length=context_length)


def load_tokenizer(model_name: str, directory: str | os.PathLike | None = None):
    """open_clip's tokenizer for a model: `open_clip.get_tokenizer`, or the same tokenizer read from
    `directory` (a saved Hugging Face tokenizer) with the model's context length and options.

    Args:
        model_name: a registered open_clip model name.
        directory: `model.tokenizer`; only for models with a Hugging Face tokenizer.
    Raises:
        TokenizerError: `directory` for a CLIP-BPE model, or not a tokenizer; transformers missing;
            the hub tokenizer neither cached nor reachable.
    """
    if directory is not None and not str(directory).strip():
        raise TokenizerError(
            "model.tokenizer is empty: give a saved Hugging Face tokenizer's directory, or leave the key "
            "unset (model.tokenizer=null) for the model's own tokenizer"
        )
    hub_name = hub_tokenizer_name(model_name)
    if hub_name is None:
        if directory is not None:
            raise TokenizerError(
                f"model.tokenizer={directory}: model {model_name} uses CLIP's BPE tokenizer, which ships with "
                "open_clip; model.tokenizer is for models with a Hugging Face tokenizer (leave it unset)"
            )
        return _model_bpe(model_name, json.dumps(open_clip.get_model_config(model_name), sort_keys=True))
    try:
        import transformers  # noqa: F401  (open_clip's HFTokenizer imports it when built)
    except ImportError:
        raise TokenizerError(
            f"model {model_name} needs the Hugging Face tokenizer '{hub_name}' and transformers is not "
            f"installed: {HF_EXTRA}"
        ) from None
    if directory is not None:
        return _from_directory(model_name, hub_name, Path(directory).expanduser())
    cache, online = _cache_holding(hub_name), hub_reachable()
    if cache is None and not online:
        raise TokenizerError(_unavailable(model_name, hub_name))
    # offline: read the cache without asking the hub (its retries would take a minute)
    kwargs = {} if online else {"cache_dir": cache, "local_files_only": True}
    try:
        return open_clip.get_tokenizer(model_name, **kwargs)
    except OSError as e:
        raise TokenizerError(f"{_unavailable(model_name, hub_name)} ({_first_line(e)})") from None


@functools.lru_cache(maxsize=16)
def _model_bpe(model_name: str, config: str):
    """`open_clip.get_tokenizer(model_name)` for a CLIP-BPE model, built once per model config
    (`config`, its JSON: a config registered again under the name gets its own): reading the BPE
    merges takes ~0.2 s, and every model a process builds loads its tokenizer. (`clip_bpe` is the
    plain BPE by context length, for code that holds no model name.)"""
    return open_clip.get_tokenizer(model_name)


def _from_directory(model_name: str, hub_name: str, path: Path):
    """open_clip's `get_tokenizer` for a Hugging Face tokenizer, with `path` in place of the hub name."""
    if path.is_file():
        raise TokenizerError(
            f"model.tokenizer={path} is a file; give the directory that holds it: model.tokenizer={path.parent}"
        )
    if not path.is_dir():
        raise TokenizerError(
            f"model.tokenizer={path}: no such directory (expected a saved '{hub_name}' tokenizer)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"model.tokenizer={path} holds none of {', '.join(TOKENIZER_FILES)}: give the directory that "
            f"save_pretrained wrote for the tokenizer '{hub_name}'"
        )
    text_cfg = open_clip.get_model_config(model_name)["text_cfg"]
    kwargs = {**text_cfg.get("tokenizer_kwargs", {}), "local_files_only": True}
    try:
        return open_clip.tokenizer.HFTokenizer(
            str(path),
            context_length=text_cfg.get("context_length", DEFAULT_CONTEXT_LENGTH),
            tokenizer_mode=text_cfg.get("tokenizer_mode"),
            **kwargs,
        )
    except (OSError, ValueError) as e:
        raise TokenizerError(
            f"model.tokenizer={path}: not a Hugging Face tokenizer directory for '{hub_name}' ({_one_line(e)})"
        ) from None


def _cache_holding(hub_name: str) -> str | None:
    """The Hugging Face cache directory if it holds the tokenizer `hub_name`, else None."""
    from huggingface_hub import constants, try_to_load_from_cache

    path = try_to_load_from_cache(hub_name, "tokenizer_config.json", cache_dir=constants.HF_HUB_CACHE)
    return constants.HF_HUB_CACHE if isinstance(path, str) and os.path.isfile(path) else None


def _unavailable(model_name: str, hub_name: str) -> str:
    return (
        f"the tokenizer '{hub_name}' of model {model_name} is not in the Hugging Face cache and the hub cannot "
        f"be reached (offline?): pass model.tokenizer=DIR, a directory made where there is network with "
        f"transformers.AutoTokenizer.from_pretrained('{hub_name}').save_pretrained(DIR), or copy that "
        "machine's Hugging Face cache (HF_HOME)"
    )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _one_line(error: BaseException) -> str:
    """The whole message of `error` on one line (transformers' messages list their choices below)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


_BPE_SHA256: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SimpleTokenizer -> its vocab_sha256


class PromptTokenizer:
    """One interface over open_clip's tokenizers (CLIP's `SimpleTokenizer`, `HFTokenizer`,
    `SigLipTokenizer`), for assembling prompts from token ids.

    Args:
        tokenizer: the open_clip tokenizer of the model (`CLIP.tokenizer`).

    Attributes:
        sos_id: the start token every row begins with ([SOS], [CLS]), or None.
        eos_id: the end token after the text ([EOS], </s>), or None when the row carries none
            (CLIPA's stripped [SEP], which reads as 0).
        pad_id: the id that fills a row after the end.
        context_length: ids per row.
        n_special: how many ids a row spends on start and end tokens.
        vocab_size: the ids its vocabulary gives a text, 0..vocab_size-1 (without the tokens a
            Hugging Face tokenizer adds beyond it, such as T5's unused <extra_id_k>).
    """

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.context_length = int(tokenizer.context_length)
        name = type(tokenizer).__name__
        stripped = False
        if isinstance(tokenizer, SimpleTokenizer):
            if tokenizer.reduction_fn is not None:
                raise TokenizerError(
                    f"{name} with a reduction mask (random token dropping) cannot assemble prompts"
                )
            self._encode = tokenizer.encode  # cleans, as its __call__ does
            lead, trail, self.pad_id = [tokenizer.sot_token_id], [tokenizer.eot_token_id], 0
            self.vocab_size, self._vocabulary = len(tokenizer.encoder), lambda: tokenizer.encoder
        elif hasattr(tokenizer, "tokenizer"):  # HFTokenizer, SigLipTokenizer
            hf = tokenizer.tokenizer
            if getattr(tokenizer, "tokenizer_mode", ""):
                raise TokenizerError(f"{name} mode '{tokenizer.tokenizer_mode}' cannot assemble prompts")
            if hf.padding_side != "right":
                raise TokenizerError(f"{name} pads on the {hf.padding_side}; prompts need right padding")
            clean = getattr(tokenizer, "clean_fn", None) or _siglip_clean
            self._encode = lambda text: hf(clean(text), add_special_tokens=False)["input_ids"]
            lead, trail = _specials(hf, name)
            if getattr(tokenizer, "strip_sep_token", False):  # open_clip turns [SEP] into 0 (CLIPA)
                stripped = hf.sep_token_id in trail
                trail = [0 if t == hf.sep_token_id else t for t in trail]
            self.pad_id = hf.pad_token_id
            self.vocab_size, self._vocabulary = int(hf.vocab_size), hf.get_vocab
        else:
            raise TokenizerError(f"unsupported tokenizer {name} (expected one of open_clip's)")
        if len(lead) > 1 or len(trail) > 1:
            raise TokenizerError(
                f"{name} adds {lead} before and {trail} after a text; prompts expect at most one each"
            )
        self.lead, self.trail = lead, trail
        self.sos_id = lead[0] if lead else None
        self.eos_id = trail[0] if trail and not stripped else None
        self.n_special = len(lead) + len(trail)

    def identity(self) -> dict:
        """What a run records of its tokenizer (`check_same_tokenizer`): the vocabulary's size, the
        start, end and padding ids, and a SHA-256 of the vocabulary (every token and its id)."""
        return {
            "vocab_size": self.vocab_size,
            "sos_id": self.sos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "vocab_sha256": self._vocab_sha256(),
        }

    def _vocab_sha256(self) -> str:
        # CLIP's BPE vocabulary is fixed (and its tokenizer shared: `_model_bpe`), so its 49,408 tokens
        # are hashed once per tokenizer object; a Hugging Face tokenizer can gain tokens, so each time
        fixed = isinstance(self.inner, SimpleTokenizer)
        if fixed and (known := _BPE_SHA256.get(self.inner)) is not None:
            return known
        vocabulary = json.dumps(
            sorted(self._vocabulary().items(), key=lambda item: item[1]), ensure_ascii=False
        )
        digest = hashlib.sha256(vocabulary.encode()).hexdigest()
        if fixed:
            _BPE_SHA256[self.inner] = digest
        return digest

    def encode(self, text: str) -> list[int]:
        """The ids of `text` without start/end tokens, after the tokenizer's own cleaning."""
        return list(self._encode(text))

    def wrap(self, ids: list[int]) -> torch.Tensor:
        """(context_length,) ids: start token, `ids`, end token, padding, as the tokenizer lays out a
        text whose `encode` is `ids`. A ValueError if they do not fit."""
        row = self.lead + list(ids) + self.trail
        if len(row) > self.context_length:
            raise ValueError(f"{len(row)} tokens do not fit the context length {self.context_length}")
        return torch.tensor(row + [self.pad_id] * (self.context_length - len(row)), dtype=torch.long)

    def __call__(self, texts: str | list[str]) -> torch.Tensor:
        """(N, context_length) ids: open_clip's tokenizer itself."""
        return self.inner([texts] if isinstance(texts, str) else list(texts))


def prompt_tokenizer(tokenizer) -> PromptTokenizer:
    """`tokenizer` as a `PromptTokenizer` (itself if it already is one)."""
    return tokenizer if isinstance(tokenizer, PromptTokenizer) else PromptTokenizer(tokenizer)


def check_fits(tok: PromptTokenizer, text_cfg: TextConfig | HFTextConfig, model: str, source: str) -> None:
    """TokenizerError, in one line, unless `tok` gives ids that model `model`'s text tower reads as
    its own tokenizer's: every id of its vocabulary and its start, end and padding ids are rows of the
    token embedding, the token the tower pools is its end token (argmax pooling: the highest id;
    `pool="eos"`: the tower's `eos_id`), and the padding id is the one the tower masks (CoCa's, a
    Hugging Face tower's).

    Args:
        tok: the tokenizer.
        text_cfg: the model's text tower (`coop.model.text_support.text_config`).
        model: the model's name, for the message.
        source: where the tokenizer comes from, for the message (e.g. "model.tokenizer=DIR").
    """
    rows, problem = text_cfg.vocab_size, None
    specials = {"start": tok.sos_id, "end": tok.eos_id, "padding": tok.pad_id}
    outside = [f"{what} id {i}" for what, i in specials.items() if i is not None and i >= rows]
    if tok.vocab_size > rows:
        problem = (
            f"its vocabulary has {tok.vocab_size} tokens, more than the {rows} rows of the token embedding"
        )
    elif outside:
        problem = f"its {', '.join(outside)} is beyond the {rows} rows of the token embedding"
    elif text_cfg.masks_padding and tok.pad_id != text_cfg.pad_id:
        problem = f"it pads with id {tok.pad_id}, and the tower masks padding id {text_cfg.pad_id}"
    elif text_cfg.embed_cls:
        pass  # CoCa pools its class token, not one of the text's
    elif text_cfg.pool == "argmax" and (tok.eos_id is None or tok.eos_id < tok.vocab_size - 1):
        problem = (
            f"the tower pools the highest id, and its end token (id {tok.eos_id}) is not its highest id "
            f"({tok.vocab_size - 1})"
        )
    elif text_cfg.pool == "eos" and tok.eos_id != text_cfg.eos_id:
        problem = f"the tower pools the first id {text_cfg.eos_id}, and its end token is id {tok.eos_id}"
    if problem:
        raise TokenizerError(
            f"{source} does not fit model {model}: {problem}; is it another model's tokenizer?"
        )


def check_same_tokenizer(identity: dict, recorded: dict | None, run: str) -> None:
    """TokenizerError, in one line, unless the tokenizer's `identity` (`PromptTokenizer.identity`) is
    the one `run` recorded when it was trained; a run from before coop recorded it gets a warning."""
    if recorded is None:
        log.warning(
            "%s does not record its tokenizer (made before coop recorded it): the tokenizer here is not "
            "checked against the one it was trained with",
            run,
        )
        return
    differ = [k for k in identity if k in recorded and recorded[k] != identity[k]]
    if differ:
        k = differ[0]
        raise TokenizerError(
            f"the tokenizer here is not the one {run} was trained with ({k} {identity[k]} here, {recorded[k]} "
            "there): give that run's tokenizer (model.tokenizer=DIR, or --tokenizer DIR)"
        )


def _siglip_clean(text: str) -> str:
    return canonicalize_text(basic_clean(text))  # open_clip's SigLipTokenizer.__call__


def _specials(hf, name: str) -> tuple[list[int], list[int]]:
    """The ids a Hugging Face tokenizer puts before and after a text (found around a probe text)."""
    probe = "a"
    content = hf(probe, add_special_tokens=False)["input_ids"]
    full = hf(probe)["input_ids"]
    for i in range(len(full) - len(content) + 1):
        if full[i : i + len(content)] == content:
            return full[:i], full[i + len(content) :]
    raise TokenizerError(f"{name}: cannot find the text among its special tokens ({full} around {content})")

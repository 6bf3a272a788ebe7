"""Tiny Hugging Face tokenizers of the open_clip families, built offline with the `tokenizers`
library and saved as directories that transformers loads (`model.tokenizer`): T5-like (SigLIP,
MetaCLIP 2's mT5), BERT-like (CLIPA), Gemma-like (SigLIP2). They make the tiny configs of
`configs/models/` run offline (`tools/make_tokenizer.py`) and serve the tests; their ~100 tokens
are enough for prompts of a few words and class names (other words fall back to characters).

    make_tiny_tokenizer("configs/models/siglip-tiny.json", "tok/siglip")  # the family's kind, checked
    unigram("tok/t5", pad="</s>")                                          # one kind, by hand

Needs transformers and tokenizers (`pip install 'coop[hf]'`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from coop.model.text_support import text_config
from coop.model.tokenizer import (
    PromptTokenizer,
    TokenizerError,
    check_fits,
    hub_reachable,
    hub_tokenizer_name,
    load_tokenizer,
    prompt_tokenizer,
)
from coop.model.weights import resolve_model_name

WORDS = "a photo of the dog cat golden retriever st bernard crane bird airliner long class name x".split()
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789.,()-'"


def unigram(path, pad="<pad>", eos_last=False):
    """A T5-like tokenizer: SentencePiece pieces ("▁word"), no start token, "$A </s>".

    Specials <pad> 0, </s> 1, <unk> 2 (mT5's); `pad="</s>"` pads with </s> (open_clip's SigLIP);
    `eos_last` puts </s> at the largest id instead, as CLIP's [EOS] is, for today's argmax pooling."""
    specials = ["<pad>", "<unk>"] if eos_last else ["<pad>", "</s>", "<unk>"]
    pieces = dict.fromkeys([*specials, *("▁" + w for w in WORDS), "▁", *CHARS, *("▁" + c for c in CHARS)])
    vocab = [(p, 0.0 if p in specials else -2.0 if p[1:] in WORDS else -6.0) for p in pieces]
    if eos_last:
        vocab.append(("</s>", 0.0))
    ids = [p for p, _ in vocab]
    tok = Tokenizer(models.Unigram(vocab, unk_id=ids.index("<unk>")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", ids.index("</s>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token=pad, unk_token="<unk>")
    fast.save_pretrained(path)
    return path


def wordpiece(path):
    """A BERT-like tokenizer: lower-cased WordPiece, "[CLS] $A [SEP]", [PAD] 0."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *CHARS, *("##" + c for c in CHARS[:26])]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(dict.fromkeys(vocab))}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    )
    fast.save_pretrained(path)
    return path


def gemma_like(path):
    """A Gemma-like tokenizer (SigLIP2's): BPE on the raw text with spaces as "▁", no dummy prefix
    ("dog" alone, "▁dog" after a word), "$A <eos>" (no <bos>, as open_clip asks), <pad> 0, <eos> 1."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab, merges = dict.fromkeys([*specials, "▁", *CHARS]), []
    for word in [*WORDS, *("▁" + w for w in WORDS)]:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = None
                merges.append((word[: i - 1], word[i - 1]))
    ids = {t: i for i, t in enumerate(vocab)}
    tok = Tokenizer(models.BPE(ids, merges, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Replace("▁", " ")
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return path


def _specials_first(pieces: list[str], specials: list[str]) -> list[tuple[str, float]]:
    """A Unigram vocabulary: `specials` first (ids 0..), then `pieces`, words likelier than characters."""
    return [
        (p, 0.0 if p in specials else -2.0 if p[1:] in WORDS else -6.0)
        for p in dict.fromkeys(specials + pieces)
    ]


def _sentencepiece(specials: list[str], bpe: bool = False) -> Tokenizer:
    """SentencePiece-like pieces ("▁word"), Unigram or (`bpe`) BPE, `specials` at ids 0.."""
    if bpe:
        vocab, merges = dict.fromkeys([*specials, "▁", *CHARS]), []
        for word in ("▁" + w for w in WORDS):
            for i in range(2, len(word) + 1):
                if word[:i] not in vocab:
                    vocab[word[:i]] = None
                    merges.append((word[: i - 1], word[i - 1]))
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token="<unk>"))
    else:
        pieces = ["▁", *("▁" + w for w in WORDS), *CHARS, *("▁" + c for c in CHARS)]
        vocab = _specials_first(pieces, specials)
        tok = Tokenizer(models.Unigram(vocab, unk_id=[p for p, _ in vocab].index("<unk>")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok


# RoBERTa's, XLM-R's and NLLB's special tokens, at ids 0.. in this order, and their roles
SENTENCE_IDS = ["<s>", "<pad>", "</s>", "<unk>"]
SENTENCE_SPECIALS = dict(
    bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>", unk_token="<unk>"
)


def roberta_like(path):
    """A RoBERTa-like tokenizer: byte-level BPE ("Ġ" marks a leading space), "<s> $A </s>", specials
    <s> 0, <pad> 1, </s> 2, <unk> 3 (roberta-base's ids)."""
    from transformers import RobertaTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab, merges = dict.fromkeys([*SENTENCE_IDS, *sorted(alphabet)]), []
    for word in [*("Ġ" + w for w in WORDS), *WORDS]:  # "Ġ" + first, so "Ġphoto" is one token
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                vocab[word[:i]] = None
                merges.append((word[: i - 1], word[i - 1]))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    fast = RobertaTokenizerFast(
        tokenizer_object=tok,
        **SENTENCE_SPECIALS,
        mask_token="<unk>",
    )
    fast.save_pretrained(path)
    return path


def xlmr_like(path):
    """An XLM-R-like tokenizer: SentencePiece pieces, "<s> $A </s>", <s> 0, <pad> 1, </s> 2, <unk> 3."""
    tok = _sentencepiece(SENTENCE_IDS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        **SENTENCE_SPECIALS,
    )
    fast.save_pretrained(path)
    return path


def nllb_like(path, languages=("eng_Latn", "fra_Latn")):
    """An NLLB-like tokenizer (transformers' NllbTokenizerFast): SentencePiece BPE pieces, each text
    "<source language code> $A </s>" (eng_Latn by default), <s> 0, <pad> 1, </s> 2, <unk> 3, the
    language codes after the pieces."""
    from transformers import NllbTokenizerFast

    tok = _sentencepiece(SENTENCE_IDS, bpe=True)
    tok.add_special_tokens(list(languages))
    fast = NllbTokenizerFast(
        tokenizer_object=tok,
        src_lang=languages[0],
        **SENTENCE_SPECIALS,
        extra_special_tokens=list(languages),
    )
    fast.save_pretrained(path)
    return path


# kind: (builder, what it stands for)
KINDS = {
    "t5": (lambda path: unigram(path, pad="</s>"), "SigLIP's T5 SentencePiece, padded with </s>"),
    "mt5": (unigram, "MetaCLIP 2's mT5 SentencePiece: </s> 1, <pad> 0"),
    "bert": (wordpiece, "CLIPA's BERT WordPiece, [SEP] stripped"),
    "gemma": (gemma_like, "SigLIP2's Gemma BPE"),
    "roberta": (roberta_like, "RoBERTa's byte-level BPE, <s> $A </s>"),
    "xlmr": (xlmr_like, "XLM-R's SentencePiece, <s> $A </s>"),
    "nllb": (nllb_like, "NLLB's SentencePiece BPE, the language code first"),
}


def tiny_kind(model_name: str) -> str:
    """The kind of tiny tokenizer that stands for model `model_name`'s Hugging Face tokenizer; a
    TokenizerError for a model with CLIP's BPE (nothing to make) or a tokenizer no kind stands for."""
    hub_name = hub_tokenizer_name(model_name)
    if hub_name is None:
        raise TokenizerError(
            f"model {model_name} uses CLIP's BPE tokenizer, which ships with open_clip: no tokenizer to make"
        )
    for pattern, kind in (
        ("SigLIP2", "gemma"),
        ("SigLIP", "t5"),
        ("mt5", "mt5"),
        ("xlm-roberta", "xlmr"),
        ("roberta", "roberta"),
        ("nllb", "nllb"),
        ("bert-", "bert"),
    ):
        if pattern in hub_name:
            return kind
    raise TokenizerError(
        f"no tiny tokenizer stands for model {model_name}'s tokenizer '{hub_name}' (kinds: "
        + "; ".join(f"{k}: {what}" for k, (_, what) in KINDS.items())
        + ")"
    )


def make_tiny_tokenizer(model: str, path: str | os.PathLike, kind: str | None = None) -> PromptTokenizer:
    """Save the tiny tokenizer of `model` (an open_clip name or a model-config .json) in directory
    `path`, load it as `model.tokenizer=path` loads it, and check that it fits the model's text tower
    (`check_fits`). `kind` overrides the family's (`tiny_kind`)."""
    name = resolve_model_name(str(model))
    kind = kind or tiny_kind(name)
    if kind not in KINDS:
        raise TokenizerError(f"unknown tiny tokenizer kind '{kind}' (one of {', '.join(KINDS)})")
    with tempfile.TemporaryDirectory() as tmp:  # nothing is left in `path` if it does not fit
        KINDS[kind][0](Path(tmp))
        check_fits(
            prompt_tokenizer(load_tokenizer(name, tmp)),
            text_config(name, hub_reachable),
            name,
            f"the tiny '{kind}' tokenizer",
        )
        shutil.copytree(tmp, path, dirs_exist_ok=True)
    return prompt_tokenizer(load_tokenizer(name, path))

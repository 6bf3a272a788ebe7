"""Tokenizers offline and prompt assembly that does not assume CLIP's BPE (coop.model.tokenizer).

Tiny Hugging Face tokenizers (coop/model/tiny_tokenizers.py, saved as directories that transformers
loads: T5-like SentencePiece/Unigram with no start token, BERT-like WordPiece with [CLS] text [SEP],
Gemma-like BPE) are loaded through `model.tokenizer` into open_clip's HFTokenizer for real
open_clip model names of each family, and compared with open_clip's own `get_tokenizer` reading
the same directory. Nothing may reach the network.
"""

from __future__ import annotations

import json
import sys

import open_clip
import pytest
import torch
from conftest import REPO, TINY_CONFIG, run_tool_in_process, tiny_args
from open_clip.tokenizer import SigLipTokenizer, SimpleTokenizer

import coop
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.model.prompt import PromptError, PromptLearner, prompt_ids
from coop.model.text_support import text_config
from coop.model.tokenizer import PromptTokenizer, TokenizerError, load_tokenizer
from coop.model.weights import load_clip
from coop.train.checkpoint import load_trained

pytest.importorskip("transformers")
from transformers import PreTrainedTokenizerFast  # noqa: E402

from coop.model.tiny_tokenizers import gemma_like, unigram, wordpiece  # noqa: E402

TEXTS = ["a photo of a dog.", "A photo of a St. Bernard (dog).", "golden_retriever", "  x  X x. ", "crane"]
CLASSES = ["dog", "golden_retriever", "St. Bernard", "crane (bird)", "airliner"]


pytestmark = pytest.mark.usefixtures("no_network")  # conftest: any connection fails the test


# family: (open_clip model, tokenizer builder, expected (sos, eos, pad) ids)
FAMILIES = {
    "siglip": ("ViT-B-16-SigLIP", lambda p: unigram(p, pad="</s>"), (None, 1, 1)),
    "siglip2": ("ViT-B-16-SigLIP2", gemma_like, (None, 1, 0)),
    "metaclip2-mt5": ("ViT-L-14-worldwide", unigram, (None, 1, 0)),
    "clipa": ("ViT-L-14-CLIPA", wordpiece, (2, None, 0)),  # [SEP] stripped to 0 (strip_sep_token)
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request, tmp_path):
    model, build, specials = FAMILIES[request.param]
    return model, build(tmp_path / "tok"), specials


def open_clips_own(model: str, directory):
    """open_clip's get_tokenizer on the same tokenizer files (its 'local-dir:' schema)."""
    (directory / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": open_clip.get_model_config(model)})
    )
    return open_clip.get_tokenizer(f"local-dir:{directory}")


def test_model_tokenizer_loads_the_family_tokenizer_as_open_clip_does(family):
    model, directory, (sos, eos, pad) = family
    ours = load_tokenizer(model, directory)
    assert type(ours) is open_clip.tokenizer.HFTokenizer
    reference = open_clips_own(model, directory)
    assert torch.equal(ours(TEXTS), reference(TEXTS))
    pt = PromptTokenizer(ours)
    assert (pt.sos_id, pt.eos_id, pt.pad_id) == (sos, eos, pad)
    assert pt.context_length == open_clip.get_model_config(model)["text_cfg"]["context_length"]


def test_a_row_is_the_tokenizers_own(family):
    """wrap(encode(text)) is open_clip's row for `text`: specials, cleaning, padding, for every family."""
    model, directory, _ = family
    pt = PromptTokenizer(load_tokenizer(model, directory))
    for text in TEXTS:
        assert torch.equal(pt.wrap(pt.encode(text)), pt([text])[0]), text


def test_clip_bpe_interface():
    pt = PromptTokenizer(open_clip.get_tokenizer("ViT-B-16"))
    assert (pt.sos_id, pt.eos_id, pt.pad_id, pt.context_length) == (49406, 49407, 0, 77)
    for text in TEXTS:
        assert torch.equal(pt.wrap(pt.encode(text)), SimpleTokenizer()([text])[0])


def test_clip_bpe_and_text_config_are_read_once_per_model_config(tmp_path):
    """CLIP's BPE tokenizer and the text tower's config (`text_config`) are read once per model
    config, not per model built, and the vocabulary hashed once; a config registered again under the
    same name (another context length) gets a tokenizer and a text config of its own."""
    path = tmp_path / "bpe-once-tiny.json"
    path.write_text(TINY_CONFIG.read_text())
    open_clip.add_model_config(path)
    first = load_tokenizer(path.stem)
    assert load_tokenizer(path.stem) is first and first.context_length == 77
    tower = text_config(path.stem)
    assert text_config(path.stem) is tower and tower.context_length == 77
    config = json.loads(path.read_text())
    config["text_cfg"]["context_length"] = 16
    path.write_text(json.dumps(config))
    open_clip.add_model_config(path)
    assert load_tokenizer(path.stem).context_length == 16 and text_config(path.stem).context_length == 16
    # ... and its vocabulary, fixed, is hashed once per tokenizer (a run records it: `identity`)
    recorded = PromptTokenizer(first).identity()
    again = PromptTokenizer(first)
    again._vocabulary = None  # not read again
    assert again.identity() == recorded
    assert recorded == PromptTokenizer(SimpleTokenizer()).identity()


def test_siglip_tokenizer_cleaning(tmp_path):
    """open_clip's SigLipTokenizer (it canonicalises: lower case, no punctuation) around a tiny T5."""
    tok = SigLipTokenizer.__new__(SigLipTokenizer)  # its constructor reads a SentencePiece file
    tok.tokenizer = PreTrainedTokenizerFast.from_pretrained(unigram(tmp_path / "t5"))
    tok.context_length = 64
    pt = PromptTokenizer(tok)
    assert pt.encode("A Dog.") == pt.encode("a dog")
    for text in TEXTS:
        assert torch.equal(pt.wrap(pt.encode(text)), tok([text])[0])


@pytest.fixture(params=["clip", *sorted(FAMILIES)])
def any_tokenizer(request, tmp_path):
    """CLIP's BPE, or a family's tiny tokenizer loaded through model.tokenizer."""
    if request.param == "clip":
        return PromptTokenizer(load_tokenizer("ViT-B-16"))
    model, build, _ = FAMILIES[request.param]
    return PromptTokenizer(load_tokenizer(model, build(tmp_path / "tok")))


@pytest.mark.parametrize("position", ["end", "middle", "front"])
def test_prompt_layout_against_the_tokenizers_text(any_tokenizer, position):
    """Every class's ids are the tokenizer's own row for "x x x x {name}." with the context's
    tokens moved to the layout's slots; with ctx_init at the end, its row for the whole prompt."""
    pt = any_tokenizer
    names = [c.replace("_", " ") for c in CLASSES]
    ids, name_lens = prompt_ids(pt, position, "x x x x", names)
    start = int(pt.sos_id is not None)
    slots = coop.model.prompt.context_slots(position, 4, name_lens, start)
    for row, name, c, s in zip(ids, names, name_lens, slots, strict=True):
        whole = pt([f"x x x x {name}."])[0]
        ctx = whole[start : start + 4]
        assert len(pt.encode(f"x x x x {name}")) == 4 + c
        assert torch.equal(row[s], ctx)
        keep = torch.ones(len(row), dtype=torch.bool)
        keep[s] = False
        without = torch.cat([whole[:start], whole[start + 4 :]])  # the tokenizer's row minus the context
        assert torch.equal(row[keep], without)
        if start:
            assert row[0] == pt.sos_id
        if position == "front":
            assert s.tolist() == list(range(start + c, start + c + 4))
    if position == "end":
        ids, _ = prompt_ids(pt, "end", "a photo of a", names)
        assert torch.equal(ids, pt([f"a photo of a {n}." for n in names]))


def test_a_name_after_the_context_is_tokenised_as_in_the_text(tmp_path):
    """Gemma-like: "dog" alone is not "▁dog" as it stands in the prompt; the prompt has the latter."""
    pt = PromptTokenizer(load_tokenizer("ViT-B-16-SigLIP2", gemma_like(tmp_path / "gemma")))
    assert pt.encode("dog") != pt.encode("a dog")[1:]
    ids, _ = prompt_ids(pt, "front", "a photo of a", ["dog"])
    dog = pt.encode("a dog")[1:]
    assert ids[0, : len(dog)].tolist() == dog


def test_prompt_too_long_counts_the_tokenizers_specials(tmp_path):
    """CLIPA-like: context 32 = [CLS] + 30 + [SEP]; one token more is refused."""
    pt = PromptTokenizer(load_tokenizer("ViT-L-14-CLIPA", wordpiece(tmp_path / "bert")))
    ok = " ".join(["x"] * 28)
    assert len(pt.encode(ok + " dog.")) == 30
    prompt_ids(pt, "end", ok, ["dog"])
    with pytest.raises(PromptError, match="needs 33 tokens, more than 32"):
        prompt_ids(pt, "end", ok + " x", ["dog"])


@pytest.fixture
def no_sos_clip(tiny_openclip, tmp_path):
    """The tiny CLIP-BPE tower with a T5-like tokenizer (no [SOS]) whose </s> is its largest id,
    so that the tower's argmax pooling finds it; the ids fit the tower's vocabulary."""
    hf = open_clip.tokenizer.HFTokenizer(str(unigram(tmp_path / "t5", eos_last=True)), context_length=77)
    return coop.CLIP.from_openclip(tiny_openclip, tokenizer=hf, name="tiny-t5")


def test_learner_without_sos_matches_the_plain_prompt(no_sos_clip):
    """ctx_init="a photo of a" at the end: the learner's features are the model's own for the text."""
    clip = no_sos_clip
    learner = PromptLearner(clip, CLASSES, ctx_init="a photo of a")
    assert learner.n_sos == 0 and learner.slots[0].tolist() == [0, 1, 2, 3] and learner.shared_prefix == 4
    texts = [f"a photo of a {c.replace('_', ' ')}." for c in CLASSES]
    with torch.no_grad():
        ours = coop.PromptClassifier(clip, learner).text_features()
        plain = clip.encode_text(clip.tokenize(texts))
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "position,csc,depth",
    [("end", False, 1), ("middle", False, 1), ("front", False, 1), ("end", True, 1), ("end", False, 3)]
    + [("middle", False, 2)],
)
def test_learner_without_sos_shared_prefix_equals_full_pass(no_sos_clip, position, csc, depth):
    """[v1..vM] (no [SOS]) as the shared prefix, or nothing shared: the same as every row run whole;
    deep prompts replace the prefix's slots at positions 0.. (no [SOS] kept before them)."""
    learner = PromptLearner(no_sos_clip, CLASSES, n_ctx=4, position=position, csc=csc, depth=depth)
    with torch.no_grad():
        for p in learner.parameters():
            p.normal_()
        ours = coop.PromptClassifier(no_sos_clip, learner).text_features()
        prompts, deep = learner()
        full = no_sos_clip.text.encode_embeddings(prompts, learner.eos, deep, learner.slots)
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-5)
    assert learner.shared_prefix == (0 if csc or position == "front" else 4 if position == "end" else 2)


@pytest.mark.parametrize("position", ["end", "front"])
def test_cocoop_without_sos(no_sos_clip, position):
    """CoCoOp's per-image prefix [ctx_b] (no [SOS]), or no shared prefix at all (front): each
    image's prompts give the features of running them whole."""
    cfg = load_config(None, ["method=cocoop", "prompt.n_ctx=4", f"prompt.position={position}"])
    method = coop.methods.build_method(no_sos_clip, CLASSES, cfg)
    img = torch.randn(2, no_sos_clip.embed_dim)
    with torch.no_grad():
        ours = method.text_features(img)  # (B, n_cls, E)
        pl = method.prompt_learner
        shift = method.meta_net(torch.nn.functional.normalize(img, dim=-1))  # (B, W)
        for b in range(2):
            prompts, _ = pl(pl.ctx + shift[b])
            ref = no_sos_clip.text.encode_embeddings(prompts, pl.eos)
            torch.testing.assert_close(ours[b], ref, rtol=1e-5, atol=1e-5)


def test_offline_without_cache_says_how_to_provide_the_tokenizer(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(TokenizerError) as e:
        load_clip("ViT-B-16-SigLIP", pretrained=None)  # refused before the model is built
    message = str(e.value)
    assert "\n" not in message
    assert "'timm/ViT-B-16-SigLIP'" in message and "model.tokenizer=DIR" in message
    assert "save_pretrained" in message


def test_tokenizer_key_errors(tmp_path, monkeypatch):
    assert load_config(None, [f"model.tokenizer={tmp_path}"]).model.tokenizer == str(tmp_path)
    with pytest.raises(TokenizerError, match="uses CLIP's BPE tokenizer"):
        load_tokenizer("ViT-B-16", tmp_path)
    with pytest.raises(TokenizerError, match="no such directory"):
        load_tokenizer("ViT-B-16-SigLIP", tmp_path / "missing")
    with pytest.raises(
        TokenizerError, match=r"holds none of tokenizer.json, tokenizer_config.json: give the "
    ):
        load_tokenizer("ViT-B-16-SigLIP", tmp_path)  # empty: the files it looks for are named
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(
        TokenizerError, match=r"not a Hugging Face tokenizer directory .*from one of: \(1\)"
    ) as info:
        load_tokenizer("ViT-B-16-SigLIP", tmp_path)  # transformers' choices, on one line
    assert "\n" not in str(info.value) and str(info.value).endswith(".)")
    with pytest.raises(
        TokenizerError,
        match=f"^model.tokenizer={tmp_path / 'tokenizer.json'} is a file; give the directory that holds it: model.tokenizer={tmp_path}$",
    ):
        (tmp_path / "tokenizer.json").write_text("{}")
        load_tokenizer("ViT-B-16-SigLIP", tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="^model.tokenizer is empty"):
        load_tokenizer("ViT-B-16-SigLIP", "")
    with pytest.raises(
        ConfigError,
        match="^model.tokenizer= is empty: give a saved Hugging Face tokenizer's directory, or model.tokenizer=null",
    ):
        load_config(None, ["model.tokenizer="])  # OmegaConf alone reads it as null: the model's own
    assert load_config(None, ["model.tokenizer=null"]).model.tokenizer is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    with pytest.raises(TokenizerError, match=r"pip install 'coop\[hf\]'"):
        load_tokenizer("ViT-B-16-SigLIP", tmp_path)


def test_a_run_reads_model_tokenizer_and_records_it(image_folder, tmp_path, monkeypatch):
    """tools/train.py on a tiny CLIP-tower model whose config names a Hugging Face tokenizer: without
    model.tokenizer, offline, one line; with it, the run trains, records the directory by absolute
    path, and its checkpoint rebuilds the same prompts, all without the network."""
    cfg = json.loads(TINY_CONFIG.read_text())
    cfg["text_cfg"]["hf_tokenizer_name"] = "example/tiny-t5"  # not on any hub, nor in any cache
    model = tmp_path / "coop-tiny-t5.json"
    model.write_text(json.dumps(cfg))
    directory = unigram(tmp_path / "t5", eos_last=True)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    res = run_tool_in_process(
        REPO / "tools" / "train.py", tiny_args(image_folder, out, **{"model.name": model})
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "'example/tiny-t5'" in res.stderr and "model.tokenizer=DIR" in res.stderr
    out = tmp_path / "run2"
    args = tiny_args(image_folder, out, **{"model.name": model, "model.tokenizer": "t5", "train.epochs": 2})
    res = run_tool_in_process(REPO / "tools" / "train.py", args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert load_config(str(out / "config.yaml")).model.tokenizer == str(directory)
    monkeypatch.chdir(REPO)
    clip, learner, _ = load_trained(out / "checkpoint.pt")
    assert learner.n_sos == 0 and clip.tokenizer([" dog"])[0, 1] == len(clip.tokenizer.tokenizer) - 1  # </s>


def test_clip_lora_with_nothing_shared(no_sos_clip, monkeypatch):
    """Without [SOS], prompts that start with the class share no prefix: they run whole."""
    import coop.methods.clip_lora as clip_lora

    monkeypatch.setattr(clip_lora, "CLIP_LORA_TEMPLATE", "{}.")
    method = coop.methods.build_method(
        no_sos_clip, CLASSES, load_config(None, ["method=clip_lora", "lora.dropout=0"])
    )
    assert method.prefix == 0
    with torch.no_grad():
        ours = method.encode_classes()
        whole = no_sos_clip.text.encode_embeddings(
            no_sos_clip.text.token_embedding(method.token_ids), method.eos
        )
    torch.testing.assert_close(ours, whole)

"""The model, its weights and its tokenizer are checked before anything is built or written
(`coop.train.preflight.check_model_files`): a refused model, weights or tokenizer stops
tools/train.py, tools/federated.py and every point of tools/sweep.py in one line, before the run
folder exists; a tokenizer that does not fit the model is refused (`check_fits`); tiny tokenizers
for the tiny configs come from tools/make_tokenizer.py."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, TINY_CONFIG, run_tool_in_process, tiny_args

import coop.model.weights as coop_weights
from coop.model.text_support import TextConfig, text_config
from coop.model.tokenizer import PromptTokenizer, TokenizerError, check_fits, load_tokenizer

pytest.importorskip("transformers")
from coop.model.tiny_tokenizers import make_tiny_tokenizer, unigram, wordpiece  # noqa: E402

MODELS = REPO / "configs" / "models"
HUB = "is not in the Hugging Face cache and the hub cannot be reached"
# a Hugging Face text tower whose transformers config is not here (offline, not cached)
HF_OFFLINE = (
    "model roberta-ViT-B-32's text tower is the Hugging Face model 'roberta-base', whose config is not in the "
    "Hugging Face cache and the hub cannot be reached (offline?): run once where there is network, or copy "
    "that machine's Hugging Face cache (HF_HOME)"
)


pytestmark = pytest.mark.usefixtures("no_network")  # conftest: any connection fails the test


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Saved tiny tokenizers: T5-like padded with </s> (SigLIP's), BERT-like (CLIPA's), a
    tokenizer.json file and an empty directory."""
    root = tmp_path_factory.mktemp("tokenizers")
    (root / "empty").mkdir()
    return {
        "t5": unigram(root / "t5", pad="</s>"),
        "bert": wordpiece(root / "bert"),
        "empty": root / "empty",
        "missing": root / "missing",
    }


def small_vocabulary_config(tmp_path, rows: int = 64):
    """siglip-tiny with a token embedding of `rows` rows, fewer than the tiny T5 tokenizer's 103."""
    cfg = json.loads((MODELS / "siglip-tiny.json").read_text())
    cfg["text_cfg"]["vocab_size"] = rows
    path = tmp_path / "siglip-rows64.json"
    path.write_text(json.dumps(cfg))
    return path


def refusals(tokenizers, tmp_path):
    """(overrides, the one line) of bad models, weights and tokenizers that train.py refuses."""
    siglip, metaclip2 = MODELS / "siglip-tiny.json", MODELS / "metaclip2-tiny.json"
    t5, bert = tokenizers["t5"], tokenizers["bert"]
    return [
        ({"model.name": siglip}, f"the tokenizer 'timm/ViT-B-16-SigLIP' of model siglip-tiny {HUB}"),
        ({"model.name": "ViT-B-16-SigLIP"}, f"the tokenizer 'timm/ViT-B-16-SigLIP' of model ViT-B-16-SigLIP {HUB}"),
        ({"model.name": "roberta-ViT-B-32"}, HF_OFFLINE),
        ({"model.name": "ViT-B-32", "model.pretrained": "laion2b_s34b_b79k"}, "open_clip weights 'laion2b_s34b_b79k' for ViT-B-32 are not in the local cache"),
        ({"model.pretrained": "nosuchtag"}, "pretrained 'nosuchtag' is neither a file nor an open_clip tag of coop-tiny"),
        ({"model.name": "ViT-nosuch"}, "unknown open_clip model 'ViT-nosuch'"),
        ({"model.name": tmp_path / "missing.json"}, f"model config file not found: {tmp_path / 'missing.json'}"),
        ({"model.name": siglip, "model.tokenizer": tokenizers["missing"]}, f"model.tokenizer={tokenizers['missing']}: no such directory"),
        ({"model.name": siglip, "model.tokenizer": tokenizers["empty"]}, f"model.tokenizer={tokenizers['empty']} holds none of tokenizer.json, tokenizer_config.json"),
        ({"model.name": siglip, "model.tokenizer": t5 / "tokenizer.json"}, f"model.tokenizer={t5 / 'tokenizer.json'} is a file; give the directory that holds it: model.tokenizer={t5}"),
        ({"model.name": siglip, "model.tokenizer": ""}, "model.tokenizer= is empty: give a saved Hugging Face tokenizer's directory"),
        ({"model.tokenizer": t5}, f"model.tokenizer={t5}: model coop-tiny uses CLIP's BPE tokenizer"),
        ({"model.name": metaclip2, "model.tokenizer": bert}, f"model.tokenizer={bert} does not fit model metaclip2-tiny: the tower pools the first id 1, and its end token is id 3"),
        ({"model.name": small_vocabulary_config(tmp_path), "model.tokenizer": t5, "prompt.ctx_init": "a photo of a"},
         f"model.tokenizer={t5} does not fit model siglip-rows64: its vocabulary has 103 tokens, more than the 64 rows"),
    ]  # fmt: skip


def test_train_refuses_a_model_weights_or_tokenizer_before_the_run_folder(
    tokenizers, image_folder, tmp_path, monkeypatch
):
    """Each bad model, weights or tokenizer a new user met: one line, exit 2, and no run folder
    (no .lock, config.yaml or log.txt for collect.py to list)."""
    monkeypatch.setattr(coop_weights, "_cached_path", lambda tag_cfg: None)  # no weights cached here
    for extra, message in refusals(tokenizers, tmp_path):
        out = tmp_path / "run"
        res = run_tool_in_process(REPO / "tools" / "train.py", tiny_args(image_folder, out, **extra))
        assert res.returncode == 2, (extra, res.stderr[-2000:])
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), (extra, lines)
        assert not out.exists(), extra


def test_federated_refuses_a_model_before_the_run_folder(image_folder, tmp_path):
    pytest.importorskip("flwr")
    out = tmp_path / "fl"
    args = [
        *tiny_args(image_folder, out, **{"model.name": "roberta-ViT-B-32"}),
        "fl.clients=2",
        "fl.rounds=1",
    ]
    res = run_tool_in_process(REPO / "tools" / "federated.py", args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == ["error: " + HF_OFFLINE]
    assert not out.exists()


def test_sweep_lists_refused_points_and_runs_none_of_them(tokenizers, image_folder, tmp_path):
    """--dry-run marks a point whose model or tokenizer is refused as refused, with its reason, not
    new (exit 2); the sweep itself refuses before any run folder exists."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        f"model.name: [{TINY_CONFIG}, roberta-ViT-B-32, {MODELS / 'siglip-tiny.json'}]\n"
        "model.pretrained: none\ndata.name: imagefolder\n"
        f"data.root: {image_folder}\n"
    )
    args = ["--grid", grid, "--out", tmp_path / "runs"]
    res = run_tool_in_process(REPO / "tools" / "sweep.py", [*args, "--dry-run"])
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("new ") and "coop-tiny" in lines[0]
    assert lines[1].startswith("refused ") and lines[1].endswith(f"({HF_OFFLINE})")
    assert lines[2].startswith("refused ") and HUB in lines[2]
    assert lines[3] == "3 runs: 0 done, 0 to resume, 1 new, 2 refused"
    assert res.stderr.strip().splitlines() == ["error: 2 of 3 points are refused (listed above)"]
    res = run_tool_in_process(REPO / "tools" / "sweep.py", args)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: point model.name=roberta-ViT-B-32: " + HF_OFFLINE
    ], res.stderr[-2000:]
    assert not (tmp_path / "runs").exists()
    grid.write_text(
        grid.read_text().replace(", roberta-ViT-B-32", "") + f"model.tokenizer: {tokenizers['t5']}\n"
    )
    res = run_tool_in_process(REPO / "tools" / "sweep.py", [*args, "--dry-run"])
    assert res.returncode == 2 and "model.tokenizer=" in res.stdout  # coop-tiny refuses a directory
    assert res.stdout.strip().splitlines()[1].startswith("new ")  # siglip-tiny takes it


def fits(tok_dir, model: str = "ViT-B-16-SigLIP", tok_vocab: int | None = None, **text) -> None:
    """`check_fits` of a saved tokenizer, read as `model` reads it, against a text tower of these
    settings (CLIP's otherwise); `tok_vocab` replaces the tokenizer's vocabulary size."""
    tok = PromptTokenizer(load_tokenizer(model, tok_dir))
    tok.vocab_size = tok.vocab_size if tok_vocab is None else tok_vocab
    check_fits(tok, TextConfig(**text), "M", f"model.tokenizer={tok_dir.name}")


def test_the_fit_rule(tokenizers):
    """Every rule of `check_fits`, each against a tokenizer that breaks it and one that keeps it."""
    t5, bert = tokenizers["t5"], tokenizers["bert"]  # ids 0..102, </s> 1, pad 1 | 0..87, [CLS] 2, no end
    clipa = "ViT-L-14-CLIPA"  # [SEP] stripped: no end token
    fits(t5, vocab_size=103, pool="last")
    with pytest.raises(
        TokenizerError,
        match=r"^model.tokenizer=t5 does not fit model M: its vocabulary has 103 tokens, more than the 102 rows",
    ):
        fits(t5, vocab_size=102, pool="last")
    with pytest.raises(TokenizerError, match="its start id 2 is beyond the 2 rows of the token embedding"):
        fits(
            bert, clipa, tok_vocab=1, vocab_size=2, pool="last"
        )  # specials that the vocabulary's size leaves out
    fits(t5, vocab_size=1000, pool="eos", eos_id=1)
    with pytest.raises(TokenizerError, match="the tower pools the first id 2, and its end token is id 1"):
        fits(t5, vocab_size=1000, pool="eos", eos_id=2)
    with pytest.raises(
        TokenizerError,
        match=r"pools the highest id, and its end token \(id 1\) is not its highest id \(102\)",
    ):
        fits(t5, vocab_size=1000, pool="argmax")
    with pytest.raises(TokenizerError, match=r"end token \(id None\) is not its highest id"):
        fits(bert, clipa, vocab_size=1000, pool="argmax")
    with pytest.raises(TokenizerError, match="it pads with id 1, and the tower masks padding id 0"):
        fits(t5, vocab_size=1000, embed_cls=True, pad_id=0)
    fits(bert, clipa, vocab_size=1000, embed_cls=True, pad_id=0)


def test_clips_own_tokenizer_fits_every_clip_bpe_family():
    """CLIP's BPE on the CLIP-BPE models (argmax at [EOS] 49407; CoCa pads with 0)."""
    for name in ("ViT-B-32", "coca_ViT-B-32", "MobileCLIP-S1", "PE-Core-B-16", "EVA02-B-16"):
        check_fits(PromptTokenizer(load_tokenizer(name)), text_config(name), name, "CLIP BPE")


def test_make_tokenizer_makes_each_tiny_config_runnable(tmp_path):
    """tools/make_tokenizer.py saves the family's tiny tokenizer, which loads and fits; a CLIP-BPE
    model and a kind that does not fit are one line, leaving nothing behind."""
    for stem, specials in (("siglip", (None, 1, 1)), ("metaclip2", (None, 1, 0)), ("clipa", (2, None, 0))):
        out = tmp_path / stem
        res = run_tool_in_process(
            REPO / "tools" / "make_tokenizer.py", [MODELS / f"{stem}-tiny.json", "--out", out]
        )
        assert res.returncode == 0, res.stderr[-2000:]
        made = json.loads(res.stdout)
        assert (made["sos_id"], made["eos_id"]) == specials[:2] and (out / "tokenizer.json").is_file()
        assert PromptTokenizer(load_tokenizer("ViT-B-16-SigLIP", out)).pad_id == specials[2]
    res = run_tool_in_process(REPO / "tools" / "make_tokenizer.py", [TINY_CONFIG, "--out", tmp_path / "clip"])
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: model coop-tiny uses CLIP's BPE tokenizer, which ships with open_clip: no tokenizer to make"
    ]
    out = tmp_path / "bert-on-metaclip2"
    args = [MODELS / "metaclip2-tiny.json", "--kind", "bert", "--out", out]
    res = run_tool_in_process(REPO / "tools" / "make_tokenizer.py", args)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "error: the tiny 'bert' tokenizer does not fit model metaclip2-tiny: the tower pools the first id 1, "
        "and its end token is id 3; is it another model's tokenizer?"
    ]
    assert not out.exists() or not any(out.iterdir())  # nothing written
    with pytest.raises(
        TokenizerError,
        match="no tiny tokenizer stands for model ViT-H-14-worldwide's tokenizer 'facebook/xlm-v-base'",
    ):
        make_tiny_tokenizer("ViT-H-14-worldwide", tmp_path / "xlmv")

"""tools/describe.py on a tiny randomly initialised causal language model built here: the sentences are
garbage, the pipeline (offline loading, questions, sampling, cleaning, atomic resumable file) is real."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, make_image_folder, run_tool_in_process

from coop.data.describe import QUESTIONS, clean, describe_class, load_language_model, prompt_for
from coop.data.descriptions import load_descriptions

DESCRIBE = REPO / "tools" / "describe.py"
WORDS = "a the dog cat is has with fur stripes red small large tail ears . , looks like and".split()


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A 1-layer GPT-2 over a word-level tokenizer of ~40 tokens, random weights, saved to a folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-lm")
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *WORDS, "Q", "A", ":", "?", "Describe", "\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(
        folder
    )
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(vocab), n_positions=256, n_embd=16, n_layer=1, n_head=2, eos_token_id=1)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def test_clean_and_prompts():
    assert clean("  A red fox.  It runs.\nQ: more", 50) == "A red fox."
    assert clean("one two three four five", 3) == "one two three"
    assert clean("\n\nlater line\nmore", 5) == "later line" and clean(" \n ", 5) == ""
    assert clean("e.g. a dog", 9) == "e.g. a dog"  # a period inside a word ends nothing
    assert len(QUESTIONS) >= 4 and all("{}" in q for q in QUESTIONS)

    class Chat:
        chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<assistant>"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
            assert not tokenize and add_generation_prompt and not enable_thinking
            return f"<user>{messages[0]['content']}<assistant>"

    q = "Describe what a cat looks like."
    assert prompt_for(Chat(), q, 7) == f"<user>{q} Answer in one sentence of at most 7 words.<assistant>"
    assert prompt_for(object(), q, 7) == f"Q: {q} Answer in one sentence of at most 7 words.\nA:"


def test_seeded_per_class(tiny_lm):
    lm = load_language_model(tiny_lm)
    a = describe_class(lm, "tabby_cat", n=7, max_words=5, seed=1)
    assert len(a) == 7 and all(1 <= len(s.split()) <= 5 for s in a)
    assert describe_class(lm, "tabby_cat", n=7, max_words=5, seed=1) == a  # seeded
    assert describe_class(lm, "tabby_cat", n=7, max_words=5, seed=2) != a
    assert describe_class(lm, "dog", n=7, max_words=5, seed=1) != a
    # an instruction model's chat template, rendered by transformers
    model, tok = load_language_model(tiny_lm)
    tok.chat_template = "{% for m in messages %}Q : {{ m['content'] }}{% endfor %} A :"
    assert (
        prompt_for(tok, "Describe a cat.", 4)
        == "Q : Describe a cat. Answer in one sentence of at most 4 words. A :"
    )
    assert len(describe_class((model, tok), "tabby_cat", n=3, max_words=5, seed=1)) == 3


def test_tool_writes_resumes_and_refuses(tiny_lm, tmp_path):
    classes = tmp_path / "classes.txt"
    classes.write_text("tabby_cat\n\nGolden Retriever\nfire truck\n")
    out = tmp_path / "d.json"
    args = [classes, "--model", tiny_lm, "--out", out, "--sentences", 6, "--max-words", 8, "--seed", 3]
    res = run_tool_in_process(DESCRIBE, args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "3 of 3 classes described" in res.stdout
    first = json.loads(out.read_text())
    assert list(first) == ["tabby_cat", "Golden Retriever", "fire truck"]
    assert all(len(v) == 6 and all(1 <= len(s.split()) <= 8 for s in v) for v in first.values())
    assert (
        load_descriptions(out, ["golden retriever", "tabby cat", "fire_truck"])[0]
        == first["Golden Retriever"]
    )
    # resume: a kept class stays as it is, a missing one comes back as an uninterrupted run wrote it
    kept = {"tabby_cat": ["my own sentence."], "fire truck": first["fire truck"]}
    out.write_text(json.dumps(kept))
    assert run_tool_in_process(DESCRIBE, args).returncode == 0
    again = json.loads(out.read_text())
    assert again == {**kept, "Golden Retriever": first["Golden Retriever"]}
    assert not list(tmp_path.glob(".d.json.*"))  # no temporary left
    # a dataset name: its classes from the folder; own questions
    folder = make_image_folder(tmp_path / "mine", n_train=1, n_test=1)
    questions = tmp_path / "q.txt"
    questions.write_text("What colour is a {}?\n")
    res = run_tool_in_process(
        DESCRIBE,
        ["imagefolder", "--root", folder, "--model", tiny_lm, "--out", tmp_path / "m.json", "--sentences", 2]
        + ["--questions", questions],
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(json.loads((tmp_path / "m.json").read_text())) == ["blue_thing", "green_thing", "red_thing"]
    # bad input: one line each (the first in a real process)
    res = subprocess.run(
        [sys.executable, DESCRIBE, classes, "--model", tmp_path / "none", "--out", tmp_path / "x.json"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: --model {tmp_path / 'none'}: not a folder (a language model saved with save_pretrained)"
    ]
    for bad, message in (
        (["--model", tmp_path], f"error: --model {tmp_path}: no causal language model readable there"),
        (
            ["--model", tiny_lm, "--questions", classes],
            f"error: questions file {classes}: 'tabby_cat' has no '{{}}'",
        ),
    ):
        res = run_tool_in_process(DESCRIBE, [classes, "--out", tmp_path / "x.json", *bad])
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), res.stderr[-2000:]
    res = run_tool_in_process(DESCRIBE, ["nowhere.txt", "--model", tiny_lm, "--out", tmp_path / "x.json"])
    assert res.returncode == 2 and "nowhere.txt is neither a dataset" in res.stderr
    assert not (tmp_path / "x.json").exists()

"""Class descriptions: read in both layouts, and encoded once into the features HiCroPL and CoPrompt use."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch
import torch.nn.functional as F

from coop.data.base import DataError
from coop.data.descriptions import load_descriptions
from coop.methods.descriptions import description_features

SENTENCES = [
    ["A striped cat.", "A small animal with whiskers.", "It purrs."],
    ["A dog with a long tail."],
    ["A red fire truck with a ladder.", "A loud " + "very " * 90 + "long siren."],  # over 77 tokens
]


def openclip_reference(model, sentences_per_class):
    """HiCroPL's and CoPrompt's `gpt_clip_classifier`, one class at a time through open_clip's model."""
    tok = open_clip.get_tokenizer("ViT-B-32")  # CLIP's BPE, 77 tokens, truncating
    per_class, means = [], []
    with torch.no_grad():
        for sentences in sentences_per_class:
            f = model.encode_text(tok(sentences)).float()
            f = f / f.norm(dim=-1, keepdim=True)
            per_class.append(f)
            m = f.mean(dim=0)
            means.append(m / m.norm())
    return per_class, torch.stack(means)


@pytest.mark.parametrize("batch_size", [256, 2])  # one pass; passes that split a class
def test_features_against_the_originals_computation(tiny_clip, tiny_openclip, batch_size):
    feats = description_features(tiny_clip, SENTENCES, batch_size=batch_size)
    per_class, means = openclip_reference(tiny_openclip, SENTENCES)
    assert feats.counts.tolist() == [3, 1, 2]
    assert feats.sentences.shape == (3, 3, tiny_clip.embed_dim)
    torch.testing.assert_close(feats.mean, means, atol=1e-5, rtol=1e-5)
    for c, f in enumerate(per_class):
        torch.testing.assert_close(feats.sentences[c, : len(f)], f, atol=1e-5, rtol=1e-5)
        assert not feats.sentences[c, len(f) :].any()  # padding
    torch.testing.assert_close(feats.mean.norm(dim=-1), torch.ones(3))
    # the mean is not the first sentence's, nor an unnormalised average
    assert not torch.allclose(feats.mean[0], per_class[0][0], atol=1e-3)
    # CoPrompt's pick: sentence i of every class, modulo each class's count
    torch.testing.assert_close(
        feats.pick(1), torch.stack([per_class[0][1], per_class[1][0], per_class[2][1]])
    )
    torch.testing.assert_close(
        feats.pick(torch.tensor([2, 0, 0])),
        torch.stack([p[i] for p, i in zip(per_class, (2, 0, 0), strict=True)]),
    )
    # the truncated sentence is encoded as CLIP's tokenizer cuts it: [EOS] at the last position
    assert tiny_clip.tokenize(SENTENCES[2][1]).argmax(dim=-1).item() == 76
    torch.testing.assert_close(
        feats.sentences[2, 1],
        F.normalize(tiny_clip.encode_text(tiny_clip.tokenize(SENTENCES[2][1]))[0], dim=-1),
    )


def test_no_gradient_and_empty_class_refused(tiny_clip):
    feats = description_features(tiny_clip, SENTENCES[:2])
    assert not feats.mean.requires_grad and not feats.sentences.requires_grad
    with pytest.raises(ValueError, match="at least one sentence"):
        description_features(tiny_clip, [["a cat."], []])


def test_both_layouts_and_matching(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"Yorkshire_terrier": ["a small dog."], "cat": ["a cat.", "whiskers."]}))
    assert load_descriptions(flat, ["cat", "yorkshire terrier"]) == [
        ["a cat.", "whiskers."],
        ["a small dog."],
    ]
    bags = tmp_path / "tap.json"
    bags.write_text(json.dumps({"cat": {"shape": ["round."], "colour": ["grey.", "black."]}}))
    assert load_descriptions(bags, ["cat"]) == [["round.", "grey.", "black."]]
    with pytest.raises(DataError, match=r"has no sentences for class 'dog'$"):
        load_descriptions(flat, ["cat", "dog"])


def test_a_run_refuses_a_class_without_sentences_before_its_folder(image_folder, tmp_path):
    from conftest import REPO, run_tool_in_process, tiny_args

    from coop.config.load import load_config
    from coop.train.preflight import check_data_files

    path = tmp_path / "d.json"  # the folder's classes, sorted: blue_thing, green_thing, red_thing
    path.write_text(json.dumps({"blue thing": ["a blue thing."], "green_thing": ["a green thing."]}))
    out = tmp_path / "run"
    res = run_tool_in_process(
        REPO / "tools" / "train.py", tiny_args(image_folder, out, **{"data.descriptions": path})
    )
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        f"error: data.descriptions: {path} has no sentences for class 'red_thing'"
    ]
    assert not out.exists()
    # the classes the run trains on: base-to-new's base half (2 of 3) is described
    base = tiny_args(image_folder, out, **{"data.descriptions": path, "data.subsample_classes": "base"})
    check_data_files(load_config(None, base))
    with pytest.raises(DataError, match="no sentences for class 'red_thing'"):
        check_data_files(load_config(None, [*base, "data.subsample_classes=new"]))
    # a method that scores with the sentences (HiCroPL) needs the new half too, which the base run scores
    with pytest.raises(DataError, match="no sentences for class 'red_thing'"):
        check_data_files(load_config(None, [*base, "method=hicropl"]))


def test_float32_whatever_the_precision(tiny_clip):
    import copy

    full = description_features(tiny_clip, SENTENCES)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # inside a training step's autocast
        torch.testing.assert_close(description_features(tiny_clip, SENTENCES).mean, full.mean, atol=0, rtol=0)
    half = copy.deepcopy(tiny_clip)
    half.text.half()  # train.precision=fp16
    rounded = copy.deepcopy(tiny_clip)
    rounded.text.half().float()
    got = description_features(half, SENTENCES)
    assert got.mean.dtype == torch.float32 and half.text.token_embedding.weight.dtype == torch.float16
    torch.testing.assert_close(got.mean, description_features(rounded, SENTENCES).mean, atol=0, rtol=0)

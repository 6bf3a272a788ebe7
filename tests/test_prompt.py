"""PromptLearner layouts, deep prompts and the classifier against the reference CoOp computation."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import randomise_prompts

import coop
from coop.model.prompt import PromptError
from coop.reference.coop import coop_text_features

CLASSES = [
    "dog",
    "golden_retriever",
    "St. Bernard",
    "crane (bird)",
    "airliner",
    "a very long compound class name",
]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("csc", [False, True])
@pytest.mark.parametrize("n_ctx", [3, 4])
def test_layouts_match_full_77_token_coop(tiny_openclip, tiny_clip, position, csc, n_ctx):
    learner = randomise_prompts(
        coop.PromptLearner(tiny_clip, CLASSES, n_ctx=n_ctx, position=position, csc=csc)
    )
    with torch.no_grad():
        ours = coop.PromptClassifier(tiny_clip, learner).text_features()
        ref = coop_text_features(tiny_openclip, learner)
    assert ours.shape == (len(CLASSES), tiny_clip.embed_dim)
    assert rel(ours, ref) < 1e-5


@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("csc", [False, True])
def test_deep_prompts_match_reference(tiny_openclip, tiny_clip, position, csc):
    learner = randomise_prompts(
        coop.PromptLearner(tiny_clip, CLASSES, n_ctx=3, position=position, csc=csc, depth=3), seed=1
    )
    with torch.no_grad():
        ours = coop.PromptClassifier(tiny_clip, learner).text_features()
        ref = coop_text_features(tiny_openclip, learner)
        shallow = coop_text_features(tiny_openclip, _shallow_copy(tiny_clip, learner))
    assert rel(ours, ref) < 1e-5
    assert rel(ours, shallow) > 1e-3  # the deep tokens really act


def _shallow_copy(clip, learner):
    shallow = coop.PromptLearner(
        clip, CLASSES, n_ctx=learner.n_ctx, position=learner.position, csc=learner.csc
    )
    with torch.no_grad():
        shallow.ctx.copy_(learner.ctx)
    return shallow


def test_layout_token_order(tiny_clip):
    """end: [SOS][ctx][CLASS][.][EOS], middle: [SOS][ctx/2][CLASS][ctx/2][.][EOS], front:
    [SOS][CLASS][ctx][.][EOS]; the context slots hold the placeholders and [EOS] stays put."""
    x = 49407  # any id would do; we compare against the "X" placeholder id
    name_ids = tiny_clip.tokenizer.encode("golden retriever")
    placeholder = tiny_clip.tokenizer.encode("X")[0]
    for position, expect in {
        "end": [placeholder] * 4 + name_ids,
        "middle": [placeholder] * 2 + name_ids + [placeholder] * 2,
        "front": name_ids + [placeholder] * 4,
    }.items():
        learner = coop.PromptLearner(tiny_clip, ["golden_retriever"], position=position)
        ids = learner.token_ids[0].tolist()
        assert ids[1 : 1 + len(expect)] == expect
        assert ids[len(expect) + 2] == x and int(learner.eos[0]) == len(expect) + 2
        assert [ids[i] for i in learner.slots[0].tolist()] == [placeholder] * 4
    mid = coop.PromptLearner(tiny_clip, ["golden_retriever"], n_ctx=3, position="mid")
    assert mid.position == "middle" and mid.slots[0].tolist() == [
        1,
        1 + 1 + len(name_ids),
        2 + 1 + len(name_ids),
    ]


def test_ctx_init_reproduces_zero_shot(tiny_openclip, tiny_clip):
    learner = coop.PromptLearner(tiny_clip, CLASSES, ctx_init="a photo of a", position="end")
    assert learner.n_ctx == 4 and learner.ctx.shape == (4, tiny_clip.width)
    texts = [f"a photo of a {c.replace('_', ' ')}." for c in CLASSES]
    with torch.no_grad():
        feats = coop.PromptClassifier(tiny_clip, learner).text_features()
        zero_shot = tiny_openclip.encode_text(tiny_clip.tokenize(texts))
    assert rel(feats, zero_shot) < 1e-5
    csc = coop.PromptLearner(tiny_clip, CLASSES, ctx_init="a photo of a", csc=True)
    assert csc.ctx.shape == (len(CLASSES), 4, tiny_clip.width)
    assert torch.equal(csc.ctx[0], csc.ctx[-1]) and torch.equal(csc.ctx[0], learner.ctx)
    assert coop.PromptLearner(tiny_clip, CLASSES, ctx_init="a photo of").n_ctx == 3
    with pytest.raises(PromptError, match="conflicts with ctx_init"):
        coop.PromptLearner(tiny_clip, CLASSES, n_ctx=5, ctx_init="a photo of a")


def test_parameter_shapes(tiny_clip):
    w, n = tiny_clip.width, len(CLASSES)
    shared = coop.PromptLearner(tiny_clip, CLASSES, n_ctx=5)
    assert shared.ctx.shape == (5, w) and shared.deep_ctx is None
    deep = coop.PromptLearner(tiny_clip, CLASSES, n_ctx=2, csc=True, depth=3)
    assert deep.ctx.shape == (n, 2, w) and deep.deep_ctx.shape == (2, n, 2, w)
    assert coop.PromptLearner(tiny_clip, CLASSES, depth=2).deep_ctx.shape == (1, 4, w)
    assert abs(float(shared.ctx.detach().std()) - 0.02) < 0.01


def test_depth_one_equals_shallow(tiny_clip):
    a = coop.PromptLearner(tiny_clip, CLASSES, depth=1)
    torch.manual_seed(0)
    b = randomise_prompts(coop.PromptLearner(tiny_clip, CLASSES, depth=3))
    with torch.no_grad():
        b.ctx.copy_(a.ctx)
        b.deep_ctx.zero_()
        fa = coop.PromptClassifier(tiny_clip, a).text_features()
        b.depth, b.deep_ctx = 1, None  # a depth-3 learner reduced to depth 1 is plain CoOp again
        fb = coop.PromptClassifier(tiny_clip, b).text_features()
    assert torch.allclose(fa, fb, atol=1e-6)


@pytest.mark.parametrize("csc", [False, True])
def test_gradients_reach_ctx_and_every_deep_layer_only(tiny_clip, csc):
    learner = coop.PromptLearner(tiny_clip, CLASSES, csc=csc, depth=3, position="middle")
    classifier = coop.PromptClassifier(tiny_clip, learner)
    trainable = {n for n, p in classifier.named_parameters() if p.requires_grad}
    assert trainable == {"prompt_learner.ctx", "prompt_learner.deep_ctx"}
    images = torch.randn(4, 3, 32, 32)
    loss = torch.nn.functional.cross_entropy(classifier(images), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert learner.ctx.grad is not None and learner.ctx.grad.abs().sum() > 0
    for layer in range(2):
        assert learner.deep_ctx.grad[layer].abs().sum() > 0
    if csc:  # every class's own context gets a gradient
        assert (learner.ctx.grad.abs().sum(dim=(1, 2)) > 0).all()
    assert all(p.grad is None for p in tiny_clip.parameters())


def test_classifier_logits_formula(tiny_clip):
    learner = coop.PromptLearner(tiny_clip, CLASSES)
    classifier = coop.PromptClassifier(tiny_clip, learner)
    classifier.train()
    assert classifier.training and not tiny_clip.training
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        logits = classifier(images)
        img = torch.nn.functional.normalize(tiny_clip.encode_image(images), dim=-1)
        txt = torch.nn.functional.normalize(classifier.text_features(), dim=-1)
        expected = tiny_clip.logit_scale.exp() * img @ txt.T
    assert logits.shape == (3, len(CLASSES))
    assert torch.allclose(logits, expected, atol=1e-5)


def test_invalid_arguments(tiny_clip):
    with pytest.raises(PromptError, match="depth must be in 1..3"):
        coop.PromptLearner(tiny_clip, CLASSES, depth=0)
    with pytest.raises(PromptError, match="depth must be in 1..3"):
        coop.PromptLearner(tiny_clip, CLASSES, depth=4)
    with pytest.raises(PromptError, match="position 'left'"):
        coop.PromptLearner(tiny_clip, CLASSES, position="left")
    with pytest.raises(PromptError, match="class 'word word"):
        coop.PromptLearner(tiny_clip, ["dog", "word " * 75])
    with pytest.raises(PromptError, match="n_ctx must be >= 1"):
        coop.PromptLearner(tiny_clip, CLASSES, n_ctx=0)


def test_grad_checkpointing_gives_same_gradients(tiny_clip):
    learner = randomise_prompts(coop.PromptLearner(tiny_clip, CLASSES, depth=2, position="front"))
    classifier = coop.PromptClassifier(tiny_clip, learner)
    grads = []
    for flag in (False, True):
        tiny_clip.text.grad_checkpointing = flag
        learner.zero_grad()
        classifier.text_features().square().sum().backward()
        grads.append((learner.ctx.grad.clone(), learner.deep_ctx.grad.clone()))
    tiny_clip.text.grad_checkpointing = False
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position", ["end", "middle"])
@pytest.mark.parametrize("depth", [1, 3])
def test_shared_prefix_path_equals_general_path(tiny_clip, depth, position):
    """Shared context computes [SOS][v1..] once; values and gradients must not change."""
    learner = randomise_prompts(
        coop.PromptLearner(tiny_clip, CLASSES, n_ctx=5, depth=depth, position=position)
    )
    assert learner.shared_prefix == (6 if position == "end" else 3)
    classifier = coop.PromptClassifier(tiny_clip, learner)
    results = []
    for general in (False, True):
        learner.zero_grad()
        if general:
            prompts, deep = learner()
            slots = learner.slots if deep is not None else None
            feats = tiny_clip.text.encode_embeddings(prompts, learner.eos, deep, slots)
        else:
            feats = classifier.text_features()
        feats.square().sum().backward()
        results.append([feats.detach()] + [p.grad.clone() for p in learner.parameters()])
    for fast, general in zip(*results, strict=True):  # same math, summed in another order
        assert rel(fast, general) < 1e-5
    assert coop.PromptLearner(tiny_clip, CLASSES, csc=True).shared_prefix == 1
    assert coop.PromptLearner(tiny_clip, CLASSES, position="front").shared_prefix == 1


def test_logits_are_fp32_under_bf16_autocast(tiny_clip):
    """bf16 spaces values near 50 by 0.25, so bf16 logits would tie; they are computed in fp32."""
    learner = randomise_prompts(coop.PromptLearner(tiny_clip, CLASSES))
    classifier = coop.PromptClassifier(tiny_clip, learner)
    image_features = torch.randn(5, tiny_clip.embed_dim).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        text = classifier.text_features()
        logits = classifier.logits(image_features, text)
        again = classifier.logits(image_features)  # text features computed inside
    img = torch.nn.functional.normalize(image_features.float(), dim=-1)
    txt = torch.nn.functional.normalize(text.float(), dim=-1)
    expected = tiny_clip.logit_scale.exp() * img @ txt.T
    assert logits.dtype == again.dtype == torch.float32
    assert torch.allclose(logits, expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(logits, again)

    # Cosines 0.5 and 0.501 at CLIP's scale of 100: 50.0 and 50.1, one bf16 step (0.25) apart at most.
    scale = torch.tensor(100.0).log()
    img = torch.tensor([[1.0, 0.0]]).bfloat16()
    txt = torch.tensor([[0.5, 0.75**0.5], [0.501, (1 - 0.501**2) ** 0.5]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        close = coop.cosine_logits(img, txt, scale)
    assert close.dtype == torch.float32 and float(close[0, 1] - close[0, 0]) == pytest.approx(0.1, abs=1e-4)


def test_ctx_init_word_count_differs_from_coop(tiny_clip, caplog):
    """CoOp learns M = word count of ctx_init; we learn every BPE token and say what CoOp would do."""
    phrase = "a close-up photo of a"
    assert len(tiny_clip.tokenizer.encode(phrase)) == 7 and len(phrase.split(" ")) == 5
    with caplog.at_level(logging.INFO, logger="coop.model.prompt"):
        learner = coop.PromptLearner(tiny_clip, CLASSES, ctx_init=phrase)
    assert learner.n_ctx == 7 and learner.ctx.shape == (7, tiny_clip.width)
    lines = [r.getMessage() for r in caplog.records if r.name == "coop.model.prompt"]
    assert len(lines) == 1 and caplog.records[-1].levelno == logging.WARNING
    assert "5 words but 7 tokens" in lines[0]
    assert "M=5 context vectors" in lines[0] and "other 2 tokens frozen" in lines[0]
    assert "all 7 tokens are learned" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coop.model.prompt"):
        coop.PromptLearner(tiny_clip, CLASSES, ctx_init="a_photo_of_a")  # 4 words, 4 tokens
    assert not [r for r in caplog.records if r.name == "coop.model.prompt"]

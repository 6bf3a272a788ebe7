"""CLIP-LoRA's dropout masks against the original's: in training with dropout every token up to
[EOS] of every class (the shared prefix "[SOS] a photo of a" included) and every token of every
image draws its own mask per target and block, and the text features on those masks equal the
original's 77-token computation; without masks (eval, lora.dropout=0) the prefix is shared as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_clip_lora import CLASSES, build, randomise_adapters, relative_error
from test_image_encoder import build as build_openclip
from test_image_encoder import shrunk_config

from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
from coop.model.clip import CLIP
from coop.model.packing import pack
from coop.reference.clip_lora import text_features as reference_text_features

P = 0.25  # lora.dropout's default
INDEPENDENT = P**2 + (1 - P) ** 2  # the share of elements two independent masks agree on (one mask: 1)


@pytest.fixture(scope="module")
def vit_b():
    """A random shrunk ViT-B-16 (2 + 2 blocks, text width 64, vision width 128), open_clip's and ours."""
    oc = build_openclip(shrunk_config("ViT-B-16", layers=2, text_layers=2))
    return oc, CLIP.from_openclip(oc, name="vit-b")


@pytest.fixture
def masks(monkeypatch):
    """The keep masks of every dropout drawn (F.dropout in training mode with p > 0), in order."""
    drawn = []
    real = F.dropout

    def recording(x, p=0.5, training=True, inplace=False):
        out = real(x, p, training, inplace)
        if training and p > 0:
            assert bool((x != 0).all())  # so a zero in the output marks a dropped element
            drawn.append(out != 0)
        return out

    monkeypatch.setattr(F, "dropout", recording)
    return drawn


def test_text_masks_per_token_of_every_class_as_the_original(vit_b, masks):
    oc, clip = vit_b
    m = build(clip, "lora.towers=[text]")
    randomise_adapters(m)
    m.train()
    assert m.adapters.draws_masks("text") and m.settings["lora_dropout"] == P
    ours = m.text_features()  # (n_cls, E)
    eos, width, layers = m.eos, clip.text.cfg.width, len(clip.text.blocks)
    # One draw per target and block over every class's positions 0..[EOS]: the rows of the
    # original's (77, n_cls, W) draw that reach a feature (those after [EOS] reach none).
    lengths = eos + 1
    assert len(masks) == layers * 3
    assert all(mask.shape == (1, int(lengths.sum()), width) for mask in masks)
    layout = pack(lengths, 0)  # packed row -> (class, position)
    keep = torch.cat([mask[0] for mask in masks], dim=-1)  # (T, layers 3 W)
    assert abs(float(keep.float().mean()) - (1 - P)) < 0.03
    prefix = [
        keep[int(start) : int(start) + m.prefix] for start in layout.offsets
    ]  # (P, layers 3 W) per class
    for a, b in ((0, 1), (0, 2), (1, 2)):  # the classes' masks on the prefix are independent
        assert abs(float((prefix[a] == prefix[b]).float().mean()) - INDEPENDENT) < 0.05

    # The original's computation on the same masks (drawn at random after [EOS]) gives our features
    # and gradients; it differs from the one without dropout.
    ids = clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in CLASSES])  # (3, 77)
    gen = torch.Generator().manual_seed(3)
    full = {}
    for i, mask in enumerate(masks):
        block, target = divmod(i, 3)
        f = torch.rand(len(CLASSES), ids.shape[1], width, generator=gen) >= P  # (n_cls, 77, W)
        f[layout.row, layout.pos] = mask[0]
        full[f"text.{block}.{'qkv'[target]}"] = f
    tensors = m.learnable()
    scale = m.adapters.scale
    ref = reference_text_features(oc, ids, tensors, scale, lambda key, h: h * full[key] / (1 - P))
    assert relative_error(ours, ref) < 1e-5
    with torch.no_grad():
        assert relative_error(reference_text_features(oc, ids, tensors, scale), ref) > 1e-3
    probe = torch.randn(ours.shape, generator=gen)
    our_grads = torch.autograd.grad((ours * probe).sum(), list(tensors.values()))
    ref_grads = torch.autograd.grad((ref * probe).sum(), list(tensors.values()))
    for name, a, b in zip(tensors, our_grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, name
    m.adapters.detach()


def test_grad_checkpointing_recomputes_with_the_same_masks(vit_b):
    _, clip = vit_b
    m = build(clip, "lora.towers=[text]")
    randomise_adapters(m)
    m.train()
    tensors = list(m.learnable().values())
    grads = []
    for checkpointing in (False, True):
        clip.text.grad_checkpointing = checkpointing
        torch.manual_seed(4)
        try:
            grads.append(torch.autograd.grad(m.text_features().square().sum(), tensors))
        finally:
            clip.text.grad_checkpointing = False
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    m.adapters.detach()


def test_image_masks_per_token_of_every_image(vit_b, masks):
    """The original's (tokens, B, W) draw per target and block, here (B, tokens, W)."""
    _, clip = vit_b
    m = build(clip, "lora.towers=[vision]")
    m.train()
    m.image_features(torch.randn(2, 3, clip.image_size, clip.image_size))
    tokens, width = clip.visual.cfg.tokens, clip.visual.cfg.width
    assert len(masks) == len(clip.visual.blocks) * 3
    assert all(mask.shape == (2, tokens, width) for mask in masks)
    keep = torch.stack(masks)  # (blocks 3, 2, tokens, W)
    assert abs(float((keep[:, 0] == keep[:, 1]).float().mean()) - INDEPENDENT) < 0.02
    m.adapters.detach()


@pytest.mark.parametrize("case", ["eval", "dropout 0"])
def test_without_masks_the_prefix_is_shared_as_before(vit_b, masks, case):
    """Evaluation (dropout 0.25) and training with lora.dropout=0 draw no masks, and the text
    features are bit for bit those of the shared prefix computed once."""
    _, clip = vit_b
    m = build(clip, *(["lora.dropout=0"] if case == "dropout 0" else []))
    randomise_adapters(m)
    m.train(case != "eval")
    assert not m.adapters.draws_masks("text")
    with torch.no_grad():
        text, p = clip.text, m.prefix
        x = text.token_embedding(m.token_ids)  # (n_cls, L, W)
        shared = text.encode_with_shared_prefix(x[:1, :p], x[:, p:], m.eos)
        assert torch.equal(m.text_features(), shared) and not masks
        m.adapters.modules_of["text"]["0"].dropout = P  # one adapter with dropout: per class again
        m.train()
        assert m.adapters.draws_masks("text")
        assert not torch.equal(m.text_features(), shared) and masks
    m.adapters.detach()

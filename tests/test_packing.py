"""The packed pass (coop.model.packing): its layout and attention, and parity of outputs and of every
prompt gradient with the full-77 reference for every path that runs prompts, with class names of
every token length ImageNet has (1 up to the longest) in one batch."""

from __future__ import annotations

import pytest
import torch
from conftest import randomise_prompts
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
from test_cocoop import cocoop, grads_of

import coop
from coop.model import packing
from coop.reference.coop import cocoop_logits, coop_text_features, reference_inputs


def one_name_per_length(tokenizer) -> list[str]:
    """The first ImageNet class name of each BPE length: 1 token up to the longest name."""
    by_length = {}
    for name in IMAGENET_CLASSNAMES:
        by_length.setdefault(len(tokenizer.encode(name)), name)
    return [by_length[n] for n in sorted(by_length)]


@pytest.fixture(scope="module")
def names(tiny_clip):
    names = one_name_per_length(tiny_clip.tokenizer)
    lengths = [len(tiny_clip.tokenizer.encode(n)) for n in names]
    longest = max(len(tiny_clip.tokenizer.encode(n)) for n in IMAGENET_CLASSNAMES)
    assert lengths[0] == 1 and lengths[-1] == longest and len(set(lengths)) == len(names) > 5
    return names[::-1] + names[:3]  # longest first, then the short ones again: lengths in no order


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_layout_and_mask_follow_the_definition():
    lengths = torch.tensor([3, 1, 5, 2, 4, 4, 1])
    layout = packing.pack(lengths, prefix=2, chunk=6)
    total = int(lengths.sum())
    assert layout.size == 6 and layout.chunks == 4  # rows [3, 1] [5] [2, 4] [4, 1]: none straddles
    rows = [r for r, n in enumerate(lengths.tolist()) for _ in range(n)]
    assert layout.row.tolist() == rows and layout.last.tolist() == (torch.cumsum(lengths, 0) - 1).tolist()
    assert torch.equal(layout.source[layout.slot], torch.arange(total))
    chunk = layout.slot // layout.size
    for r in range(len(lengths)):
        assert len(set(chunk[layout.row == r].tolist())) == 1
    for t in range(total):  # every real query: all prefix keys, then its row's keys up to itself
        c, q = divmod(int(layout.slot[t]), layout.size)
        seen = layout.mask[c, 0, q]
        assert seen[:2].all()
        want = {int(layout.slot[u]) - c * layout.size for u in range(total) if rows[u] == rows[t] and u <= t}
        assert set(seen[2:].nonzero().squeeze(1).tolist()) == want
    assert packing.pack(lengths, prefix=0, chunk=2).size == 5  # a chunk holds the longest row
    assert packing.pack(lengths, prefix=1, groups=3).mask.shape[0] == 3 * packing.pack(lengths, 1).chunks


def test_packed_attention_equals_per_row_softmax():
    """Direct computation, row by row: softmax over [prefix keys | own keys <= t]."""
    torch.manual_seed(0)
    lengths, heads, dh, prefix, groups = torch.tensor([2, 5, 1, 3, 4]), 2, 4, 3, 2
    layout = packing.pack(lengths, prefix, groups, chunk=7)
    total = int(lengths.sum())
    qkv = torch.randn(groups, total, 3 * heads * dh)
    kp, vp = torch.randn(groups, heads, prefix, dh), torch.randn(groups, heads, prefix, dh)
    out = layout.attention(qkv, heads, kp, vp)
    q, k, v = qkv.view(groups, total, 3, heads, dh).unbind(2)  # each (G, T, H, Dh)
    for g in range(groups):
        for t in range(total):
            own = [u for u in range(total) if layout.row[u] == layout.row[t] and u <= t]
            keys = torch.cat([kp[g].transpose(0, 1), k[g, own]])  # (P + |own|, H, Dh)
            values = torch.cat([vp[g].transpose(0, 1), v[g, own]])
            p = torch.einsum("hd,khd->hk", q[g, t], keys).mul(dh**-0.5).softmax(-1)  # (H, keys)
            want = torch.einsum("hk,khd->hd", p, values).reshape(-1)
            torch.testing.assert_close(out[g, t], want, rtol=1e-5, atol=1e-6)
    last = layout.attention(qkv, heads, kp, vp, out=layout.last)
    torch.testing.assert_close(last, out[:, layout.last])


@pytest.mark.parametrize(
    "position, csc, depth",
    [
        ("end", False, 1),
        ("end", False, 3),  # deep tokens all in the shared prefix
        ("middle", False, 3),  # half in the prefix, half in the rows' own tokens
        ("front", False, 3),  # all in the rows' own tokens
        ("end", True, 3),  # one set per class
        ("middle", True, 1),
        ("front", True, 3),
    ],
)
def test_outputs_and_gradients_equal_the_reference(tiny_openclip, tiny_clip, names, position, csc, depth):
    learner = randomise_prompts(
        coop.PromptLearner(tiny_clip, names, n_ctx=4, position=position, csc=csc, depth=depth), seed=2
    )
    classifier = coop.PromptClassifier(tiny_clip, learner)
    weights = torch.randn(len(names), tiny_clip.embed_dim, generator=torch.Generator().manual_seed(3))
    results = []
    for compute in (classifier.text_features, lambda: coop_text_features(tiny_openclip, learner)):
        learner.zero_grad(set_to_none=True)
        feats = compute()
        (feats * weights).sum().backward()  # a loss that weighs every feature differently
        results.append((feats.detach(), {k: p.grad.clone() for k, p in learner.prompt_tensors().items()}))
    (ours, g_ours), (ref, g_ref) = results
    assert rel(ours, ref) < 1e-5
    assert set(g_ours) == ({"ctx", "deep_ctx"} if depth > 1 else {"ctx"})
    for key, grad in g_ref.items():
        assert grad.abs().max() > 0, key
        assert rel(g_ours[key], grad) < 1e-5, key
    if csc:  # every class's own context gets its own gradient
        assert (g_ours["ctx"].abs().sum(dim=(1, 2)) > 0).all()


@pytest.mark.parametrize("chunk", [1, 16, 256], ids=["chunk-per-row", "small", "one-chunk"])
def test_chunk_size_changes_nothing(tiny_clip, names, monkeypatch, chunk):
    learner = randomise_prompts(coop.PromptLearner(tiny_clip, names, n_ctx=3, position="middle", depth=2))
    classifier = coop.PromptClassifier(tiny_clip, learner)
    results = []
    for size in (None, chunk):
        if size:
            monkeypatch.setattr(packing, "CHUNK", size)
        learner.zero_grad(set_to_none=True)
        feats = classifier.text_features()
        feats.square().sum().backward()
        results.append([feats.detach(), learner.ctx.grad.clone(), learner.deep_ctx.grad.clone()])
    for a, b in zip(*results, strict=True):
        assert rel(a, b) < 1e-5


def test_one_pass_whatever_the_lengths(tiny_clip, names):
    """Every block's MLP runs once per forward (one matrix multiply each), whatever the lengths."""
    learner = coop.PromptLearner(tiny_clip, names, position="front", csc=True)
    calls = []
    hooks = [
        b.mlp.c_fc.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
        for b in tiny_clip.text.blocks
    ]
    try:
        with torch.no_grad():
            coop.PromptClassifier(tiny_clip, learner).text_features()
    finally:
        for h in hooks:
            h.remove()
    own = int((learner.eos + 1 - learner.shared_prefix).sum())  # every prompt's own tokens
    assert len(set((learner.eos + 1).tolist())) >= 8  # ")." is one token: "(bird of prey)." has 5
    width, layers = tiny_clip.width, len(tiny_clip.text.blocks)
    prefix = [(1, 1, width)] * (layers - 1)  # [SOS] once; the last block's prefix output is never read
    packed = [(1, own, width)] * (layers - 1) + [(1, len(names), width)]  # last block: each row's [EOS]
    assert calls == prefix + packed


@pytest.mark.parametrize(
    "prompt",
    [
        {"position": "end"},
        {"position": "middle", "n_ctx": 4, "depth": 3},
        {"position": "front", "depth": 2},
        {"position": "end", "csc": True},
    ],
    ids=["end", "middle-deep", "front-deep", "end-csc"],
)
def test_cocoop_batch_equals_reference_loop(tiny_clip, tiny_openclip, names, prompt):
    method = cocoop(tiny_clip, classes=names, **prompt)
    images = torch.randn(3, tiny_clip.embed_dim, generator=torch.Generator().manual_seed(4)) * 3
    inputs = reference_inputs(tiny_openclip, method.prompt_learner)
    ours = method.logits(images)
    ref, _ = cocoop_logits(tiny_openclip, method.prompt_learner, method.meta_net, images, inputs)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    g_ours, g_ref = grads_of(method, ours), grads_of(method, ref)
    assert set(g_ours) == set(g_ref)
    for key, grad in g_ref.items():
        assert grad.abs().max() > 0, key
        assert rel(g_ours[key], grad) < 1e-4, key


def test_tiles_and_chunk_size():
    lengths = torch.tensor([3, 5, 2, 7, 9, 1])
    assert packing.tiles(lengths, size=8) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5), slice(5, 6)]
    assert packing.tiles(lengths, groups=2, size=16) == packing.tiles(lengths, size=8)  # G tokens per row
    assert packing.tiles(lengths, size=100) == [slice(0, 6)]
    # rows of 20 after [SOS]: 32 slots hold one (65 kept rows per row), 40 hold two (81 per pair)
    # at fewer scores (40 x 41 < 2 x 32 x 33); 60 would hold three but at more scores
    assert packing.chunk_size([20] * 10, prefix=1) == 40
    assert packing.chunk_size([16] * 4, prefix=1) == 32
    assert packing.pack(torch.tensor([20] * 10), prefix=1).size == 40
    assert packing.pack(torch.tensor([20] * 10), prefix=1, chunk=32).size == 32  # asked for: kept


@pytest.mark.parametrize("tile", [1, 12])
def test_tiles_equal_the_full_sequence(tiny_clip, monkeypatch, tile):
    """Rows in tiles (1: one row each) against the full-sequence blocks (`encode_with_attention`):
    a shared prefix [SOS][v1 v2], per-row tokens at its slots (unsharing it) and shared deep tokens."""
    monkeypatch.setattr(packing, "TILE", tile)
    text, width = tiny_clip.text, tiny_clip.width
    gen = torch.Generator().manual_seed(3)
    eos = torch.tensor([3, 9, 4, 6, 3, 12, 5])  # absolute [EOS] positions after a 3-token prefix
    prefix = torch.randn(1, 3, width, generator=gen, requires_grad=True)
    x = torch.randn(len(eos), 10, width, generator=gen, requires_grad=True)
    per_row = torch.randn(len(eos), 3, width, generator=gen, requires_grad=True)  # block 1, every row
    shared = torch.randn(1, 3, width, generator=gen, requires_grad=True)  # block 2
    slots = torch.tensor([1, 2, 3]).expand(len(eos), -1)  # two in the prefix, one in each row
    deep = {1: per_row, 2: shared}
    ours = text.encode_with_shared_prefix(prefix, x, eos, deep, slots)
    full = torch.cat([prefix.expand(len(eos), -1, -1), x], 1)  # (N, 13, W)
    ref = text.encode_with_attention(full, eos, deep, slots)[0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    weights = torch.randn(ref.shape, generator=gen)
    grads = [torch.autograd.grad((out * weights).sum(), (prefix, x, per_row, shared)) for out in (ours, ref)]
    for a, b in zip(*grads, strict=True):
        assert b.abs().max() > 0
        assert rel(a, b) < 1e-5


def test_a_layout_is_built_once_and_never_as_inference_tensors():
    """The same lengths give the same Packing object (built once: every step and every TPT image
    asks for it again); one first asked for under inference mode still serves a forward with a graph."""
    from coop.model.packing import pack

    lengths = torch.tensor([3, 5, 2, 7, 4])
    with torch.inference_mode():
        first = pack(lengths, 2, groups=2)
    again = pack(lengths.clone(), 2, groups=2)
    assert again is first and not first.mask.is_inference() and not first.row.is_inference()
    assert pack(lengths, 3, groups=2) is not first and pack(torch.tensor([3, 5, 2, 7, 5]), 2, 2) is not first
    x = torch.randn(1, int(lengths.sum()), 6, requires_grad=True)
    x[:, again.source].sum().backward()  # the cached index tensor in a graph
    assert x.grad is not None

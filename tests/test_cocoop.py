"""CoCoOp: the batched shared-prefix path against the per-image reference loop, what trains,
the meta-net's semantics, the chunked memory mode, transfer and the benchmark (runs end to end:
test_kgcoop.py, with all methods)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_CONFIG, randomise_prompts
from omegaconf import OmegaConf

from coop.methods import TransferError, build_method
from coop.reference.coop import cocoop_logits, reference_inputs

CLASSES = [
    "dog",
    "golden_retriever",
    "St. Bernard",
    "crane (bird)",
    "airliner",
    "a very long compound class name",
]


def cocoop(clip, classes=CLASSES, seed=1, chunk=1024, **prompt):
    p = {"n_ctx": 3, "ctx_init": None, "position": "end", "csc": False, "depth": 1, **prompt}
    cfg = OmegaConf.create(
        {"method": "cocoop", "data": {"name": "dtd"}, "prompt": p, "cocoop": {"chunk_prompts": chunk}}
    )
    torch.manual_seed(seed)
    method = build_method(clip, classes, cfg)
    randomise_prompts(method.prompt_learner, seed)  # N(0, 1) context: every slot matters
    return method


def grads_of(method, out) -> dict[str, torch.Tensor]:
    method.zero_grad(set_to_none=True)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a loss that weighs every logit
    return {k: v.grad.clone() for k, v in method.learnable().items()}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "prompt",
    [
        {"position": "end"},
        {"position": "middle"},
        {"position": "middle", "n_ctx": 4, "depth": 3},  # deep prompts, in the prefix and after it
        {"position": "front", "csc": True, "depth": 2},  # only [SOS] shared
    ],
    ids=["end", "middle", "middle-deep", "front-csc-deep"],
)
def test_batched_equals_reference_loop(tiny_clip, tiny_openclip, prompt):
    method = cocoop(tiny_clip, **prompt)
    images = torch.randn(3, tiny_clip.embed_dim) * 4  # B > 1, unnormalised as the image tower gives them
    inputs = reference_inputs(tiny_openclip, method.prompt_learner)
    ours = method.logits(images)
    ref, ref_text = cocoop_logits(tiny_openclip, method.prompt_learner, method.meta_net, images, inputs)
    g_ours, g_ref = grads_of(method, ours), grads_of(method, ref)
    with torch.no_grad():
        text = method.text_features(images)
    assert ours.shape == (3, len(CLASSES)) and text.shape == (3, len(CLASSES), tiny_clip.embed_dim)
    assert rel(text, ref_text) < 1e-5
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    expected = {"ctx", "meta_net.linear1.weight", "meta_net.linear1.bias"}
    expected |= {"meta_net.linear2.weight", "meta_net.linear2.bias"}
    expected |= {"deep_ctx"} if prompt.get("depth", 1) > 1 else set()
    assert set(g_ours) == expected
    for key in g_ours:
        assert g_ref[key].abs().max() > 0, key
        assert rel(g_ours[key], g_ref[key]) < 1e-4, key


def test_batch_one_gives_the_per_image_gradients(tiny_clip, tiny_openclip):
    """Batch 1, as the original trains: the same loss and gradients as its per-image code."""
    method = cocoop(tiny_clip, position="end")
    image, label = torch.randn(1, tiny_clip.embed_dim), torch.tensor([2])
    loss, logits = method.loss(image, label)
    ref, _ = cocoop_logits(tiny_openclip, method.prompt_learner, method.meta_net, image)
    ref_loss = F.cross_entropy(ref, label)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    method.zero_grad(set_to_none=True)
    loss.backward()
    ours = {k: v.grad.clone() for k, v in method.learnable().items()}
    method.zero_grad(set_to_none=True)
    ref_loss.backward()
    for key, grad in ours.items():
        assert rel(grad, method.learnable()[key].grad) < 1e-4, key


@pytest.mark.parametrize(
    "position, chunk",
    [("end", 4), ("middle", 13), ("front", 5)],  # blocks of classes within an image; of two images
)
def test_chunked_checkpointed_path_is_the_same(tiny_clip, position, chunk):
    """train.grad_checkpointing: blocks of at most chunk_prompts prompts, recomputed in backward."""
    images = torch.randn(3, tiny_clip.embed_dim)
    whole = cocoop(tiny_clip, position=position)
    ref = whole.logits(images)
    g_ref = grads_of(whole, ref)
    method = cocoop(tiny_clip, position=position, chunk=chunk)
    tiny_clip.text.grad_checkpointing = True
    try:
        out = method.logits(images)
        grads = grads_of(method, out)
    finally:
        tiny_clip.text.grad_checkpointing = False
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for key in grads:
        assert rel(grads[key], g_ref[key]) < 1e-5, key
    with torch.no_grad():  # evaluation always runs in blocks (here of 8 prompts)
        torch.testing.assert_close(cocoop(tiny_clip, position=position, chunk=1).logits(images), ref.detach())


def test_meta_net_semantics_and_what_trains(tiny_clip):
    method = cocoop(tiny_clip)
    e, w = tiny_clip.embed_dim, tiny_clip.width
    net = method.meta_net
    assert net.linear1.weight.shape == (e // 16, e) and net.linear2.weight.shape == (w, e // 16)
    assert isinstance(net.relu, torch.nn.ReLU)
    trainable = {n for n, p in method.named_parameters() if p.requires_grad}
    assert trainable == {"prompt_learner.ctx"} | {f"meta_net.{n}" for n, _ in net.named_parameters()}
    # the meta-net sees the L2-normalised feature: scaling an image changes nothing
    images = torch.randn(2, e)
    with torch.no_grad():
        torch.testing.assert_close(method.logits(images), method.logits(images * 7.5))
        # a zero meta-net leaves CoOp: every image sees the same class features
        for p in net.linear2.parameters():
            p.zero_()
        text = method.text_features(images)
    torch.testing.assert_close(text[0], text[1])


def test_initial_prompt_with_silent_meta_net_is_zero_shot_clip(tiny_clip, tiny_openclip):
    cfg = OmegaConf.create(
        {
            "method": "cocoop",
            "data": {"name": "dtd"},
            "prompt": {
                "n_ctx": None,
                "ctx_init": "a photo of a",
                "position": "end",
                "csc": False,
                "depth": 1,
            },
        }
    )
    method = build_method(tiny_clip, CLASSES, cfg)
    with torch.no_grad():
        for p in method.meta_net.linear2.parameters():
            p.zero_()
        images = torch.randn(2, tiny_clip.embed_dim)
        ids = tiny_clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES])
        text = tiny_openclip.encode_text(ids)
        want = tiny_openclip.logit_scale.exp() * F.normalize(images, dim=-1) @ F.normalize(text, dim=-1).T
        torch.testing.assert_close(method.logits(images), want, rtol=1e-5, atol=1e-4)


def test_transfer_shared_and_refuse_csc(tiny_clip):
    source = cocoop(tiny_clip)
    target = cocoop(tiny_clip, classes=["purple thing", "grey thing"], seed=5)
    target.load_learnable(source.learnable(), CLASSES)
    for key, t in source.learnable().items():
        assert torch.equal(target.learnable()[key], t), key
    with torch.no_grad():
        assert target.logits(torch.randn(4, tiny_clip.embed_dim)).shape == (4, 2)
    csc = cocoop(tiny_clip, csc=True)
    with pytest.raises(TransferError, match="class-specific"):
        cocoop(tiny_clip, classes=CLASSES[:2], csc=True).load_learnable(csc.learnable(), CLASSES)


def test_bench_cocoop_runs_on_the_tiny_model(capsys):
    from test_bench import load_tool

    args = ["--model", str(TINY_CONFIG), "--classes", "5", "--batch", "2", "--repeats", "1", "--warmup", "0"]
    assert load_tool("bench_cocoop").main([*args, "--position", "middle"]) == 0
    out = capsys.readouterr().out
    assert "10 prompts per step" in out and "speed-up:" in out
    grads = re.search(r"gradients, .*: ctx ([0-9.e+-]+), meta_net.linear1.weight ([0-9.e+-]+)", out)
    assert grads and max(float(g) for g in grads.groups()) < 1e-4

"""CLIP-LoRA on timm image towers: the adapters on timm's q/k/v projections (a fused `qkv` Linear
with its bias, EVA's fused weight with separate q/v biases, or `q_proj`/`k_proj`/`v_proj`).

1. Logits, loss and every adapter gradient against the reference (open_clip's own forward on the
   merged weights, `coop.reference.clip_lora`), on shrunk towers of each projection kind; merged
   weights in open_clip's forward; hooks that change no state dict or dtype and come off again;
   grad checkpointing with dropout: the same gradients.
2. End to end on the tiny family models (SigLIP, EVA02, PE-Core; each with its own text tower):
   both towers against the reference, then two training steps; a run killed with SIGKILL and
   resumed is bit-identical; CNN towers are refused in one line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    TINY_CONFIG,
    build_family,
    kill_at_first_checkpoint,
    randomise_text_tower,
    shrunk_timm,
    tiny_args,
)
from test_clip_lora import CLASSES, build, randomise_adapters, relative_error
from test_image_timm import small_tower

from coop.config.load import load_config
from coop.methods import build_method
from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
from coop.model.clip import CLIP
from coop.model.errors import ModelError
from coop.reference.clip_lora import clip_lora_logits
from coop.reference.clip_lora import image_features as reference_image_features
from coop.train.runner import train_run

# model -> how its timm attention computes q, k and v
KINDS = {
    "ViT-B-16-SigLIP2": "fused qkv Linear with bias (timm Attention)",
    "EVA02-B-16": "separate q_proj/k_proj/v_proj (EvaAttention)",
    "PE-Core-B-16": "fused qkv Linear with bias (AttentionRope)",
    "EVA01-g-14": "fused qkv weight through F.linear, q_bias/v_bias (EvaAttention)",
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def models(request):
    """(open_clip's model, ours): a shrunk timm image tower (2 blocks, width 64) and the tiny
    config's text tower (randomised) projecting to the image tower's feature width."""
    visual = small_tower(request.param)
    with torch.no_grad():
        width = visual(torch.zeros(1, 3, *visual.image_size)).shape[-1]
    cfg = json.loads(TINY_CONFIG.read_text())
    torch.manual_seed(0)
    oc = randomise_text_tower(open_clip.CLIP(width, cfg["vision_cfg"], cfg["text_cfg"])).eval()
    oc.visual = visual
    return oc, CLIP.from_openclip(copy.deepcopy(oc), name=request.param)  # the adapters' hooks stay on ours


def images_for(clip, n: int = 2) -> torch.Tensor:
    size = clip.image_size
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "overrides", [[], ["lora.towers=[vision]", "lora.targets=[k,v]", "lora.layers=[1]", "lora.rank=3"]]
)
def test_logits_and_every_gradient_match_the_reference(models, overrides):
    oc, clip = models
    m = build(clip, *overrides)
    m.eval()  # dropout off: the reference merges the updates into the weights
    randomise_adapters(m)
    tensors = m.learnable()
    assert {k.split(".")[0] for k in tensors} == ({"vision"} if overrides else {"text", "vision"})
    images, labels = images_for(clip), torch.tensor([0, 2])
    ids = clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in CLASSES])
    ref = clip_lora_logits(oc, images, ids, tensors, m.adapters.scale)
    loss, ours = m.loss(images, labels)
    assert relative_error(ours, ref) < 1e-5
    ref_loss = F.cross_entropy(ref, labels)
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    our_grads = torch.autograd.grad(loss, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
    for name, a, b in zip(tensors, our_grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, name
    m.adapters.detach()  # the module's CLIP is shared with other tests


def test_hooks_change_nothing_of_clip_and_come_off(models):
    """The state dict (keys, dtypes, values) is CLIP's while adapted; a second set of adapters
    replaces the first; detach leaves no hook and gives the frozen features bit for bit."""
    oc, clip = models
    images = images_for(clip)
    with torch.no_grad():
        frozen = clip.encode_image(images)
    before = {k: v.clone() for k, v in clip.state_dict().items()}
    first, second = build(clip, "lora.towers=[vision]", seed=0), build(clip, "lora.towers=[vision]", seed=1)
    for method, seed in ((first, 0), (second, 1)):
        randomise_adapters(method, seed)
        method.eval()
    assert all(p.shape == (64, 2) for k, p in first.learnable().items() if k.endswith("_B"))
    first.adapters.attach()
    second.adapters.attach()  # replaces the first: only the second's updates
    attn = clip.visual.blocks[0].attn
    assert getattr(attn, "qkv_bias_separate", False) == (clip.name == "EVA01-g-14")
    with torch.no_grad():
        adapted = clip.encode_image(images)
        ref = reference_image_features(oc.visual, images, second.learnable(), second.adapters.scale)
    assert relative_error(adapted, ref) < 1e-5 and relative_error(adapted, frozen) > 1e-2
    after = clip.state_dict()
    assert list(after) == list(before)
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    merged = copy.deepcopy(oc.visual)  # the merged weights in open_clip's own forward
    weights = {k.removeprefix("visual."): v for k, v in second.adapters.merged_weights().items()}
    assert len(weights) == (6 if clip.name == "EVA02-B-16" else 2)  # q_proj, k_proj, v_proj or qkv per block
    merged.load_state_dict(weights, strict=False)
    with torch.no_grad():
        assert relative_error(merged(images), adapted) < 1e-5
    second.adapters.detach()
    hooked = [m for m in clip.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert not hooked and not getattr(attn, "qkv_bias_separate", False)
    with torch.no_grad():
        assert torch.equal(clip.encode_image(images), frozen)


def test_grad_checkpointing_with_dropout_gives_the_same_gradients(models):
    """In training mode with dropout, the recomputed blocks run the hooks again on the same masks
    (torch's checkpoint restores the random state): the same loss and gradients."""
    _, clip = models
    m = build(clip, "lora.towers=[vision]", "lora.dropout=0.5")
    randomise_adapters(m)
    m.train()
    images, labels = images_for(clip), torch.tensor([0, 2])
    tensors = list(m.learnable().values())
    runs = []
    for checkpointing in (False, True):
        m.grad_checkpointing = checkpointing
        torch.manual_seed(3)
        loss = m.loss(images, labels)[0]
        runs.append((loss.detach(), torch.autograd.grad(loss, tensors)))
    (loss, grads), (again, ckpt_grads) = runs
    assert torch.equal(loss, again)
    for a, b in zip(grads, ckpt_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.manual_seed(4)  # other masks: another loss (dropout acts)
    assert not torch.equal(m.loss(images, labels)[0].detach(), loss)
    m.adapters.detach()


# --- 2. the tiny family models, end to end -------------------------------------------------------

FAMILIES = {"siglip": "siglip-tiny", "eva02": "eva02-tiny", "pe-core": "pe-core-tiny"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_both_towers_match_the_reference_and_train_on_the_family(family, tmp_path, monkeypatch):
    """lora.towers=[text,vision] on the family's tiny model (its own text tower and timm image
    tower; EVA02's and PE-Core's on 2 of their 12 blocks): logits and every gradient equal the reference's (eval, adapters randomised); two AdamW
    steps in training mode (dropout on): the loss is finite, every A and B moves, and no weight of
    CLIP receives a gradient."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = None
    if family == "siglip":
        from coop.model.tiny_tokenizers import unigram

        tok = unigram(tmp_path / "tok", pad="</s>")
    with shrunk_timm(depth=2) if family in ("eva02", "pe-core") else contextlib.nullcontext():
        clip, oc = build_family(FAMILIES[family], tok)
    method = build_method(clip, CLASSES, load_config(None, ["method=clip_lora", "lora.towers=[text,vision]"]))
    tensors = method.learnable()
    assert len(tensors) == 6 * (len(clip.text.blocks) + clip.visual.layers)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from B = 0, small enough for 12 blocks
        for p in tensors.values():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    method.eval()
    images, labels = images_for(clip), torch.tensor([0, 2])
    ids = clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in CLASSES])  # full context
    ref_loss = F.cross_entropy(clip_lora_logits(oc, images, ids, tensors, method.adapters.scale), labels)
    loss = method.loss(images, labels)[0]
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    our_grads = torch.autograd.grad(loss, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
    for name, a, b in zip(tensors, our_grads, ref_grads, strict=True):
        assert relative_error(a, b) < 1e-4, name

    before = {k: v.detach().clone() for k, v in tensors.items()}
    optimizer = torch.optim.AdamW(list(tensors.values()), lr=1e-2)
    method.train()
    for _ in range(2):
        loss = method.loss(images, labels)[0]
        assert bool(torch.isfinite(loss))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    still = [k for k, v in method.learnable().items() if torch.equal(v.detach(), before[k])]
    assert not still, still
    assert all(p.grad is None and not p.requires_grad for p in clip.parameters())


def test_killed_and_resumed_run_on_eva02_is_bit_identical(image_folder, tmp_path):
    """tools/train.py with both towers adapted on EVA02's tiny model (separate q/k/v projections,
    RoPE; 2 of its 12 blocks), killed with SIGKILL after its first checkpoint and resumed: the same
    adapters, loss and accuracy as the run that was never stopped."""
    extra = {
        "model.name": REPO / "configs" / "models" / "eva02-tiny.json",
        "method": "clip_lora",
        "train.epochs": 2,
        "train.lr": 0.01,
    }
    out = tmp_path / "killed"
    cmd = [sys.executable, str(REPO / "tools" / "train.py"), *tiny_args(image_folder, out, **extra)]
    with shrunk_timm(depth=2):  # the tool's process is forked inside: the same tower
        whole = train_run(load_config(None, tiny_args(image_folder, tmp_path / "whole", **extra)))
        kill_at_first_checkpoint(cmd, out)
        assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] < 2, "killed too late"
        resumed = train_run(load_config(None, tiny_args(image_folder, out, **extra)))
    final = torch.load(out / "checkpoint.pt", weights_only=True)["prompt"]
    want = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)["prompt"]
    assert {k.split(".")[0] for k in want} == {"text", "vision"}
    assert final.keys() == want.keys() and all(torch.equal(final[k], v) for k, v in want.items())
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert resumed["accuracy"] == whole["accuracy"]


def test_cnn_towers_refuse_the_vision_adapters_in_one_line():
    """MobileCLIP-S's FastViT (a CNN) takes no vision adapters; lora.towers=[text] runs."""
    clip, _ = build_family("mobileclip-s-tiny")
    with pytest.raises(ModelError) as e:
        build_method(clip, CLASSES, load_config(None, ["method=clip_lora"]))
    message = str(e.value)
    assert message.startswith("method=clip_lora adapts the image tower (lora.towers), and model")
    assert "\n" not in message and "lora.towers=[text]" in message
    text_only = build_method(clip, CLASSES, load_config(None, ["method=clip_lora", "lora.towers=[text]"]))
    assert {k.split(".")[0] for k in text_only.learnable()} == {"text"}
    text_only.adapters.detach()

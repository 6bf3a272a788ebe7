"""Our ViT image tower: parity with open_clip, refusals, and vision prompts against the reference.

Tolerances (relative to the largest |feature|): fp32 1e-5; bf16 autocast 2e-2 against open_clip in
fp32 and against open_clip under the same autocast (open_clip keeps its residual stream in bf16,
ours in fp32, so the two round differently). Gradients w.r.t. prompts: 1e-4 in fp32.
"""

from __future__ import annotations

import copy
import json

import open_clip
import pytest
import torch
from conftest import TINY_CONFIG
from open_clip.timm_model import TimmModel
from torch import nn

import coop
from coop.model.clip import cosine_logits
from coop.model.errors import ModelError
from coop.model.image_encoder import ImageTransformer
from coop.reference.vision import vision_features
from coop.reference.vision_prompts import ivlp_logits, maple_logits, vpt_logits
from coop.train.features import cache_key, weights_fingerprint

# Every standard OpenCLIP ViT this forward covers, shrunk to a few layers and a small image; each
# keeps its family's options: patch size, head width, MLP ratio, activation.
ARCHS = [
    "ViT-B-32",
    "ViT-B-32-quickgelu",
    "ViT-B-16",
    "ViT-B-16-quickgelu",
    "ViT-L-14",
    "ViT-L-14-quickgelu",
    "ViT-H-14",
    "ViT-H-14-quickgelu",
]
FP32_TOL, BF16_TOL, GRAD_TOL = 1e-5, 2e-2, 1e-4


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial LayerNorm weights and biases everywhere, so that no term hides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def shrunk_config(name: str, layers: int = 3, text_layers: int = 1, **vision) -> dict:
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    v = cfg["vision_cfg"]
    head_width = v.get("head_width", 64)
    v.update(layers=layers, width=2 * head_width, image_size=3 * v["patch_size"], **vision)
    cfg["text_cfg"].update(width=64, heads=2, layers=text_layers)
    cfg["embed_dim"] = 32
    return cfg


def build(cfg: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomise(open_clip.CLIP(**cfg), seed)


@pytest.fixture(scope="module")
def vit():
    """A shrunk ViT-B-16 (3 vision and 3 text layers, 2 heads) and its CLIP wrapper."""
    oc = build(shrunk_config("ViT-B-16", text_layers=3))
    return oc, coop.CLIP.from_openclip(oc, name="ViT-B-16-small")


# --- 1. the plain tower ---------------------------------------------------------------------


@pytest.mark.parametrize("name", [*ARCHS, "coop-tiny"])
def test_features_match_open_clip_fp32_and_bf16(name):
    cfg = json.loads(TINY_CONFIG.read_text()) if name == "coop-tiny" else shrunk_config(name, layers=2)
    oc = build(cfg)
    clip = coop.CLIP.from_openclip(oc, name=name)
    tower = clip.visual
    assert clip.supports_vision_prompts and clip.image_forward == "coop"
    assert tower.cfg.quick_gelu == name.endswith("quickgelu")
    assert tower.cfg.patch_size == cfg["vision_cfg"]["patch_size"]
    assert tower.cfg.width // tower.cfg.heads == cfg["vision_cfg"].get("head_width", 64)
    size = tower.cfg.image_size
    images = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = oc.encode_image(images)
        assert relative_error(clip.encode_image(images), ref) < FP32_TOL
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours_bf16 = clip.encode_image(images)
            ref_bf16 = oc.encode_image(images)
    assert ours_bf16.dtype == torch.bfloat16
    assert relative_error(ours_bf16, ref) < BF16_TOL
    assert relative_error(ours_bf16, ref_bf16) < BF16_TOL


def test_state_dict_keys_are_open_clips_visual_keys(vit):
    oc, clip = vit
    ref = {k.removeprefix("visual.") for k in oc.state_dict() if k.startswith("visual.")}
    assert set(clip.visual.state_dict()) == ref
    assert all(not p.requires_grad for p in clip.visual.parameters())
    assert clip.visual.layers == 3 and clip.visual.width == 128
    # weights are copied: changing ours leaves open_clip's model untouched
    assert clip.visual.proj.data_ptr() != oc.visual.proj.data_ptr()
    assert torch.equal(clip.visual.proj, oc.visual.proj)


def test_key_and_shape_mismatches_are_one_line_errors(vit):
    oc, _ = vit
    extra = copy.deepcopy(oc.visual)
    extra.register_buffer("extra_thing", torch.zeros(1))
    with pytest.raises(
        ValueError, match=r"image-tower keys differ from OpenCLIP's: missing \[\], extra \['extra_thing'\]"
    ):
        ImageTransformer.from_openclip(extra)
    wrong = copy.deepcopy(oc.visual)
    wrong.positional_embedding = nn.Parameter(torch.zeros(5, 128))
    with pytest.raises(
        ValueError, match=r"shape mismatch for visual.positional_embedding: \(5, 128\) vs \(10, 128\)"
    ):
        ImageTransformer.from_openclip(wrong)


RN_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
}


@pytest.mark.parametrize(
    "vision, problem",
    [
        (None, r"is a ResNet \(a CNN\): it has no tokens"),
        ({"ls_init_value": 0.1}, "layer scale"),
    ],
)
def test_other_towers_keep_open_clips_forward_and_refuse_prompts(vision, problem):
    if vision is None:
        cfg = {**RN_TINY, "text_cfg": shrunk_config("ViT-B-16")["text_cfg"]}
    else:
        cfg = shrunk_config("ViT-B-16", layers=2, **vision)
    oc = build(cfg)
    clip = coop.CLIP.from_openclip(oc, name="odd-model")
    assert clip.visual is oc.visual and not clip.supports_vision_prompts and clip.image_forward == "open_clip"
    size = clip.image_size
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():  # the feature-based methods run on these towers exactly as before
        assert torch.equal(clip.encode_image(images), oc.encode_image(images))
    prompts = [torch.zeros(2, 8)]
    with pytest.raises(ModelError, match=f"^model odd-model.*{problem}") as e:
        clip.encode_image(images, prompts)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="odd-model"):
        clip.require_vision_prompts()


def test_load_clip_names_the_model_and_the_cache_key_records_the_forward(vit, tmp_path):
    clip = coop.load_clip(str(TINY_CONFIG))
    assert clip.name == "coop-tiny" and clip.supports_vision_prompts
    clip.require_vision_prompts()  # no error
    oc, ours = vit
    theirs = coop.CLIP(oc.visual, ours.text, oc.logit_scale, ours.tokenizer)  # open_clip's forward
    assert theirs.image_forward == "open_clip" and not theirs.supports_vision_prompts
    args = ([], "transform", 1, None, "fp32", False)
    # the same weights and state-dict keys, yet two forwards: the caches never mix
    assert cache_key(ours, *args) != cache_key(theirs, *args)
    assert cache_key(ours, *args) == cache_key(coop.CLIP.from_openclip(oc), *args)


def _same_weights(tower: nn.Module, src: nn.Module) -> nn.Module:
    tower.load_state_dict(src.state_dict())  # strict: every key and shape
    assert weights_fingerprint(tower) == weights_fingerprint(src)
    return tower.eval()


def test_cache_key_records_how_the_tower_pools_not_only_its_weights(vit):
    oc, ours = vit
    args = ([], "transform", 1, None, "fp32", False)
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(3))

    def key(visual: nn.Module) -> str:  # open_clip's forward of `visual`
        return cache_key(coop.CLIP(visual, ours.text, oc.logit_scale, ours.tokenizer), *args)

    def features(visual: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            out = visual(images)
        return out[0] if isinstance(out, tuple) else out

    base = key(oc.visual)
    twin = _same_weights(build(shrunk_config("ViT-B-16", text_layers=3), seed=5).visual, oc.visual)
    assert key(twin) == base  # identical settings and weights: one cache entry
    # CLIPA's average pooling, then with ln_post after pooling: the same weights file, other features
    towers = [oc.visual] + [
        _same_weights(build(shrunk_config("ViT-B-16", text_layers=3, **vision)).visual, oc.visual)
        for vision in ({"pool_type": "avg"}, {"pool_type": "avg", "final_ln_after_pool": True})
    ]
    for a, b in zip(towers[:-1], towers[1:], strict=True):
        assert relative_error(features(a), features(b)) > 1e-3
    assert len({key(t) for t in towers}) == 3
    tokens = _same_weights(
        build(shrunk_config("ViT-B-16", text_layers=3, output_tokens=True)).visual, oc.visual
    )
    assert key(tokens) != base  # its forward returns the tokens too
    # our forward: QuickGELU or GELU is a setting, not a weight
    quick = build(shrunk_config("ViT-B-16-quickgelu", text_layers=3))
    quick.load_state_dict(oc.state_dict())
    assert cache_key(coop.CLIP.from_openclip(quick), *args) != cache_key(ours, *args)
    # a timm trunk pooled by its average or by its class token
    avg = TimmModel("test_vit", 32, image_size=32, pool="avg").eval()
    token = _same_weights(TimmModel("test_vit", 32, image_size=32, pool="token"), avg)
    small = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert relative_error(token(small), avg(small)) > 1e-3
    assert key(avg) != key(token)
    assert key(avg) == key(_same_weights(TimmModel("test_vit", 32, image_size=32, pool="avg"), avg))


def test_prompt_shapes_are_checked(vit):
    _, clip = vit
    images = torch.randn(1, 3, 48, 48)
    w = clip.visual.width
    with pytest.raises(ValueError, match="vision prompt depth 4 exceeds the image tower's 3 layers"):
        clip.encode_image(images, [torch.zeros(2, w)] * 4)
    with pytest.raises(ValueError, match=r"at least 1 token per layer \(vision.n_ctx >= 1\)"):
        clip.encode_image(images, [torch.zeros(0, w)])
    with pytest.raises(ValueError, match=r"prompts\[1\] has shape \(3, 128\); expected \(2, 128\)"):
        clip.encode_image(images, [torch.zeros(2, w), torch.zeros(3, w)])
    with pytest.raises(ValueError, match="empty list"):
        clip.encode_image(images, [])


# --- 2. vision prompts against the reference on open_clip's modules -------------------------


def make_prompts(depth: int, m: int = 2, width: int = 128, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(m, width, generator=gen).requires_grad_() for _ in range(depth)]


def features_and_grads(fn, prompts, images, weight):
    """fn(images, prompts) -> (B, E); its value and d(sum(weight * features))/d prompts."""
    prompts = [p.detach().clone().requires_grad_() for p in prompts]
    feats = fn(images, prompts)
    grads = torch.autograd.grad((feats * weight).sum(), prompts)
    return feats.detach(), grads


def wrong_variant(visual, images, prompts, mistake):
    """The reference with one deliberate mistake, to show the tests would catch it."""
    x = visual.conv1(images).flatten(2).transpose(1, 2)  # (B, P, W)
    b, m = len(x), prompts[0].shape[0]
    x = torch.cat([visual.class_embedding.expand(b, 1, -1), x], dim=1) + visual.positional_embedding
    first = prompts[0].expand(b, -1, -1)
    if mistake == "positional embedding on the prompts":
        first = first + visual.positional_embedding[-m:]
    if mistake in ("prepended after the class token", "prepended, replaced at the end"):
        x = torch.cat([x[:, :1], first, x[:, 1:]], dim=1)
    elif mistake == "prepended before the class token":
        x = torch.cat([first, x], dim=1)
    elif mistake == "ln_pre before appending":
        x = torch.cat([visual.ln_pre(x), first], dim=1)
    else:
        x = torch.cat([x, first], dim=1)
    if mistake != "ln_pre before appending":
        x = visual.ln_pre(x)
    for i, block in enumerate(visual.transformer.resblocks):
        if 1 <= i < len(prompts):
            new = prompts[i].expand(b, -1, -1)
            if mistake == "prepended after the class token":
                x = torch.cat([x[:, :1], new, x[:, 1 + m :]], dim=1)
            elif mistake == "prepended before the class token":
                x = torch.cat([new, x[:, m:]], dim=1)
            elif mistake == "added instead of replaced":
                x = torch.cat([x[:, :-m], x[:, -m:] + new], dim=1)
            else:
                x = torch.cat([x[:, :-m], new], dim=1)
        x = block(x)
    return visual.ln_post(x[:, 0]) @ visual.proj


MISTAKES = [
    "positional embedding on the prompts",
    "prepended before the class token",  # the pooled token 0 is then a prompt
    "ln_pre before appending",
    "prepended, replaced at the end",  # deeper prompts overwrite patch tokens
    "added instead of replaced",
]


@pytest.mark.parametrize("depth", [1, 3])
def test_prompted_tower_matches_the_reference_and_not_its_wrong_variants(vit, depth):
    oc, clip = vit
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    prompts = make_prompts(depth)
    weight = torch.randn(2, 32, generator=torch.Generator().manual_seed(3))
    ours, ours_grads = features_and_grads(clip.encode_image, prompts, images, weight)
    ref, ref_grads = features_and_grads(
        lambda x, p: vision_features(oc.visual, x, p), prompts, images, weight
    )
    assert relative_error(ours, ref) < FP32_TOL
    for g, r in zip(ours_grads, ref_grads, strict=True):
        assert relative_error(g, r) < GRAD_TOL
    with torch.no_grad():
        plain = clip.encode_image(images)
    assert relative_error(ours, plain) > 1e-2  # the prompts matter
    for mistake in MISTAKES if depth > 1 else MISTAKES[:3]:  # the last two need deeper layers
        wrong, wrong_grads = features_and_grads(
            lambda x, p, mistake=mistake: wrong_variant(oc.visual, x, p, mistake), prompts, images, weight
        )
        assert wrong.shape == ours.shape
        assert relative_error(wrong, ref) > 100 * FP32_TOL, mistake
        assert max(relative_error(g, r) for g, r in zip(wrong_grads, ref_grads, strict=True)) > 100 * GRAD_TOL
    # Without positional embedding and mask, attention is blind to order: prompts kept right after
    # the class token (inserted and replaced there) give the same features, as they must.
    same, _ = features_and_grads(
        lambda x, p: wrong_variant(oc.visual, x, p, "prepended after the class token"),
        prompts,
        images,
        weight,
    )
    assert relative_error(same, ref) < FP32_TOL


def test_the_deepest_prompts_do_not_leak_and_checkpointing_is_exact(vit):
    _, clip = vit
    images = torch.randn(2, 3, 48, 48)
    prompts = make_prompts(3)
    weight = torch.randn(2, 32)
    plain, plain_grads = features_and_grads(clip.encode_image, prompts, images, weight)
    ckpt, ckpt_grads = features_and_grads(
        lambda x, p: clip.encode_image(x, p, grad_checkpointing=True), prompts, images, weight
    )
    assert torch.allclose(plain, ckpt, atol=1e-6)
    for g, r in zip(plain_grads, ckpt_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-6)
    # replaced prompts get a gradient only through the blocks after them: none is zero here
    assert all(float(g.abs().max()) > 0 for g in plain_grads)
    # per-image prompts (B, M, W) equal shared ones repeated
    per_image = [p.detach().expand(2, -1, -1) for p in prompts]
    with torch.no_grad():
        assert torch.allclose(clip.encode_image(images, per_image), plain, atol=1e-6)


# --- 3. the VPT / IVLP / MaPLe references against our two towers ----------------------------


def maple_inputs(clip, names=("red thing", "green thing", "blue thing")):
    """ids of "a photo of a {name}." with the 2 tokens after [SOS] learnable, as MaPLe's n_ctx=2."""
    ids = clip.tokenize([f"a photo of a {n}." for n in names])
    slots = torch.zeros(ids.shape, dtype=torch.bool)
    slots[:, 1:3] = True
    return ids, slots


def our_text(clip, ids, slots, ctx, deep):
    """Our text tower on the same prompts: context in place, deep tokens at the slot positions."""
    eos = ids.argmax(dim=-1)
    x = clip.text.token_embedding(ids).masked_scatter(
        slots.unsqueeze(-1).expand(-1, -1, ctx.shape[-1]),
        ctx.expand(len(ids), -1, -1).reshape(-1, ctx.shape[-1]),
    )
    positions = slots.nonzero()[:, 1].view(len(ids), -1)  # (n_cls, M)
    return clip.text.encode_embeddings(x, eos, deep.unsqueeze(1), positions)


def test_vpt_reference_matches_ours(vit):
    oc, clip = vit
    images = torch.randn(2, 3, 48, 48)
    ids, _ = maple_inputs(clip)
    prompts = make_prompts(3, m=4)
    ref = vpt_logits(oc, images, ids, prompts)
    ours = cosine_logits(clip.encode_image(images, prompts), clip.encode_text(ids), clip.logit_scale)
    assert relative_error(ours, ref) < FP32_TOL
    g_ref = torch.autograd.grad(ref.logsumexp(-1).sum(), prompts)
    g_ours = torch.autograd.grad(ours.logsumexp(-1).sum(), prompts)
    assert all(relative_error(a, b) < GRAD_TOL for a, b in zip(g_ours, g_ref, strict=True))


@pytest.mark.parametrize("depth", [1, 3])
def test_ivlp_and_maple_references_match_ours(vit, depth):
    oc, clip = vit
    images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(4))
    ids, slots = maple_inputs(clip)
    gen = torch.Generator().manual_seed(5)
    ctx = (
        clip.text.token_embedding.weight[ids[0, 1:3]] + 0.1 * torch.randn(2, 64, generator=gen)
    ).requires_grad_()
    deep = torch.randn(depth - 1, 2, 64, generator=gen).requires_grad_()
    vision = make_prompts(depth, m=2, seed=6)
    projections = nn.ModuleList(nn.Linear(64, 128) for _ in range(depth))
    labels = torch.tensor([0, 2])

    def loss_and_grads(logits, tensors):
        loss = nn.functional.cross_entropy(logits, labels)
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)  # deep is empty at depth 1
        return loss.detach(), [torch.zeros(0) if g is None else g for g in grads]

    # IVLP: independent text and vision prompts
    tensors = [ctx, deep, *vision]
    ref = ivlp_logits(oc, images, ids, slots, ctx, deep, vision)
    ours = cosine_logits(
        clip.encode_image(images, vision), our_text(clip, ids, slots, ctx, deep), clip.logit_scale
    )
    assert relative_error(ours, ref) < FP32_TOL
    (ref_loss, ref_grads), (our_loss, our_grads) = loss_and_grads(ref, tensors), loss_and_grads(ours, tensors)
    assert abs(float(ref_loss - our_loss)) < 1e-5
    for name, a, b in zip(["ctx", "deep", *["vision"] * depth], our_grads, ref_grads, strict=True):
        if b.numel():
            assert relative_error(a, b) < GRAD_TOL, name

    # MaPLe: vision prompts are projections of the text prompts; gradients reach the text side
    tensors = [ctx, deep, *projections.parameters()]
    ref = maple_logits(oc, images, ids, slots, ctx, deep, projections)
    layers = [ctx, *deep]
    coupled = [project(t) for project, t in zip(projections, layers, strict=True)]
    ours = cosine_logits(
        clip.encode_image(images, coupled), our_text(clip, ids, slots, ctx, deep), clip.logit_scale
    )
    assert relative_error(ours, ref) < FP32_TOL
    (ref_loss, ref_grads), (our_loss, our_grads) = loss_and_grads(ref, tensors), loss_and_grads(ours, tensors)
    for a, b in zip(our_grads, ref_grads, strict=True):
        if b.numel():
            assert relative_error(a, b) < GRAD_TOL
    coupled = [project(t) for project, t in zip(projections, layers, strict=True)]
    image_only = torch.autograd.grad(clip.encode_image(images, coupled).sum(), ctx)[0]
    assert float(image_only.abs().max()) > 0  # the vision side's gradient flows into the text context

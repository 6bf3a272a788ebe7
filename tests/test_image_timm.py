"""The image towers beyond open_clip's plain ViT: timm's ViT and EVA trunks (SigLIP/SigLIP2, EVA,
PE-Core, MobileCLIP-B/L, ViTamin) and open_clip's CLIPA and CoCa variants.

1. Parity: every image-tower architecture open_clip names (one model per timm architecture and
   pool, shrunk to 2 blocks at 4x4 patches) matches open_clip's forward, or is refused in one line.
2. The insertion rules against their references, on every trunk of 1. that our forward walks:
   prompts and MMRL's inserted tokens as timm's own prefix tokens (`coop.reference.timm_vit`), the
   pool with and without the added tokens, every token's projected features.

Tolerances (relative to the largest |feature|): fp32 1e-5, bf16 autocast 2e-2.
"""

from __future__ import annotations

import copy
import re

import open_clip
import pytest
import torch
from conftest import shrunk_timm
from open_clip.model import _build_vision_tower
from timm.models.vitamin import VitCfg, VitConvCfg
from torch import nn

from coop.model.clip import CLIP, _image_tower
from coop.model.image_encoder import ImageTransformer
from coop.model.image_timm import TimmImageTower
from coop.model.image_tower import identity_rows
from coop.model.inserted import InsertedTokens
from coop.reference.timm_vit import timm_vision_features
from coop.reference.vision import vision_features

FP32_TOL, BF16_TOL = 1e-5, 2e-2


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _timm_archs() -> dict[str, str]:
    """One open_clip model per timm architecture (resolution variants folded) and pool/projection."""
    seen: dict[tuple, str] = {}
    for name in open_clip.list_models():
        v = open_clip.get_model_config(name)["vision_cfg"]
        if "timm_model_name" in v:
            arch = re.sub(r"_\d+$", "", v["timm_model_name"])
            seen.setdefault((arch, v.get("timm_pool"), v.get("timm_proj")), name)
    return {name: arch for (arch, _, _), name in seen.items()}


TIMM_ARCHS = _timm_archs()
TOKENLESS = ("convnext", "fastvit", "swin", "relpos")  # CNNs, windowed and relative-position trunks


def patch_of(arch: str) -> int:
    return int(re.search(r"patch(\d+)", arch).group(1)) if "patch" in arch else 16


# ViTamin's convolutional stem ends at the trunk's width: its stages shrunk with it (timm's layout
# of every ViTamin, one block per stage, widths 16 -> 32 -> 64).
VITAMIN_STEM = VitCfg(
    embed_dim=(16, 32, 64),
    depths=(1, 1, 1),
    stem_width=16,
    conv_cfg=VitConvCfg(norm_layer="layernorm2d", norm_eps=1e-6),
    head_type="1d",
)


def small_tower(name: str, seed: int = 0, shrink_width: bool = True, **timm_kwargs) -> nn.Module:
    """open_clip's image tower of model `name`, its timm trunk built with 2 blocks at 4x4 patches
    (and width 64 where the config allows) and `timm_kwargs`, LayerNorm weights and biases
    randomised."""
    cfg = open_clip.get_model_config(name)
    arch = TIMM_ARCHS.get(name, "")
    size = 4 * patch_of(arch)
    kwargs = {"depth": 2, "img_size": size, **timm_kwargs}
    if shrink_width:
        kwargs.update(embed_dim=64, num_heads=2)
        if "vitamin" in arch:
            kwargs.update(embed_cfg=VITAMIN_STEM)
    torch.manual_seed(seed)
    try:
        with shrunk_timm(**kwargs):
            visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    except AssertionError:  # a head without projection must keep the trunk's width (MobileCLIP-B)
        visual = None
    if visual is None:
        return small_tower(name, seed, shrink_width=False, **timm_kwargs)
    randomise(visual, seed)
    visual.image_size = (size, size)
    return visual.eval()


def randomise(visual: nn.Module, seed: int) -> None:
    """Weights of unit-variance outputs (timm's 0.02 init leaves attention nearly uniform, where
    a wrongly placed token would hide), norm weights near 1, biases nonzero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in visual.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            elif "norm" in key and key.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def images_for(tower: nn.Module, n: int = 2) -> torch.Tensor:
    size = tower.image_size[0]
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


# --- 1. parity, every timm architecture open_clip names ----------------------------------------


def tokenless(name: str) -> bool:
    return any(kind in TIMM_ARCHS[name] for kind in TOKENLESS)


# Every timm trunk open_clip names that our forward walks (a new one joins the day open_clip ships
# it); the insertion rules below run on each of them.
WALKABLE = [name for name in sorted(TIMM_ARCHS) if not tokenless(name)]


@pytest.fixture(scope="module")
def trunk(request):
    """(name, open_clip's shrunk tower, what `CLIP.from_openclip` makes of it, its refusal)."""
    visual = small_tower(request.param)
    tower, refusal = _image_tower(visual, request.param)
    return request.param, visual, tower.requires_grad_(False), refusal


@pytest.mark.parametrize("name", [name for name in sorted(TIMM_ARCHS) if tokenless(name)])
def test_timm_towers_without_tokens_are_refused_in_one_line(name):
    from coop.model.support import vision_support

    refusal = vision_support(name)  # built on the meta device: no weights needed to refuse
    assert refusal is not None and refusal.startswith(f"model {name}'s image tower is timm's")
    assert "\n" not in refusal and "lora.towers=[text]" in refusal


@pytest.mark.parametrize("trunk", WALKABLE, indirect=True)
def test_every_timm_tower_matches_open_clip(trunk):
    """Parity, with open_clip's tensors themselves: the tower takes the trunk and head over, so
    loading a model holds its weights once (EVA02-E, PE-Core-bigG)."""
    _, visual, tower, refusal = trunk
    assert refusal is None and isinstance(tower, TimmImageTower)
    ours, theirs = tower.state_dict(keep_vars=True), visual.state_dict(keep_vars=True)
    assert set(ours) == set(theirs)  # open_clip's visual.* keys
    assert all(ours[k].data_ptr() == theirs[k].data_ptr() for k in ours)  # the same storage
    images = images_for(tower)
    with torch.no_grad():
        ref = visual(images)
        assert relative_error(tower(images), ref) < FP32_TOL
    assert tower.output_dim == ref.shape[-1] and tower.layers == 2


FAMILIES = ["ViT-B-16-SigLIP2", "EVA02-B-16", "PE-Core-B-16"]


@pytest.mark.parametrize("trunk", FAMILIES, indirect=True)
def test_bf16_autocast_matches(trunk):
    _, visual, tower, _ = trunk
    images = images_for(tower)
    with torch.no_grad():
        ref = visual(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, theirs = tower(images), visual(images)
    assert relative_error(ours, ref) < BF16_TOL and relative_error(ours, theirs) < BF16_TOL


@pytest.mark.parametrize("trunk", FAMILIES, indirect=True)
def test_clip_freezes_the_tower(trunk, tiny_clip):
    tower = copy.deepcopy(trunk[2]).requires_grad_(True)
    clip = CLIP(tower, tiny_clip.text, tiny_clip.logit_scale, tiny_clip.tokenizer)
    assert clip.supports_vision_prompts and clip.image_forward == "coop-timm"
    assert all(not p.requires_grad for p in clip.visual.parameters())


# --- 2. the insertion rules against timm's own forward, on every walkable trunk ----------------


def prompts_for(tower, depth: int = 2, m: int = 3, seed: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(m, tower.width, generator=gen) for _ in range(depth)]


@pytest.mark.parametrize("trunk", WALKABLE, indirect=True)
@pytest.mark.parametrize("pool_prompts", [False, True])
def test_prompts_are_prefix_tokens_of_timms_own_forward(trunk, pool_prompts):
    """Appended prompts with the identity rotation equal prompts placed among timm's prefix tokens
    (which RoPE skips), replaced at deeper blocks; the pool sees them only with `pool_prompts`."""
    _, visual, tower, _ = trunk
    images, prompts = images_for(tower), prompts_for(tower)
    tower.pool_prompts = pool_prompts
    try:
        with torch.no_grad():
            ours = tower(images, prompts)
        ref = timm_vision_features(visual, images, prompts, pool_prompts=pool_prompts)
    finally:
        tower.pool_prompts = False
    assert relative_error(ours, ref) < FP32_TOL
    assert relative_error(ours, tower(images).detach()) > 1e-3  # the prompts change the features


@pytest.mark.parametrize("trunk", WALKABLE, indirect=True)
def test_pooling_with_or_without_prompts_differs_only_for_pools_that_read_all_tokens(trunk):
    _, visual, tower, _ = trunk
    images, prompts = images_for(tower), prompts_for(tower)
    with torch.no_grad():
        without = tower(images, prompts)
        tower.pool_prompts = True
        try:
            with_prompts = tower(images, prompts)
        finally:
            tower.pool_prompts = False
    reads_all = visual.trunk.global_pool in ("map", "avg")  # SigLIP2, PE-Core: the attention pool
    assert (relative_error(with_prompts, without) > 1e-4) == reads_all


@pytest.mark.parametrize("trunk", ["EVA02-B-16", "PE-Core-B-16"], indirect=True)
def test_a_rotated_prompt_would_differ_so_the_rule_is_checked(trunk):
    """On RoPE towers the identity rotation matters: giving the prompts the first patches'
    angles instead changes the features (so the reference comparison above can fail)."""
    tower = trunk[2]
    assert tower.rotary
    images, prompts = images_for(tower), prompts_for(tower, depth=1)
    rope = tower.embed(images)[1]
    m = prompts[0].shape[0]
    rotated = torch.cat([rope, rope[..., :m, :]], dim=-2)
    assert not torch.equal(rotated, identity_rows(rope, 0, m))
    with torch.no_grad():
        x = tower.pre(torch.cat([tower.embed(images)[0], prompts[0].expand(len(images), -1, -1)], 1))
        for i in range(tower.layers):
            x = tower.run_block(i, x, rotated)
        wrong = tower.pool(x[:, :-m])
        assert relative_error(wrong, tower(images, prompts)) > 1e-4


@pytest.mark.parametrize("trunk", WALKABLE, indirect=True)
def test_inserted_tokens_follow_the_prefix_tokens(trunk):
    """MMRL's tokens enter after [CLS] (EVA02, PE-Core) or first (SigLIP2: no class token) at the
    first listed block and are replaced at the next: [1] alone, and [0, 1]."""
    _, visual, tower, _ = trunk
    images = images_for(tower)
    gen = torch.Generator().manual_seed(3)
    for layers in ([1], [0, 1]):
        tokens = [torch.randn(2, tower.width, generator=gen) for _ in layers]
        with torch.no_grad():
            feats, rows, plain = tower.encode_with_inserted(
                images, InsertedTokens(tokens, layers), frozen=True
            )
        ref, ref_rows = timm_vision_features(visual, images, inserted=(tokens, layers))
        assert relative_error(feats, ref) < FP32_TOL and relative_error(rows, ref_rows) < FP32_TOL
        assert relative_error(plain, visual(images).detach()) < FP32_TOL
    assert tower.n_prefix == visual.trunk.num_prefix_tokens


@pytest.mark.parametrize("trunk", FAMILIES, indirect=True)
def test_prompt_gradients_reach_the_prompts_and_not_the_weights(trunk):
    tower = trunk[2]
    prompts = [p.requires_grad_() for p in prompts_for(tower)]
    tower(images_for(tower), prompts, grad_checkpointing=True).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in prompts)
    assert all(p.grad is None for p in tower.parameters())


@pytest.mark.parametrize("trunk", WALKABLE, indirect=True)
def test_tokens_are_every_position_projected(trunk):
    """FedOTP's patch features: every token after the final norms, through the heads, equal to
    the rows of timm's own forward with the prompts as prefix tokens (ours come after the patches);
    on a class-token tower the class token's row is the image feature itself."""
    _, visual, tower, _ = trunk
    images, prompts = images_for(tower), prompts_for(tower)
    n, m = tower.n_prefix, prompts[0].shape[0]
    with torch.no_grad():
        tokens = tower(images, prompts, tokens=True)
        feats = tower(images, prompts)
    ref = timm_vision_features(visual, images, prompts, all_tokens=True)  # [prefix; prompts; patches]
    assert tokens.shape == ref.shape == (2, n + 16 + m, tower.output_dim)  # 4x4 patches
    ref = torch.cat([ref[:, :n], ref[:, n + m :], ref[:, n : n + m]], dim=1)  # [prefix; patches; prompts]
    assert relative_error(tokens, ref) < FP32_TOL
    if visual.trunk.global_pool == "token":  # EVA02
        assert relative_error(tokens[:, 0], feats) < FP32_TOL


# --- open_clip's own variants: CLIPA's average pool, CoCa's attention pool ---------------------


def openclip_variant(name: str, **vision_cfg) -> nn.Module:
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    v = cfg["vision_cfg"]
    v.update(layers=2, width=64, head_width=32, image_size=3 * v["patch_size"], **vision_cfg)
    torch.manual_seed(0)
    visual = _build_vision_tower(32, v, quick_gelu=cfg.get("quick_gelu", False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, p in visual.named_parameters():
            if key.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return visual.eval()


@pytest.mark.parametrize("name", ["ViT-L-14-CLIPA", "coca_ViT-B-32"])
def test_open_clip_variants_run_through_our_vit_with_prompts(name):
    visual = openclip_variant(name)
    tower, refusal = _image_tower(visual, name)
    assert refusal is None and isinstance(tower, ImageTransformer)
    size = visual.image_size[0]
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    prompts = prompts_for(tower)
    with torch.no_grad():
        out = visual(images)
        ref = out[0] if isinstance(out, tuple) else out
        assert relative_error(tower(images), ref) < FP32_TOL
        assert relative_error(tower(images, prompts), vision_features(visual, images, prompts)) < FP32_TOL


# --- patch dropout: one rule for both back ends ------------------------------------------------


@pytest.mark.parametrize("name", ["ViT-B-16", "ViT-B-16-SigLIP2", "EVA02-B-16"])
def test_patch_dropout_drops_no_patch_in_either_back_end(name, tiny_clip):
    """open_clip's and timm's patch dropout act in training mode only, and CLIP keeps its towers in
    eval mode: both back ends take a tower built with it (open_clip's ViT, and so its vision
    prompts, used to be refused), and in CLIP's training mode compute the eval forward, prompts
    included."""
    if "timm_model_name" in open_clip.get_model_config(name)["vision_cfg"]:
        visual = small_tower(name, patch_drop_rate=0.5)
        reference = timm_vision_features
    else:
        visual = openclip_variant(name, patch_dropout=0.5)
        reference = vision_features
    images = images_for(visual)
    torch.manual_seed(0)
    with torch.no_grad():
        dropped, ref = visual.train()(images), visual.eval()(images)
    assert relative_error(dropped, ref) > 1e-3  # open_clip's module, in training mode, drops patches
    tower, refusal = _image_tower(visual, name)
    assert refusal is None
    prompts = prompts_for(tower)
    with torch.no_grad():
        ref_prompted = reference(visual, images, prompts)
    clip = CLIP(tower, tiny_clip.text, tiny_clip.logit_scale, tiny_clip.tokenizer).train()
    with torch.no_grad():
        assert relative_error(clip.encode_image(images), ref) < FP32_TOL
        assert relative_error(clip.encode_image(images, prompts), ref_prompted) < FP32_TOL

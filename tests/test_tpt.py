"""TPT and C-TPT (coop.tta.tpt): every host kind against the original-style reference per image
(coop.reference.tpt: 77 tokens x all classes, forward, backward, forward), a written-out first
step, the reset between images, the selection's edge cases, C-TPT's lambda and the refusals."""

from __future__ import annotations

import copy
import json
import math

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_CONFIG, build_openclip, randomise_text_tower

import coop
from coop.config.load import load_config
from coop.methods import build_method
from coop.reference.coop import reference_inputs
from coop.reference.tpt import cocoop_start, maple_forward, prompt_forward, tpt_image
from coop.tta import TTA_METHODS
from coop.tta import base as tta_base
from coop.tta.base import n_confident
from coop.tta.tpt import CTPT, TPT, average_entropy, ctpt_lambda, text_dispersion

CLASSES = ["dog", "golden_retriever", "St. Bernard", "crane (bird)", "airliner", "t-shirt"]


@pytest.fixture(scope="module")
def models64(tiny_name):
    """(open_clip's tiny model, ours) in float64: the reference comparisons then see the tuned
    tensors to far below Adam's eps, where a first step g / (|g| + eps) turns float32 noise in a
    near-zero gradient into a visible step."""
    torch.set_default_dtype(torch.float64)
    try:
        oc = build_openclip(tiny_name).double()
        return oc, coop.CLIP.from_openclip(copy.deepcopy(oc))
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.fixture
def f64(models64):
    """models64, with float64 the default dtype while the test runs (prompts built in it)."""
    torch.set_default_dtype(torch.float64)
    yield models64
    torch.set_default_dtype(torch.float32)


def cfg_of(method: str, *overrides: str):
    return load_config(None, [f"method={method}", f"model.name={TINY_CONFIG}", "data.name=dtd", *overrides])


def host_of(clip, method: str, *overrides: str, classes=CLASSES):
    """A host with its learned tensors moved away from their initialisation (every term matters)."""
    torch.manual_seed(0)
    host = build_method(clip, classes, cfg_of(method, *overrides))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in host.learnable().values():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return host


def features(clip, n: int, seed: int = 2) -> torch.Tensor:
    """Unnormalised image features (n, E) as the frozen tower gives them."""
    return 3 * torch.randn(n, clip.embed_dim, generator=torch.Generator().manual_seed(seed))


def reference(oc, tpt: TPT, x: torch.Tensor, lambda_term: float = 0.0):
    """The reference's (logits, tuned tensors by our names) for one image, x features or pixels."""
    pl = tpt.calls.inner.prompt_learner
    inputs = reference_inputs(oc, pl)
    params = dict(tpt.calls.named_parameters())
    short = {name: name.removeprefix("inner.").removeprefix("classifier.").removeprefix("prompt_learner.")
             for name in tpt.tuned}  # fmt: skip
    if tpt.host.name == "maple":
        forward = maple_forward(oc, inputs[0], inputs[2], pl.depth)
    else:
        forward = prompt_forward(oc, pl, inputs)
    start = {short[n]: params[n] for n in tpt.tuned}
    if tpt.host.name == "cocoop":
        start = cocoop_start(pl, tpt.host.meta_net, x)
    cfg = tpt.cfg.tpt
    logits, tuned = tpt_image(
        forward, start, x, cfg.selection, cfg.lr, cfg.steps, cfg.weight_decay, lambda_term
    )
    return logits, {n: tuned[short[n]] for n in tpt.tuned}


CASES = {
    "zeroshot": ("zeroshot", []),
    "coop-end": ("coop", ["prompt.n_ctx=4"]),
    "coop-middle-deep": ("coop", ["prompt.n_ctx=4", "prompt.position=middle", "prompt.depth=3"]),
    "coop-front-csc-deep": ("coop", ["prompt.n_ctx=3", "prompt.position=front", "prompt.csc=true", "prompt.depth=2"]),
    "kgcoop": ("kgcoop", ["prompt.n_ctx=2"]),
    "cocoop": ("cocoop", ["prompt.n_ctx=4"]),
    "cocoop-csc-deep": ("cocoop", ["prompt.n_ctx=2", "prompt.csc=true", "prompt.depth=2"]),
    "maple": ("maple", ["prompt.depth=2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_host_equals_the_reference_per_image(f64, case):
    """Logits and the tuned tensors equal the reference's for every image, TPT and C-TPT, the
    shared start reused across images (TPT: images 0, 1, 0)."""
    tiny_openclip, tiny_clip = f64
    method, overrides = CASES[case]
    host = host_of(tiny_clip, method, *overrides)
    cfg = cfg_of(method, *overrides, "ctpt.lambda_term=5")
    pixels = host.input == "pixels"
    gen = torch.Generator().manual_seed(3)
    inputs = [
        torch.randn(20, 3, 32, 32, generator=gen) if pixels else features(tiny_clip, 20, s) for s in (4, 5)
    ]
    for cls, order in ((TPT, (0, 1, 0)), (CTPT, (1,))):
        tpt = cls(host, cfg)
        for x in (inputs[i] for i in order):
            ours, tuned = tpt.adapt(x, None) if pixels else tpt.adapt(None, x)
            ref, ref_tuned = reference(tiny_openclip, tpt, x, tpt.weight)
            torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=2e-5)
            for name, value in tuned.items():
                start = dict(tpt.calls.named_parameters())[name]
                moved = (ref_tuned[name] - start).abs().max()
                assert moved > 1e-4, name  # every tuned tensor took its step
                # MaPLe's couplings: their loss gradient passes our fp32 logits; entries near Adam's
                # eps turn its rounding into a visible share of a step (first step: g / (|g| + eps))
                tol = 1e-5 if "proj" in name else 1e-7
                torch.testing.assert_close(value, ref_tuned[name], rtol=0, atol=tol)


def test_the_first_step_written_out(tiny_clip):
    """Zero-shot host, 20 views: TPT's own prompt is zero-shot CLIP's "a photo of a {class}."; the
    2 views of lowest entropy; the entropy of their mean probability; one AdamW step from fresh
    state, theta (1 - lr wd) - lr g / (|g| + eps); the image scored with the updated prompt."""
    host = host_of(tiny_clip, "zeroshot")
    tpt = TPT(host, cfg_of("zeroshot"))
    x = features(tiny_clip, 20)
    pl = tpt.calls.inner.prompt_learner
    ctx0 = pl.ctx.detach().clone()
    scale = tiny_clip.logit_scale.exp()
    with torch.no_grad():
        ids = tiny_clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES])
        clip_text = tiny_clip.encode_text(ids)
    ctx = ctx0.clone().requires_grad_(True)
    text = tpt.calls.inner.text_features(ctx)
    torch.testing.assert_close(text.detach(), clip_text, rtol=1e-5, atol=1e-5)
    logits = scale * F.normalize(x, dim=-1) @ F.normalize(text, dim=-1).t()  # (20, C)
    p = logits.softmax(-1)
    entropies = [-(row * row.log()).sum() for row in p.detach()]
    kept = sorted(range(20), key=lambda v: float(entropies[v]))[:2]
    mean = p[kept].mean(0)
    loss = -(mean * mean.log()).sum()
    (g,) = torch.autograd.grad(loss, ctx)
    lr, wd, eps = 5e-3, 0.01, 1e-8
    ctx1 = ctx0 * (1 - lr * wd) - lr * g / (g.abs() + eps)
    with torch.no_grad():
        want = (
            scale * F.normalize(x[:1], dim=-1) @ F.normalize(tpt.calls.inner.text_features(ctx1), dim=-1).t()
        )
    ours, tuned = tpt.adapt(None, x)
    torch.testing.assert_close(tuned["inner.prompt_learner.ctx"], ctx1, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, want[0], rtol=1e-5, atol=1e-5)
    assert float(loss.detach()) == pytest.approx(float(average_entropy(logits[kept].detach())), rel=1e-5)


def test_reset_between_images_and_order(tiny_clip):
    """predict leaves the host and the starting prompt as they were: an image gives the same
    logits first, after another image, and twice in a row."""
    host = host_of(tiny_clip, "coop", "prompt.n_ctx=4", "prompt.depth=2")
    before = {k: v.detach().clone() for k, v in host.learnable().items()}
    tpt = TPT(host, cfg_of("coop"))
    a, b = features(tiny_clip, 16, 7), features(tiny_clip, 16, 8)
    first = tpt.adapt(None, a)[0]
    tpt.adapt(None, b)
    again = tpt.adapt(None, a)[0]
    assert torch.equal(first, again) and torch.equal(tpt.adapt(None, a)[0], first)
    assert all(torch.equal(v, before[k]) for k, v in host.learnable().items())
    fresh = TPT(host, cfg_of("coop")).adapt(None, a)[0]
    assert torch.equal(fresh, first)
    # predict on pixels: the host's image tower, then the same adaptation
    views = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        feats = tiny_clip.encode_image(views)
    want = tpt.adapt(None, feats)[0]
    torch.testing.assert_close(tpt.predict(views, 0), want)
    with torch.inference_mode():  # a runner's evaluation mode does not stop the step
        torch.testing.assert_close(tpt.predict(views, 0), want)
    maple = TPT(host_of(tiny_clip, "maple", "prompt.depth=2"), cfg_of("maple"))
    with torch.no_grad():
        first = maple.predict(views, 0)
    with torch.inference_mode():
        torch.testing.assert_close(maple.predict(views, 0), first)


def test_steps_and_grad_checkpointing_equal_the_reference(f64):
    """tpt.steps=2 (the selection kept from the first step) and tpt.grad_checkpointing (the shared
    graph recomputed in every image's backward) against the reference."""
    tiny_openclip, tiny_clip = f64
    host = host_of(tiny_clip, "coop", "prompt.n_ctx=4", "prompt.position=middle", "prompt.depth=2")
    x = features(tiny_clip, 30)
    plain = TPT(host, cfg_of("coop")).adapt(None, x)[0]
    for overrides in (["tpt.steps=2"], ["tpt.grad_checkpointing=true"]):
        tpt = TPT(host, cfg_of("coop", *overrides))
        ours = [tpt.adapt(None, x)[0] for _ in range(2)]  # the checkpointed graph serves twice
        ref, _ = reference(tiny_openclip, tpt, x)
        torch.testing.assert_close(ours[0], ref.float(), rtol=1e-5, atol=2e-5)
        assert torch.equal(ours[0], ours[1])
    assert not torch.allclose(plain, TPT(host, cfg_of("coop", "tpt.steps=2")).adapt(None, x)[0])
    assert not tiny_clip.text.grad_checkpointing  # switched on only while TPT's graphs are built


@pytest.mark.parametrize(
    "views, fraction, kept", [(64, 0.1, 6), (9, 0.1, 1), (1, 0.1, 1), (5, 1.0, 5), (10, 0.5, 5)]
)
def test_selection_edge_cases(f64, views, fraction, kept):
    """int(V * fraction) views, at least one (TPT keeps none of fewer than 10 views and fails):
    one view adapts on the image alone; the result equals the reference's selection."""
    tiny_openclip, tiny_clip = f64
    assert n_confident(views, fraction) == kept
    host = host_of(tiny_clip, "zeroshot")
    tpt = TPT(host, cfg_of("zeroshot", f"tpt.selection={fraction}"))
    x = features(tiny_clip, views, 11)
    ours = tpt.adapt(None, x)[0]
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, reference(tiny_openclip, tpt, x)[0].float(), rtol=1e-5, atol=2e-5)


def test_the_kept_views_are_the_confident_ones(tiny_clip):
    """The views left out do not count: replaced by views of uniform logits (features orthogonal to
    every class's text feature, the highest entropy), the result stays; the image itself is
    scored whether it was kept or not."""
    host = host_of(tiny_clip, "zeroshot")
    tpt = TPT(host, cfg_of("zeroshot", "tpt.selection=0.25"))
    x = features(tiny_clip, 8, 12)
    with torch.no_grad():
        text = tpt.calls.inner.text_features()
    logits = 100 * F.normalize(x, dim=-1) @ F.normalize(text, dim=-1).t()
    p = logits.softmax(-1)
    order = (-(p * p.log()).sum(-1)).argsort().tolist()
    rest = [v for v in order[2:] if v != 0]
    basis = torch.linalg.qr(torch.cat([text.t(), torch.randn(text.shape[1], 8)], 1)).Q[:, len(text) :]
    y = x.clone()
    y[rest] = basis[:, : len(rest)].t() * 5  # (|rest|, E): orthogonal to every text feature
    torch.testing.assert_close(tpt.adapt(None, y)[0], tpt.adapt(None, x)[0])
    y[order[0]] = y[rest[0]]  # a kept view replaced: the step changes
    assert not torch.allclose(tpt.adapt(None, y)[0], tpt.adapt(None, x)[0])


def test_average_entropy_and_dispersion_written_out():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    mean = logits.softmax(-1).mean(0)
    assert float(average_entropy(logits)) == pytest.approx(float(-(mean * mean.log()).sum()), rel=1e-6)
    onehot = torch.tensor([[-1e30, 0.0]])  # a probability of exactly 0: clamped, not NaN
    assert float(average_entropy(onehot)) == 0.0
    text = torch.tensor([[3.0, 0.0], [0.0, 2.0]])  # normalised: e1, e2; mean (.5, .5)
    assert float(text_dispersion(text)) == pytest.approx(math.sqrt(0.5), rel=1e-6)


def test_ctpt_lambda_from_its_scripts():
    assert ctpt_lambda(load_config(None, ["data.name=imagenet_a"])) == 20.0
    assert ctpt_lambda(load_config(None, ["data.name=imagenet_sketch"])) == 20.0
    assert ctpt_lambda(load_config(None, ["data.name=imagenet"])) == 50.0
    assert ctpt_lambda(load_config(None, ["data.name=dtd"])) == 50.0
    assert ctpt_lambda(load_config(None, ["data.name=dtd", "ctpt.lambda_term=7"])) == 7.0
    assert TTA_METHODS["tpt"] is TPT and TTA_METHODS["ctpt"] is CTPT


@pytest.mark.parametrize(
    "method, overrides",
    [("linear_probe", []), ("tip_adapter", []), ("vpt", ["vision.n_ctx=2", "vision.depth=1"]),
     ("ivlp", ["vision.n_ctx=2", "vision.depth=1", "prompt.depth=1"])],
)  # fmt: skip
def test_hosts_without_a_tunable_prompt_are_refused(tiny_clip, method, overrides):
    torch.manual_seed(0)
    host = build_method(tiny_clip, CLASSES, cfg_of(method, *overrides))
    for cls in (TPT, CTPT):
        with pytest.raises(tta_base.TestTimeError) as err:
            cls(host, cfg_of(method, *overrides))
        line = str(err.value)
        assert "\n" not in line and f"method={method}" in line and f"tta.method={cls.name}" in line


def test_bad_settings_are_refused(tiny_clip):
    host = host_of(tiny_clip, "zeroshot")
    cfg = cfg_of("zeroshot")
    for key, value in (("selection", 0.0), ("selection", 1.5), ("steps", 0), ("lr", 0.0)):
        bad = cfg.copy()
        bad.tpt[key] = value
        with pytest.raises(tta_base.TestTimeError, match=f"tpt.{key}"):
            TPT(host, bad)
    with pytest.raises(Exception, match="tpt.selection"):
        load_config(None, ["tpt.selection=0"])


# --- other towers: SigLIP (no causal mask: no cut), EVA02 and PE-Core --------------------------


def text_family(stem: str):
    """(open_clip's model, ours) with the text tower of configs/models/{stem}.json, CLIP's BPE (the
    reference tokenises with it: the vocabulary widened to 49,408 rows) and a tiny ViT."""
    cfg = json.loads((REPO / "configs" / "models" / f"{stem}.json").read_text())
    text = {k: v for k, v in cfg["text_cfg"].items() if k not in ("hf_tokenizer_name", "tokenizer_kwargs")}
    text["vocab_size"] = max(text["vocab_size"], 49408)
    vision = {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16}
    torch.manual_seed(0)
    build = open_clip.CustomTextCLIP if cfg.get("custom_text") else open_clip.CLIP
    oc = randomise_text_tower(build(embed_dim=cfg["embed_dim"], vision_cfg=vision, text_cfg=text)).eval()
    return oc, coop.CLIP.from_openclip(copy.deepcopy(oc), name=stem)


@pytest.mark.parametrize("stem", ["siglip-tiny", "eva02-tiny", "pe-core-tiny"])
def test_other_towers_equal_the_reference(stem):
    oc, clip = text_family(stem)
    cfg = load_config(None, ["method=zeroshot", "ctpt.lambda_term=3"])
    host = build_method(clip, CLASSES[:4], cfg)
    tpt = CTPT(host, cfg)
    x = features(clip, 12)
    ours, tuned = tpt.adapt(None, x)
    ref, ref_tuned = reference(oc, tpt, x, 3.0)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2e-5)
    name = tpt.tuned[0]
    assert (ref_tuned[name] - dict(tpt.calls.named_parameters())[name]).abs().max() > 1e-4
    torch.testing.assert_close(tuned, ref_tuned, rtol=0, atol=1e-6)

"""DePT on its hosts against the reference (loss, fused logits and the gradient of every learned
tensor, host's and DePT's), the head on other classes, parameter groups, recipes and names."""

from __future__ import annotations

import logging

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import DePT, build_method
from coop.reference.coop import coop_text_features, deep_text_features, reference_inputs
from coop.reference.dept import dept_loss, dept_test_logits
from coop.reference.vision import vision_features
from coop.reference.vision_prompts import _clip_logits
from coop.train.grid import load_grid
from coop.train.sweep import plan

CLASSES = ["banded", "golden_retriever", "crane (bird)", "a very long compound class name"]


def dept(clip, method, *overrides, classes=CLASSES, seed=1):
    cfg = load_config(None, [f"method={method}", "dept.enabled=true", "data.name=dtd", *overrides])
    torch.manual_seed(0)
    m = build_method(clip, classes, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the initialisation (FiLM at ones/zeros), so every term matters
        for t in m.learnable().values():
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    return m


def host_reference(oc, m, x):
    """(sim, text, image, extra) of the host, from the host's own reference computation."""
    host, pl = m.host, m.host.prompt_learner
    if host.name == "maple":
        ids, _, slots = reference_inputs(oc, pl)
        text = deep_text_features(oc, ids, slots, pl.ctx, pl.deep_ctx)
        prompts = [host.proj(pl.ctx)] + [
            p(pl.deep_ctx[i]) for i, p in enumerate(host.compound_prompt_projections)
        ]
        image = vision_features(oc.visual, x, prompts)
    else:
        text, image = coop_text_features(oc, pl), x
    extra = 0.0
    if host.name == "kgcoop":  # KgCoOp's DTD template, DePT's W
        tokens = open_clip.get_tokenizer("ViT-B-32")(
            [f"a photo of a {c.replace('_', ' ')}, a type of texture." for c in CLASSES]
        )
        with torch.no_grad():
            clip_text = oc.encode_text(tokens)
        extra = host.weight * (1 - torch.nn.CosineSimilarity(dim=1, eps=1e-7)(text, clip_text).mean())
    return _clip_logits(oc, image, text), text, image, extra


@pytest.mark.parametrize(
    ("method", "overrides"),
    [("coop", ["prompt.n_ctx=3"]), ("kgcoop", []), ("maple", ["prompt.depth=2"])],
)
def test_loss_logits_and_gradients_equal_reference(tiny_clip, tiny_openclip, method, overrides):
    m = dept(tiny_clip, method, *overrides)
    assert isinstance(m, DePT) and m.host.name == method
    if method == "maple":
        x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    else:
        x = torch.randn(5, tiny_clip.embed_dim, generator=torch.Generator().manual_seed(4))
    labels = torch.tensor([0, 1, 2, 3, 1])
    tensors = m.learnable()
    loss, _ = m.loss(x, labels)
    sim, text, image, extra = host_reference(tiny_openclip, m, x)
    want = dept_loss(sim, text, image, labels, tensors, 0.7, extra)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    names = list(tensors)
    assert sum(n.startswith("dept.") for n in names) == 6  # two FiLMs (scale, bias) and the head
    grads = torch.autograd.grad(loss, list(tensors.values()))
    ref = torch.autograd.grad(want, list(tensors.values()))
    for name, a, b in zip(names, grads, ref, strict=True):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        ours = m.logits(x, m.prepare())
        torch.testing.assert_close(ours, dept_test_logits(sim, image, tensors, 0.7), rtol=1e-5, atol=1e-4)


def test_head_on_training_classes_only(tiny_clip, caplog):
    """A subset of the training classes keeps the head's rows (ImageNet-A's case); other classes
    drop the head with a log line and score with the host's logits alone."""
    trained = dept(tiny_clip, "coop", "prompt.n_ctx=3")
    saved = {k: t.detach().clone() for k, t in trained.learnable().items()}
    x = torch.randn(3, tiny_clip.embed_dim)
    with torch.no_grad():
        full = trained.logits(x)
    subset = [CLASSES[2], CLASSES[0]]
    part = dept(tiny_clip, "coop", "prompt.n_ctx=3", classes=subset)
    part.load_trained(saved, CLASSES)
    with torch.no_grad():
        torch.testing.assert_close(part.logits(x), full[:, [2, 0]], rtol=1e-5, atol=1e-5)
    new = dept(tiny_clip, "coop", "prompt.n_ctx=3", classes=["striped", "dotted"])
    with caplog.at_level(logging.INFO, logger="coop.methods.dept"):
        new.load_trained(saved, CLASSES)
    assert "head (one row per training class) is dropped" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(new.logits(x), new.host.logits(x))


def test_param_groups_recipes_and_names(tiny_clip):
    m = dept(tiny_clip, "coop", "prompt.n_ctx=3")
    groups = m.param_groups()
    own = {id(t) for t in m.own().values()}
    assert [g.get("lr_scale", 1.0) for g in groups] == [1.0, 6.5]
    assert {id(t) for t in groups[1]["params"]} == own and not own & {id(t) for t in groups[0]["params"]}
    coop = load_config(None, ["method=coop", "dept.enabled=true"])
    assert (coop.prompt.n_ctx, coop.train.lr, coop.train.epochs, coop.train.batch_size) == (16, 0.0035, 10, 4)
    kg = load_config(None, ["method=kgcoop", "dept.enabled=true"])
    assert (kg.kgcoop.weight, kg.prompt.ctx_init, kg.train.lr) == (2.0, "a photo of a", 0.0035)
    maple = load_config(None, ["method=maple", "dept.enabled=true"])
    assert (maple.prompt.depth, maple.train.epochs, maple.dept.weight, maple.dept.lr_scale) == (
        9,
        10,
        0.7,
        6.5,
    )
    cocoop = load_config(None, ["method=cocoop", "dept.enabled=true"])
    assert (cocoop.train.lr, cocoop.train.batch_size) == (0.002, 1)
    assert load_config(None, ["method=kgcoop"]).kgcoop.weight == 8.0  # the host's own recipe is untouched
    assert run_name(coop).split("/")[3].endswith("_dept")
    with pytest.raises(ConfigError, match="dept.enabled=true wraps"):
        load_config(None, ["method=vpt", "dept.enabled=true"])
    with pytest.raises(ConfigError, match="dept.weight"):
        load_config(None, ["dept.weight=2"])


def test_cocoop_host_uses_each_images_own_text_feature(tiny_clip):
    """CoCoOp: the head's text points are text[b, y_b], the feature of image b's own prompts."""
    m = dept(tiny_clip, "cocoop", "prompt.n_ctx=2", "prompt.ctx_init=null")
    x, labels = torch.randn(3, tiny_clip.embed_dim), torch.tensor([1, 0, 3])
    loss, _ = m.loss(x, labels)
    text = m.host.text_features(x)  # (B, C, E)
    sim = m.host.logits(x)
    tensors = m.learnable()
    points = text[torch.arange(3), labels]  # (B, E)
    t = tensors["dept.film_text.scale"] * points + tensors["dept.film_text.bias"]
    i = tensors["dept.film_image.scale"] * x + tensors["dept.film_image.bias"]
    head = F.linear(torch.cat([t, i]), tensors["dept.head.weight"], tensors["dept.head.bias"])
    want = 0.3 * F.cross_entropy(sim, labels) + 0.7 * F.cross_entropy(head, torch.cat([labels, labels]))
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)


def test_config_files_spell_out_the_recipes_and_grids_run_them(tmp_path):
    """configs/dept/*.yaml and configs/tcp/ resolve to what the recipe alone gives; every protocol
    grid plans DePT on each host and TCP with their recipes' lengths and rates."""
    files = {
        "coop": "dept/coop_vit_b16_ep10_bs4_lr35.yaml",
        "cocoop": "dept/cocoop_vit_b16_c4_ep10_batch1_ctxv1.yaml",
        "kgcoop": "dept/kgcoop_vit_b16_ep10_ctxv1_bs4_lr35.yaml",
        "maple": "dept/maple_vit_b16_c2_ep10_batch4_2ctx.yaml",
        "tcp": "tcp/vit_b16_ep100_ctxv1.yaml",
    }
    for host, path in files.items():
        extra = [] if host == "tcp" else ["dept.enabled=true"]
        spelled = load_config(str(REPO / "configs" / path))
        alone = load_config(None, [f"method={host}", "data.name=imagenet", "model.name=ViT-B-16", *extra])
        for section in ("prompt", "train", "dept", "kgcoop", "tcp"):
            assert spelled[section] == alone[section], (host, section)
    one = ["data.seed=1", "data.name=imagenet", "data.shots=16"]  # one point per method
    for grid in ("base_to_new", "cross_dataset", "domain_generalization", "few_shot"):
        path = str(REPO / "configs" / "protocols" / f"{grid}.yaml")
        runs = plan(
            load_grid(
                path,
                ["method=[coop,cocoop,kgcoop,maple]", "dept.enabled=true", *one, f"data.root={tmp_path}"],
            ),
            tmp_path,
        )
        assert len(runs) == 4
        for run in runs:
            cfg = load_config(None, run.overrides)
            assert (cfg.train.epochs, cfg.dept.enabled) == (10, True) and "_dept" in run.folder.parent.name
        runs = plan(
            load_grid(
                path, ["method=tcp", "prompt.ctx_init=null", "prompt.n_ctx=4", *one, f"data.root={tmp_path}"]
            ),
            tmp_path,
        )
        cfg = load_config(None, runs[0].overrides)
        assert (cfg.train.optimizer, cfg.train.eps, cfg.train.epochs, cfg.prompt.ctx_init) == (
            "adam",
            1e-3,
            25,  # ImageNet's length in TCP's train.py
            None,
        )


def test_fp16_as_the_originals(tiny_openclip):
    """train.precision=fp16: DePT's head is half (the original's `.type(dtype)`), its FiLM stays fp32;
    TCP is half throughout (ctx and meta-net, as its PREC=fp16); both losses stay finite."""
    from coop.model.clip import CLIP

    clip = CLIP.from_openclip(tiny_openclip)  # its own copy: halving it must not touch the fixture's
    m = dept(clip, "coop", "prompt.n_ctx=3")
    t = build_method(clip, CLASSES, load_config(None, ["method=tcp", "tcp.layer=1", "data.name=dtd"]))
    clip.half()
    m.to_half()
    t.to_half()
    assert m.head.weight.dtype == torch.float16 and m.film_image.scale.dtype == torch.float32
    assert {p.dtype for p in t.learnable().values()} == {torch.float16}
    x, labels = torch.randn(4, clip.embed_dim).half(), torch.tensor([0, 1, 2, 3])
    for method in (m, t):
        loss, _ = method.loss(x, labels)
        assert torch.isfinite(loss)
        loss.backward()

"""KgCoOp's regulariser against a direct computation; the methods' recipes in the config; the grids
with all prompt methods; CoOp, CoCoOp, KgCoOp and zero-shot runs end to end, in one table."""

from __future__ import annotations

import json

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, interrupted_at, randomise_prompts
from omegaconf import OmegaConf
from test_protocols import data_root, tiny_cfg  # noqa: F401  (data_root is a fixture)

import coop.methods.kgcoop as kgcoop_module
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import build_method
from coop.reference.coop import coop_text_features
from coop.results.tables import dataset_table, load_runs
from coop.train.evaluation import evaluate_checkpoint, evaluate_checkpoint_targets
from coop.train.grid import load_grid
from coop.train.runner import train_run
from coop.train.sweep import plan

CLASSES = ["banded", "golden_retriever", "crane (bird)", "a very long compound class name"]


def kgcoop(clip, weight=8.0, **prompt):
    p = {"n_ctx": 3, "ctx_init": None, "position": "end", "csc": False, "depth": 1, **prompt}
    cfg = {"method": "kgcoop", "data": {"name": "dtd"}, "prompt": p, "kgcoop": {"weight": weight}}
    torch.manual_seed(0)
    method = build_method(clip, CLASSES, OmegaConf.create(cfg))
    randomise_prompts(method.prompt_learner, 3)
    return method


def direct_loss(oc, learner, images, labels, weight):
    """KgCoOp's forward written out: CE on CoOp's logits + weight * (1 - mean cos(w, w_clip))."""
    text = coop_text_features(oc, learner)  # the learned prompts, full 77 tokens
    prompts = [f"a photo of a {c.replace('_', ' ')}, a type of texture." for c in CLASSES]
    with torch.no_grad():
        clip_text = oc.encode_text(open_clip.get_tokenizer("ViT-B-32")(prompts))  # KgCoOp's DTD template
    logits = oc.logit_scale.exp() * F.normalize(images, dim=-1) @ F.normalize(text, dim=-1).T
    score = 1.0 - torch.nn.CosineSimilarity(dim=1, eps=1e-7)(text, clip_text).mean()
    return F.cross_entropy(logits, labels) + weight * score, score


@pytest.mark.parametrize(
    "prompt",
    [{"position": "end"}, {"position": "middle", "depth": 2}, {"position": "front", "csc": True}],
    ids=["end", "middle-deep", "front-csc"],
)
def test_loss_and_gradient_equal_direct_computation(tiny_clip, tiny_openclip, prompt):
    method = kgcoop(tiny_clip, **prompt)
    images, labels = torch.randn(5, tiny_clip.embed_dim), torch.tensor([0, 1, 2, 3, 1])
    loss, logits = method.loss(images, labels)
    want, score = direct_loss(tiny_openclip, method.prompt_learner, images, labels, 8.0)
    assert 0 < float(score) < 2
    torch.testing.assert_close(
        method.regulariser(method.classifier.text_features()), score, rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert logits.shape == (5, len(CLASSES))
    ctx = method.learnable()["ctx"]
    ours = torch.autograd.grad(loss, ctx)[0]
    ref = torch.autograd.grad(want, ctx)[0]
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4


def test_frozen_features_once_and_weight_zero_is_coop(tiny_clip, monkeypatch):
    calls = []
    real = kgcoop_module.template_features
    monkeypatch.setattr(kgcoop_module, "template_features", lambda *a: calls.append(1) or real(*a))
    method = kgcoop(tiny_clip)
    images, labels = torch.randn(3, tiny_clip.embed_dim), torch.tensor([0, 1, 2])
    first, _ = method.loss(images, labels)
    second, _ = method.loss(images, labels)
    assert len(calls) == 1 and torch.equal(first, second)
    assert not method.clip_features().requires_grad
    assert set(method.learnable()) == {"ctx"}  # w_clip is never a checkpoint tensor
    assert method.describe()["kgcoop_weight"] == 8.0

    plain = kgcoop(tiny_clip, weight=0.0)
    loss, logits = plain.loss(images, labels)
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels))


def test_recipes_and_names():
    co = load_config(None, ["method=cocoop"])
    assert (co.prompt.ctx_init, co.prompt.n_ctx, co.train.epochs, co.train.batch_size) == (
        "a photo of a",
        None,
        10,
        1,
    )
    assert (co.train.lr, co.train.warmup_epochs, co.train.warmup_lr) == (0.002, 1, 1e-5)
    kg = load_config(None, ["method=kgcoop"])
    assert (kg.prompt.ctx_init, kg.train.epochs, kg.train.batch_size, kg.kgcoop.weight) == (
        "a photo of a",
        100,
        128,
        8.0,
    )
    assert load_config(None, []).prompt.ctx_init is None  # CoOp's defaults unchanged
    # an explicit M means random context (CoCoOp's c4/c8/c16 configs); explicit values win
    c16 = load_config(None, ["method=cocoop", "prompt.n_ctx=16", "train.batch_size=8"])
    assert (c16.prompt.ctx_init, c16.train.batch_size, c16.train.epochs) == (None, 8, 10)
    assert run_name(co).split("/")[3] == "cocoop_nctxinit_cscfalse_posend_depth1"
    assert run_name(c16).split("/")[3] == "cocoop_nctx16_cscfalse_posend_depth1"
    assert run_name(kg).split("/")[3] == "kgcoop_nctxinit_cscfalse_posend_depth1"
    with pytest.raises(ConfigError, match="kgcoop.weight"):
        load_config(None, ["method=kgcoop", "kgcoop.weight=-1"])
    with pytest.raises(ConfigError, match="cocoop.chunk_prompts"):
        load_config(None, ["cocoop.chunk_prompts=0"])
    for recipe in ("cocoop/vit_b16_c4_ep10_batch1_ctxv1.yaml", "kgcoop/vit_b16_ep100_ctxv1.yaml"):
        cfg = load_config(str(REPO / "configs" / recipe))
        assert cfg.method == recipe.split("/")[0] and cfg.prompt.ctx_init == "a photo of a"


@pytest.mark.parametrize(
    "grid, narrow",
    [
        ("protocols/base_to_new", "data.name=[dtd,eurosat]"),
        ("protocols/few_shot", "data.name=[dtd]"),
        ("ablations/csc", "data.shots=[1,16]"),
        ("ablations/depth", "prompt.depth=[1,12]"),
    ],
)
def test_grids_accept_all_prompt_methods(grid, narrow, tmp_path):
    path = str(REPO / "configs" / f"{grid}.yaml")
    runs = plan(load_grid(path, ["method=[coop,cocoop,kgcoop]", narrow]), tmp_path, check_data=False)
    assert len({r.folder for r in runs}) == len(runs)
    for method in ("coop", "cocoop", "kgcoop"):
        overrides = next(r.overrides for r in runs if f"method={method}" in r.overrides)
        cfg = load_config(None, overrides)
        assert cfg.method == method
        if method == "cocoop":
            assert cfg.train.epochs == 10 and cfg.train.batch_size == 1
            assert (cfg.prompt.ctx_init is None) == (cfg.prompt.n_ctx is not None)  # M set: random context


def learned(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]


def test_all_methods_end_to_end(data_root, tmp_path):  # noqa: F811
    """coop, cocoop, kgcoop and zeroshot on the generated ImageNet layout with cached features:
    every run finishes and evaluates on ImageNet-A's classes; CoCoOp resumed after an interruption
    ends with the same tensors; eval.py's function scores the checkpoints again; one table."""
    root = tmp_path / "runs"
    common = ["data.name=imagenet", f"data.root={data_root}", "train.aug_views=2", "train.epochs=2"]
    common += ["eval.targets=[imagenet_a]", "cocoop.chunk_prompts=6"]
    metrics = {}
    for method in ("coop", "cocoop", "kgcoop", "zeroshot"):
        metrics[method] = train_run(tiny_cfg(root / method, *common, f"method={method}"))
        target = json.loads((root / method / "eval_imagenet_a.json").read_text())
        assert target["trained_on"] == "imagenet" and len(target["per_class_accuracy"]) == 2
        assert evaluate_checkpoint(root / method / "checkpoint.pt")["accuracy"] == metrics[method]["accuracy"]
    assert metrics["cocoop"]["n_ctx"] == 4 and metrics["kgcoop"]["kgcoop_weight"] == 8.0
    meta = {f"meta_net.linear{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
    assert set(learned(root / "cocoop")) == {"ctx"} | meta and set(learned(root / "kgcoop")) == {"ctx"}
    assert learned(root / "cocoop")["meta_net.linear1.weight"].shape == (2, 32)  # E//16 x E

    out = tmp_path / "resumed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(out, *common, "method=cocoop"))
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] == 1
    assert train_run(tiny_cfg(out, *common, "method=cocoop"))["accuracy"] == metrics["cocoop"]["accuracy"]
    for key, t in learned(root / "cocoop").items():
        assert torch.equal(learned(out)[key], t), key
    again = evaluate_checkpoint_targets(out / "checkpoint.pt", ["imagenet_a"])["eval_imagenet_a.json"]
    assert again["accuracy"] == json.loads((root / "cocoop" / "eval_imagenet_a.json").read_text())["accuracy"]

    table = dataset_table(load_runs(root), "accuracy")  # what tools/collect.py --table datasets prints
    assert sorted(table["method"]) == ["cocoop", "coop", "kgcoop", "zeroshot"]
    assert {"imagenet_mean", "imagenet_a_mean"} <= set(table.columns)

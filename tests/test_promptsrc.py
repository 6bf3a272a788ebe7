"""PromptSRC's parts against direct computations written out here: each loss term and the total
(the KL summed over all entries, divided by numel), t0 (the mean of the unnormalised template
features, then normalised), the GPA weights and the running aggregate, and the config keys; then
base-to-new runs end to end (GPA in the checkpoint, resume mid-GPA, a table with MaPLe)."""

from __future__ import annotations

import json
import logging
import math

import open_clip
import pytest
import torch
from conftest import REPO, interrupted_at
from test_bench import load_tool
from test_protocols import data_root, tiny_cfg  # noqa: F401  (data_root is a fixture)

import coop
import coop.reference.promptsrc as reference
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import build_method
from coop.methods.gpa import GaussianAggregate, gpa_weights
from coop.methods.promptsrc import (
    PROMPTSRC_TEMPLATES,
    PromptSRC,
    frozen_text_features,
    promptsrc_loss,
    resolve_promptsrc_templates,
    zero_shot_logits,
)
from coop.reference.coop import reference_inputs
from coop.reference.promptsrc import promptsrc_fixed_embeddings
from coop.results.tables import dataset_table, load_runs, summarize
from coop.train.evaluation import evaluate_checkpoint
from coop.train.grid import load_grid
from coop.train.runner import train_run
from coop.train.sweep import plan

CLASSNAMES = ["red_thing", "green thing", "blue whale", "a dog"]


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def random_step(seed=0, batch=5, n_cls=7, dim=16):
    gen = torch.Generator().manual_seed(seed)
    t, t0 = unit(torch.randn(n_cls, dim, generator=gen)), unit(torch.randn(n_cls, dim, generator=gen))
    v, v0 = unit(torch.randn(batch, dim, generator=gen)), unit(torch.randn(batch, dim, generator=gen))
    labels = torch.randint(n_cls, (batch,), generator=gen)
    return t, t0, v, v0, labels


def test_loss_terms_and_total_equal_direct_computation():
    t, t0, v, v0, labels = random_step()
    scale = torch.tensor(math.log(50.0))
    logits = 50.0 * v @ t.T
    zs = zero_shot_logits(v0, t0, scale)
    assert torch.allclose(zs, 50.0 * (v0 @ t0.T), atol=1e-5)
    total, terms = promptsrc_loss(
        logits, labels, t, t0, v, v0, zs, text_weight=25, image_weight=10, kl_weight=1
    )

    # direct: cross-entropy from log-sum-exp, L1 as a mean of absolute differences over all entries,
    # KL(p_zs || p) summed over every entry and divided by B * n_cls (not by B: not "batchmean")
    B, n_cls = logits.shape
    log_p = logits - logits.exp().sum(1, keepdim=True).log()
    log_q = zs - zs.exp().sum(1, keepdim=True).log()
    ce = -log_p[torch.arange(B), labels].mean()
    text = (t - t0).abs().sum() / t.numel()
    image = (v - v0).abs().sum() / v.numel()
    kl = (log_q.exp() * (log_q - log_p)).sum() / (B * n_cls)
    for name, expected in {"ce": ce, "text": text, "image": image, "kl": kl}.items():
        assert torch.allclose(terms[name], expected, rtol=1e-5, atol=1e-7), name
    assert torch.allclose(total, ce + 25 * text + 10 * image + kl, rtol=1e-6)
    weighted, _ = promptsrc_loss(logits, labels, t, t0, v, v0, zs, text_weight=2, image_weight=3, kl_weight=4)
    assert torch.allclose(weighted, ce + 2 * text + 3 * image + 4 * kl, rtol=1e-6)
    assert kl > 0 and not torch.allclose(kl, kl * n_cls)  # the reduction matters


def test_loss_is_ce_at_the_frozen_model_and_differentiable():
    """With t = t0 and v = v0 every regulariser is zero; gradients flow to t and v."""
    t, _, v, _, labels = random_step(1)
    t, v = t.clone().requires_grad_(), v.clone().requires_grad_()
    logits = 30.0 * v @ t.T
    zs = 30.0 * v.detach() @ t.detach().T
    total, terms = promptsrc_loss(logits, labels, t, t.detach(), v, v.detach(), zs)
    assert terms["text"] == 0 and terms["image"] == 0 and abs(terms["kl"].item()) < 1e-7
    assert torch.equal(total, terms["ce"] + 0.0)
    total.backward()
    assert t.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_t0_is_the_mean_before_normalisation(tiny_openclip, tiny_clip):
    templates = list(PROMPTSRC_TEMPLATES[:3])
    t0 = frozen_text_features(tiny_clip, CLASSNAMES, templates)
    tok = open_clip.get_tokenizer("ViT-B-16")
    names = [c.replace("_", " ") for c in CLASSNAMES]
    with torch.no_grad():  # open_clip's own text tower, one template at a time
        raw = torch.stack([tiny_openclip.encode_text(tok([tp.format(c) for c in names])) for tp in templates])
    expected = unit(raw.mean(0))  # (n_cls, E): average the UNnormalised features, then normalise
    assert t0.dtype == torch.float32 and t0.shape == expected.shape
    assert torch.allclose(t0, expected, atol=2e-6)
    normalised_first = unit(unit(raw).mean(0))  # CLIP's ensemble rule: a different vector
    assert (normalised_first - expected).abs().max() > 1e-3


def test_t0_in_fp32_from_a_half_text_tower(tiny_clip):
    import copy

    half = copy.deepcopy(tiny_clip).half()
    templates = list(PROMPTSRC_TEMPLATES[:2])
    t0 = frozen_text_features(half, CLASSNAMES, templates)
    assert t0.dtype == torch.float32 and half.text.token_embedding.weight.dtype == torch.float16
    fp32_of_half_weights = frozen_text_features(copy.deepcopy(half).float(), CLASSNAMES, templates)
    assert torch.equal(t0, fp32_of_half_weights)


def test_method_loss_and_gradients_equal_the_official_computation(tiny_openclip, tiny_clip, depth=2):
    """PromptSRC.loss (our towers, exact text fast paths, t0 once) against `coop.reference.promptsrc`'s
    step the official way (full 77-token prompts through open_clip's modules, frozen tower on the
    same images, the repository's fixed embeddings): every term, the total and every gradient."""
    overrides = [
        "method=promptsrc",
        "model.pretrained=none",
        f"prompt.depth={depth}",
        f"vision.depth={depth}",
    ]
    method = build_method(tiny_clip, CLASSNAMES, load_config(None, overrides))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for t in method.learnable().values():
            t.add_(0.5 * torch.randn(t.shape, generator=gen))
    images = torch.randn(3, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 3, 1])
    tensors = list(method.learnable().values())
    ours, _ = method.loss(images, labels)
    terms = method.last_terms
    our_grads = torch.autograd.grad(ours, tensors)

    learner = method.prompt_learner
    ids, _, slots = reference_inputs(tiny_openclip, learner)
    fixed = promptsrc_fixed_embeddings(tiny_openclip, CLASSNAMES, PROMPTSRC_TEMPLATES)
    ref, ref_terms = reference.promptsrc_loss(
        tiny_openclip, images, labels, ids, slots, learner.ctx, learner.deep_ctx, method.vision(), fixed
    )
    ref_grads = torch.autograd.grad(ref, tensors)
    for name in ("ce", "text", "image", "kl"):
        assert torch.allclose(terms[name], ref_terms[name], rtol=1e-4, atol=1e-7), name
    assert torch.allclose(ours, ref, rtol=1e-5)
    for name, a, b in zip(method.learnable(), our_grads, ref_grads, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-4, name
    learned = {id(t) for t in tensors}
    assert all(id(p) in learned for p in method.parameters() if p.requires_grad)  # nothing of CLIP


def test_fp16_step_and_gpa_keep_the_originals_dtypes(tiny_openclip):
    """train.precision=fp16 as the official PREC=fp16: CLIP and ctx half, the other prompts fp32;
    the loss terms in fp32 with t0 from an fp32 copy; GPA sums each tensor in its own dtype."""
    clip = coop.CLIP.from_openclip(tiny_openclip)  # its own copy: it becomes half here
    overrides = [
        "method=promptsrc",
        "model.pretrained=none",
        "prompt.depth=2",
        "vision.depth=2",
        "train.epochs=2",
        "promptsrc.templates=a photo of a {}.",  # one template: half precision on a CPU is slow
    ]
    method = build_method(clip, CLASSNAMES, load_config(None, overrides))
    fp32_t0 = frozen_text_features(clip, CLASSNAMES, method.templates)
    method.to_half()
    images, labels = torch.randn(2, 3, 32, 32).half(), torch.tensor([0, 2])
    loss, logits = method.loss(images, labels)
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == logits.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in method.last_terms.values())
    assert method.frozen_text().dtype == torch.float32
    assert (method.frozen_text() - fp32_t0).abs().max() < 5e-3  # from half-rounded weights
    learned = method.learnable()
    assert learned["ctx"].dtype == learned["ctx"].grad.dtype == torch.half
    assert learned["vision_ctx"].dtype == learned["deep_ctx"].dtype == torch.float32
    before = {k: v.detach().clone() for k, v in learned.items()}
    w = gpa_weights(2, 15.0, 1.0)
    method.end_epoch(1, 2)
    method.end_epoch(2, 2)  # the same tensors twice: the aggregate is (w1 + w2) x them
    for name, t in learned.items():
        assert t.dtype == before[name].dtype, name
        expected = before[name] * w[0] + before[name] * w[1]
        assert torch.equal(t.detach(), expected), name


def test_template_sets():
    ensemble = [t("{}") for t in open_clip.OPENAI_IMAGENET_TEMPLATES]
    assert len(set(PROMPTSRC_TEMPLATES)) == 60 and set(PROMPTSRC_TEMPLATES) <= set(ensemble)
    assert PROMPTSRC_TEMPLATES[0] == "a photo of a {}." and PROMPTSRC_TEMPLATES[-1] == "itap of the {}."
    assert resolve_promptsrc_templates("promptsrc", "dtd") == list(PROMPTSRC_TEMPLATES)
    assert resolve_promptsrc_templates("ensemble", "dtd") == ensemble
    assert resolve_promptsrc_templates("coop", "dtd") == ["{} texture."]
    assert resolve_promptsrc_templates("a {} here.", "dtd") == ["a {} here."]
    with pytest.raises(ConfigError, match="promptsrc.templates='nope'"):
        resolve_promptsrc_templates("nope", "dtd")


@pytest.mark.parametrize(
    "epochs, mean, std", [(20, 15, 1), (20, 6, 10), (50, 30, 30), (50, 45, 5), (3, 1.6, 1)]
)
def test_gpa_weights_equal_normalised_gaussian_densities(epochs, mean, std):
    density = [
        math.exp(-0.5 * ((e - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi))
        for e in range(1, epochs + 1)
    ]
    expected = [d / sum(density) for d in density]
    weights = gpa_weights(epochs, mean, std)
    assert len(weights) == epochs and math.isclose(sum(weights), 1.0, rel_tol=1e-12)
    for w, x in zip(weights, expected, strict=True):
        assert math.isclose(w, x, rel_tol=1e-9, abs_tol=1e-300)
    assert max(range(epochs), key=lambda e: weights[e]) + 1 == min(max(round(mean), 1), epochs)


def test_gpa_weights_far_mean_and_bad_std():
    weights = gpa_weights(2, mean=1000.0, std=1.0)  # the plain densities underflow to 0 / 0
    assert weights[1] == pytest.approx(1.0) and all(math.isfinite(w) for w in weights)
    with pytest.raises(ValueError, match="standard deviation"):
        gpa_weights(5, 1.0, 0.0)


def test_gpa_aggregate_equals_direct_weighted_sum_and_resumes_exactly():
    epochs, weights = 5, gpa_weights(5, mean=3.0, std=1.5)
    gen = torch.Generator().manual_seed(0)
    snapshots = [
        {"ctx": torch.randn(4, 8, generator=gen), "deep": torch.randn(2, 4, 8, generator=gen)}
        for _ in range(epochs)
    ]
    gpa = GaussianAggregate(weights)
    for e, tensors in enumerate(snapshots, 1):
        gpa.add(e, tensors)
        if e == 2:  # a checkpoint after epoch 2, restored into a fresh aggregate
            resumed = GaussianAggregate(weights)
            resumed.load_state_dict(gpa.state_dict())
    for e in range(3, epochs + 1):
        resumed.add(e, snapshots[e - 1])
    assert gpa.complete and resumed.complete
    for name in ("ctx", "deep"):
        direct = sum(w * s[name].double() for w, s in zip(weights, snapshots, strict=True))
        assert torch.allclose(gpa.sum[name].double(), direct, atol=1e-6), name
        assert torch.equal(resumed.sum[name], gpa.sum[name]), name
        assert gpa.sum[name].dtype == torch.float32
    with pytest.raises(ValueError, match="epoch 1"):
        GaussianAggregate(weights).add(2, snapshots[0])


def test_promptsrc_config_keys():
    cfg = load_config(None, [])
    assert dict(cfg.promptsrc) == {
        "text_weight": 25.0,
        "image_weight": 10.0,
        "kl_weight": 1.0,
        "templates": "promptsrc",
        "gpa_mean": 15.0,
        "gpa_std": 1.0,
    }
    for bad, key in [
        ("promptsrc.gpa_std=0", "promptsrc.gpa_std"),
        ("promptsrc.text_weight=-1", "promptsrc.text_weight"),
        ("promptsrc.kl_weight=x", "promptsrc.kl_weight"),
        ("promptsrc.gpa_mean=.inf", "promptsrc.gpa_mean"),
        ("promptsrc.gpa_weight=1", "promptsrc.gpa_weight"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])


def record_epochs(monkeypatch) -> list[dict]:
    """Copies of PromptSRC's learned tensors after every epoch, before GPA touches them."""
    snapshots, real = [], PromptSRC.end_epoch

    def end_epoch(self, epoch, epochs):
        snapshots.append({k: v.detach().clone() for k, v in self.learnable().items()})
        real(self, epoch, epochs)

    monkeypatch.setattr(PromptSRC, "end_epoch", end_epoch)
    return snapshots


def test_promptsrc_and_maple_end_to_end(data_root, tmp_path, monkeypatch, caplog):  # noqa: F811
    """Base-to-new PromptSRC with eval.targets: the final checkpoint holds the GPA aggregate of the
    epochs (checked against a direct weighted sum), evaluation uses it, a run interrupted mid-GPA
    and resumed ends bit-identical; a MaPLe run beside it; one table with both rows."""
    root = tmp_path / "runs"
    common = ["data.name=imagenet", f"data.root={data_root}", "data.subsample_classes=base"]
    common += ["prompt.depth=2", "train.epochs=3"]  # the tiny towers have 2 image and 3 text blocks
    src = ["method=promptsrc", "vision.depth=2", "promptsrc.gpa_mean=2", "promptsrc.gpa_std=1"]
    src += ["eval.targets=[imagenet_a]"]
    snapshots = record_epochs(monkeypatch)
    caplog.set_level(logging.INFO, logger="coop.methods.promptsrc")
    metrics = train_run(tiny_cfg(root / "promptsrc", *common, *src))
    monkeypatch.undo()
    folder = root / "promptsrc"
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert ckpt["finished"] and ckpt["method_state"]["gpa"]["epoch"] == 3 and len(snapshots) == 3
    density = [math.exp(-0.5 * (e - 2) ** 2) for e in (1, 2, 3)]
    weights = [d / sum(density) for d in density]
    assert set(ckpt["prompt"]) == {"ctx", "deep_ctx", "vision_ctx", "vision_deep_ctx"}
    for name, saved in ckpt["prompt"].items():
        direct = sum(w * s[name].double() for w, s in zip(weights, snapshots, strict=True))
        assert torch.allclose(saved.double(), direct, atol=1e-6), name
        assert not torch.allclose(saved, snapshots[-1][name]), name  # not simply the last epoch
    assert metrics["method"] == "promptsrc" and metrics["gpa_mean"] == 2.0 and metrics["vision_n_ctx"] == 4
    new = json.loads((folder / "eval_imagenet_new.json").read_text())
    target = json.loads((folder / "eval_imagenet_a.json").read_text())
    assert new["subsample_classes"] == "new" and len(new["per_class_accuracy"]) == 2
    assert target["trained_on"] == "imagenet" and len(target["per_class_accuracy"]) == 2
    assert evaluate_checkpoint(folder / "checkpoint.pt")["accuracy"] == metrics["accuracy"]
    assert "v0 from the frozen image tower on every step" in caplog.text  # the run says which way it goes
    assert "GPA aggregate of epochs 1..3 replaces" in caplog.text

    out = tmp_path / "resumed"  # stopped before its third epoch: GPA has summed epochs 1 and 2
    with interrupted_at(2), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(out, *common, *src))
    partial = torch.load(out / "checkpoint.pt", weights_only=True)
    assert partial["epoch"] == 2 and partial["method_state"]["gpa"]["epoch"] == 2
    assert train_run(tiny_cfg(out, *common, *src))["accuracy"] == metrics["accuracy"]
    resumed = torch.load(out / "checkpoint.pt", weights_only=True)
    for name, t in ckpt["prompt"].items():
        assert torch.equal(resumed["prompt"][name], t), name
    for name, t in ckpt["method_state"]["gpa"]["sum"].items():
        assert torch.equal(resumed["method_state"]["gpa"]["sum"][name], t), name
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in ckpt["history"]]

    train_run(tiny_cfg(root / "maple", *common, "method=maple", "train.epochs=2"))
    runs = load_runs(root)
    table = dataset_table(runs, "accuracy")  # what tools/collect.py --table datasets prints
    assert sorted(table["method"]) == ["maple", "promptsrc"] and "imagenet_mean" in table.columns
    settings = summarize(runs, by=["method"])  # tools/collect.py's default table: base, new, HM
    assert sorted(settings["method"]) == ["maple", "promptsrc"]
    assert settings["hm_mean"].notna().all()


def test_promptsrc_recipes_and_grids(tmp_path):
    """method=promptsrc is the base-to-new recipe; the recipe files spell out the official configs;
    the protocol grids plan promptsrc runs that keep its recipe where the grid does not set it."""
    cfg = load_config(None, ["method=promptsrc"])
    assert (cfg.prompt.n_ctx, cfg.prompt.ctx_init, cfg.prompt.depth) == (4, "a photo of a", 9)
    assert (cfg.vision.n_ctx, cfg.vision.depth) == (4, 9)
    assert (cfg.train.lr, cfg.train.batch_size, cfg.train.epochs) == (0.0025, 4, 20)
    assert run_name(cfg).split("/")[3] == "promptsrc_nctx4_cscfalse_posend_depth9_vctx4_vdepth9"
    expected = {  # file: (epochs, depth, gpa_mean, gpa_std)
        "vit_b16_c2_ep20_batch4_4+4ctx": (20, 9, 15, 1),
        "vit_b16_c2_ep20_batch4_4+4ctx_cross_datasets": (20, 3, 6, 10),
        "vit_b16_c2_ep50_batch4_4+4ctx_few_shot": (50, 9, 30, 30),
        "vit_b16_c2_ep50_batch4_4+4ctx_few_shot_gpa45": (50, 9, 45, 5),
    }
    for name, (epochs, depth, mean, std) in expected.items():
        r = load_config(str(REPO / "configs" / "promptsrc" / f"{name}.yaml"))
        assert (r.method, r.train.epochs, r.prompt.depth, r.vision.depth) == (
            "promptsrc",
            epochs,
            depth,
            depth,
        )
        assert (r.promptsrc.gpa_mean, r.promptsrc.gpa_std, r.train.lr, r.train.batch_size) == (
            mean,
            std,
            0.0025,
            4,
        )
        assert (r.promptsrc.text_weight, r.promptsrc.image_weight, r.promptsrc.templates) == (
            25,
            10,
            "promptsrc",
        )
    base = load_config(
        str(REPO / "configs" / "promptsrc" / "vit_b16_c2_ep20_batch4_4+4ctx.yaml"), ["data.name=textile"]
    )
    assert base == cfg
    for grid in ("base_to_new", "cross_dataset", "domain_generalization", "few_shot"):
        path = str(REPO / "configs" / "protocols" / f"{grid}.yaml")
        runs = plan(
            load_grid(path, ["method=[maple,promptsrc]", "data.seed=1"]), tmp_path / grid, check_data=False
        )
        run_cfg = load_config(None, next(r.overrides for r in runs if "method=promptsrc" in r.overrides))
        assert run_cfg.train.epochs == 20 and run_cfg.vision.depth == 9 and run_cfg.train.lr == 0.0025


def test_bench_vl_promptsrc_step_matches_the_official_way(tmp_path, capsys):
    """tools/bench/bench_vl.py --method promptsrc on the tiny model: both sides run, the same loss terms
    and gradients, the speed-up printed."""
    out_json = tmp_path / "vl.json"
    args = ["--method", "promptsrc", "--model", str(REPO / "configs" / "models" / "coop-tiny.json")]
    args += [
        "--classes",
        "4",
        "--batch",
        "2",
        "--warmup",
        "0",
        "--set",
        "prompt.depth=2",
        "--set",
        "vision.depth=2",
    ]
    assert load_tool("bench_vl").main([*args, "--no-memory", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "speed-up:" in out and "loss terms (reference vs ours): ce" in out
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["reference_text"] == 4 * 77 and step["ours_text"] < 4 * 77
    assert set(step["term_diff"]) == {"ce", "text", "image", "kl"} and max(step["term_diff"].values()) < 1e-5
    assert set(step["grad_diff"]) == {"ctx", "deep_ctx", "vision_ctx", "vision_deep_ctx"}
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4

"""Tip-Adapter and Tip-Adapter-F: logits and the learned keys' gradient against the reference on
open_clip's modules, the alpha/beta search against an independent re-derivation, the recipes, the
cache's views, and runs end to end (tune on val, metrics.json, transfer, resume, fp16)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import REPO, interrupted_at
from test_protocols import data_root, tiny_cfg  # noqa: F401  (data_root is a fixture)

import coop.reference.tip_adapter as ref
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.recipes import TIP_SETTINGS
from coop.config.run_names import run_name
from coop.data import ImageDataset, build_dataset
from coop.data.images import derive_seed
from coop.methods import build_method
from coop.methods.tip_adapter import search_alpha_beta, search_grid
from coop.methods.zeroshot import IMAGENET_TEMPLATES_SELECT
from coop.train.engine import clip_transforms
from coop.train.evaluation import evaluate_checkpoint_targets
from coop.train.grid import load_grid
from coop.train.run_features import REQUEST_STREAM
from coop.train.runner import train_run
from coop.train.schedule import plan_schedule
from coop.train.sweep import plan

CLASSES = ["banded", "golden_retriever", "crane (bird)", "a very long compound class name"]


def tip(clip, method="tip_adapter_f", dataset="dtd", *extra):
    cfg = load_config(None, [f"method={method}", f"data.name={dataset}", "model.pretrained=none", *extra])
    return build_method(clip, CLASSES, cfg), cfg


@pytest.mark.parametrize("dataset", ["dtd", "imagenet"])
def test_logits_and_key_gradient_equal_the_reference(tiny_clip, tiny_openclip, dataset):
    gen = torch.Generator().manual_seed(0)
    views = [torch.randn(8, 3, 32, 32, generator=gen) for _ in range(3)]  # 3 augmented passes
    labels = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    images, y = torch.randn(5, 3, 32, 32, generator=gen), torch.tensor([2, 0, 1, 3, 3])
    method, cfg = tip(tiny_clip, "tip_adapter_f", dataset)
    assert method.templates == (["{} texture."] if dataset == "dtd" else list(IMAGENET_TEMPLATES_SELECT))
    with torch.no_grad():
        feats = torch.stack([tiny_clip.encode_image(v) for v in views])  # (V, N, E)
        x = tiny_clip.encode_image(images)
    method.fit((feats, labels))
    alpha, beta = cfg.tip.init_alpha, cfg.tip.init_beta
    keys, values = ref.build_cache(tiny_openclip, views, labels, len(CLASSES))
    weights = ref.clip_classifier(tiny_openclip, CLASSES, method.templates)
    torch.testing.assert_close(method.keys, keys.t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(method.zero_shot_weights(), weights.t(), rtol=1e-5, atol=1e-6)

    # Tip-Adapter-F's training loss and the gradient of its keys, before and after a change of W_a
    adapter = ref.adapter_from_keys(keys)
    with torch.no_grad():
        shift = 0.05 * torch.randn(keys.shape[::-1], generator=gen)
        adapter.weight.add_(shift)
        method.adapter.add_(shift)
    loss, logits = method.loss(x, y)
    want = ref.tip_adapter_f_loss(tiny_openclip, images, y, weights, adapter, values, alpha, beta)
    torch.testing.assert_close(logits, ref.tip_logits(tiny_openclip, images, weights, adapter, values, alpha, beta), rtol=1e-5, atol=1e-4)  # fmt: skip
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    assert method.adapter.grad.abs().sum() > 0 and [
        n for n, p in method.named_parameters() if p.requires_grad
    ] == ["adapter"]
    torch.testing.assert_close(method.adapter.grad, adapter.weight.grad, rtol=1e-4, atol=1e-6)

    # training-free Tip-Adapter at another alpha/beta: the same logits through the fixed keys
    plain, _ = tip(tiny_clip, "tip_adapter", dataset)
    plain.fit((feats, labels))
    plain.alpha, plain.beta = 3.7, 5.5
    with torch.no_grad():
        torch.testing.assert_close(plain.logits(x), ref.tip_logits(tiny_openclip, images, weights, keys, values, 3.7, 5.5), rtol=1e-5, atol=1e-4)  # fmt: skip


def search_by_hand(features, labels, clip_weights, keys, values, cfg):
    """Tip-Adapter's `search_hp`, re-derived loop by loop: every grid point's logits from scratch,
    accuracy via top-1 as its `cls_acc`, a new best only when strictly better."""
    s_beta, s_alpha = cfg["search_scale"]
    n_beta, n_alpha = cfg["search_step"]
    betas = [i * (s_beta - 0.1) / n_beta + 0.1 for i in range(n_beta)]
    alphas = [i * (s_alpha - 0.1) / n_alpha + 0.1 for i in range(n_alpha)]
    best_acc, best_beta, best_alpha = 0.0, 0, 0
    for beta in betas:
        for alpha in alphas:
            affinity = features @ keys
            cache_logits = ((-1) * (beta - beta * affinity)).exp() @ values
            tip_logits = 100.0 * features @ clip_weights + cache_logits * alpha
            pred = tip_logits.topk(1, 1, True, True)[1].t()
            acc = 100 * float(pred.eq(labels.view(1, -1)).float().sum()) / labels.shape[0]
            if acc > best_acc:
                best_acc, best_beta, best_alpha = acc, beta, alpha
    return best_beta, best_alpha, best_acc


def test_search_equals_an_independent_rederivation():
    gen = torch.Generator().manual_seed(0)
    n_cls, dim = 5, 16
    centres = torch.nn.functional.normalize(torch.randn(n_cls, dim, generator=gen), dim=-1)
    ky = torch.arange(20) % n_cls
    keys = torch.nn.functional.normalize(centres[ky] + 0.5 * torch.randn(20, dim, generator=gen), dim=-1)
    near = torch.randint(0, 20, (60,), generator=gen)  # val images near a cached one: the cache helps
    val = torch.nn.functional.normalize(keys[near] + 0.25 * torch.randn(60, dim, generator=gen), dim=-1)
    vy = ky[near]
    zs = torch.nn.functional.normalize(centres + torch.randn(n_cls, dim, generator=gen), dim=-1)
    values = torch.nn.functional.one_hot(ky, n_cls).float()
    for setting in ({"search_scale": [7, 3], "search_step": [200, 20]}, {"search_scale": [50, 50], "search_step": [40, 10]}):  # fmt: skip
        want = search_by_hand(val, vy, zs.t(), keys.t(), values, setting)
        got = search_alpha_beta(val, zs, keys, values, vy, setting["search_scale"], setting["search_step"])
        assert got == pytest.approx(want, rel=0, abs=1e-12)
        assert 0.1 < want[0] and 0.1 < want[1]  # an interior point: the grids matter
    grid = search_grid(7, 200)
    assert (
        len(grid) == 200
        and grid[0] == 0.1
        and grid[-1] == pytest.approx(0.1 + 199 * 6.9 / 200)
        and 7 not in grid
    )


def test_recipes_per_dataset_and_the_cosine_length(tmp_path):
    f = load_config(None, ["method=tip_adapter_f", "data.name=dtd"])
    t = f.train
    assert (t.optimizer, t.lr, t.eps, t.weight_decay, t.betas) == ("adamw", 0.001, 1e-4, 0.01, [0.9, 0.999])
    assert (t.schedule, t.min_lr, t.warmup_epochs, t.batch_size, t.epochs) == ("cosine_iter", 0.0, 0, 256, 20)
    assert list(t.crop_scale) == [0.5, 1.0] and t.drop_last is False
    assert (f.tip.init_beta, f.tip.init_alpha, list(f.tip.search_scale)) == (1.0, 2.0, [13, 13])
    # the original's T = train_epoch * len(train_loader) with drop_last=False: DTD 16 shots, 752 images
    schedule = plan_schedule(f, 47 * 16)
    assert schedule.steps_per_epoch == 3 and schedule.total == 60
    assert load_config(None, ["method=tip_adapter_f", "data.name=eurosat"]).train.epochs == 100
    assert (
        load_config(None, ["method=tip_adapter_f", "data.name=eurosat", "train.epochs=7"]).train.epochs == 7
    )
    fgvc = load_config(None, ["method=tip_adapter", "data.name=fgvc_aircraft"]).tip
    assert (fgvc.init_alpha, list(fgvc.search_scale)) == (5.0, [30, 30])
    assert set(TIP_SETTINGS) == {"imagenet", "caltech101", "oxford_pets", "stanford_cars", "oxford_flowers",
                                 "food101", "fgvc_aircraft", "sun397", "dtd", "eurosat", "ucf101"}  # fmt: skip
    plain = load_config(None, ["method=tip_adapter", "data.name=oxford_flowers", "tip.init_alpha=4"])
    assert (plain.tip.init_alpha, list(plain.tip.search_scale)) == (4, [50, 50])  # an explicit value wins
    assert run_name(plain).split("/")[3] == "tip_adapter_views10"
    assert load_config(None, []).train.drop_last is True  # CoOp's loaders unchanged
    for bad, key in (("tip.augment_epochs=0", "tip.augment_epochs"), ("tip.search_scale=[7]", "tip.search_scale"),
                     ("tip.search_step=[200,0.5]", "tip.search_step"), ("tip.init_alpha=-1", "tip.init_alpha"),
                     ("train.drop_last=sometimes", "train.drop_last")):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["method=tip_adapter", bad])
    # the protocol grids run both with their recipes
    grid = load_grid(str(REPO / "configs/protocols/few_shot.yaml"), ["method=[tip_adapter,tip_adapter_f]", "data.name=[eurosat]"])  # fmt: skip
    runs = plan(grid, tmp_path, check_data=False)
    f_euro = load_config(None, next(r.overrides for r in runs if "method=tip_adapter_f" in r.overrides))
    assert (f_euro.train.epochs, f_euro.train.batch_size, f_euro.tip.init_alpha) == (100, 256, 2.0)


def test_runs_tune_on_val_transfer_and_resume(data_root, tmp_path):  # noqa: F811
    """Both methods end to end on an image folder with a val split: the cache keys are the mean of
    10 views at crop scale 0.5-1; alpha/beta are the val search's; ImageNet-A's class subset keeps
    its cache columns; Tip-Adapter-F killed after epoch 1 and resumed ends bit-identical."""
    folder = str(data_root / "folder")
    common = ["data.name=imagefolder", f"data.root={folder}", "tip.search_step=[20,10]", "train.epochs=3"]
    out = tmp_path / "tip"
    metrics = train_run(tiny_cfg(out, *common, "method=tip_adapter"))
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert metrics["epochs"] == 0 and metrics["tip_alpha"] == float(ckpt["prompt"]["alpha"])
    assert (metrics["tip_beta"], metrics["tip_augment_epochs"]) == (float(ckpt["prompt"]["beta"]), 10)
    assert (
        metrics["val_accuracy"] >= 0
        and json.loads((out / "metrics.json").read_text())["tip_alpha"] == metrics["tip_alpha"]
    )

    # the keys: each training image's 10 views (scale 0.5-1, flip), mean of raw features, normalised
    s_cfg = tiny_cfg(tmp_path / "unused", *common, "method=tip_adapter")
    from coop.model.weights import load_clip

    clip = load_clip(s_cfg.model.name, pretrained=None)
    train_tf, _ = clip_transforms(clip, s_cfg.train.crop_scale)
    assert "scale=(0.5, 1.0)" in repr(train_tf) and "bicubic" in repr(train_tf).lower()
    items = build_dataset("imagefolder", folder, shots=4, seed=1).train
    stream = derive_seed(1, REQUEST_STREAM)
    with torch.no_grad():
        views = [torch.stack([x for x, _, _ in ImageDataset(items, train_tf, seed=derive_seed(stream, v))]) for v in range(10)]  # fmt: skip
        keys, _ = ref.build_cache(clip, views, torch.tensor([d.label for d in items]), 4)
    torch.testing.assert_close(ckpt["prompt"]["keys"], keys.t(), rtol=1e-5, atol=1e-6)

    f_out = tmp_path / "tip_f"
    f_metrics = train_run(tiny_cfg(f_out, *common, "method=tip_adapter_f", "train.batch_size=256"))
    f_ckpt = torch.load(f_out / "checkpoint.pt", weights_only=True)
    assert set(f_ckpt["prompt"]) == {"adapter", "values", "alpha", "beta"} and f_metrics["epochs"] == 3
    assert not torch.equal(f_ckpt["prompt"]["adapter"], ckpt["prompt"]["keys"])  # trained
    assert [row["lr"] for row in f_ckpt["history"]] == pytest.approx(
        [0.05, 0.05 * 0.75, 0.05 * 0.25]
    )  # tiny_cfg: lr 0.05

    resumed = tmp_path / "resumed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(resumed, *common, "method=tip_adapter_f", "train.batch_size=256"))
    again = train_run(tiny_cfg(resumed, *common, "method=tip_adapter_f", "train.batch_size=256"))
    r_ckpt = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert torch.equal(r_ckpt["prompt"]["adapter"], f_ckpt["prompt"]["adapter"])
    assert (again["accuracy"], again["tip_alpha"], again["tip_beta"]) == (f_metrics["accuracy"], f_metrics["tip_alpha"], f_metrics["tip_beta"])  # fmt: skip

    # another class list: columns by class name (ImageNet-A's subset), zero-shot alone where none
    inet = tmp_path / "inet"
    train_run(tiny_cfg(inet, "data.name=imagenet", f"data.root={data_root}", "method=tip_adapter", "tip.search_step=[5,5]"))  # fmt: skip
    a = evaluate_checkpoint_targets(inet / "checkpoint.pt", ["imagenet_a"])["eval_imagenet_a.json"]
    assert len(a["per_class_accuracy"]) == 2 and a["tip_alpha"] > 0


def test_fp16_halves_the_cache_and_keeps_alpha_beta(tiny_clip):
    method, cfg = tip(copy.deepcopy(tiny_clip), "tip_adapter_f", "dtd")  # to_half halves its CLIP
    gen = torch.Generator().manual_seed(1)
    feats, labels = torch.randn(2, 8, tiny_clip.embed_dim, generator=gen), torch.arange(8) % 4
    method.fit((feats, labels))
    x = torch.randn(3, tiny_clip.embed_dim, generator=gen)
    with torch.no_grad():
        full = method.logits(x)
    method.to_half()
    assert method.adapter.dtype == method.values.dtype == torch.float16 and method.alpha == cfg.tip.init_alpha
    with torch.no_grad():
        half = method.logits(x.half())
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), full, rtol=2e-2, atol=0.5)


def test_published_rn50_curves_sit_under_our_rows(tmp_path):
    from test_results import collect, write_run

    from coop.results.published import lookup

    fig = lookup("tip_adapter_f", "few_shot", "dtd", shots=16, model="RN50")
    assert (fig.value, fig.checked) == (66.55, True) and lookup("tip_adapter_f", "few_shot", "dtd") is None
    assert lookup("tip_adapter", "few_shot", "eurosat", shots=1, model="RN50").value == 54.38
    rn50 = ["method=tip_adapter_f", "model.name=RN50", "data.name=dtd", "data.shots=16"]
    write_run(tmp_path / "dtd", rn50, metrics={"accuracy": 66.0})
    assert collect(tmp_path, "--table", "datasets", "--published", "--out", tmp_path / "t") == 0
    md = (tmp_path / "t" / "results_datasets.md").read_text()
    assert "| tip_adapter_f: paper" in md and "66.55" in md and "1 of 1 cell(s) checked" in md


def test_other_classes_keep_their_cache_columns_by_name(tiny_clip):
    method, _ = tip(tiny_clip, "tip_adapter", "dtd")
    gen = torch.Generator().manual_seed(2)
    method.fit((torch.randn(2, 8, tiny_clip.embed_dim, generator=gen), torch.arange(8) % 4))
    saved = {k: v.clone() for k, v in method.learnable().items()}
    cfg = load_config(None, ["method=tip_adapter", "data.name=dtd", "model.pretrained=none"])
    other = build_method(tiny_clip, [CLASSES[1], "a class never cached"], cfg)
    other.load_trained(saved, CLASSES)
    assert torch.equal(other.values[:, 0], saved["values"][:, 1]) and not other.values[:, 1].any()
    assert (other.alpha, other.beta) == (method.alpha, method.beta)
    x = torch.randn(3, tiny_clip.embed_dim, generator=gen)
    with torch.no_grad():
        zero_shot = 100.0 * torch.nn.functional.normalize(x, dim=-1) @ other.zero_shot_weights().t()
        torch.testing.assert_close(
            other.logits(x)[:, 1], zero_shot[:, 1]
        )  # no cache entries: zero-shot alone
        torch.testing.assert_close(other.logits(x)[:, 0], method.logits(x)[:, 1])


def test_a_dataset_without_val_is_refused_before_encoding(image_folder, tmp_path, monkeypatch):
    from conftest import tiny_args

    import coop.train.runner
    from coop.data import DataError

    monkeypatch.setattr(coop.train.runner, "requested_features", lambda *a: pytest.fail("encoded features"))
    with pytest.raises(
        DataError, match="method=tip_adapter chooses its hyper-parameters on the val split"
    ) as e:
        train_run(load_config(None, tiny_args(image_folder, tmp_path / "run", method="tip_adapter")))
    assert "\n" not in str(e.value)

"""The engine's general hooks: optimizers and parameter groups, per-epoch and per-iteration
schedules with iteration budgets, which classes a method scores, and the train-transform keys
(`train.augment`, `train.crop_scale`). Runs are in-process on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import interrupted_at, tiny_args

import coop.train.engine
import coop.train.runner
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.methods import METHODS, build_method
from coop.train.engine import setup
from coop.train.runner import train_run
from coop.train.schedule import Schedule, build_optimizer, set_lr


def torch_cosine_lrs(lr: float, min_lr: float, total: int) -> list[float]:
    """Per-step rates of torch's CosineAnnealingLR stepped after every optimizer step."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total, eta_min=min_lr)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    return lrs


def test_per_iteration_cosine_is_torchs_cosine_annealing_stepped_every_iteration():
    s = Schedule("cosine_iter", lr=2e-4, epochs=4, steps_per_epoch=7, min_lr=1e-6, steps=25)
    ours = [s.lr_at(e, t) for e in range(4) for t in range(s.steps_in_epoch(e))]
    assert [s.steps_in_epoch(e) for e in range(4)] == [7, 7, 7, 4]  # the budget cuts the last epoch
    assert ours == pytest.approx(torch_cosine_lrs(2e-4, 1e-6, 25), rel=1e-12, abs=1e-18)
    const = Schedule("constant", lr=1e-3, epochs=3, steps_per_epoch=2, warmup_epochs=1, warmup_lr=1e-5)
    assert {const.lr_at(e, t) for e in range(3) for t in range(2)} == {1e-3}


def test_parameter_groups_scale_the_rate_and_keep_their_own_decay():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    cfg = load_config(None, ["train.optimizer=adam", "train.eps=1e-3", "train.betas=[0.8,0.99]"])
    opt = build_optimizer([{"params": [a]}, {"params": [b], "lr_scale": 6.5, "weight_decay": 0.0}], cfg.train)
    assert isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW)
    set_lr(opt, 0.0035)
    g0, g1 = opt.param_groups
    assert (g0["lr"], g1["lr"]) == (0.0035, 0.0035 * 6.5)
    assert (g0["weight_decay"], g1["weight_decay"]) == (5e-4, 0.0)
    assert g0["eps"] == 1e-3 and g0["betas"] == (0.8, 0.99)
    warm = Schedule("cosine", lr=0.0035, epochs=10, steps_per_epoch=1, warmup_epochs=1, warmup_lr=1e-5)
    assert warm.apply(opt, 0) == 1e-5 and (g0["lr"], g1["lr"]) == (1e-5, 1e-5)  # Dassl: every group
    assert warm.apply(opt, 1) == 0.0035 and g1["lr"] == 0.0035 * 6.5
    adamw = build_optimizer([{"params": [a]}], load_config(None, ["train.optimizer=adamw"]).train)
    assert isinstance(adamw, torch.optim.AdamW)


def test_iteration_budget_runs_exactly_its_steps_at_per_step_rates(image_folder, tmp_path, monkeypatch):
    """12 few-shot images at batch 4: 3 steps per epoch, so 7 iterations are 3 epochs (3, 3, 1)."""
    rates = []
    real_step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    extra = {
        "train.epochs": "null",
        "train.iterations": 7,
        "train.schedule": "cosine_iter",
        "train.optimizer": "adamw",
        "train.warmup_epochs": 0,
        "train.min_lr": 1e-6,
        "train.lr": 0.01,
    }
    out = tmp_path / "iters"
    train_run(load_config(None, tiny_args(image_folder, out, **extra)))
    assert rates == pytest.approx(torch_cosine_lrs(0.01, 1e-6, 7), rel=1e-12)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 3 and len(ckpt["history"]) == 3
    assert "exp_avg" in next(iter(ckpt["optimizer"]["state"].values()))  # AdamW's state, saved

    # killed after epoch 1 and resumed: the same prompts as the uninterrupted run
    resumed = tmp_path / "resumed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(load_config(None, tiny_args(image_folder, resumed, **extra)))
    train_run(load_config(None, tiny_args(image_folder, resumed, **extra)))
    again = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert torch.equal(again["prompt"]["ctx"], ckpt["prompt"]["ctx"])


@pytest.mark.parametrize(
    "override, match",
    [
        (["train.iterations=10", "train.epochs=3"], "both set the run's length"),
        (["train.iterations=10", "train.iterations_per_shot=5"], "set one of them to null"),
        (["train.betas=[0.9]"], "train.betas"),
        (["train.eps=0"], "train.eps"),
        (["train.min_lr=1.0"], "train.min_lr"),
        (["train.crop_scale=[0.6,0.5]"], "train.crop_scale"),
        (["train.augment=maybe"], "train.augment"),
        (["train.optimizer=lbfgs"], "train.optimizer"),
        (["train.schedule=step"], "train.schedule"),
    ],
)
def test_bad_optimizer_and_schedule_keys_are_one_line_errors(override, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_a_recipes_length_yields_to_a_length_in_the_other_unit():
    cfg = load_config(None, ["method=maple", "train.iterations=100"])  # maple's recipe: 5 epochs
    assert cfg.train.epochs is None and cfg.train.iterations == 100
    assert load_config(None, ["method=maple"]).train.epochs == 5


def test_a_method_knows_whether_it_scores_its_training_classes(tiny_clip):
    names = ["cat", "dog", "bird"]
    cfg = load_config(None, ["model.pretrained=none"])
    trained = build_method(tiny_clip, names, cfg)
    assert trained.on_training_classes and trained.trained_class_index.tolist() == [0, 1, 2]
    tensors = {k: v.detach().clone() for k, v in trained.learnable().items()}
    subset = build_method(tiny_clip, ["bird", "cat"], cfg)  # e.g. ImageNet-A's share of ImageNet
    subset.load_trained(tensors, names)
    assert subset.on_training_classes and subset.trained_class_index.tolist() == [2, 0]
    new = build_method(tiny_clip, ["cat", "fish"], cfg)  # base-to-new's new classes
    new.load_trained(tensors, names)
    assert not new.on_training_classes and new.trained_class_index is None


PIXEL_METHODS = sorted(name for name, cls in METHODS.items() if cls.input == "pixels")


@pytest.mark.parametrize("method", PIXEL_METHODS)
def test_without_augmentation_pixel_methods_train_on_the_test_transform(method, image_folder, tmp_path):
    """train.augment=false: each training batch is the test transform of its images, in the
    epoch's order, and the run folder says so."""
    extra = {"method": method, "train.augment": "false", "prompt.depth": 2, "vision.depth": 2}
    if method == "hicropl":  # it crosses below its depth and reads class descriptions
        path = tmp_path / "descriptions.json"
        path.write_text(json.dumps({c: [f"a {c}."] for c in ("red_thing", "green_thing", "blue_thing")}))
        extra |= {"hicropl.cross_layer": 1, "data.descriptions": path}
    if method == "coprompt":  # its class descriptions; each of its two views is the test transform
        extra["data.descriptions"] = tmp_path / "descriptions.json"
        extra["data.descriptions"].write_text(
            json.dumps({c: [f"a {c}."] for c in ("red_thing", "green_thing", "blue_thing")})
        )
    args = tiny_args(image_folder, tmp_path / "noaug", **extra)
    cfg = load_config(None, [*args, "train.epochs=2", "output_dir=null"])
    assert coop.train.runner.default_output_dir(cfg).split("/")[-2].endswith("_noaug")
    s = setup(cfg)
    seen = []
    real = s.method.loss

    def spy(images, labels):
        seen.append(images.detach().clone())
        return real(images, labels)

    s.method.loss = spy
    optimizer = build_optimizer(s.method.param_groups(), cfg.train)
    coop.train.engine.train_one_epoch(s, optimizer, 1, None)
    order = torch.randperm(
        len(s.dataset.train), generator=coop.train.engine.seed_epoch(int(cfg.data.seed), 1)
    )
    expected = torch.stack([s.test_tf(coop.data.images.load_image(s.dataset.train[i].path)) for i in order])
    seen = torch.cat(seen)
    if s.method.train_views > 1:  # (B, V, 3, H, W)
        assert all(torch.equal(seen[:, 0], seen[:, v]) for v in range(s.method.train_views))
        seen = seen[:, 0]
    assert torch.equal(seen, expected[: len(seen)])


def test_crop_scale_reaches_the_train_transform(tiny_clip):
    train, test = coop.train.engine.clip_transforms(tiny_clip, (0.5, 1.0))
    assert "scale=(0.5, 1.0)" in repr(train) and "RandomResizedCrop" not in repr(test)
    same, _ = coop.train.engine.clip_transforms(tiny_clip, augment=False)
    assert repr(same) == repr(test)

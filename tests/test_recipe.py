"""Fidelity to CoOp's recipe: lr schedule, fp16, config checks, cache keys, worker-count
invariance, unusable checkpoints and empty training splits. Runs are in-process on a tiny model."""

from __future__ import annotations

import copy
import csv
import logging

import pytest
import torch
from conftest import REPO, TINY_CONFIG, interrupted_at, make_image_folder, run_tool_in_process, tiny_args

import coop
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data import DataError, ImageDataset, build_dataset, build_transforms
from coop.train import features
from coop.train.checkpoint import CheckpointError, CheckpointNotFoundError, load_checkpoint
from coop.train.engine import clip_transforms, setup, use_fp16
from coop.train.evaluation import evaluate_checkpoint
from coop.train.features import cache_dir, cache_key, cached_features
from coop.train.precision import resolve_precision
from coop.train.runner import RunError, train_run
from coop.train.schedule import epoch_lr

CPU = torch.device("cpu")


def tiny_overrides(folder, out, **extra) -> list[str]:
    return tiny_args(folder, out, **{"train.aug_views": 1, **extra})


def tiny_cfg(folder, out, **extra):
    return load_config(None, tiny_overrides(folder, out, **extra))


def dassl_lrs(lr: float, warmup_lr: float, warmup: int, epochs: int) -> list[float]:
    """Per-epoch lrs of Dassl's constant warm-up with WARMUP_RECOUNT=True, built independently:
    warmup_lr for W epochs, then torch's CosineAnnealingLR(T_max=epochs) stepped after each
    later epoch only."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    lrs = []
    for e in range(epochs):
        lrs.append(warmup_lr if e < warmup else optimizer.param_groups[0]["lr"])
        if e >= warmup:
            optimizer.step()
            cosine.step()
    return lrs


def ctx_of(out):
    return torch.load(out / "checkpoint.pt", weights_only=True)["prompt"]["ctx"]


# --- 1. lr schedule -------------------------------------------------------------------------


@pytest.mark.parametrize("lr, warmup_lr, warmup, epochs", [(0.002, 1e-5, 1, 40), (0.05, 1e-4, 2, 7)])
def test_lr_schedule_is_dassls_warmup_recount(lr, warmup_lr, warmup, epochs):
    ours = [
        epoch_lr(e, lr=lr, epochs=epochs, warmup_epochs=warmup, warmup_lr=warmup_lr) for e in range(epochs)
    ]
    ref = dassl_lrs(lr, warmup_lr, warmup, epochs)
    assert ours[warmup] == lr  # the first epoch after warm-up trains at exactly the base lr
    assert ours[:warmup] == [warmup_lr] * warmup
    assert ours == pytest.approx(ref, rel=1e-12, abs=0)


def test_history_lr_is_the_rate_each_epoch_trained_at(image_folder, tmp_path, monkeypatch):
    import coop.train.runner

    used, real = [], coop.train.runner.train_one_epoch

    def spy(s, optimizer, *args):
        before = optimizer.param_groups[0]["lr"]
        stats = real(s, optimizer, *args)
        assert optimizer.param_groups[0]["lr"] == before  # one rate for the whole epoch
        used.append(before)
        return stats

    monkeypatch.setattr(coop.train.runner, "train_one_epoch", spy)
    out = tmp_path / "run"
    train_run(tiny_cfg(image_folder, out))
    with open(out / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    lrs = [float(r["lr"]) for r in rows]
    assert lrs == used  # the rate the optimizer really trained each epoch at
    assert lrs[1] == 0.05 and lrs == pytest.approx(dassl_lrs(0.05, 1e-5, 1, 4), rel=1e-12, abs=0)


def test_resume_keeps_the_schedule_and_refuses_an_older_one(image_folder, tmp_path):
    out = tmp_path / "resumed"
    with interrupted_at(2), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(image_folder, out))
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2

    older = tmp_path / "older"
    older.mkdir()
    (older / ".lock").touch()  # a run folder of ours (coop.train.lock), written by an older version
    del ckpt["lr_schedule"]  # as written before the cosine restarted after warm-up
    torch.save(ckpt, older / "checkpoint.pt")
    with pytest.raises(RunError, match="older lr schedule"):
        train_run(tiny_cfg(image_folder, older))

    train_run(tiny_cfg(image_folder, out))
    history = torch.load(out / "checkpoint.pt", weights_only=True)["history"]
    assert [r["lr"] for r in history] == pytest.approx(dassl_lrs(0.05, 1e-5, 1, 4), rel=1e-12, abs=0)


# --- 3. worker-count invariance -------------------------------------------------------------


def test_augmented_training_ignores_the_number_of_workers(image_folder, tmp_path):
    """aug_views=0: the same prompts with 0 or 2 workers, and killed with 2 then resumed with 0."""
    extra = {"train.aug_views": 0, "train.epochs": 2}
    train_run(tiny_cfg(image_folder, tmp_path / "w0", **extra))
    train_run(tiny_cfg(image_folder, tmp_path / "w2", **extra, **{"data.num_workers": 2}))
    out = tmp_path / "killed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(tiny_cfg(image_folder, out, **extra, **{"data.num_workers": 2}))
    train_run(tiny_cfg(image_folder, out, **extra))
    ref = ctx_of(tmp_path / "w0")
    assert torch.equal(ref, ctx_of(tmp_path / "w2")) and torch.equal(ref, ctx_of(out))


def test_image_dataset_seeds_each_image_by_index(image_folder, monkeypatch):
    items = build_dataset("imagefolder", str(image_folder)).train[:3]
    train_tf, _ = build_transforms(32)
    ds = ImageDataset(items, train_tf, seed=7)

    def reseeded(seed):
        raise AssertionError("an image's seed reached the GPU's generator")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded)  # a GPU run's generator is left alone
    state = torch.get_rng_state()
    first = ds[2][0]
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    ds[0], ds[1]
    assert torch.equal(ds[2][0], first)  # the same crop whatever was loaded before
    assert not torch.equal(ImageDataset(items, train_tf, seed=8)[2][0], first)


def test_view_cache_ignores_the_number_of_workers(tiny_clip, image_folder):
    items = build_dataset("imagefolder", str(image_folder)).train
    train_tf, _ = clip_transforms(tiny_clip)
    feats = [
        cached_features(
            tiny_clip, items, train_tf, views=2, seed=1, device=CPU, num_workers=w, use_disk=False
        )[0]
        for w in (0, 2)
    ]
    assert feats[0].shape == (2, len(items), 32)
    assert torch.equal(feats[0], feats[1])
    assert not torch.equal(feats[0][0], feats[0][1])  # two different augmentations


# --- 2. feature-cache keys ------------------------------------------------------------------


def test_cache_key_holds_everything_features_depend_on(tiny_clip, image_folder):
    items = build_dataset("imagefolder", str(image_folder)).test
    train_tf, test_tf = clip_transforms(tiny_clip)
    base = dict(views=1, seed=None, precision="fp32", skip_corrupt=False)
    key = cache_key(tiny_clip, items, test_tf, **base)
    variants = [
        ((tiny_clip, items[:-1], test_tf), {}),
        ((tiny_clip, items, train_tf), {}),
        ((tiny_clip, items, test_tf), {"views": 2}),
        ((tiny_clip, items, test_tf), {"seed": 1}),
        ((tiny_clip, items, test_tf), {"precision": "amp"}),
        ((tiny_clip, items, test_tf), {"precision": "fp16"}),
        ((tiny_clip, items, test_tf), {"skip_corrupt": True}),
    ]
    keys = {cache_key(*args, **{**base, **change}) for args, change in variants}
    assert key not in keys and len(keys) == len(variants)
    other = coop.load_clip(str(TINY_CONFIG))
    with torch.no_grad():
        other.visual.conv1.weight.add_(1e-3)
    assert cache_key(other, items, test_tf, **base) != key
    # the key holds the precision that really ran: amp and fp16 run fp32 on a CPU
    assert {resolve_precision(p, CPU) for p in ("amp", "fp16", "fp32")} == {"fp32"}


def test_a_towers_weights_are_hashed_once(monkeypatch):
    """`cache_key` hashes an image tower's weights once per tower (they are frozen): again only for
    another tower, or once a weight was written in place or converted."""
    hashed = []
    hash_tensors = features._hash_tensors
    monkeypatch.setattr(features, "_hash_tensors", lambda tensors: hashed.append(1) or hash_tensors(tensors))
    args = ([], "transform", 1, None, "fp32", False)
    clip = coop.load_clip(str(TINY_CONFIG))
    key = cache_key(clip, *args)
    assert cache_key(clip, *args) == key and len(hashed) == 1  # the second call hashes nothing
    other = copy.deepcopy(clip)
    assert cache_key(other, *args) == key and len(hashed) == 2  # another tower, the same weights
    with torch.no_grad():
        other.visual.conv1.weight.add_(1e-3)
    assert cache_key(other, *args) != key and len(hashed) == 3  # written in place: hashed again
    assert cache_key(other, *args) != cache_key(other.half(), *args) and len(hashed) == 4  # converted
    assert cache_key(clip, *args) == key and len(hashed) == 4


def test_strict_run_never_reuses_features_with_skipped_images(tiny_clip, tmp_path):
    folder = make_image_folder(tmp_path / "data", n_train=2, n_test=2)
    bad = folder / "test" / "red_thing" / "0.png"
    bad.write_bytes(b"not a png")
    items = build_dataset("imagefolder", str(folder)).test
    _, test_tf = clip_transforms(tiny_clip)
    feats, labels = cached_features(tiny_clip, items, test_tf, device=CPU, skip_corrupt=True)
    assert feats.shape[1] == len(labels) == len(items) - 1
    loose = cache_dir() / f"{cache_key(tiny_clip, items, test_tf, 1, None, 'fp32', True)}.pt"
    strict = cache_dir() / f"{cache_key(tiny_clip, items, test_tf, 1, None, 'fp32', False)}.pt"
    assert loose.is_file() and not strict.exists()
    kept = [i for i, d in enumerate(items) if d.path != str(bad)]
    assert len(kept) == 5 and torch.load(loose, weights_only=True)["index"].tolist() == kept
    strict.write_bytes(loose.read_bytes())  # even a strict-keyed file that skipped images is refused
    with pytest.raises(DataError, match=f"cannot read image {bad}"):
        cached_features(tiny_clip, items, test_tf, device=CPU, skip_corrupt=False)


# --- 4. fp16 --------------------------------------------------------------------------------


def test_fp16_casts_clip_and_prompts_to_half():
    clip = coop.load_clip(str(TINY_CONFIG))
    learner = coop.PromptLearner(clip, ["red thing", "green thing"], n_ctx=4, depth=2)
    use_fp16(clip, learner)
    assert {p.dtype for p in clip.parameters()} == {torch.float16}
    assert learner.ctx.dtype == learner.deep_ctx.dtype == learner.token_embeds.dtype == torch.float16
    assert learner.slots.dtype == torch.long
    # plain SGD updates the half-precision prompts themselves (no fp32 master copy)
    classifier = coop.PromptClassifier(clip, learner)
    optimizer = torch.optim.SGD(learner.parameters(), lr=0.1, momentum=0.9)
    images = clip.encode_image(torch.randn(2, 3, 32, 32, dtype=torch.float16))
    loss = torch.nn.functional.cross_entropy(classifier.logits(images), torch.tensor([0, 1]))
    before = learner.ctx.detach().clone()
    loss.backward()
    optimizer.step()
    assert learner.ctx.grad.dtype == torch.float16 and not torch.equal(learner.ctx, before)


def test_fp16_falls_back_to_fp32_on_cpu(image_folder, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="coop"):
        s = setup(tiny_cfg(image_folder, tmp_path / "r", **{"train.precision": "fp16"}))
    assert s.precision == "fp32" and s.method.learnable()["ctx"].dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if "fp16" in r.getMessage()]
    assert lines == ["train.precision=fp16 is not available on cpu; running fp32"]


# --- 5. config validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=0", "train.lr must be a number > 0, got 0"),
        ("train.lr=-0.1", "train.lr must be a number > 0, got -0.1"),
        ("train.batch_size=0", "train.batch_size must be an integer >= 1, got 0"),
        ("data.shots=-1", "data.shots must be an integer >= 0, got -1"),
        ("train.epochs=-3", "train.epochs must be an integer >= 0 or null, got -3"),
        ("train.warmup_lr=-1e-5", "train.warmup_lr must be a number >= 0, got -1e-05"),
        ("train.epochs=1", "train.warmup_epochs=1 must be less than the 1 training epochs"),
    ],
)
def test_invalid_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_valid_edge_values():
    load_config(None, ["train.epochs=0", "prompt.ctx_init='a photo of a'"])  # zero-shot, warm-up 1
    load_config(None, ["train.epochs=1", "train.warmup_epochs=0", "train.warmup_lr=0"])
    with pytest.raises(ConfigError, match="train.warmup_epochs=4 must be less than the 4"):
        load_config(None, ["data.shots=0", "train.epochs=4", "train.warmup_epochs=4"])
    cfg = load_config(None, ["data.shots=1", "train.warmup_epochs=49"])  # 50 epochs by CoOp's rule
    assert cfg.train.warmup_epochs == 49
    with pytest.raises(ConfigError, match="train.warmup_epochs=50 must be less than the 50"):
        load_config(None, ["data.shots=1", "train.warmup_epochs=50"])


# --- 6. unusable checkpoints ----------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(image_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    train_run(tiny_cfg(image_folder, out, **{"train.epochs": 2}))
    return out / "checkpoint.pt"


def bad_checkpoints(trained, folder):
    """(file, what the error must say) for a random-bytes, truncated and foreign checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    random_bytes = folder / "random.pt"
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    random_bytes.write_bytes(noise.numpy().tobytes())
    truncated = folder / "truncated.pt"
    data = trained.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    foreign = folder / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    return [
        (random_bytes, "not a torch.save file"),
        (truncated, "truncated or corrupt"),
        (foreign, "missing keys 'prompt', 'config', 'classnames'"),
    ]


def test_unusable_checkpoints_raise_one_line_naming_the_file(trained, tmp_path):
    for path, reason in bad_checkpoints(trained, tmp_path):
        for load in (load_checkpoint, evaluate_checkpoint):
            with pytest.raises(CheckpointError) as err:
                load(path)
            message = str(err.value)
            assert str(path) in message and reason in message and "\n" not in message
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list, not a dict"):
        load_checkpoint(tmp_path / "list.pt")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint not found"):
        load_checkpoint(tmp_path / "nope.pt")
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)


def test_resume_from_unusable_checkpoint_is_one_line(trained, image_folder, tmp_path):
    for path, reason in bad_checkpoints(trained, tmp_path / "files"):
        out = tmp_path / path.stem
        out.mkdir()
        (out / ".lock").touch()  # a run folder of ours whose checkpoint is unusable
        path.rename(out / "checkpoint.pt")
        with pytest.raises(CheckpointError) as err:
            train_run(tiny_cfg(image_folder, out))
        message = str(err.value)
        assert message.startswith("cannot resume: ") and str(out / "checkpoint.pt") in message
        assert reason in message and "\n" not in message
    # an evaluation-only file (no optimizer/RNG state) cannot be resumed from
    ckpt = torch.load(trained, weights_only=True)
    out = tmp_path / "eval-only"
    out.mkdir()
    (out / ".lock").touch()
    torch.save({k: ckpt[k] for k in ("prompt", "config", "classnames", "n_ctx")}, out / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="missing keys 'optimizer', 'epoch', 'history', 'rng'"):
        train_run(tiny_cfg(image_folder, out))


def test_eval_tool_prints_one_line_for_an_unusable_checkpoint(trained, tmp_path):
    (random_bytes, _), _, _ = bad_checkpoints(trained, tmp_path / "files")
    # in-process: tools/eval.py's real process is tested in test_train.py
    res = run_tool_in_process(REPO / "tools" / "eval.py", ["--checkpoint", random_bytes])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert errors == [f"error: cannot read checkpoint {random_bytes}: not a torch.save file"]


# --- 7. no training images ------------------------------------------------------------------


@pytest.mark.parametrize("aug_views", [0, 1])
def test_no_readable_training_image_is_a_data_error(tmp_path, aug_views):
    folder = make_image_folder(tmp_path / "data", n_train=2, n_test=2)
    for image in (folder / "train").rglob("*.png"):
        image.write_bytes(b"broken")
    cfg = tiny_cfg(folder, tmp_path / "run", **{"data.skip_corrupt": "true", "train.aug_views": aug_views})
    with pytest.raises(DataError, match="no readable images in the train split of imagefolder: all 6"):
        train_run(cfg)


def test_empty_training_split_is_a_data_error(image_folder, tmp_path, monkeypatch):
    import dataclasses

    import coop.train.engine

    real = coop.train.engine.build_dataset
    monkeypatch.setattr(
        coop.train.engine, "build_dataset", lambda *a, **k: dataclasses.replace(real(*a, **k), train=[])
    )
    for views in (0, 1):
        with pytest.raises(DataError, match="the train split of imagefolder has no images"):
            train_run(tiny_cfg(image_folder, tmp_path / f"run{views}", **{"train.aug_views": views}))

"""Few-shot training and evaluation of any method (`coop.methods`), as plain functions over a run config.

    s = setup(load_config("configs/coop/vit_b16.yaml", ["data.shots=4"]))
    feats = training_features(s)           # None for aug_views=0: re-encode at every step
    stats = train_one_epoch(s, optimizer, epoch, feats)
    metrics = evaluate_run(s)              # cached test features, or the method's prompted tower

`coop.runner.train_run` strings these together into a run folder with resuming and checkpoints.

CoOp's recipe, as Dassl runs it:
- the lr schedule (`epoch_lr`): a constant warm-up, then a cosine that restarts after it
  (Dassl's WARMUP_RECOUNT=True), so the first epoch after warm-up trains at exactly the base lr;
- `train.precision=fp16` (`use_fp16`): CoOp's PREC=fp16, the whole CLIP model and the prompts in
  half precision, trained by plain SGD; the default `amp` keeps fp32 prompts under bf16 autocast.

A method that sees pixels (`Method.input == "pixels"`: VPT, IVLP, MaPLe) gets the augmented image
batches themselves at every step and is evaluated through its own prompted image tower, batch by
batch (`evaluate_run`); a feature method gets image-tower features, cached where they can be.

Every epoch draws its randomness from (seed, epoch) alone: the order of the images comes from a
generator seeded by (seed, epoch), and image i's augmentation from (seed, epoch, i), whatever the
number of DataLoader workers. A run killed at any moment and resumed, with any `data.num_workers`,
therefore ends bit-identical (on CPU) to an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop.config import ConfigError, run_name
from coop.data import (
    CLIP_MEAN,
    CLIP_STD,
    DataError,
    ImageDataset,
    build_dataset,
    build_transforms,
    collate_skip_none,
    require_train_split,
    subsample_classes,
)
from coop.data.images import derive_seed
from coop.features import autocast, cached_features, resolve_precision
from coop.methods import Method, build_method
from coop.model import CLIP
from coop.weights import load_clip

log = logging.getLogger(__name__)

# Stored in checkpoints; a run trained under another schedule is not resumed under this one.
LR_SCHEDULE = "constant warm-up, then cosine restarted after warm-up (Dassl WARMUP_RECOUNT)"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


@dataclass
class Setup:
    cfg: DictConfig
    device: torch.device
    clip: CLIP
    dataset: object
    method: Method
    train_tf: object
    test_tf: object
    precision: str  # what really runs on `device`: fp32, amp or fp16 (`resolve_precision`)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} requested but CUDA is not available")
    return torch.device(name)


def clip_transforms(clip: CLIP):
    """CoOp's (train, test) transforms at the image tower's size and normalisation."""
    pre = clip.preprocess_cfg
    return build_transforms(
        pre.get("size", clip.image_size), pre.get("mean", CLIP_MEAN), pre.get("std", CLIP_STD)
    )


def use_fp16(clip: CLIP, method: Method) -> None:
    """CoOp's PREC=fp16: cast the whole CLIP model and the method's tensors to half precision.

    As in CoOp, the prompt vectors themselves become fp16 and plain SGD updates them: no loss
    scaling, no fp32 master copy (`Method.to_half`; the vision-prompt methods keep the tensors that
    their original keeps in fp32 in fp32 and cast them to half in the forward pass). Images and cached features are fed in the same dtype; only the
    cosine logits (`coop.model.cosine_logits`) are formed in fp32 from the fp16 features.
    """
    clip.half()
    getattr(method, "to_half", method.half)()  # a bare module (e.g. a PromptLearner) is halved whole


def setup(cfg: DictConfig, ckpt: dict | None = None, clip: CLIP | None = None) -> Setup:
    """Dataset, CLIP and method of a run.

    Args:
        cfg: the run config.
        ckpt: a checkpoint whose learned tensors are loaded into the method, which is built for
            `cfg`'s dataset (all its images, no few-shot sampling): evaluation, also on other
            datasets where the method can transfer (`Method.load_learnable`).
        clip: an already loaded CLIP of `cfg.model` to reuse (evaluating several datasets).
    """
    device = resolve_device(cfg.device)
    shots = 0 if ckpt is not None else int(cfg.data.shots)
    dataset = build_dataset(
        cfg.data.name, cfg.data.root, shots=shots, seed=int(cfg.data.seed), split_file=cfg.data.split_file
    )
    if ckpt is None:
        require_train_split(dataset)  # test-only datasets (ImageNet-V2/-Sketch/-A/-R) do not train
    dataset = subsample_classes(dataset, cfg.data.subsample_classes)
    if clip is None:
        clip = load_clip(cfg.model.name, pretrained=cfg.model.pretrained, device=device)
    clip.text.grad_checkpointing = bool(cfg.train.grad_checkpointing)  # memory for 1,000 classes
    train_tf, test_tf = clip_transforms(clip)
    precision = resolve_precision(cfg.train.precision, device)
    if precision != cfg.train.precision:
        log.info(
            "train.precision=%s is not available on %s; running %s", cfg.train.precision, device, precision
        )
    torch.manual_seed(int(cfg.data.seed))  # initialisation of learnable tensors
    method = build_method(clip.float(), dataset.classnames, cfg)
    if method.input == "pixels" and int(cfg.train.aug_views) > 0:
        raise ConfigError(
            f"train.aug_views={cfg.train.aug_views} caches image features, and method={cfg.method} runs "
            "its prompted image tower on the images at every step; set train.aug_views=0"
        )
    if ckpt is not None:
        method.load_learnable(ckpt["prompt"], ckpt["classnames"])
    if precision == "fp16":
        use_fp16(clip, method)
    return Setup(cfg, device, clip, dataset, method.to(device), train_tf, test_tf, precision)


def epoch_lr(epoch: int, *, lr: float, epochs: int, warmup_epochs: int, warmup_lr: float) -> float:
    """The learning rate of 0-based `epoch` under CoOp's schedule, as Dassl runs it.

    Epochs e < W = `warmup_epochs` train at the constant `warmup_lr`. Then Dassl's
    CosineAnnealingLR(T_max=epochs) starts counting from zero (WARMUP_RECOUNT=True): epoch e >= W
    trains at lr * 0.5 (1 + cos(pi (e - W) / epochs)), so epoch W trains at exactly `lr`.
    """
    if epoch < warmup_epochs:
        return warmup_lr
    return lr * 0.5 * (1 + math.cos(math.pi * (epoch - warmup_epochs) / max(epochs, 1)))


def seed_epoch(seed: int, epoch: int) -> torch.Generator:
    """All randomness of one epoch derives from (seed, epoch), so resuming replays it exactly."""
    s = seed * 100_003 + epoch
    torch.manual_seed(s)
    random.seed(s)
    return torch.Generator().manual_seed(s)


def train_one_epoch(s: Setup, optimizer, epoch: int, train_feats) -> dict:
    """One epoch of SGD on `s.method.loss`; `train_feats` = ((V, N, E), labels) cached, or None to
    re-encode (feature methods) or to hand the augmented images to the method (pixel methods)."""
    cfg, method, device, precision = s.cfg, s.method, s.device, s.precision
    dtype = s.clip.logit_scale.dtype  # half under fp16, where images and features go in as half
    batch_size = int(cfg.train.batch_size)
    gen = seed_epoch(int(cfg.data.seed), epoch)
    n = len(s.dataset.train) if train_feats is None else train_feats[0].shape[1]
    if n == 0:
        raise DataError(f"the train split of {cfg.data.name} has no images")
    order = torch.randperm(n, generator=gen)
    if train_feats is None:
        images = ImageDataset(
            s.dataset.train,
            s.train_tf,
            skip_corrupt=bool(cfg.data.skip_corrupt),
            seed=derive_seed(int(cfg.data.seed), epoch),  # image i's crop and flip: (seed, epoch, i)
        )
        loader = DataLoader(
            images,
            batch_size=batch_size,
            sampler=order.tolist(),
            drop_last=n >= batch_size,  # as Dassl does for few-shot loaders
            num_workers=int(cfg.data.num_workers),
            collate_fn=collate_skip_none,
            generator=gen,
            persistent_workers=False,
        )
        batches = (b for b in loader if b is not None)
        # the slow, re-encoding path gets a progress bar of its own
        batches = tqdm(batches, total=len(loader), desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
    else:
        feats, labels = train_feats
        view = torch.randint(feats.shape[0], (n,), generator=gen)
        n_batches = n // batch_size if n >= batch_size else 1
        batches = (
            (feats[view[idx], idx], labels[idx], None)
            for idx in (order[b * batch_size : (b + 1) * batch_size] for b in range(n_batches))
        )
    method.train()
    total_loss, correct, seen = 0.0, 0, 0
    for step, (x, y, _) in enumerate(batches):
        x, y = x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            if train_feats is None and method.input == "features":
                with torch.no_grad():
                    x = s.clip.encode_image(x)
            loss, logits = method.loss(x, y)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at epoch {epoch + 1}, step {step + 1}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(y)
        correct += int((logits.argmax(-1) == y).sum())
        seen += len(y)
    if seen == 0:
        raise DataError(
            f"no readable images in the train split of {cfg.data.name}: all {n} were skipped as unreadable"
        )
    return {"loss": total_loss / seen, "train_acc": 100.0 * correct / seen}


@torch.no_grad()
def predict(method: Method, features: torch.Tensor, device, precision="fp32") -> torch.Tensor:
    """Predicted labels (N,) from cached image features (N, ...), 1,000 images at a time."""
    method.eval()
    dtype = method.clip.logit_scale.dtype
    with autocast(device, precision):
        prepared = method.prepare()  # e.g. the class text features, once for all images
        return torch.cat(
            [method.logits(f.to(device, dtype), prepared).argmax(-1).cpu() for f in features.split(1000)]
        )


def evaluate(method: Method, features: torch.Tensor, labels: torch.Tensor, device, precision="fp32"):
    """Top-1 accuracy (%), macro F1 and per-class accuracy from cached image features (N, E)."""
    return classification_metrics(predict(method, features, device, precision), labels, method.n_cls)


@torch.no_grad()
def evaluate_images(s: Setup, split: str = "test") -> dict:
    """`evaluate` for a pixel method: the split's images (test transform) through the method's
    prompted image tower, `train.eval_batch_size` at a time, with a progress bar."""
    cfg, method = s.cfg, s.method
    items = getattr(s.dataset, split)
    what = f"the {split} split of {cfg.data.name}"
    if not items:
        raise DataError(f"{what} has no images")
    images = ImageDataset(items, s.test_tf, skip_corrupt=bool(cfg.data.skip_corrupt))
    loader = DataLoader(
        images,
        batch_size=int(cfg.train.eval_batch_size),
        shuffle=False,
        num_workers=int(cfg.data.num_workers),
        collate_fn=collate_skip_none,
    )
    method.eval()
    dtype = s.clip.logit_scale.dtype
    preds, labels = [], []
    with autocast(s.device, s.precision):
        prepared = method.prepare()  # text features and vision prompts, once for all images
        for batch in tqdm(loader, desc=f"{split} (prompted image tower)", leave=False, dynamic_ncols=True):
            if batch is None:
                continue
            x, y, _ = batch
            preds.append(method.logits(x.to(s.device, dtype, non_blocking=True), prepared).argmax(-1).cpu())
            labels.append(y)
    if not preds:
        raise DataError(f"no readable images in {what}: all {len(items)} were skipped as unreadable")
    labels = torch.cat(labels)
    if len(labels) < len(items):
        log.warning("%d of %d images were skipped as unreadable", len(items) - len(labels), len(items))
    return classification_metrics(torch.cat(preds), labels, method.n_cls)


def evaluate_run(s: Setup) -> dict:
    """The run's metrics on the test split, whichever input its method consumes."""
    if s.method.input == "pixels":
        return evaluate_images(s, "test")
    feats, labels = eval_features(s)
    return evaluate(s.method, feats[0], labels, s.device, s.precision)


def classification_metrics(preds: torch.Tensor, labels: torch.Tensor, n_cls: int) -> dict:
    """Top-1 accuracy (%), macro F1 (%) over the present classes and per-class accuracy."""
    conf = torch.bincount(labels * n_cls + preds, minlength=n_cls * n_cls).reshape(n_cls, n_cls).double()
    tp = conf.diag()
    support, predicted = conf.sum(1), conf.sum(0)
    recall = torch.where(support > 0, tp / support.clamp(min=1), torch.nan)
    f1 = 2 * tp / (support + predicted).clamp(min=1)
    present = support > 0
    return {
        "accuracy": float(100.0 * tp.sum() / conf.sum()),
        "macro_f1": float(100.0 * f1[present].mean()),
        "per_class_accuracy": [None if math.isnan(r) else round(100.0 * float(r), 4) for r in recall],
        "n_test": int(labels.numel()),
    }


def _features(s: Setup, split: str, transform, desc: str, views: int = 1, seed: int | None = None):
    cfg = s.cfg
    return cached_features(
        s.clip,
        getattr(s.dataset, split),
        transform,
        views=views,
        seed=seed,
        device=s.device,
        batch_size=int(cfg.train.eval_batch_size),
        num_workers=int(cfg.data.num_workers),
        skip_corrupt=bool(cfg.data.skip_corrupt),
        precision=s.precision,
        use_disk=bool(cfg.train.cache_features),
        desc=desc,
        what=f"the {split} split of {cfg.data.name}",
    )


def eval_features(s: Setup):
    """Test-split features ((1, N, E), labels), computed once and kept in the disk cache."""
    return _features(s, "test", s.test_tf, "test features")


def val_features(s: Setup):
    """Val-split features ((1, N, E), labels) under the test transform."""
    return _features(s, "val", s.test_tf, "val features")


def training_features(s: Setup, views: int | None = None):
    """Cached training features for aug_views >= 1, None for aug_views == 0 (CoOp's way).

    Args:
        s: the run.
        views: overrides `train.aug_views` (the linear probe takes 1: the test transform).
    """
    views = int(s.cfg.train.aug_views) if views is None else views
    if views == 0:
        return None
    if views == 1:  # one deterministic pass with the test transform
        return _features(s, "train", s.test_tf, "train features")
    return _features(s, "train", s.train_tf, "train features", views, int(s.cfg.data.seed))


def default_output_dir(cfg: DictConfig) -> str:
    return str(Path("output") / run_name(cfg))

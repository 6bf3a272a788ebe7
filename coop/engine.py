"""Few-shot CoOp training and evaluation, as plain functions over a run config.

    result = run(load_config("configs/coop/vit_b16.yaml", ["data.shots=4"]))

`run` writes a run folder (config.yaml, log.txt, history.csv, checkpoint.pt, metrics.json),
resumes from `checkpoint.pt` when the folder already holds an unfinished run, and returns the
finished run's metrics without training again. Every epoch draws its randomness from
(seed, epoch) alone, so a run killed at any moment and resumed ends bit-identical (on CPU) to an
uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop.checkpoint import learner_from_checkpoint
from coop.config import run_name
from coop.data import (
    CLIP_MEAN,
    CLIP_STD,
    ImageDataset,
    build_dataset,
    build_transforms,
    collate_skip_none,
    subsample_classes,
)
from coop.features import autocast, cached_features
from coop.model import CLIP, load_clip
from coop.prompt import N_CTX_DEFAULT, PromptClassifier, PromptLearner

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf; the last good checkpoint is kept."""


@dataclass
class Setup:
    cfg: DictConfig
    device: torch.device
    clip: CLIP
    dataset: object
    classifier: PromptClassifier
    train_tf: object
    test_tf: object


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} requested but CUDA is not available")
    return torch.device(name)


def build_learner(clip: CLIP, cfg: DictConfig, classnames: list[str]) -> PromptLearner:
    p = cfg.prompt
    return PromptLearner(
        clip,
        classnames,
        n_ctx=N_CTX_DEFAULT if p.n_ctx is None else int(p.n_ctx),
        ctx_init=p.ctx_init,
        position=p.position,
        csc=bool(p.csc),
        depth=int(p.depth),
    )


def clip_transforms(clip: CLIP):
    """CoOp's (train, test) transforms at the image tower's size and normalisation."""
    pre = clip.preprocess_cfg
    return build_transforms(
        pre.get("size", clip.image_size), pre.get("mean", CLIP_MEAN), pre.get("std", CLIP_STD)
    )


def setup(cfg: DictConfig, ckpt: dict | None = None) -> Setup:
    """Dataset, CLIP and classifier of a run; with `ckpt`, the saved prompts on the full test set."""
    device = resolve_device(cfg.device)
    shots = 0 if ckpt is not None else int(cfg.data.shots)
    dataset = build_dataset(cfg.data.name, cfg.data.root, shots=shots, seed=int(cfg.data.seed))
    dataset = subsample_classes(dataset, cfg.data.subsample_classes)
    clip = load_clip(cfg.model.name, pretrained=cfg.model.pretrained, device=device)
    clip.text.grad_checkpointing = bool(cfg.train.grad_checkpointing)  # memory for 1,000 classes
    train_tf, test_tf = clip_transforms(clip)
    if ckpt is None:
        torch.manual_seed(int(cfg.data.seed))  # prompt initialisation
        learner = build_learner(clip, cfg, dataset.classnames)
    else:
        learner = learner_from_checkpoint(clip, ckpt, dataset.classnames)
    classifier = PromptClassifier(clip, learner.to(device))
    return Setup(cfg, device, clip, dataset, classifier, train_tf, test_tf)


def lr_factor(epoch: int, epochs: int, warmup_epochs: int, warmup_ratio: float) -> float:
    """CoOp's schedule as a multiplier of the base lr: constant warm-up, then cosine over `epochs`."""
    if epoch < warmup_epochs:
        return warmup_ratio
    return 0.5 * (1 + math.cos(math.pi * epoch / max(epochs, 1)))


def seed_epoch(seed: int, epoch: int) -> torch.Generator:
    """All randomness of one epoch derives from (seed, epoch), so resuming replays it exactly."""
    s = seed * 100_003 + epoch
    torch.manual_seed(s)
    random.seed(s)
    return torch.Generator().manual_seed(s)


def train_one_epoch(s: Setup, optimizer, epoch: int, train_feats, precision: str) -> dict:
    """One epoch of CoOp; `train_feats` = ((V, N, E), labels) from the cache, or None to re-encode."""
    cfg, classifier, device = s.cfg, s.classifier, s.device
    batch_size = int(cfg.train.batch_size)
    gen = seed_epoch(int(cfg.data.seed), epoch)
    if train_feats is None:
        n = len(s.dataset.train)
        loader = DataLoader(
            ImageDataset(s.dataset.train, s.train_tf, skip_corrupt=bool(cfg.data.skip_corrupt)),
            batch_size=batch_size,
            shuffle=True,
            drop_last=n >= batch_size,  # as Dassl does for few-shot loaders
            num_workers=int(cfg.data.num_workers),
            collate_fn=collate_skip_none,
            generator=gen,
            persistent_workers=False,
        )
        batches = (b for b in loader if b is not None)
        n_batches = len(loader)
    else:
        feats, labels = train_feats
        views, n = feats.shape[0], feats.shape[1]
        order = torch.randperm(n, generator=gen)
        view = torch.randint(views, (n,), generator=gen)
        n_batches = n // batch_size if n >= batch_size else 1
        batches = (
            (feats[view[idx], idx], labels[idx], None)
            for idx in (order[b * batch_size : (b + 1) * batch_size] for b in range(n_batches))
        )
    classifier.train()
    total_loss, correct, seen = 0.0, 0, 0
    if train_feats is None:  # the slow, re-encoding path gets a progress bar of its own
        batches = tqdm(batches, total=n_batches, desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
    for step, (x, y, _) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            if train_feats is None:
                with torch.no_grad():
                    x = s.clip.encode_image(x)
            logits = classifier.logits(x)
            loss = F.cross_entropy(logits.float(), y)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(f"non-finite loss ({loss.item()}) at epoch {epoch + 1}, step {step + 1}")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        total_loss += loss.item() * len(y)
        correct += int((logits.argmax(-1) == y).sum())
        seen += len(y)
    return {"loss": total_loss / max(seen, 1), "train_acc": 100.0 * correct / max(seen, 1)}


@torch.no_grad()
def evaluate(
    classifier: PromptClassifier, features: torch.Tensor, labels: torch.Tensor, device, precision="fp32"
):
    """Top-1 accuracy (%), macro F1 and per-class accuracy from cached image features (N, E)."""
    classifier.eval()
    with autocast(device, precision):
        text = classifier.text_features()
        preds = torch.cat(
            [classifier.logits(f.to(device), text).argmax(-1).cpu() for f in features.split(1000)]
        )
    n_cls = classifier.prompt_learner.n_cls
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


def _features(s: Setup, items, transform, desc: str, views: int = 1, seed: int | None = None):
    cfg = s.cfg
    return cached_features(
        s.clip,
        items,
        transform,
        views=views,
        seed=seed,
        device=s.device,
        batch_size=int(cfg.train.eval_batch_size),
        num_workers=int(cfg.data.num_workers),
        skip_corrupt=bool(cfg.data.skip_corrupt),
        precision=cfg.train.precision,
        use_disk=bool(cfg.train.cache_features),
        desc=desc,
    )


def eval_features(s: Setup):
    """Test-split features ((1, N, E), labels), computed once and kept in the disk cache."""
    return _features(s, s.dataset.test, s.test_tf, "test features")


def training_features(s: Setup):
    """Cached training features for aug_views >= 1, None for aug_views == 0 (CoOp's way)."""
    views = int(s.cfg.train.aug_views)
    if views == 0:
        return None
    if views == 1:  # one deterministic pass with the test transform
        return _features(s, s.dataset.train, s.test_tf, "train features")
    return _features(s, s.dataset.train, s.train_tf, "train features", views, int(s.cfg.data.seed))


def default_output_dir(cfg: DictConfig) -> str:
    return str(Path("output") / run_name(cfg))

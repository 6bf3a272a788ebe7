"""Few-shot training and evaluation of any method (`coop.methods`), as plain functions over a run config.

    s = setup(load_config("configs/coop/vit_b16.yaml", ["data.shots=4"]))
    feats = training_features(s)           # coop.train.run_features; None for aug_views=0
    stats = train_one_epoch(s, optimizer, epoch, feats)
    metrics = evaluate_run(s)              # coop.train.run_features: test features, or the prompted tower

`coop.train.runner.train_run` strings these together into a run folder with resuming and checkpoints.

CoOp's recipe, as Dassl runs it:
- the lr schedule (`coop.train.schedule`): a constant warm-up, then a cosine that restarts after it
  (Dassl's WARMUP_RECOUNT=True), so the first epoch after warm-up trains at exactly the base lr
  (other methods' recipes choose a per-iteration cosine or a constant rate, and their optimizer);
- `train.precision=fp16` (`use_fp16`): CoOp's PREC=fp16, the whole CLIP model and the prompts in
  half precision, trained by plain SGD; the default `amp` keeps fp32 prompts under bf16 autocast.

A method that sees pixels (`Method.input == "pixels"`: VPT, IVLP, MaPLe) gets the augmented image
batches themselves at every step and is evaluated through its own prompted image tower, batch by
batch (`evaluate_images`); a feature method gets image-tower features, cached where they can be.

Every epoch draws its randomness from (seed, epoch) alone: the order of the images comes from a
generator seeded by (seed, epoch), and image i's augmentation from (seed, epoch, i), whatever the
number of DataLoader workers. A run killed at any moment and resumed, with any `data.num_workers`,
therefore ends bit-identical (on CPU) to an uninterrupted one.

The same holds across torchrun's ranks (`coop.distributed`, docs/distributed.md): each rank takes
a contiguous share of every global batch (`rank_share`), the gradients are averaged over the
global batch before each step, and the feature encoding and the pixel methods' evaluation run
each rank's share of the batches and gather the results; one process is the case of one rank.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop import distributed
from coop.config.checks import ConfigError
from coop.config.run_names import run_name
from coop.data import (
    CLIP_MEAN,
    CLIP_STD,
    DataError,
    ImageDataset,
    Views,
    build_dataset,
    build_transforms,
    collate_skip_none,
    require_train_split,
    subsample_classes,
)
from coop.data.images import derive_seed
from coop.data.randaugment import randaugment_transform
from coop.methods import METHODS, Method, build_method
from coop.model.clip import CLIP
from coop.model.weights import load_clip
from coop.train.metrics import classification_metrics
from coop.train.precision import autocast, resolve_precision
from coop.train.schedule import Schedule, steps_per_epoch

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/inf (a run's or a federated client's); a run keeps its last good checkpoint."""


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


def clip_transforms(clip: CLIP, crop_scale=(0.08, 1.0), augment: bool = True, transform: str = "coop"):
    """CoOp's (train, test) transforms at the image tower's size and normalisation.

    Args:
        clip: the model, whose preprocessing config gives size, mean and std.
        crop_scale: the train crop's RandomResizedCrop scale range (`train.crop_scale`).
        augment: False (`train.augment=false`): training uses the test transform, no randomness.
        transform: the train transform (`train.transform`): "coop" (crop and flip) or
            "randaugment" (Dassl's resize and RandAugment(2, 10), `coop.data.randaugment`: CoPrompt's).
    """
    pre = clip.preprocess_cfg
    size, mean, std = pre.get("size", clip.image_size), pre.get("mean", CLIP_MEAN), pre.get("std", CLIP_STD)
    train, test = build_transforms(size, mean, std, crop_scale=tuple(float(c) for c in crop_scale))
    if transform == "randaugment":
        train = randaugment_transform(size, mean, std)
    return (train if augment else test), test


def use_fp16(clip: CLIP, method: Method) -> None:
    """CoOp's PREC=fp16: cast the whole CLIP model and the method's tensors to half precision.

    As in CoOp, the prompt vectors themselves become fp16 and plain SGD updates them: no loss
    scaling, no fp32 master copy (`Method.to_half`; the vision-prompt methods keep the tensors that
    their original keeps in fp32 in fp32 and cast them to half in the forward pass). Images and cached features are fed in the same dtype; only the
    cosine logits (`coop.model.clip.cosine_logits`) are formed in fp32 from the fp16 features.
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
    device = distributed.init(resolve_device(cfg.device), cfg.train.dist_backend)  # cuda:LOCAL_RANK
    shots = 0 if ckpt is not None else int(cfg.data.shots)
    dataset = build_dataset(
        cfg.data.name,
        cfg.data.root,
        shots=shots,
        seed=int(cfg.data.seed),
        split_file=cfg.data.split_file,
        fewshot_source=cfg.data.fewshot_source if shots else "sample",  # evaluation: every image
    )
    if ckpt is None:
        require_train_split(dataset)  # test-only datasets (ImageNet-V2/-Sketch/-A/-R) do not train
    dataset = subsample_classes(dataset, cfg.data.subsample_classes)
    sgd = getattr(METHODS.get(cfg.method), "trainer", "") == "sgd"
    if ckpt is None and sgd and len(dataset.train):  # before the model; an empty split: a DataError later
        batch_size = int(cfg.train.batch_size)
        batches = global_batches(torch.arange(len(dataset.train)), batch_size, cfg.train.drop_last)
        rank_share(batches[-1], batch_size)  # the smallest: every rank needs a share of each batch
    if clip is None:
        clip = load_clip(cfg.model.name, cfg.model.pretrained, device, cfg.model.tokenizer)
    clip.text.grad_checkpointing = bool(cfg.train.grad_checkpointing)  # memory for 1,000 classes
    train_tf, test_tf = clip_transforms(
        clip, cfg.train.crop_scale, bool(cfg.train.augment), str(cfg.train.transform)
    )
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
        method.load_trained(ckpt["prompt"], ckpt["classnames"])
    if precision == "fp16":
        use_fp16(clip, method)
    return Setup(cfg, device, clip, dataset, method.to(device), train_tf, test_tf, precision)


def seed_epoch(seed: int, epoch: int) -> torch.Generator:
    """All randomness of one epoch derives from (seed, epoch), so resuming replays it exactly."""
    s = seed * 100_003 + epoch
    torch.manual_seed(s)
    random.seed(s)
    return torch.Generator().manual_seed(s)


def global_batches(order: torch.Tensor, batch_size: int, drop_last: bool = True) -> list[torch.Tensor]:
    """The epoch's batches of indices, in `order`: full batches only (drop_last, as Dassl's few-shot
    loaders), or one batch of all when there are fewer than `batch_size`; without drop_last a last,
    smaller batch too (`steps_per_epoch`)."""
    steps = steps_per_epoch(len(order), batch_size, drop_last)
    return [order[b * batch_size : (b + 1) * batch_size] for b in range(steps)]


def rank_share(batch: torch.Tensor, batch_size: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch (`coop.distributed.share`; all of it in one
    process), so that the shares in rank order are the one-process batch."""
    distributed.require_shares(len(batch), f"train.batch_size={batch_size}: a global batch")
    start, end = distributed.share(len(batch))
    return batch[start:end]


def train_one_epoch(s: Setup, optimizer, epoch: int, train_feats, schedule: Schedule | None = None) -> dict:
    """One epoch of SGD on `s.method.loss`.

    Args:
        s, optimizer, epoch: the run, its optimizer and the 0-based epoch.
        train_feats: ((V, N, E), labels) cached, or None to re-encode (feature methods) or to hand
            the augmented images to the method (pixel methods).
        schedule: sets the rate before every step of a per-iteration schedule, and ends the
            epoch early where the run's iteration budget (`train.iterations`) runs out; None:
            every batch at the optimizer's current rate.
    """
    cfg, method, device, precision = s.cfg, s.method, s.device, s.precision
    dtype = s.clip.logit_scale.dtype  # half under fp16, where images and features go in as half
    batch_size, drop_last = int(cfg.train.batch_size), bool(cfg.train.drop_last)
    gen = seed_epoch(int(cfg.data.seed), epoch)
    n = len(s.dataset.train) if train_feats is None else train_feats[0].shape[1]
    if n == 0:
        raise DataError(f"the train split of {cfg.data.name} has no images")
    order = torch.randperm(n, generator=gen)
    if train_feats is None:
        views = int(method.train_views)
        images = ImageDataset(
            s.dataset.train,
            s.train_tf if views == 1 else Views(s.train_tf, views),  # (V, 3, H, W) per image
            skip_corrupt=bool(cfg.data.skip_corrupt),
            seed=derive_seed(int(cfg.data.seed), epoch),  # image i's crop and flip: (seed, epoch, i)
        )
        loader = DataLoader(
            images,
            batch_sampler=[
                rank_share(idx, batch_size).tolist() for idx in global_batches(order, batch_size, drop_last)
            ],
            num_workers=int(cfg.data.num_workers),
            collate_fn=collate_skip_none,
            generator=gen,
            persistent_workers=False,
        )
        # ranks step together: a share whose images were all unreadable joins its step empty
        batches = (b for b in loader if b is not None or distributed.active())
        # the slow, re-encoding path gets a progress bar of its own
        batches = tqdm(batches, total=len(loader), desc=f"epoch {epoch + 1}", leave=False, dynamic_ncols=True)
    else:
        feats, labels = train_feats
        view = torch.randint(feats.shape[0], (n,), generator=gen)
        batches = (
            (feats[view[idx], idx], labels[idx], None)
            for idx in (rank_share(b, batch_size) for b in global_batches(order, batch_size, drop_last))
        )
    method.train()
    total_loss, correct, seen = 0.0, 0, 0
    max_steps = None if schedule is None else schedule.steps_in_epoch(epoch)
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for step, batch in enumerate(batches):
        if step == max_steps:
            break
        if schedule is not None and schedule.per_step:
            schedule.apply(optimizer, epoch, step)
        optimizer.zero_grad(set_to_none=True)
        method.start_step(epoch, step)
        n_local = 0 if batch is None else len(batch[1])
        if n_local:
            x, y = batch[0].to(device, dtype, non_blocking=True), batch[1].to(device, non_blocking=True)
            with autocast(device, precision):
                if train_feats is None and method.input == "features":
                    with torch.no_grad():
                        x = s.clip.encode_image(x)
                loss, logits = method.loss(x, y)
            if not torch.isfinite(loss):
                raise NonFiniteLossError(
                    f"non-finite loss ({loss.item()}) at epoch {epoch + 1}, step {step + 1}"
                )
            loss.backward()
            total_loss += loss.item() * n_local
            correct += int((logits.argmax(-1) == y).sum())
            seen += n_local
        params = [p for p in tensors if p.requires_grad]  # a stage's tensors (2SFS trains two in turn)
        if distributed.average_gradients(params, n_local):  # the global batch's mean (one rank: as is)
            optimizer.step()
    total_loss, correct, seen = distributed.all_sum([total_loss, correct, seen])  # over the ranks
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


def evaluate(
    method: Method, features: torch.Tensor, labels: torch.Tensor, device, precision="fp32", domains=None
) -> dict:
    """`coop.train.metrics.classification_metrics` of the predictions from cached image features (N, ...);
    with `domains` (one name per image), also per-domain accuracy."""
    preds = predict(method, features, torch.device(device), precision)
    return classification_metrics(preds, labels, method.n_cls, domains)


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
    loader = DataLoader(  # under torchrun, this rank's share of the batches
        images,
        batch_size=int(cfg.train.eval_batch_size),
        sampler=distributed.batch_range(len(items), int(cfg.train.eval_batch_size)),
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
    preds, labels = distributed.gather_lists(preds, labels)  # every rank's, in order
    if not preds:
        raise DataError(f"no readable images in {what}: all {len(items)} were skipped as unreadable")
    labels = torch.cat(labels)
    if len(labels) < len(items):
        log.warning("%d of %d images were skipped as unreadable", len(items) - len(labels), len(items))
    return classification_metrics(torch.cat(preds), labels, method.n_cls)


def default_output_dir(cfg: DictConfig) -> str:
    return str(Path("output") / run_name(cfg))

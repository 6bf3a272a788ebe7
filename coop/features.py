"""Image-feature caching: the frozen image tower runs once per image, not once per step.

Image features do not depend on the prompt, so test features are computed once per run (and kept
on disk, keyed by model weights, images and transform, so the seeds and ablation points of a
sweep share them). Training can use them too (`train.aug_views`, see README):

    0  re-augment and re-encode every step, exactly like CoOp (slow, faithful);
    1  encode each training image once with the test transform (no augmentation);
    K  encode K random augmented views per image once and sample one view per step.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop.data import Datum, ImageDataset, collate_skip_none
from coop.io import atomic_write
from coop.model import CLIP

log = logging.getLogger(__name__)


def autocast(device: torch.device, precision: str):
    """bf16 autocast on a GPU when precision is amp; fp32 elsewhere.

    GPUs without bf16 run fp32 rather than fp16: fp16 would need loss scaling to keep the small
    prompt gradients from underflowing, and the text side is cheap enough after trimming.
    """
    if precision != "amp" or device.type != "cuda" or not torch.cuda.is_bf16_supported():
        return nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16)


def cache_dir() -> Path:
    return Path(os.environ.get("COOP_CACHE_DIR", Path.home() / ".cache" / "coop")) / "features"


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A hash of every parameter and buffer: equal weights give equal keys, whatever their source."""
    h = hashlib.sha1()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def cache_key(clip: CLIP, items: Sequence[Datum], transform: Callable, views: int, seed: int | None) -> str:
    h = hashlib.sha1()
    h.update(weights_fingerprint(clip.visual).encode())
    h.update(repr(transform).encode())
    h.update(f"views={views} seed={seed}".encode())
    for d in items:
        h.update(f"{d.path}\t{d.label}\n".encode())
    return h.hexdigest()[:24]


def encode_images(
    clip: CLIP,
    items: Sequence[Datum],
    transform: Callable,
    *,
    device: torch.device,
    batch_size: int = 100,
    num_workers: int = 0,
    skip_corrupt: bool = False,
    precision: str = "fp32",
    generator: torch.Generator | None = None,
    desc: str = "encode",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image features of `items`: (features (N', E) fp32 on CPU, labels (N',), kept indices (N',)).

    Unreadable images raise, or are skipped with `skip_corrupt` (then N' < N).
    """
    dataset = ImageDataset(items, transform, skip_corrupt=skip_corrupt)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=collate_skip_none,
        generator=generator,
    )
    feats, labels, index = [], [], []
    with torch.no_grad(), autocast(device, precision):
        for batch in tqdm(loader, desc=desc, leave=False, dynamic_ncols=True):
            if batch is None:
                continue
            images, y, i = batch
            feats.append(clip.encode_image(images.to(device, non_blocking=True)).float().cpu())
            labels.append(y)
            index.append(i)
    if not feats:
        raise ValueError(f"no readable images among {len(items)} ({desc})")
    return torch.cat(feats), torch.cat(labels), torch.cat(index)


def cached_features(
    clip: CLIP,
    items: Sequence[Datum],
    transform: Callable,
    *,
    views: int = 1,
    seed: int | None = None,
    use_disk: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of `views` passes over `items` through `transform`: ((V, N, E), labels (N,)).

    With a random transform each view is a fresh augmentation; `seed` makes them reproducible.
    Deterministic results are stored in the disk cache (`$COOP_CACHE_DIR/features`).
    """
    key = cache_key(clip, items, transform, views, seed)
    path = cache_dir() / f"{key}.pt"
    if use_disk and path.is_file():
        try:
            data = torch.load(path, weights_only=True)
            log.info("image features from cache %s", path)
            return data["features"], data["labels"]
        except Exception as e:  # a broken cache file is recomputed, never fatal
            log.warning("ignoring unreadable feature cache %s (%s)", path, e)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    per_view, kept = [], None
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        for v in range(views):
            desc = kwargs.pop("desc", "encode") if v == 0 else f"view {v + 1}/{views}"
            feats, labels, index = encode_images(
                clip, items, transform, generator=generator, desc=desc, **kwargs
            )
            per_view.append(feats)
            kept = labels, index
    labels, index = kept
    if len(index) < len(items):
        log.warning("%d of %d images were skipped as unreadable", len(items) - len(index), len(items))
    features = torch.stack(per_view)  # (V, N', E)
    if use_disk:
        try:
            atomic_write(path, lambda tmp: torch.save({"features": features, "labels": labels}, tmp))
        except OSError as e:
            log.warning("could not write feature cache %s (%s)", path, e)
    return features, labels

"""Image-feature caching: the frozen image tower runs once per image, not once per step.

Image features do not depend on the prompt, so test features are computed once per run and kept
on disk, so that the seeds and ablation points of a sweep share them. Training can use them too
(`train.aug_views`, see README):

    0  re-augment and re-encode every step, exactly like CoOp (slow, faithful);
    1  encode each training image once with the test transform (no augmentation);
    K  encode K random augmented views per image once and sample one view per step.

A cache file is named by `cache_key`, which holds everything the features depend on: the image
tower's weights (hashed once per tower, `weights_fingerprint`), its settings (`forward_settings`: how it pools, normalises and activates, which
no weight records) and which forward ran them (`CLIP.image_forward`: our `ImageTower` over
open_clip's ViT or a timm trunk, open_clip's module otherwise; equal in fp32 up to rounding, yet
never mixed), the
image list, the transform, the precision that really ran (`resolve_precision`),
the number of views and their seed, and `skip_corrupt`. The file also records which images it
kept, and a cache that skipped unreadable images is never served to a run that may not skip any.
Augmented views are seeded per image (`ImageDataset(seed=...)`), so they do not depend on the
number of DataLoader workers: view v of image i is seeded by (seed, v, i), the same crop and flip
that `aug_views=0` gives image i in epoch v.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from coop import distributed
from coop.data import DataError, Datum, ImageDataset, collate_skip_none
from coop.data.images import derive_seed
from coop.io import atomic_write
from coop.model.clip import CLIP
from coop.train.precision import autocast, resolve_precision

log = logging.getLogger(__name__)

CACHE_FORMAT = 2  # bump when what a cache file holds, or how views are seeded, changes


def cache_dir() -> Path:
    return Path(os.environ.get("COOP_CACHE_DIR", Path.home() / ".cache" / "coop")) / "features"


# module -> (stamp of its tensors, their hash); weak, so that a tower's memo goes with the tower
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weights_fingerprint(module: torch.nn.Module) -> str:
    """A hash of every parameter and buffer: equal weights give equal keys, whatever their source.

    Hashed once per module, not on every `cache_key`: a loaded tower's weights are frozen, so they
    do not change between the calls (hashing a large tower in fp32 takes seconds). The memo is
    kept only while every tensor has the same storage, dtype, shape, device and in-place version
    counter as when it was hashed, so a weight replaced (`.half()`, `.to()`, a new tensor) or
    written in place (`load_state_dict`, `add_`) is hashed again all the same.
    """
    tensors = sorted(module.state_dict(keep_vars=True).items())
    if any(t.is_inference() for _, t in tensors):  # no version counter: nothing to key a memo by
        return _hash_tensors(tensors)
    stamp = [(name, t.data_ptr(), t._version, t.dtype, t.device, t.shape) for name, t in tensors]
    memo = _FINGERPRINTS.get(module)
    if memo is None or memo[0] != stamp:
        memo = _FINGERPRINTS[module] = (stamp, _hash_tensors(tensors))
    return memo[1]


def _hash_tensors(tensors: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha1()
    for name, t in tensors:
        h.update(name.encode())
        h.update(f"{tuple(t.shape)} {t.dtype}".encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# Module attributes that never change what the forward computes without gradients.
NOT_SETTINGS = frozenset({"training", "grad_checkpointing"})


def forward_settings(module: torch.nn.Module) -> str:
    """What the module computes besides its weights: per submodule, its path, class and settings.

    Read off the built module generically, so that every tower's options count: open_clip's
    `VisionTransformer.pool_type` ('tok', CLIPA's 'avg'), `final_ln_after_pool`, `output_tokens`,
    an attentional pooler; a timm trunk's `global_pool` and its head's layers (`TimmModel`); an
    activation (QuickGELU or GELU) or a LayerNorm eps (`extra_repr`); our `ImageTransformer`'s
    `VisionConfig`. Two towers that load the same weights but pool differently give different
    strings. Settings are a submodule's public attributes except `NOT_SETTINGS`, written by value
    (numbers, strings, tuples, dicts, dataclasses), functions and classes by their qualified name,
    other objects by their type.
    """
    lines = []
    for path, m in module.named_modules():
        attrs = (f"{k}={_setting(v)}" for k, v in sorted(vars(m).items()) if _is_setting(k))
        lines.append(
            f"{path or '.'} {type(m).__module__}.{type(m).__qualname__}({m.extra_repr()}) " + " ".join(attrs)
        )
    return "\n".join(lines)


def _is_setting(name: str) -> bool:
    return not name.startswith("_") and name not in NOT_SETTINGS


def _setting(v) -> str:
    """One attribute's value in `forward_settings`, the same in every process (no addresses)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_setting(x) for x in v) + ")"
    if isinstance(v, dict):
        return (
            "{"
            + ",".join(f"{k}:{_setting(x)}" for k, x in sorted(v.items(), key=lambda kv: str(kv[0])))
            + "}"
        )
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return repr(v)
    if isinstance(v, torch.Tensor):  # a plain tensor attribute (not a parameter or buffer)
        data = v.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        return f"tensor{tuple(v.shape)}:{hashlib.sha1(data).hexdigest()[:16]}"
    name = getattr(v, "__qualname__", None)  # functions and classes
    return f"{getattr(v, '__module__', '')}.{name}" if name else type(v).__qualname__


def cache_key(
    clip: CLIP,
    items: Sequence[Datum],
    transform: Callable,
    views: int,
    seed: int | None,
    precision: str,
    skip_corrupt: bool,
    tokens: bool = False,
) -> str:
    """The cache file name: a hash of everything the features depend on.

    Args:
        clip: its image tower's weights (and their dtype), its `forward_settings` and
            `clip.image_forward` are hashed.
        items: the images, by path and label, in order.
        transform: hashed by its repr (sizes, interpolation, normalisation).
        views: how many passes; `seed` seeds their augmentations.
        precision: the precision that really ran, from `resolve_precision` (fp32, amp, fp16).
        skip_corrupt: whether unreadable images were skipped (a strict run never shares a cache).
        tokens: every projected token per image (`CLIP.encode_image(tokens=True)`) instead of [CLS].
    """
    h = hashlib.sha1()
    h.update(f"format={CACHE_FORMAT}\n".encode())
    h.update(weights_fingerprint(clip.visual).encode())
    h.update(forward_settings(clip.visual).encode())
    h.update(f"image_forward={clip.image_forward}\n".encode())
    h.update(repr(transform).encode())
    h.update(f"views={views} seed={seed} precision={precision} skip_corrupt={skip_corrupt}\n".encode())
    if tokens:  # only then, so that the keys of existing [CLS] caches stay valid
        h.update(b"tokens\n")
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
    seed: int | None = None,
    desc: str = "encode",
    what: str = "the images",
    tokens: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Image features of `items`: (features (N', E) fp32 on CPU, labels (N',), kept indices (N',)).

    With `tokens`, every projected token per image: features (N', n_prefix+P, E).

    Unreadable images raise, or are skipped with `skip_corrupt` (then N' < N); a DataError naming
    `what` (e.g. "the train split of dtd") when none is readable. With `seed`, image i's random
    transform is seeded by (seed, i), whatever `num_workers` is.
    """
    dataset = ImageDataset(items, transform, skip_corrupt=skip_corrupt, seed=seed)
    loader = DataLoader(  # under torchrun, this rank's share of the batches (`distributed.batch_range`)
        dataset,
        batch_size=batch_size,
        sampler=distributed.batch_range(len(items), batch_size),
        num_workers=num_workers,
        collate_fn=collate_skip_none,
    )
    dtype = clip.logit_scale.dtype  # half when the model was cast to fp16
    feats, labels, index = [], [], []
    with torch.no_grad(), autocast(device, precision):
        for batch in tqdm(loader, desc=desc, leave=False, dynamic_ncols=True):
            if batch is None:
                continue
            images, y, i = batch
            feats.append(
                clip.encode_image(images.to(device, dtype, non_blocking=True), tokens=tokens).float().cpu()
            )
            labels.append(y)
            index.append(i)
    feats, labels, index = distributed.gather_lists(feats, labels, index)  # every rank's, in order
    if not items:
        raise DataError(f"{what} has no images")
    if not feats:
        raise DataError(f"no readable images in {what}: all {len(items)} were skipped as unreadable")
    return torch.cat(feats), torch.cat(labels), torch.cat(index)


def _load_cache(path: Path, n_items: int, skip_corrupt: bool):
    """A cache file's (features, labels, kept indices), or None if it is unreadable or unusable."""
    try:
        data = torch.load(path, weights_only=True)
        features, labels, index = data["features"], data["labels"], data["index"]
    except Exception as e:  # a broken cache file is recomputed, never fatal
        log.warning("ignoring unreadable feature cache %s (%s)", path, e)
        return None
    if not features.shape[1] == len(labels) == len(index):
        log.warning("ignoring inconsistent feature cache %s", path)
        return None
    if len(index) < n_items and not skip_corrupt:
        log.warning("ignoring feature cache %s: it skipped unreadable images", path)
        return None
    return features, labels, index


def cached_features(
    clip: CLIP,
    items: Sequence[Datum],
    transform: Callable,
    *,
    device: torch.device,
    precision: str = "fp32",
    skip_corrupt: bool = False,
    views: int = 1,
    seed: int | None = None,
    use_disk: bool = True,
    tokens: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of `views` passes over `items` through `transform`: ((V, N, E), labels (N,)).

    With `tokens`: every projected token, ((V, N, n_prefix+P, E), labels); n_prefix+P = 1+196 for ViT-B/16.

    With a random transform each view is a fresh augmentation, view v seeded by (seed, v) per
    image. Results go to the disk cache (`$COOP_CACHE_DIR/features`) under `cache_key`. Other
    keyword arguments go to `encode_images` (batch_size, num_workers, desc, what).
    """
    ran = resolve_precision(precision, device)
    key = cache_key(clip, items, transform, views, seed, ran, skip_corrupt, tokens)
    path = cache_dir() / f"{key}.pt"
    found = distributed.is_main() and use_disk and path.is_file()
    # rank 0 reads and hands the file to the others, so that the ranks never disagree on a hit
    cached = distributed.broadcast(_load_cache(path, len(items), skip_corrupt) if found else None)
    if cached is not None:
        log.info("image features from cache %s", path)
        features, labels, index = cached
    else:
        per_view = []
        for v in range(views):
            desc = kwargs.pop("desc", "encode") if v == 0 else f"view {v + 1}/{views}"
            view_seed = None if seed is None else derive_seed(seed, v)
            feats, labels, index = encode_images(
                clip,
                items,
                transform,
                device=device,
                precision=precision,
                skip_corrupt=skip_corrupt,
                seed=view_seed,
                desc=desc,
                tokens=tokens,
                **kwargs,
            )
            per_view.append(feats)
        features = torch.stack(per_view)  # (V, N', E) or, with tokens, (V, N', n_prefix+P, E)
        if use_disk:
            state = {"features": features, "labels": labels, "index": index}
            try:
                atomic_write(path, lambda tmp: torch.save(state, tmp))
            except OSError as e:
                log.warning("could not write feature cache %s (%s)", path, e)
    if len(index) < len(items):
        log.warning("%d of %d images were skipped as unreadable", len(items) - len(index), len(items))
    return features, labels

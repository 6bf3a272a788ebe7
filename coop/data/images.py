"""Image loading and CLIP/CoOp transforms.

    train_tf, test_tf = build_transforms(224, CLIP_MEAN, CLIP_STD)
    loader = DataLoader(ImageDataset(ds.train, train_tf, skip_corrupt=True), batch_size=32,
                        collate_fn=collate_skip_none)

Each item is `(image, label, index)`; the index lets callers key feature caches by position.
With `seed`, image i's random transform draws from torch's RNG seeded by `derive_seed(seed, i)`,
so an augmentation depends on (seed, index) alone: never on the DataLoader worker that loads it,
the number of workers, or the order of loading.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torch.utils.data import Dataset, default_collate
from torchvision import transforms as T

from coop.data.base import DataError, Datum

logger = logging.getLogger(__name__)

CLIP_MEAN: tuple[float, float, float] = tuple(OPENAI_DATASET_MEAN)
CLIP_STD: tuple[float, float, float] = tuple(OPENAI_DATASET_STD)


def build_transforms(
    image_size: int | Sequence[int],
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
    crop_scale: tuple[float, float] = (0.08, 1.0),
) -> tuple[Callable, Callable]:
    """CoOp's transforms: (train, test).

    Train: RandomResizedCrop(scale 0.08-1, bicubic) + horizontal flip + ToTensor + Normalize.
    (Some methods' recipes crop less: MMRL's and Tip-Adapter's views use scale 0.5-1.)
    Test: Resize of the shorter side (bicubic) + CenterCrop + ToTensor + Normalize.

    Args:
        image_size: side of the square crop, or (h, w); the test resize uses max(h, w), as
            Dassl does, so a non-square crop never cuts into padding.
        mean: per-channel normalisation mean (CLIP's by default).
        std: per-channel normalisation std.
        crop_scale: the (min, max) area share of the train crop.
    """
    if isinstance(image_size, int):
        size, short_side = image_size, image_size
    else:
        h, w = (int(s) for s in image_size)
        size, short_side = (h if h == w else (h, w)), max(h, w)
    bicubic = T.InterpolationMode.BICUBIC
    normalize = T.Normalize(mean=list(mean), std=list(std))
    train = T.Compose(
        [
            T.RandomResizedCrop(size, scale=tuple(crop_scale), interpolation=bicubic),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            normalize,
        ]
    )
    test = T.Compose(
        [T.Resize(short_side, interpolation=bicubic), T.CenterCrop(size), T.ToTensor(), normalize]
    )
    return train, test


class Views:
    """`k` independent draws of a random `transform`, stacked: (k, ...) per image, as Dassl's
    K_TRANSFORMS gives a method several augmented views of each training image (CoPrompt's two).
    Under `ImageDataset(seed=...)` the draws follow one another from image i's seeded RNG."""

    def __init__(self, transform: Callable, k: int):
        self.transform, self.k = transform, int(k)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return torch.stack([self.transform(img) for _ in range(self.k)])


def load_image(path: str) -> Image.Image:
    """Open `path` as an RGB PIL image, decoding it fully; raises DataError naming the file."""
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated JPEG fails here, not later inside a transform
            return img.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"cannot read image {path}: {reason}") from e


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, e.g. (seed, epoch, index); the same on every machine and run."""
    text = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class ImageDataset(Dataset):
    """A torch Dataset over `Datum`s returning `(transform(image), label, index)`.

    Args:
        items: the images (e.g. `build_dataset(...).train`).
        transform: applied to the RGB PIL image; None returns the PIL image.
        skip_corrupt: if True, an unreadable image logs a warning and yields None (drop it with
            `collate_skip_none`); if False it raises DataError.
        seed: if given, item i is transformed with torch's RNG seeded by `derive_seed(seed, i)`
            (torchvision's random transforms draw from it); the caller's RNG state is restored.
            None leaves the RNG alone (fine for deterministic transforms).
    """

    def __init__(
        self,
        items: Sequence[Datum],
        transform: Callable | None = None,
        skip_corrupt: bool = False,
        seed: int | None = None,
    ):
        self.items = list(items)
        self.transform = transform
        self.skip_corrupt = skip_corrupt
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        item = self.items[i]
        try:
            img = load_image(item.path)
        except DataError as e:
            if not self.skip_corrupt:
                raise
            logger.warning("skipping %s", e)
            return None
        if self.transform is None:
            return img, item.label, i
        if self.seed is None:
            return self.transform(img), item.label, i
        # only the CPU generator, which the transforms draw from and fork_rng restores: torch.manual_seed
        # would also reseed (and leave changed) every accelerator's, formatting a stack trace for each
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(self.seed, i))
            return self.transform(img), item.label, i


def collate_skip_none(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """DataLoader `collate_fn` that drops None items; None if the whole batch was dropped.

    Args:
        batch: items from `ImageDataset.__getitem__`.
    """
    batch = [b for b in batch if b is not None]
    if not batch:
        return None
    return default_collate(batch)

"""Dassl's RandAugment (`dassl/data/transforms/randaugment.py`, `RandAugment(n, m)` over
`randaugment_list`), the train transform of CoPrompt's configs ("randaugment", "normalize").

    transform = randaugment_transform(224, CLIP_MEAN, CLIP_STD)   # `train.transform=randaugment`

Resize to size x size (bicubic: Dassl resizes to INPUT.SIZE when no crop is chosen, without
keeping the aspect ratio), then `n` operations drawn with replacement from Dassl's 16, each at
magnitude m / 30 of its range, then ToTensor and Normalize. No crop, no flip. As in Dassl, the
geometric operations flip their sign with probability 1/2, CutoutAbs draws its corner from
numpy's `uniform(w)` (that is, uniform on (1, w]) and paints it (125, 123, 114), and SolarizeAdd
adds its magnitude to the integer pixels, clips to 0..255 and truncates before solarizing at 128.
Dassl draws from Python's and numpy's global generators; here every draw comes from torch's, so
that `ImageDataset(seed=...)` seeds each image's augmentation (the same distributions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import PIL.ImageDraw
import PIL.ImageEnhance
import PIL.ImageOps
import torch
from PIL import Image
from torchvision import transforms as T


def _flip(v: float) -> float:
    return -v if float(torch.rand(())) > 0.5 else v


def _affine(img: Image.Image, coeffs: tuple) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, coeffs)


def _solarize_add(img: Image.Image, addition: float) -> Image.Image:
    pixels = np.clip(np.asarray(img).astype(np.int64) + addition, 0, 255).astype(np.uint8)
    return PIL.ImageOps.solarize(Image.fromarray(pixels), 128)


def _cutout(img: Image.Image, v: float) -> Image.Image:
    w, h = img.size
    x0 = w + (1.0 - w) * float(torch.rand(()))  # numpy's uniform(low=w, high=1.0)
    y0 = h + (1.0 - h) * float(torch.rand(()))
    x0, y0 = int(max(0, x0 - v / 2.0)), int(max(0, y0 - v / 2.0))
    img = img.copy()
    PIL.ImageDraw.Draw(img).rectangle((x0, y0, min(w, x0 + v), min(h, y0 + v)), (125, 123, 114))
    return img


def _enhance(kind) -> Callable:
    return lambda img, v: kind(img).enhance(v)


# Dassl's randaugment_list, in its order: (operation(img, v), min, max)
OPERATIONS: tuple[tuple[Callable, float, float], ...] = (
    (lambda img, v: PIL.ImageOps.autocontrast(img), 0, 1),
    (lambda img, v: PIL.ImageOps.equalize(img), 0, 1),
    (lambda img, v: PIL.ImageOps.invert(img), 0, 1),
    (lambda img, v: img.rotate(_flip(v)), 0, 30),
    (lambda img, v: PIL.ImageOps.posterize(img, int(v)), 4, 8),
    (lambda img, v: PIL.ImageOps.solarize(img, v), 0, 256),
    (_solarize_add, 0, 110),
    (_enhance(PIL.ImageEnhance.Color), 0.1, 1.9),
    (_enhance(PIL.ImageEnhance.Contrast), 0.1, 1.9),
    (_enhance(PIL.ImageEnhance.Brightness), 0.1, 1.9),
    (_enhance(PIL.ImageEnhance.Sharpness), 0.1, 1.9),
    (lambda img, v: _affine(img, (1, _flip(v), 0, 0, 1, 0)), 0.0, 0.3),
    (lambda img, v: _affine(img, (1, 0, 0, _flip(v), 1, 0)), 0.0, 0.3),
    (_cutout, 0, 40),
    (lambda img, v: _affine(img, (1, 0, _flip(v), 0, 1, 0)), 0.0, 100),
    (lambda img, v: _affine(img, (1, 0, 0, 0, 1, _flip(v))), 0.0, 100),
)


class RandAugment:
    """`n` of Dassl's operations, drawn uniformly with replacement, at magnitude `m` (0..30)."""

    def __init__(self, n: int = 2, m: int = 10):
        if not 0 <= m <= 30:
            raise ValueError(f"RandAugment's magnitude is 0..30, got {m}")
        self.n, self.m = int(n), m

    def __call__(self, img: Image.Image) -> Image.Image:
        for i in torch.randint(len(OPERATIONS), (self.n,)).tolist():
            op, low, high = OPERATIONS[i]
            img = op(img, (self.m / 30) * (high - low) + low)
        return img


def randaugment_transform(
    image_size: int | Sequence[int], mean: Sequence[float], std: Sequence[float], n: int = 2, m: int = 10
) -> Callable:
    """Dassl's ("randaugment", "normalize") train transform: Resize((h, w), bicubic),
    RandAugment(n, m), ToTensor, Normalize."""
    size = (image_size, image_size) if isinstance(image_size, int) else tuple(int(s) for s in image_size)
    return T.Compose(
        [
            T.Resize(size, interpolation=T.InterpolationMode.BICUBIC),
            RandAugment(n, m),
            T.ToTensor(),
            T.Normalize(mean=list(mean), std=list(std)),
        ]
    )

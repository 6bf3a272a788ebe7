"""The views of a test image that a test-time method sees: TPT's `AugMixAugmenter`, seeded per image.

    make = ViewMaker(test_transform, views=64, augment="augmix", seed=1)
    views = make(pil_image, index)            # (64, 3, H, W): views[0] the image under the test transform

View 0 is the image under the run's test transform (resize the short side, centre crop, normalise).
Views 1..V-1 are TPT's (azshue/TPT, `data/datautils.py`): a random resized crop (scale 0.08-1,
bilinear) and a horizontal flip of the original image, then, with AugMix, a mix of that crop with
three chains of 1-3 of TPT's nine PIL operations at severity 1 (`data/augmix_ops.py`):

    mix = m * pre(crop) + (1 - m) * sum_i w_i * pre(chain_i(crop)),   w ~ Dir(1, 1, 1), m ~ Beta(1, 1)

where pre is ToTensor + the model's normalisation. TPT decides by its set_id: the ImageNet sets
(ImageNet, -A, -V2, -R, -Sketch) get the crop and flip alone, every other set AugMix
(`augment="tpt"`); "augmix" and "crop_flip" choose one everywhere (ZERO's code uses crop and flip
on every set).

Determinism: view j of image i draws from generators seeded by `derive_seed(seed, i, j)` alone
(torch's for the crop and flip, numpy's for AugMix), so a view depends neither on the order of
the images, nor on the DataLoader worker or rank that makes it, nor on the number of views (the
first 16 of 64 views are the 16 views). TPT draws from the processes' global generators instead;
the distributions are the same, the draws are not.

Differences from TPT's operations: the crop is at the model's image size (TPT crops at 224 for
every model), and the operations' output size and translation range follow that size (TPT's
IMAGE_SIZE is 224). The point operations run through torchvision's functional API (which calls
the same PIL functions); shear and translate keep TPT's own affine coefficients through PIL, since
torchvision's affine shears about the centre and TPT's shears about the corner.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from coop.data import DataError, Datum
from coop.data.images import derive_seed, load_image

IMAGENET_SETS = ("imagenet", "imagenetv2", "imagenet_sketch", "imagenet_a", "imagenet_r")


def augment_for(rule: str, dataset: str) -> str:
    """ "augmix" or "crop_flip" for the views of `dataset` under `tta.augment`'s `rule`."""
    if rule == "tpt":
        return "crop_flip" if dataset in IMAGENET_SETS else "augmix"
    return rule


def _level(rng: np.random.Generator, severity: float) -> float:
    return rng.uniform(low=0.1, high=severity)  # TPT's sample_level


def _sign(rng: np.random.Generator, value: float) -> float:
    return -value if rng.uniform() > 0.5 else value


def _affine(img: Image.Image, coefficients: tuple) -> Image.Image:
    return img.transform(img.size, Image.AFFINE, coefficients, resample=Image.BILINEAR)


# TPT's `augmentations` list in its order, each (image, rng, severity) -> image; levels as TPT scales
# them: int(level * max / 10) or float(level) * max / 10.
def _autocontrast(img, rng, severity):
    return TF.autocontrast(img)


def _equalize(img, rng, severity):
    return TF.equalize(img)


def _posterize(img, rng, severity):
    return TF.posterize(img, 4 - int(_level(rng, severity) * 4 / 10))


def _rotate(img, rng, severity):
    degrees = _sign(rng, int(_level(rng, severity) * 30 / 10))
    return TF.rotate(img, degrees, interpolation=T.InterpolationMode.BILINEAR)


def _solarize(img, rng, severity):
    return TF.solarize(img, 256 - int(_level(rng, severity) * 256 / 10))


def _shear_x(img, rng, severity):
    return _affine(img, (1, _sign(rng, float(_level(rng, severity)) * 0.3 / 10), 0, 0, 1, 0))


def _shear_y(img, rng, severity):
    return _affine(img, (1, 0, 0, _sign(rng, float(_level(rng, severity)) * 0.3 / 10), 1, 0))


def _translate_x(img, rng, severity):
    return _affine(img, (1, 0, _sign(rng, int(_level(rng, severity) * img.size[0] / 3 / 10)), 0, 1, 0))


def _translate_y(img, rng, severity):
    return _affine(img, (1, 0, 0, 0, 1, _sign(rng, int(_level(rng, severity) * img.size[1] / 3 / 10))))


OPERATIONS = (
    _autocontrast,
    _equalize,
    _posterize,
    _rotate,
    _solarize,
    _shear_x,
    _shear_y,
    _translate_x,
    _translate_y,
)


class ViewMaker:
    """The V views of one test image (module docstring).

    Args:
        test_transform: the run's test transform (a Compose ending in ToTensor and Normalize, with a
            CenterCrop giving the size).
        views: V, at least 1 (the image alone).
        augment: "augmix" or "crop_flip" (`augment_for`).
        seed: the run's seed; view j of image i is seeded by (seed, i, j).
        severity: AugMix's operation severity (TPT's 1).
    """

    def __init__(self, test_transform: T.Compose, views: int, augment: str, seed: int, severity: int = 1):
        if augment not in ("augmix", "crop_flip"):
            raise ValueError(f"augment must be augmix or crop_flip, got {augment!r}")
        self.test, self.views, self.augment = test_transform, int(views), augment
        self.seed, self.severity = int(seed), severity
        self.preprocess = T.Compose(test_transform.transforms[-2:])  # ToTensor, Normalize
        size = next(t.size for t in test_transform.transforms if isinstance(t, T.CenterCrop))
        self.crop_flip = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip()])

    def __call__(self, img: Image.Image, index: int) -> torch.Tensor:
        """The views (V, 3, H, W) of test image `index`."""
        return torch.stack([self.test(img)] + [self.view(img, index, j) for j in range(1, self.views)])

    def view(self, img: Image.Image, index: int, j: int) -> torch.Tensor:
        """Augmented view j >= 1 of test image `index`."""
        seed = derive_seed(self.seed, index, j)
        with torch.random.fork_rng(devices=[]):  # the CPU generator only, as coop.data.images seeds a crop
            torch.default_generator.manual_seed(seed)
            crop = self.crop_flip(img)
        x = self.preprocess(crop)
        if self.augment == "crop_flip":
            return x
        rng = np.random.default_rng(seed)
        w = rng.dirichlet([1.0, 1.0, 1.0]).astype(np.float32)
        m = float(np.float32(rng.beta(1.0, 1.0)))
        mix = torch.zeros_like(x)
        for i in range(3):
            chained = crop.copy()
            for _ in range(rng.integers(1, 4)):  # 1 to 3 operations, as np.random.randint(1, 4)
                chained = OPERATIONS[rng.integers(len(OPERATIONS))](chained, rng, self.severity)
            mix += float(w[i]) * self.preprocess(chained)
        return m * x + (1 - m) * mix


class ViewDataset(Dataset):
    """Test images as (views (V, 3, H, W), label, index), for a DataLoader over any subset of indices.

    Args:
        items: the test split.
        make: the `ViewMaker`.
        skip_corrupt: an unreadable image yields None (logged by the caller) instead of a DataError.
    """

    def __init__(self, items: Sequence[Datum], make: ViewMaker, skip_corrupt: bool = False):
        self.items, self.make, self.skip_corrupt = list(items), make, skip_corrupt

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        try:
            img = load_image(self.items[i].path)
        except DataError:
            if not self.skip_corrupt:
                raise
            return None
        return self.make(img, i), self.items[i].label, i

"""The views of a test image (coop.tta.views): TPT's AugMixAugmenter, seeded by (seed, image, view),
and the metrics of a test-time pass (coop.train.metrics: top5, ECE)."""

from __future__ import annotations

import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as TF

import coop.tta.views as views_module
from coop.data import build_transforms
from coop.data.images import derive_seed
from coop.train.metrics import expected_calibration_error, logit_metrics, top_k_accuracy
from coop.tta.views import IMAGENET_SETS, OPERATIONS, ViewMaker, augment_for

TEST = build_transforms(32)[1]


def image(seed: int = 0) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (40, 48, 3), generator=gen, dtype=torch.uint8).numpy())


def test_view_zero_is_the_test_transform_and_the_others_are_seeded_by_seed_image_view():
    img = image()
    make = ViewMaker(TEST, 6, "augmix", seed=3)
    views = make(img, 7)
    assert views.shape == (6, 3, 32, 32) and torch.equal(views[0], TEST(img))
    assert torch.equal(views, make(img, 7))  # whatever ran before
    torch.manual_seed(123)
    assert torch.equal(views[1:4], ViewMaker(TEST, 4, "augmix", seed=3)(img, 7)[1:])  # a prefix of more views
    assert not torch.equal(views[1], views[2])
    assert not torch.equal(views[1], ViewMaker(TEST, 6, "augmix", seed=4)(img, 7)[1])  # another seed
    assert not torch.equal(views[1], make(img, 8)[1])  # another image


def test_crop_and_flip_views_are_torchvision_seeded_per_view():
    img = image(1)
    views = ViewMaker(TEST, 3, "crop_flip", seed=2)(img, 5)
    crop = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), *TEST.transforms[-2:]])
    for j in (1, 2):
        torch.manual_seed(derive_seed(2, 5, j))
        assert torch.equal(views[j], crop(img))


def test_augmix_mixes_the_crop_with_three_chains(monkeypatch):
    """With every operation the identity, AugMix's mix is m x + (1 - m) sum_i w_i x = x: the crop."""
    img = image(2)
    crop_flip = ViewMaker(TEST, 4, "crop_flip", seed=1)(img, 0)
    monkeypatch.setattr(views_module, "OPERATIONS", (lambda im, rng, s: im,) * 9)
    mixed = ViewMaker(TEST, 4, "augmix", seed=1)(img, 0)
    torch.testing.assert_close(mixed, crop_flip, rtol=0, atol=1e-5)
    monkeypatch.undo()
    assert (ViewMaker(TEST, 4, "augmix", seed=1)(img, 0)[1:] - crop_flip[1:]).abs().max() > 1e-3


def test_the_operations_at_severity_one_have_tpt_s_magnitudes():
    img = image(3).resize((32, 32))
    rng = lambda: __import__("numpy").random.default_rng(0)  # noqa: E731
    names = [op.__name__.lstrip("_") for op in OPERATIONS]
    assert (
        names
        == "autocontrast equalize posterize rotate solarize shear_x shear_y translate_x translate_y".split()
    )
    posterize = OPERATIONS[2](img, rng(), 1)  # int(level * 4 / 10) = 0 for level < 2.5: 4 bits kept
    assert posterize.tobytes() == TF.posterize(img, 4).tobytes()
    for op in OPERATIONS:
        assert op(img, rng(), 1).size == img.size


def test_tpt_s_rule_crops_the_imagenet_sets_and_augmixes_the_others():
    assert {augment_for("tpt", d) for d in IMAGENET_SETS} == {"crop_flip"}
    assert augment_for("tpt", "dtd") == "augmix" and augment_for("crop_flip", "dtd") == "crop_flip"
    assert augment_for("augmix", "imagenet_a") == "augmix"


def test_top5_ranks_equal_logits_by_class_index_and_ece_bins_the_confidence():
    logits = torch.tensor([[0.0] * 7, [5.0, 0, 0, 0, 0, 0, 1]])
    labels = torch.tensor([4, 6])
    assert top_k_accuracy(logits, labels, 5) == 100.0  # row 0: classes 0-4 first; row 1: 6 second
    assert top_k_accuracy(logits, torch.tensor([5, 6]), 5) == 50.0
    # two images: confidence 0.9 right, confidence 0.6 wrong: ECE = (|1 - 0.9| + |0 - 0.6|) / 2
    p = torch.tensor([[0.9, 0.1], [0.6, 0.4]], dtype=torch.float64)
    assert abs(expected_calibration_error(p.log(), torch.tensor([0, 1])) - 35.0) < 1e-5
    # both in one bin (0.8, 0.867]: |0.5 - 0.85|
    p = torch.tensor([[0.85, 0.15], [0.85, 0.15]], dtype=torch.float64)
    assert abs(expected_calibration_error(p.log(), torch.tensor([0, 1])) - 35.0) < 1e-5
    m = logit_metrics(logits, labels)
    assert m["accuracy"] == 0.0 and m["top5"] == 100.0 and m["n_test"] == 2

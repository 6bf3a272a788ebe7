"""The image features of a run's splits: test, val, training views and a method's own views.

Each goes through the image-feature cache (`coop.train.features.cached_features`) with the run's
`train.eval_batch_size`, `data.num_workers`, precision, `data.skip_corrupt` and `train.cache_features`.

    feats = training_features(s)           # None for aug_views=0: re-encode at every step
    test, labels = eval_features(s)        # ((1, N, E), labels)
    metrics = evaluate_run(s)              # the test split's metrics, whichever input the method takes
"""

from __future__ import annotations

from coop.data.images import derive_seed
from coop.methods.base import FeatureRequest
from coop.train.engine import Setup, evaluate, evaluate_images
from coop.train.features import cached_features


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
        views: overrides `train.aug_views`.
    """
    views = int(s.cfg.train.aug_views) if views is None else views
    if views == 0:
        return None
    if views == 1:  # one deterministic pass with the test transform
        return _features(s, "train", s.test_tf, "train features")
    return _features(s, "train", s.train_tf, "train features", views, int(s.cfg.data.seed))


# The seed stream of a method's own augmented views (`requested_features`): drawn independently of
# the views that SGD epochs see (image i's crop in epoch e is seeded by (seed, e, i)).
REQUEST_STREAM = 7_919


def requested_features(s: Setup, request: FeatureRequest):
    """The training features a method asks for (`Method.fit_request`): ((V, N, E), labels).

    Unaugmented: one pass with the test transform (the linear probe). Augmented: V passes through
    the train transform (`train.crop_scale`, flip; Tip-Adapter's cache takes 10 at scale 0.5-1),
    pass v of image i seeded by (seed, REQUEST_STREAM, v, i), cached on disk like every view.
    """
    if not request.augment:
        return _features(s, "train", s.test_tf, "train features")
    seed = derive_seed(int(s.cfg.data.seed), REQUEST_STREAM)
    return _features(s, "train", s.train_tf, "train features (method views)", int(request.views), seed)


def evaluate_run(s: Setup) -> dict:
    """The run's metrics on the test split, whichever input its method consumes."""
    if s.method.input == "pixels":
        return evaluate_images(s, "test")
    feats, labels = eval_features(s)
    return evaluate(s.method, feats[0], labels, s.device, s.precision)

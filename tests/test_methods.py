"""The method interface: zero-shot templates, CoOp's linear-probe search, transfer between classes."""

from __future__ import annotations

import math

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from coop.methods import COOP_TEMPLATES, TransferError, build_method, resolve_templates
from coop.methods.linear_probe import search_c

pytestmark = pytest.mark.filterwarnings("ignore:'penalty' was deprecated:FutureWarning")

CLASSES = ["red_thing", "green thing", "blue thing", "yellow thing"]


def method_cfg(method: str, dataset: str = "dtd", templates: str = "coop"):
    return OmegaConf.create(
        {
            "method": method,
            "data": {"name": dataset},
            "prompt": {"n_ctx": None, "ctx_init": None, "position": "end", "csc": False, "depth": 1},
            "zeroshot": {"templates": templates},
        }
    )


def direct_text_features(openclip_model, texts):
    tokens = open_clip.get_tokenizer("ViT-B-32")(texts)
    with torch.no_grad():
        return F.normalize(openclip_model.encode_text(tokens), dim=-1)


def test_coop_templates_and_choices():
    assert resolve_templates("coop", "dtd") == ["{} texture."]
    assert resolve_templates("coop", "eurosat") == ["a centered satellite photo of {}."]
    assert resolve_templates("coop", "textile") == ["a photo of a {}."]
    assert resolve_templates("a sketch of {}.", "dtd") == ["a sketch of {}."]
    ensemble = resolve_templates("ensemble", "dtd")
    assert len(ensemble) == 80 and len(set(ensemble)) == 80 and all("{}" in t for t in ensemble)
    assert len(COOP_TEMPLATES) == 15  # CoOp's 11 datasets and the 4 ImageNet variants
    with pytest.raises(ValueError, match="zeroshot.templates"):
        resolve_templates("no placeholder", "dtd")


def test_zeroshot_equals_open_clip_features(tiny_clip, tiny_openclip):
    method = build_method(tiny_clip, CLASSES, method_cfg("zeroshot", dataset="dtd"))
    text = method.prepare()
    expected = direct_text_features(tiny_openclip, [f"{c.replace('_', ' ')} texture." for c in CLASSES])
    torch.testing.assert_close(text, expected, rtol=1e-5, atol=1e-6)
    images = torch.randn(5, tiny_clip.embed_dim)
    logits = method.logits(images, text)
    want = tiny_openclip.logit_scale.exp() * F.normalize(images, dim=-1) @ expected.T
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    assert method.learnable() == {}


def test_zeroshot_ensemble_is_the_renormalised_mean(tiny_clip, tiny_openclip, monkeypatch):
    templates = open_clip.OPENAI_IMAGENET_TEMPLATES[:6]  # a few of the 80 keep the test fast
    monkeypatch.setattr(open_clip, "OPENAI_IMAGENET_TEMPLATES", templates)
    method = build_method(tiny_clip, CLASSES, method_cfg("zeroshot", templates="ensemble"))
    assert len(method.templates) == 6
    total = sum(
        direct_text_features(tiny_openclip, [t(c.replace("_", " ")) for c in CLASSES]) for t in templates
    )
    torch.testing.assert_close(method.prepare(), F.normalize(total / 6, dim=-1), rtol=1e-5, atol=1e-6)


def clusters(n_per_class: int, n_cls: int = 4, dim: int = 16, seed: int = 0):
    gen = np.random.default_rng(seed)
    centres = gen.normal(size=(n_cls, dim)) * 1.5
    x = np.concatenate([centres[c] + gen.normal(size=(n_per_class, dim)) * 2.0 for c in range(n_cls)])
    y = np.repeat(np.arange(n_cls), n_per_class)
    return x, y


def coop_search_by_hand(tx, ty, vx, vy):
    """CoOp's lpclip search written out step by step, for comparison."""
    from sklearn.linear_model import LogisticRegression

    def fit(c):
        return LogisticRegression(solver="lbfgs", max_iter=1000, penalty="l2", C=c).fit(tx, ty)

    grid = [1e6, 1e4, 1e2, 1, 1e-2, 1e-4, 1e-6]
    accs = [np.mean(fit(c).predict(vx) == vy) for c in grid]
    c_peak = grid[int(np.argmax(accs))]
    c_left, c_right = 0.1 * c_peak, 10 * c_peak
    for _ in range(8):
        left, right = fit(c_left), fit(c_right)
        if np.mean(left.predict(vx) == vy) < np.mean(right.predict(vx) == vy):
            c_final, clf = c_right, right
            c_left, c_right = 10 ** (0.5 * (np.log10(c_right) + np.log10(c_left))), c_right
        else:
            c_final, clf = c_left, left
            c_left, c_right = c_left, 10 ** (0.5 * (np.log10(c_right) + np.log10(c_left)))
    return clf, c_final


def test_linear_probe_search_equals_coops(tiny_clip):
    tx, ty = clusters(8, dim=tiny_clip.embed_dim)
    vx, vy = clusters(4, dim=tiny_clip.embed_dim, seed=1)
    sx, sy = clusters(30, dim=tiny_clip.embed_dim, seed=2)
    clf, c = coop_search_by_hand(tx, ty, vx, vy)
    _, ours_c, _ = search_c(tx, ty, vx, vy)
    assert ours_c == c

    method = build_method(tiny_clip, CLASSES, method_cfg("linear_probe"))
    as_t = lambda a: torch.from_numpy(a).float()  # noqa: E731
    extra = method.tune((as_t(tx), torch.from_numpy(ty)), (as_t(vx), torch.from_numpy(vy)))
    assert extra["C"] == c
    preds = method.logits(as_t(sx)).argmax(-1).numpy()
    np.testing.assert_array_equal(preds, clf.predict(as_t(sx).double().numpy()))


def test_linear_probe_binary_and_subset_transfer(tiny_clip):
    tx, ty = clusters(8, n_cls=2, dim=tiny_clip.embed_dim)
    vx, vy = clusters(4, n_cls=2, dim=tiny_clip.embed_dim, seed=1)
    method = build_method(tiny_clip, CLASSES[:2], method_cfg("linear_probe"))
    method.tune(
        (torch.from_numpy(tx).float(), torch.from_numpy(ty)),
        (torch.from_numpy(vx).float(), torch.from_numpy(vy)),
    )
    clf, _ = coop_search_by_hand(tx, ty, vx, vy)
    x = torch.from_numpy(clusters(20, n_cls=2, dim=tiny_clip.embed_dim, seed=3)[0]).float()
    np.testing.assert_array_equal(method.logits(x).argmax(-1).numpy(), clf.predict(x.double().numpy()))

    # Scoring a subset of the trained classes keeps their rows (ImageNet-A/R from ImageNet).
    tx, ty = clusters(8, dim=tiny_clip.embed_dim)
    vx, vy = clusters(4, dim=tiny_clip.embed_dim, seed=1)
    full = build_method(tiny_clip, CLASSES, method_cfg("linear_probe"))
    full.tune(
        (torch.from_numpy(tx).float(), torch.from_numpy(ty)),
        (torch.from_numpy(vx).float(), torch.from_numpy(vy)),
    )
    subset = build_method(tiny_clip, [CLASSES[3], CLASSES[1]], method_cfg("linear_probe"))
    subset.load_learnable(full.learnable(), CLASSES)
    x = torch.randn(6, tiny_clip.embed_dim)
    torch.testing.assert_close(subset.logits(x), full.logits(x)[:, [3, 1]])
    assert math.isclose(subset.describe()["C"], full.describe()["C"])
    stranger = build_method(tiny_clip, ["purple thing"], method_cfg("linear_probe"))
    with pytest.raises(TransferError, match="purple thing"):
        stranger.load_learnable(full.learnable(), CLASSES)


def test_coop_transfer_shared_and_csc(tiny_clip):
    source = build_method(tiny_clip, CLASSES, method_cfg("coop"))
    with torch.no_grad():
        source.learnable()["ctx"].normal_()
    target = build_method(tiny_clip, ["purple thing", "grey thing"], method_cfg("coop"))
    target.load_learnable(source.learnable(), CLASSES)
    torch.testing.assert_close(target.learnable()["ctx"], source.learnable()["ctx"])
    assert target.prepare().shape == (2, tiny_clip.embed_dim)

    cfg = method_cfg("coop")
    cfg.prompt.csc = True
    csc = build_method(tiny_clip, CLASSES, cfg)
    other = build_method(tiny_clip, CLASSES[:2], cfg)
    with pytest.raises(TransferError, match="class-specific"):
        other.load_learnable(csc.learnable(), CLASSES)


def test_only_prompt_tensors_train_in_coop(tiny_clip):
    method = build_method(tiny_clip, CLASSES, method_cfg("coop"))
    trainable = {n for n, p in method.named_parameters() if p.requires_grad}
    assert trainable == {"classifier.prompt_learner.ctx"}
    loss, logits = method.loss(torch.randn(3, tiny_clip.embed_dim), torch.tensor([0, 1, 2]))
    loss.backward()
    assert method.learnable()["ctx"].grad is not None and logits.shape == (3, 4)

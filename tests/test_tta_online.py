"""The online test-time methods (coop.tta.tda, coop.tta.dpe, coop.tta.boostadapter): the caches'
update rules on hand-made cases, each method's per-image logits along a stream against the
originals' computation written out here (their dict-of-lists caches, `sorted`, `update_cache`),
and a resumed stream bit-identical to an uninterrupted one."""

from __future__ import annotations

import io
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from conftest import build_family, shrunk_timm, small_timm_config

from coop.config.load import load_config
from coop.methods import build_method
from coop.tta import TTA_METHODS
from coop.tta.base import TestTimeError as TtaError
from coop.tta.boostadapter import BoostAdapter
from coop.tta.dpe import DPE
from coop.tta.online import ClassCache
from coop.tta.tda import TDA

CLASSES = ["cat", "dog", "car", "tree", "boat"]
ONLINE = (TDA, DPE, BoostAdapter)


def config(dataset: str, *extra: str):
    return load_config(None, ["method=zeroshot", f"data.name={dataset}", *extra])


def pictures(size: int = 32) -> torch.Tensor:
    """Five random pictures (5, 3, size, size), one per class."""
    return torch.randn(5, 3, size, size, generator=torch.Generator().manual_seed(5))


def stream(n: int, views: int, size: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """n images' views (views, 3, size, size): image i is picture i % 3 plus noise, its other views
    that image plus more noise; so that classes 0-2 overflow their caches."""
    out, base = [], pictures(size)
    for i in range(n):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        image = base[i % 3] + torch.randn(1, 3, size, size, generator=gen)
        noise = (
            0.7
            * torch.randn(views, 3, size, size, generator=gen)
            * (torch.arange(views) > 0).view(-1, 1, 1, 1)
        )
        out.append(image + noise)
    return out


def host_for(clip, cfg, monkeypatch=None):
    """A zero-shot host; with `monkeypatch`, its class text features are the five pictures'
    centred image features, so that the stream's images fall into different classes with
    entropies on both sides of TDA's negative band (the random tiny towers put every image in
    one class otherwise)."""
    host = build_method(clip, CLASSES, cfg)
    if monkeypatch is not None:
        with torch.no_grad():
            features = F.normalize(clip.encode_image(pictures()).float(), dim=-1)
        text = F.normalize(features - features.mean(0), dim=-1)
        monkeypatch.setattr(host, "prepare", lambda: text)
    return host


# -- the originals, written out ---------------------------------------------------------------------


def tda_update(cache, pred, item, capacity):  # TDA's update_cache
    if pred in cache:
        if len(cache[pred]) < capacity:
            cache[pred].append(item)
        elif item[1] < cache[pred][-1][1]:
            cache[pred][-1] = item
        cache[pred] = sorted(cache[pred], key=operator.itemgetter(1))
    else:
        cache[pred] = [item]


def boost_update(cache, pred, item, capacity, fifo):  # BoostAdapter's update_cache
    if pred in cache:
        cache[pred].append(item)
        if fifo:
            if len(cache[pred]) > capacity:
                cache[pred] = cache[pred][1:]
        else:
            cache[pred] = sorted(cache[pred], key=operator.itemgetter(1))[:capacity]
    else:
        cache[pred] = [item]


def cache_logits(f, cache, alpha, beta, n_cls, mask=None):  # TDA's compute_cache_logits
    keys, values = [], []
    for c in sorted(cache):
        for item in cache[c]:
            keys.append(item[0])
            values.append(item[2] if mask else c)
    keys = torch.stack(keys).T
    if mask:
        values = ((torch.stack(values) > mask[0]) & (torch.stack(values) < mask[1])).float()
    else:
        values = F.one_hot(torch.tensor(values), n_cls).float()
    return alpha * ((-1) * (beta - beta * (f @ keys))).exp() @ values


def avg_entropy(outputs):  # TPT's, TDA's and DPE's
    logits = outputs - outputs.logsumexp(dim=-1, keepdim=True)
    avg = logits.logsumexp(dim=0) - math.log(logits.shape[0])
    avg = torch.clamp(avg, min=torch.finfo(avg.dtype).min)
    return -(avg * torch.exp(avg)).sum(dim=-1)


def softmax_entropy(x):
    return -(x.softmax(1) * x.log_softmax(1)).sum(1)


def clip_logits(f, weights, scale, infer_ori_image=False):  # get_clip_logits on features (V, E)
    logits = scale * f @ weights  # weights (E, C)
    if f.shape[0] > 1 and not infer_ori_image:
        idx = torch.argsort(softmax_entropy(logits), stable=True)[: int(f.shape[0] * 0.1)]
        output = logits[idx]
        return (
            f[idx].mean(0),
            output.mean(0),
            avg_entropy(output),
            output.softmax(1).mean(0),
            int(output.mean(0).argmax()),
        )
    return f[0], logits[0], softmax_entropy(logits[:1])[0], logits[0].softmax(-1), int(logits[0].argmax())


def reference_tda(features, weights, s, boost=None):
    """TDA's run_test_tda (boost: BoostAdapter's, with its infer_ori_image and delta)."""
    pos, neg, out = {}, {}, []
    n_cls = weights.shape[1]
    for f in features:
        image_only = boost is not None and boost["image_only"]
        feat, logits, loss, prob, pred = clip_logits(f, weights, s["scale"], image_only)
        if boost is None:
            tda_update(pos, pred, [feat, float(loss)], s["pos_capacity"])
        else:
            boost_update(pos, pred, [feat, float(loss)], s["pos_capacity"], fifo=False)
            view_logits = s["scale"] * f @ weights
            idx = torch.argsort(softmax_entropy(view_logits), stable=True)[: max(1, int(f.shape[0] * 0.1))]
            current = {c: list(items) for c, items in pos.items()}
            for i in idx.tolist():
                item = [f[i], float(softmax_entropy(view_logits[i : i + 1])[0])]
                boost_update(
                    current, int(view_logits[i].argmax()), item, s["pos_capacity"] + boost["delta"], False
                )
        if s["neg_entropy"][0] < float(loss / math.log2(n_cls)) < s["neg_entropy"][1]:
            if boost is None:
                tda_update(neg, pred, [feat, float(loss), prob], s["neg_capacity"])
            else:
                boost_update(neg, pred, [feat, float(loss), prob], s["neg_capacity"], fifo=True)
        final = logits.clone()
        final += cache_logits(feat, pos if boost is None else current, s["pos_alpha"], s["pos_beta"], n_cls)
        if neg:
            final -= cache_logits(feat, neg, s["neg_alpha"], s["neg_beta"], n_cls, s["neg_mask"])
        out.append(final)
    return out


def info_nce(query, keys, temperature):  # info_nce-pytorch, no negative keys
    query, keys = F.normalize(query, dim=-1), F.normalize(keys, dim=-1)
    return F.cross_entropy(query @ keys.T / temperature, torch.arange(len(query)))


def reference_dpe(features, weights, s):
    """DPE's run_test_dpe, its AdamW step from zero written out: -lr g / (|g| + eps)."""
    n_cls = weights.shape[1]
    global_w, cache, n_avg, out = weights.clone(), {}, 0, []
    for f in features:
        text_res = torch.zeros_like(global_w, requires_grad=True)
        new_w = F.normalize(global_w + text_res, dim=0)
        feat, logits, loss, _, pred = clip_logits(f, new_w, s["scale"])
        tda_update(cache, pred, [feat.detach(), float(loss.detach()) / math.log2(n_cls)], s["capacity"])
        classes = sorted(cache)
        keys = torch.stack([sum(item[0] / len(cache[c]) for item in cache[c]) for c in classes]).T
        values = F.one_hot(torch.tensor(classes), n_cls).float()
        image_res = torch.zeros_like(keys, requires_grad=True)
        new_keys = F.normalize(keys + image_res, dim=0)
        final = logits + s["alpha"] * ((-1) * (s["beta"] - s["beta"] * feat @ new_keys)).exp() @ values
        loss = avg_entropy(final[None]) + s["align"] * info_nce(new_keys.T, new_w[:, classes].T, 0.01)
        loss.backward()
        with torch.no_grad():
            text_res = -s["lr_text"] * text_res.grad / (text_res.grad.abs() + s["eps"])
            image_res = -s["lr_image"] * image_res.grad / (image_res.grad.abs() + s["eps"])
            new_w = F.normalize(global_w + text_res, dim=0)
            if s["infer_all_views"]:
                feat, logits, *_ = clip_logits(f, new_w, s["scale"])
            else:
                feat, logits, *_ = clip_logits(f[:1], new_w, s["scale"])
            new_keys = F.normalize(keys + image_res, dim=0)
            final = logits + s["alpha"] * ((-1) * (s["beta"] - s["beta"] * feat @ new_keys)).exp() @ values
            if float(avg_entropy(final[None])) / math.log2(n_cls) < 0.1:
                n_avg += 1
                global_w = global_w * (n_avg / (n_avg + 1)) + new_w * (1 / (n_avg + 1))
        out.append(final)
    return out


# -- fixtures ---------------------------------------------------------------------------------------


def encoded(host, views):
    """The reference's inputs: normalised features (V, E) and clip_weights (E, C)."""
    with torch.no_grad():
        f = F.normalize(host.clip.encode_image(views).float(), dim=-1)
        return f, host.prepare().float().T


def run(method, views_list):
    return [method.predict(v, i) for i, v in enumerate(views_list)]


# -- the caches -------------------------------------------------------------------------------------


def test_admit_is_tdas_update_cache_on_hand_made_cases():
    cache = ClassCache(n_cls=2, capacity=3, dim=1)
    key = lambda x: torch.tensor([float(x)])  # noqa: E731  the key names the entry
    for x, loss in ((1, 0.5), (2, 0.2), (3, 0.9)):  # room: append, then sort by loss
        cache.admit(0, key(x), torch.tensor(loss))
    assert cache.count.tolist() == [3, 0]
    assert cache.keys[0, :, 0].tolist() == [2, 1, 3] and cache.loss[0].tolist() == pytest.approx(
        [0.2, 0.5, 0.9]
    )
    cache.admit(0, key(4), torch.tensor(0.9))  # full, equal to the last: not strictly lower, kept out
    assert cache.keys[0, :, 0].tolist() == [2, 1, 3]
    cache.admit(0, key(5), torch.tensor(1.5))  # higher: kept out
    assert cache.keys[0, :, 0].tolist() == [2, 1, 3]
    cache.admit(0, key(6), torch.tensor(0.1))  # lower: replaces the last, then the sort puts it first
    assert cache.keys[0, :, 0].tolist() == [6, 2, 1] and cache.loss[0].tolist() == pytest.approx(
        [0.1, 0.2, 0.5]
    )
    cache.admit(0, key(7), torch.tensor(0.2))  # ties the second: stable sort keeps it after
    assert cache.keys[0, :, 0].tolist() == [6, 2, 7]
    cache.admit(1, key(8), torch.tensor(0.3))
    keys, classes, probs = cache.entries()  # class order, then slot order
    assert keys[:, 0].tolist() == [6, 2, 7, 8] and classes.tolist() == [0, 0, 0, 1] and probs is None


def test_admit_and_push_match_the_originals_on_a_random_stream():
    gen = torch.Generator().manual_seed(0)
    ours = {"tda": ClassCache(4, 3, 2, probs=True), "fifo": ClassCache(4, 2, 2, probs=True)}
    theirs = {"tda": {}, "fifo": {}}
    for _ in range(200):
        c = int(torch.randint(4, (1,), generator=gen))
        key, probs = torch.randn(2, generator=gen), torch.rand(4, generator=gen)
        loss = torch.randint(5, (1,), generator=gen).float()[0] / 4  # ties happen
        ours["tda"].admit(c, key, loss, probs)
        tda_update(theirs["tda"], c, [key, float(loss), probs], 3)
        ours["fifo"].push(c, key, loss, probs)
        boost_update(theirs["fifo"], c, [key, float(loss), probs], 2, fifo=True)
    for rule in ours:
        keys, classes, probs = ours[rule].entries()
        expected = [(c, item) for c in sorted(theirs[rule]) for item in theirs[rule][c]]
        assert classes.tolist() == [c for c, _ in expected]
        assert torch.equal(keys, torch.stack([item[0] for _, item in expected]))
        assert torch.equal(probs, torch.stack([item[2] for _, item in expected]))
    # BoostAdapter's positive rule (append, sort, cut) is TDA's admit
    ours, theirs = ClassCache(1, 3, 1), {}
    for _ in range(50):
        loss = torch.randint(6, (1,), generator=gen).float()[0]
        key = torch.randn(1, generator=gen)
        ours.admit(0, key, loss)
        boost_update(theirs, 0, [key, float(loss)], 3, fifo=False)
        assert torch.equal(ours.entries()[0], torch.stack([item[0] for item in theirs[0]]))


def test_widened_copy_leaves_the_cache_alone():
    cache = ClassCache(2, 2, 1)
    cache.admit(1, torch.ones(1), torch.tensor(0.5))
    wide = cache.widened(2)
    for x in range(3):
        wide.admit(1, torch.full((1,), x + 2.0), torch.tensor(0.1 * x))
    assert wide.count.tolist() == [0, 4] and cache.count.tolist() == [0, 1]
    assert wide.keys[1, :, 0].tolist() == [2, 3, 4, 1]
    wide.admit(1, torch.full((1,), 5.0), torch.tensor(0.3))  # full at 4: replaces the 0.5
    assert wide.keys[1, :, 0].tolist() == [2, 3, 4, 5] and cache.keys[1, 0, 0] == 1


# -- the negative gate, on hand-made features (the host's image tower replaced by the identity) --


def test_negative_gate_divides_nats_by_log2_and_masks_the_probabilities(tiny_clip, monkeypatch):
    cfg = config("dtd", "tda.scale=10", "tda.pos_alpha=2", "tda.pos_beta=5")
    host = host_for(tiny_clip, cfg)
    text = torch.eye(5, 32)  # (n_cls, E): class c is axis c
    monkeypatch.setattr(host, "prepare", lambda: text)
    monkeypatch.setattr(host.clip, "encode_image", lambda x: x)
    tda = TDA(host, cfg)

    def image(margin):  # features (1, E) whose logits are margin on class 0, 0 elsewhere
        f = torch.zeros(1, 32)
        f[0, 0], f[0, 5] = margin, 1.0  # axis 5 is no class: scales the cosine
        return f

    def gate(margin):  # entropy (nats) / log2(5) of the image's softmax
        f = F.normalize(image(margin), dim=-1)
        return float(softmax_entropy(10 * f @ text.T)[0] / math.log2(5))

    # a margin whose entropy / log2(C) is in (0.2, 0.5) while entropy / ln(C) is above 0.5
    inside = next(m for m in torch.linspace(0.0, 5, 5001).tolist() if 0.36 < gate(m) < 0.49)
    assert gate(inside) * math.log2(5) / math.log(5) > 0.5
    out = tda.predict(image(inside), 0)
    assert tda.neg.count.tolist() == [1, 0, 0, 0, 0] and tda.pos.count.tolist() == [1, 0, 0, 0, 0]
    f = F.normalize(image(inside), dim=-1)[0]
    z = 10 * f @ text.T
    p = z.softmax(-1)
    mask = ((p > 0.03) & (p < 1.0)).float()
    # the image is in both caches before it is scored: affinity with itself is 1
    torch.testing.assert_close(out, z + 2 * F.one_hot(torch.tensor(0), 5) - 0.117 * mask)
    assert mask.sum() == 5  # every class within the mask here
    confident = next(m for m in torch.linspace(0.0, 5, 5001).tolist() if gate(m) < 0.2)
    tda.predict(image(confident), 1)
    assert tda.neg.count.tolist() == [1, 0, 0, 0, 0] and tda.pos.count.tolist() == [2, 0, 0, 0, 0]
    unsure = image(0.0)  # uniform: entropy / log2(5) = ln 5 / log2 5 = 0.69, above the band
    tda.predict(unsure, 2)
    assert tda.neg.count.sum() == 1 and tda.pos.count.sum() == 3


# -- per-image logits against the originals -------------------------------------------------------


TDA_CASES = {  # dataset, overrides: the image alone (dtd) and 64 AugMix views (imagenet_a)
    "dtd": ("dtd", ["tda.scale=30"]),
    "imagenet_a": ("imagenet_a", ["tda.scale=30"]),
}


@pytest.mark.parametrize("case", sorted(TDA_CASES))
def test_tda_logits_are_the_originals(tiny_clip, case, monkeypatch):
    dataset, extra = TDA_CASES[case]
    cfg = config(dataset, *extra)
    host = host_for(tiny_clip, cfg, monkeypatch)
    tda = TDA(host, cfg)
    assert TDA.views_for(cfg) == (1 if dataset == "dtd" else 64) and TDA.augment == "augmix"
    views = stream(16, TDA.views_for(cfg))
    ours = run(tda, views)
    s = {**tda.settings, "scale": 30.0}
    assert (s["pos_alpha"], s["pos_beta"]) == ((2.0, 3.0) if dataset == "dtd" else (2.0, 5.0))
    theirs = reference_tda([encoded(host, v)[0] for v in views], encoded(host, views[0])[1], s)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert tda.neg.count.sum() > 0 and tda.pos.count.sum() > len(CLASSES)  # the gate and a full class


@pytest.mark.parametrize("dataset", ["dtd", "imagenet_r"])
def test_boostadapter_logits_are_the_originals(tiny_clip, dataset, monkeypatch):
    cfg = config(dataset, "boostadapter.scale=30")
    host = host_for(tiny_clip, cfg, monkeypatch)
    boost = BoostAdapter(host, cfg)
    assert BoostAdapter.views_for(cfg) == 64 and BoostAdapter.augment == "crop_flip"
    views = stream(16, 64)
    ours = run(boost, views)
    s = {**boost.settings, "scale": 30.0}
    assert s["image_only"] == (dataset == "dtd") and s["delta"] == {"dtd": 0, "imagenet_r": 3}[dataset]
    theirs = reference_tda([encoded(host, v)[0] for v in views], encoded(host, views[0])[1], s, boost=s)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert boost.neg.count.sum() > 0


@pytest.mark.parametrize("dataset", ["dtd", "imagenet", "imagenet_a"])
def test_dpe_logits_are_the_originals(tiny_clip, dataset, monkeypatch):
    cfg = config(dataset, "dpe.scale=30", "dpe.lr_text=0.01", "dpe.lr_image=0.02", "dpe.align=0.5")
    host = host_for(tiny_clip, cfg, monkeypatch)
    dpe = DPE(host, cfg)
    assert DPE.views_for(cfg) == (1 if dataset == "dtd" else 64) and DPE.augment == "augmix"
    views = stream(10, DPE.views_for(cfg))
    ours = run(dpe, views)
    s = {**dpe.settings, "scale": 30.0}
    assert s["infer_all_views"] == (dataset == "imagenet_a")
    theirs = reference_dpe([encoded(host, v)[0] for v in views], encoded(host, views[0])[1], s)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert dpe.updates > 0  # the textual prototypes evolved


def test_settings_are_the_originals_per_dataset_unless_set(tiny_clip):
    cfg = config("imagenet_sketch")
    tda = TDA(host_for(tiny_clip, cfg), cfg)
    assert (tda.settings["pos_alpha"], tda.settings["pos_beta"], tda.scale) == (2.363, 7.45, 100.0)
    assert TDA.views_for(cfg) == 64 and TDA.views_for(config("imagenet")) == 1
    assert DPE.views_for(config("imagenet")) == 64 and DPE.views_for(config("dtd")) == 1
    assert BoostAdapter.views_for(config("imagenet")) == 1 and BoostAdapter.views_for(config("dtd")) == 64
    cfg = config("imagenet_sketch", "tda.pos_alpha=1.5", "tda.scale=null")
    tda = TDA(host_for(tiny_clip, cfg), cfg)
    assert tda.settings["pos_alpha"] == 1.5 and tda.settings["pos_beta"] == 7.45
    assert tda.scale == pytest.approx(float(tiny_clip.logit_scale.exp()))
    dpe = DPE(host_for(tiny_clip, config("eurosat")), config("eurosat"))
    assert [dpe.settings[k] for k in ("alpha", "beta", "lr_text", "lr_image", "align")] == [
        3.0,
        8.0,
        5e-5,
        5e-5,
        0.2,
    ]
    textile = TDA(host_for(tiny_clip, config("textile")), config("textile"))  # no original file: ImageNet's
    assert (textile.settings["pos_alpha"], textile.settings["pos_beta"]) == (2.0, 5.0)
    with pytest.raises(TtaError, match=r"^tda.neg_entropy=\[0.5, 0.2\] must be"):
        TDA(host_for(tiny_clip, cfg), config("dtd", "tda.neg_entropy=[0.5,0.2]"))


def test_a_host_without_class_text_is_refused(tiny_clip):
    cfg = load_config(None, ["method=linear_probe", "data.name=dtd"])
    host = build_method(tiny_clip, CLASSES, cfg)
    assert all(TTA_METHODS[cls.name] is cls and cls.kind == "online" for cls in ONLINE)
    for cls in ONLINE:
        with pytest.raises(TtaError, match=f"^tta.method={cls.name} reads the host's class text features"):
            cls(host, cfg)


# -- resume -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [cls.name for cls in ONLINE])
def test_a_resumed_stream_is_bit_identical(tiny_clip, name, monkeypatch):
    cfg = config("imagenet_a", f"{name}.scale=30")
    host = host_for(tiny_clip, cfg, monkeypatch)
    views = stream(12, 8, seed=1)
    whole = TTA_METHODS[name](host, cfg)
    straight = run(whole, views)
    first = TTA_METHODS[name](host, cfg)
    assert first.state() == {}
    head = run(first, views[:6])
    buffer = io.BytesIO()
    torch.save(first.state(), buffer)  # plain tensors: a weights_only checkpoint
    buffer.seek(0)
    resumed = TTA_METHODS[name](host, cfg)
    resumed.load_state(torch.load(buffer, weights_only=True))
    tail = [resumed.predict(v, 6 + i) for i, v in enumerate(views[6:])]
    for a, b in zip(straight, head + tail, strict=True):
        assert torch.equal(a, b)
    end = resumed.state()
    assert end.keys() == whole.state().keys() and all(
        torch.equal(v, end[k]) for k, v in whole.state().items()
    )


# -- other towers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stem, size", [("siglip-tiny", 64), ("eva02-tiny", 56), ("pe-core-tiny", 64)])
def test_online_methods_run_on_timm_towers(stem, size, tmp_path):
    """Each online method on the timm towers (2 blocks at 4x4 patches, `shrunk_timm`): finite
    logits per image and its caches filled."""
    from conftest import REPO

    tok = None
    if stem == "siglip-tiny":  # its tokenizer: a tiny one built here (transformers)
        pytest.importorskip("transformers")
        from coop.model.tiny_tokenizers import make_tiny_tokenizer

        tok = tmp_path / "tok"
        make_tiny_tokenizer(REPO / "configs" / "models" / f"{stem}.json", tok)
    with shrunk_timm(depth=2, img_size=size):
        clip, _ = build_family(
            small_timm_config(REPO / "configs" / "models" / f"{stem}.json", tmp_path, size), tok
        )
    assert clip.image_size == size
    cfg = config("imagenet_a")
    host = build_method(clip, CLASSES, cfg)
    for cls in ONLINE:
        method = cls(host, cfg)
        for i, views in enumerate(stream(2, 2, size=size)):
            out = method.predict(views, i)
            assert out.shape == (len(CLASSES),) and torch.isfinite(out).all()
        assert method.state()["pos.count"].sum() == 2


def test_bench_reports_the_overhead_per_image_over_zero_shot():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location(
        "bench_tta_online", REPO / "tools/bench/bench_tta_online.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.overhead(
        str(REPO / "configs/models/coop-tiny.json"), 6, 2, (1, 3), "dtd", torch.device("cpu")
    )
    assert [(r["method"], r["views"]) for r in rows] == [
        (m, v) for v in (1, 3) for m in ("tda", "dpe", "boostadapter")
    ]
    for r in rows:
        assert r["encode_ms"] > 0 and r["zeroshot_ms"] > 0 and r["method_ms"] > 0
        assert r["overhead_ms"] == pytest.approx(r["method_ms"] - r["zeroshot_ms"])
        total = r["encode_ms"] + r["zeroshot_ms"]
        assert r["ratio"] == pytest.approx((r["encode_ms"] + r["method_ms"]) / total)


@pytest.mark.parametrize(
    "overrides", [["method=coop"], ["method=maple", "prompt.depth=1"], ["method=cocoop"]], ids=lambda o: o[0]
)
def test_trained_hosts_give_their_towers_text_and_image(tiny_clip, overrides):
    """A CoOp (feature), MaPLe (pixel, prompted image tower) or CoCoOp (text per image) host: the
    first image's TDA logits are the host's towers' cosine x 100, plus alpha at its class (its own
    entry: affinity 1), minus the negative term when gated; DPE refuses CoCoOp."""
    cfg = load_config(None, [*overrides, "data.name=dtd"])
    host = build_method(tiny_clip, CLASSES, cfg)
    views = stream(1, 1)[0]
    with torch.no_grad():
        x = tiny_clip.encode_image(views) if host.input == "features" else views
        towers = host.towers(x)
        f, text = F.normalize(towers.image.float(), dim=-1), F.normalize(towers.text.float(), dim=-1)
        z = 100 * (torch.einsum("ve,vce->vc", f, text) if text.dim() == 3 else f @ text.T)[0]
    p = z.softmax(-1)
    expected = z + 2.0 * F.one_hot(z.argmax(), len(CLASSES))  # dtd: alpha+ 2
    if 0.2 < float(softmax_entropy(z[None])[0] / math.log2(len(CLASSES))) < 0.5:
        expected -= 0.117 * ((p > 0.03) & (p < 1.0)).float()
    torch.testing.assert_close(TDA(host, cfg).predict(views, 0), expected, rtol=1e-5, atol=1e-4)
    if overrides[0] == "method=cocoop":
        with pytest.raises(TtaError, match="^tta.method=dpe evolves one set of class text features"):
            DPE(host, cfg)
    else:
        assert torch.isfinite(DPE(host, cfg).predict(views, 0)).all()

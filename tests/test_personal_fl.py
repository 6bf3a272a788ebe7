"""Personalised federated prompt learning (FedOTP, FedPGP) without Ray: the pathological_fedotp
draw against a re-derivation of the originals' function (and, for FedPGP's base-to-novel, of its
per-dataset readers: K-shot subset first on DTD, the full base split on Oxford Pets), the OT
solvers against NumPy float64,
the patch tokens against open_clip, FedPGP's loss term by term, and both methods end to end on
Flower's Message API through an in-process grid (tests/local_grid.py: the ServerApp's `run_server`
and the ClientApp, TRAIN and EVALUATE, no simulation engine), with the personalised metrics recomputed by
hand from the checkpoint's global tensors and the clients' state files, no personal tensor in any
message or in the checkpoint, and crashes (inside a round, after a client saved its state but
before the server's checkpoint, during the evaluation) resumed to the same tensors. One real Flower
simulation of FedOTP lives in tests/test_federated_runs.py."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("flwr")

from conftest import TINY_CONFIG, make_image_folder  # noqa: E402
from local_grid import LocalGrid, run_inprocess  # noqa: E402
from test_data import make_split_json_dataset  # noqa: E402

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.federated import task  # noqa: E402
from coop.federated.fedotp import sinkhorn, unbalanced_ot  # noqa: E402
from coop.federated.personal import round_summary  # noqa: E402
from coop.federated.personal_data import fedotp_partition, labeldir100_partition, labeldir_partition  # noqa: E402

# ---------------------------------------------------------------- the originals' draw, re-derived


def original_federated_fewshot(train_labels, test_labels, shots, users):
    """generate_federated_fewshot_dataset (train) and generate_federated_dataset (test) of the
    FedOTP/FedPGP Dassl copy, non-IID and repeat rate 0, on item ids; Python's global `random`,
    reseeded with 2023 inside each function as the original does (state restored afterwards)."""
    saved = random.getstate()
    try:
        out = []
        for labels, few in ((train_labels, True), (test_labels, False)):
            class_num = max(set(labels)) + 1
            class_per_user = int(round(class_num / users))
            class_list = list(range(0, class_num))
            random.seed(2023)
            random.shuffle(class_list)
            tracker = defaultdict(list)
            for i, y in enumerate(labels):
                tracker[y].append(i)
            if not few:  # the test function shuffles a sample order per label (unused when non-IID)
                for items in tracker.values():
                    random.shuffle(list(range(len(items))))
            per_user = {}
            for idx in range(users):
                if idx == users - 1:
                    mine = class_list[idx * class_per_user : class_num]
                else:
                    mine = class_list[idx * class_per_user : (idx + 1) * class_per_user]
                dataset = []
                for label, items in tracker.items():
                    if label in mine:
                        if not few:
                            dataset.extend(items)
                        elif len(items) >= shots:
                            dataset.extend(random.sample(items, shots))
                        else:
                            dataset.extend(items)
                per_user[idx] = dataset
            out.append(per_user)
        return out
    finally:
        random.setstate(saved)


@pytest.mark.parametrize("n_classes, users, shots", [(10, 3, 2), (37, 10, 4), (7, 2, 8), (100, 10, 16)])
def test_pathological_fedotp_equals_the_originals_function(n_classes, users, shots):
    gen = random.Random(n_classes)
    train = [gen.randrange(n_classes) for _ in range(n_classes * 12)]
    train += list(range(n_classes))  # every class present; some have fewer than K images
    gen.shuffle(train)
    test = [gen.randrange(n_classes) for _ in range(n_classes * 3)]
    ref_train, ref_test = original_federated_fewshot(train, test, shots, users)
    random.seed(12345)  # the partition must not depend on the global stream (or on data.seed)
    part = fedotp_partition(train, test, shots=shots, clients=users)
    assert part.clients == [ref_train[k] for k in range(users)]
    assert [sorted(t) for t in part.settings["client_test"]] == [sorted(ref_test[k]) for k in range(users)]
    classes = part.settings["client_classes"]
    per = int(round(n_classes / users))
    assert [len(c) for c in classes[:-1]] == [per] * (users - 1) and sorted(sum(classes, [])) == list(
        range(n_classes)
    )
    for own, test_idx in zip(classes, part.settings["client_test"], strict=True):
        assert {test[i] for i in test_idx} <= set(own)


def test_pathological_fedotp_of_a_run_ignores_data_seed(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=("a", "b", "c", "d"), n_train=5, n_test=2)
    parts = []
    for seed in (1, 2):
        cfg = load_config(
            None,
            [*BASE, f"data.root={root}", f"data.seed={seed}", "fl.method=fedpgp"],
            base=task.FEDERATED_BASE,
        )
        task.check_config(cfg)
        parts.append(task.client_partition(cfg, task.load_data(cfg)))
    assert parts[0].clients == parts[1].clients and parts[0].settings == parts[1].settings
    assert parts[0].sizes() == [4, 4]  # 2 classes x 2 shots per client


def original_fewshot(labels, shots, seed):
    """Dassl's generate_fewshot_dataset on a train split right after `random.seed(seed)`, on item
    ids: per label in order of first appearance, `random.sample(items, K)` (all items if fewer)."""
    rng, tracker, out = random.Random(seed), defaultdict(list), []
    for i, y in enumerate(labels):
        tracker[y].append(i)
    for items in tracker.values():
        out.extend(rng.sample(items, shots) if len(items) >= shots else items)
    return out


@pytest.mark.parametrize("name, split", [("dtd", "DescribableTextures"), ("oxford_pets", "OxfordPets")])
def test_fedpgp_base_to_novel_clients_follow_its_reader_of_the_dataset(tmp_path, monkeypatch, name, split):
    """FedPGP's DTD reader (like its Caltech101, Food101 and Flowers ones) deals the base classes'
    clients from Dassl's seeded K-shot subset; its Oxford Pets reader from the full base split."""
    monkeypatch.setenv("COOP_CACHE_DIR", str(tmp_path / "cache"))
    classes = [f"c{i}" for i in range(6)]
    make_split_json_dataset(tmp_path, name, "images", f"split_zhou_{split}.json", classes, counts=(8, 2, 2))
    split_file = tmp_path / name / f"split_zhou_{split}.json"
    obj = json.loads(split_file.read_text())
    random.Random(0).shuffle(obj["train"])  # labels first appear in a non-trivial order
    split_file.write_text(json.dumps(obj))
    shots, seed, users = 2, 3, 2
    labels, test = [y for _, y, _ in obj["train"]], [y for _, y, _ in obj["test"]]

    def clients_of(pool):  # the original's client draw on `pool` restricted to the 3 base classes
        base = [i for i in pool if labels[i] < 3]
        drawn, _ = original_federated_fewshot(
            [labels[i] for i in base], [y for y in test if y < 3], shots, users
        )
        return [[obj["train"][base[j]][0] for j in drawn[k]] for k in range(users)]

    fewshot_first, full = clients_of(original_fewshot(labels, shots, seed)), clients_of(range(len(labels)))
    assert fewshot_first != full  # the fixture tells the two rules apart
    cfg = load_config(
        None,
        [*BASE, f"data.name={name}", f"data.root={tmp_path}", f"data.seed={seed}", f"data.shots={shots}",
         f"fl.clients={users}", "fl.method=fedpgp", "data.subsample_classes=base"],
        base=task.FEDERATED_BASE,
    )  # fmt: skip
    task.check_config(cfg)
    ds = task.load_data(cfg)
    part = task.client_partition(cfg, ds)
    image_dir = tmp_path / name / "images"
    ours = [[Path(ds.train[i].path).relative_to(image_dir).as_posix() for i in c] for c in part.clients]
    assert ours == (fewshot_first if name == "dtd" else full)


def original_labeldir(y_train, y_test, n_parties, beta, seed):
    """partition_data(..., "noniid-labeldir") of FedOTP's utils/datasplit.py on label arrays, after
    Dassl's np.random.seed(seed) (global state restored afterwards)."""
    saved = np.random.get_state()
    np.random.seed(seed)
    try:
        K, N_train = int(y_train.max()) + 1, y_train.shape[0]
        min_size = 0
        while min_size < 10:
            idx_batch_train = [[] for _ in range(n_parties)]
            idx_batch_test = [[] for _ in range(n_parties)]
            for k in range(K):
                train_idx_k = np.where(y_train == k)[0]
                test_idx_k = np.where(y_test == k)[0]
                np.random.shuffle(train_idx_k)
                np.random.shuffle(test_idx_k)
                proportions = np.random.dirichlet(np.repeat(beta, n_parties))
                proportions = np.array(
                    [
                        p * (len(idx_j) < N_train / n_parties)
                        for p, idx_j in zip(proportions, idx_batch_train, strict=True)
                    ]
                )
                proportions = proportions / proportions.sum()
                cut_train = (np.cumsum(proportions) * len(train_idx_k)).astype(int)[:-1]
                cut_test = (np.cumsum(proportions) * len(test_idx_k)).astype(int)[:-1]
                idx_batch_train = [
                    a + b.tolist()
                    for a, b in zip(idx_batch_train, np.split(train_idx_k, cut_train), strict=True)
                ]
                idx_batch_test = [
                    a + b.tolist()
                    for a, b in zip(idx_batch_test, np.split(test_idx_k, cut_test), strict=True)
                ]
                min_size = min(min(len(i) for i in idx_batch_train), min(len(i) for i in idx_batch_test))
        for j in range(n_parties):
            np.random.shuffle(idx_batch_train[j])
            np.random.shuffle(idx_batch_test[j])
        return idx_batch_train, idx_batch_test
    finally:
        np.random.set_state(saved)


@pytest.mark.parametrize("n_classes, users, beta, seed", [(10, 5, 0.3, 1), (20, 10, 0.1, 2), (10, 4, 5.0, 3)])
def test_dirichlet_labeldir_equals_the_originals_function(n_classes, users, beta, seed):
    gen = np.random.RandomState(0)
    y_train, y_test = gen.randint(n_classes, size=2000), gen.randint(n_classes, size=1000)
    ref_train, ref_test = original_labeldir(y_train, y_test, users, beta, seed)
    part = labeldir_partition(y_train.tolist(), y_test.tolist(), beta=beta, clients=users, seed=seed)
    assert part.clients == ref_train and part.settings["client_test"] == ref_test
    assert min(len(c) for c in part.clients + part.settings["client_test"]) >= 10


def original_labeldir100(y, n_parties, beta, run_seed):
    """partition_data(..., "noniid-labeldir100") on labels y (train then test), transcribed; the
    final client shuffle uses Python's global random after Dassl's random.seed(run_seed)."""
    from coop.federated.personal_data import CIFAR100_COARSE

    saved, saved_np = random.getstate(), np.random.get_state()
    random.seed(run_seed)
    try:
        coarse_labels = np.array(CIFAR100_COARSE)
        rng = random.Random(12345)
        np.random.seed(12345)
        n_samples = y.shape[0]
        selected_indices = rng.sample(list(range(n_samples)), n_samples)
        n_samples_by_client = n_samples // n_parties
        by_fine = {k: list() for k in range(100)}
        by_coarse = {k: list() for k in range(20)}
        for idx in selected_indices:
            by_fine[y[idx]].append(idx)
            by_coarse[coarse_labels[y[idx]]].append(idx)
        available = [ii for ii in range(20)]
        fine_of = {k: list() for k in range(20)}
        for fine_label, coarse_label in enumerate(coarse_labels):
            fine_of[coarse_label].append(fine_label)
        net = [[] for i in range(n_parties)]

        def renormalize(weights, index):
            w = np.delete(weights, index)
            return w / w.sum()

        for client_idx in range(n_parties):
            cw = np.random.dirichlet(alpha=beta * np.ones(len(fine_of)))
            fw = {c: np.random.dirichlet(alpha=10 * np.ones(len(f))) for c, f in fine_of.items()}
            for _ in range(n_samples_by_client):
                ci = int(np.argmax(np.random.multinomial(1, cw)))
                c = available[ci]
                fi = int(np.argmax(np.random.multinomial(1, fw[c])))
                f = fine_of[c][fi]
                sample_idx = int(rng.choice(list(by_fine[f])))
                net[client_idx] = np.append(net[client_idx], sample_idx)
                by_fine[f].remove(sample_idx)
                by_coarse[c].remove(sample_idx)
                if len(by_fine[f]) == 0:
                    fine_of[c].remove(f)
                    fw[c] = renormalize(fw[c], fi)
                    if len(by_coarse[c]) == 0:
                        fine_of.pop(c, None)
                        available.remove(c)
                        cw = renormalize(cw, ci)
        random.shuffle(net)
        return net
    finally:
        random.setstate(saved)
        np.random.set_state(saved_np)


def test_dirichlet_labeldir100_equals_the_originals_function():
    train = [k for k in range(100) for _ in range(4)]
    test = list(range(100))
    y = np.array(train + test)
    ref = original_labeldir100(y, 5, 0.3, run_seed=1)
    part = labeldir100_partition(train, test, beta=0.3, clients=5, seed=1)
    assert part.clients == [[int(i) for i in r if i < 400] for r in ref]
    assert part.settings["client_test"] == [[int(i) - 400 for i in r if i >= 400] for r in ref]
    assert sorted(sum(part.clients, [])) == list(range(400))  # 500 // 5 each: every image dealt once


# ---------------------------------------------------------------- the OT solvers


def numpy_cot(K, a, b, max_iter, thresh):
    """entropic_COT_fast in float64 NumPy, problem by problem, with the batch-global stop rule."""
    K = K.astype(np.float64)
    u, v, it = np.ones_like(a), np.ones_like(b), 0
    while it < max_iter:
        it += 1
        v0 = v.copy()
        for p in range(len(K)):
            kp = np.diag(1.0 / a[p]) @ K[p]
            kq = np.diag(1.0 / b[p]) @ K[p].T
            u[p] = np.minimum(1.0 / (kp @ v[p]), 1.0)
            v[p] = 1.0 / (kq @ u[p])
        if np.abs(v - v0).mean() < thresh:
            break
    return np.stack([np.diag(u[p]) @ K[p] @ np.diag(v[p]) for p in range(len(K))]), it


@pytest.mark.parametrize("thresh, max_iter", [(1e-3, 100), (1e-12, 7), (1e30, 100)])
def test_unbalanced_ot_against_numpy_float64(thresh, max_iter):
    gen = torch.Generator().manual_seed(0)
    sim = torch.rand(6, 9, 2, generator=gen, dtype=torch.float64) * 2 - 1  # cosines
    K = torch.exp(-(1 - sim) / 0.1)
    a, b = torch.full((6, 9), 1 / 9, dtype=torch.float64), torch.full((6, 2), 0.8 / 2, dtype=torch.float64)
    plan, it = unbalanced_ot(K, a, b, max_iter, thresh)
    ref, ref_it = numpy_cot(K.numpy(), a.numpy(), b.numpy(), max_iter, thresh)
    assert it == ref_it
    np.testing.assert_allclose(plan.numpy(), ref, rtol=1e-10, atol=1e-14)
    if thresh == 1e30:
        assert it == 1  # the stop rule is checked after the first update
    if thresh == 1e-12:
        assert it == max_iter
    torch.testing.assert_close(plan.sum(1), b, rtol=1e-9, atol=1e-12)  # the prompt marginal: exact (v last)


def test_unbalanced_ot_relaxes_only_the_patch_marginal_at_convergence():
    gen = torch.Generator().manual_seed(2)
    K = torch.exp(-(1 - torch.rand(4, 6, 2, generator=gen, dtype=torch.float64)) / 0.5)
    a, b = torch.full((4, 6), 1 / 6, dtype=torch.float64), torch.full((4, 2), 0.8 / 2, dtype=torch.float64)
    plan, it = unbalanced_ot(K, a, b, max_iter=5000, thresh=1e-13)
    assert it < 5000
    torch.testing.assert_close(plan.sum(1), b)  # gamma / N per prompt
    assert (plan.sum(2) <= a + 1e-9).all() and (plan.sum(2) < a - 1e-3).any()  # <= 1/M, some strictly
    torch.testing.assert_close(plan.sum((1, 2)), torch.full((4,), 0.8, dtype=torch.float64))  # mass gamma


def test_sinkhorn_balances_both_marginals():
    gen = torch.Generator().manual_seed(1)
    K = torch.exp(-(1 - torch.rand(4, 5, 2, generator=gen, dtype=torch.float64)) / 0.5)
    a, b = torch.full((4, 5), 0.2, dtype=torch.float64), torch.full((4, 2), 0.5, dtype=torch.float64)
    plan, _ = sinkhorn(K, a, b, max_iter=1000, thresh=1e-14)
    torch.testing.assert_close(plan.sum(2), a)
    torch.testing.assert_close(plan.sum(1), b)


# ---------------------------------------------------------------- the methods' terms


def method_cfg(method: str, *extra: str):
    return load_config(None, [f"fl.method={method}", "prompt.n_ctx=4", *extra], base=task.FEDERATED_BASE)


def test_patch_tokens_are_open_clips_tokens_after_ln_post_projected(tiny_clip, tiny_openclip):
    images = torch.randn(
        2, 3, tiny_clip.image_size, tiny_clip.image_size, generator=torch.Generator().manual_seed(0)
    )
    visual = tiny_openclip.visual
    visual.output_tokens = True
    try:
        with torch.no_grad():
            pooled, tokens = visual(images)  # tokens: after ln_post, not projected
            ours = tiny_clip.encode_image(images, tokens=True)
    finally:
        visual.output_tokens = False
    assert ours.shape == (2, 1 + tokens.shape[1], tiny_clip.embed_dim)
    torch.testing.assert_close(ours[:, 0], pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[:, 1:], tokens @ visual.proj, rtol=1e-5, atol=1e-5)


def test_fedotp_logits_are_the_transport_weighted_similarity(tiny_clip):
    torch.manual_seed(0)
    method = task.build_method(tiny_clip, ["red thing", "green thing", "blue thing"], method_cfg("fedotp"))
    tokens = torch.randn(3, 5, tiny_clip.embed_dim)
    with torch.no_grad():
        text = method.prepare()  # (N, C, E)
        logits = method.logits(tokens, text).double().numpy()
    assert text.shape == (2, 3, tiny_clip.embed_dim)
    f = F.normalize(tokens[:, 1:].double(), dim=-1).numpy()  # [CLS] dropped
    t = F.normalize(text.double(), dim=-1).numpy()
    scale = float(tiny_clip.logit_scale.exp())
    sims, kernels = [], []
    for b in range(3):
        for c in range(3):
            s = f[b] @ t[:, c].T  # (M, N)
            sims.append(s)
            kernels.append(np.exp(-(1 - s) / 0.1))
    K = np.stack(kernels)
    plan, _ = numpy_cot(K, np.full((9, 4), 1 / 4), np.full((9, 2), 0.8 / 2), 100, 1e-3)
    ref = scale * (plan * np.stack(sims)).sum((1, 2)).reshape(3, 3)
    np.testing.assert_allclose(logits, ref, rtol=2e-4, atol=1e-4)
    loss, _ = method.loss(tokens, torch.tensor([0, 1, 2]))
    loss.backward()
    grads = {k: v.grad for k, v in method.learnable().items()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())  # both prompts learn
    method.global_only = True
    assert method.prepare().shape == (1, 3, tiny_clip.embed_dim)


def test_fedpgp_loss_term_by_term(tiny_clip):
    from coop.methods import CoOp

    names = ["red thing", "green_thing", "blue thing"]
    torch.manual_seed(0)
    method = task.build_method(tiny_clip, names, method_cfg("fedpgp", "fedpgp.rank=2"))
    sigma, U, V = method.sigma, method.U, method.V
    assert U.shape == (4, 2) and V.shape == (2, tiny_clip.width) and sigma.shape == (4, tiny_clip.width)
    assert set(method.learnable()) == {"sigma", "U", "V"}
    feats, labels = torch.randn(5, tiny_clip.embed_dim), torch.tensor([0, 1, 2, 0, 1])
    loss, logits = method.loss(feats, labels)

    plain = CoOp(tiny_clip, names, load_config(None, ["prompt.n_ctx=4"]))  # CoOp's own prompt assembly
    with torch.no_grad():
        plain.prompt_learner.ctx.copy_(sigma + U @ V)
        t = F.normalize(plain.prepare().double(), dim=-1)
        plain.prompt_learner.ctx.copy_(sigma)
        t_sigma = F.normalize(plain.prepare().double(), dim=-1)
        ids = tiny_clip.tokenize([f"X X X X {n.replace('_', ' ')}." for n in names])
        t0 = F.normalize(tiny_clip.encode_text(ids).double(), dim=-1)
    s = tiny_clip.logit_scale.exp().double()
    ref_logits = s * F.normalize(feats.double(), dim=-1) @ t.T
    ce = F.cross_entropy(ref_logits, labels)
    pos, neg = (t0 * t_sigma).sum(-1), (t_sigma * t).sum(-1)
    con = torch.stack(
        [
            -torch.log(torch.exp(p / 0.5) / (torch.exp(p / 0.5) + torch.exp(q / 0.5)))
            for p, q in zip(pos, neg, strict=True)
        ]
    )
    torch.testing.assert_close(logits.double(), ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss.double(), ce + 0.5 * con.mean(), rtol=1e-4, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (sigma, U, V))
    method.global_only = True
    torch.testing.assert_close(method.prepare().double(), plain.prepare().double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["fl.method=fedpgp", "prompt.csc=true"], "prompt.csc=false"),
        (["fl.method=fedotp", "fl.aggregation=fedprox"], "fl.aggregation=fedavg or uniform"),
        (["fl.method=fedotp", "fedotp.eps=0"], "fedotp.eps"),
        (["fl.method=fedpgp", "fedpgp.rank=0"], "fedpgp.rank"),
        (["fl.partition=pathological_fedotp", "data.shots=0"], "data.shots >= 1"),
        (["fl.partition=pathological_fedotp", "data.subsample_classes=new"], "not new"),
    ],
)
def test_bad_personal_settings_are_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        task.check_config(load_config(None, args, base=task.FEDERATED_BASE))


@pytest.fixture
def no_model_builds(monkeypatch):
    """Building an open_clip model (what loading one starts with) fails the test."""
    import open_clip

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built: the check should read the towers on the meta device")

    monkeypatch.setattr(open_clip, "create_model", refuse)
    monkeypatch.setattr(open_clip, "create_model_and_transforms", refuse)


def test_fedotp_refuses_a_tower_without_patch_tokens_before_any_simulation(tmp_path, no_model_builds):
    """From the towers built on the meta device (no model, no weights): a ResNet has no tokens, and
    RN50 with OpenAI's tag is refused without its weights being looked for."""
    from coop.model.errors import ModelError

    tiny = json.loads(TINY_CONFIG.read_text())
    resnet = {
        **tiny,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "patch_size": None},
    }
    (tmp_path / "tiny-rn.json").write_text(json.dumps(resnet))
    for model, pretrained in [(tmp_path / "tiny-rn.json", "none"), ("RN50", "openai")]:
        args = ["fl.method=fedotp", f"model.name={model}", f"model.pretrained={pretrained}"]
        name = Path(str(model)).stem
        with pytest.raises(ModelError) as e:
            task.check_config(load_config(None, args, base=task.FEDERATED_BASE))
        assert str(e.value) == (
            f"fl.method=fedotp matches prompts to the image tower's patch tokens, and model {name}'s image "
            "tower is a ResNet (a CNN): it has no tokens, so it takes no vision prompts (CLIP-LoRA runs "
            "with lora.towers=[text])"
        )
    ok = ["fl.method=fedotp", f"model.name={TINY_CONFIG}", "model.pretrained=openai"]  # no such weights
    task.check_config(load_config(None, ok, base=task.FEDERATED_BASE))  # a ViT: accepted, nothing built


@pytest.mark.parametrize(
    "name, method, partition",
    [
        ("fedotp_fewshot", "fedotp", "pathological_fedotp"),
        ("fedotp_cifar100", "fedotp", "dirichlet_labeldir100"),
        ("fedpgp_base2novel", "fedpgp", "pathological_fedotp"),
    ],
)
def test_recipes_are_valid_configs(name, method, partition):
    from conftest import REPO

    cfg = load_config(str(REPO / "configs" / "federated" / f"{name}.yaml"), [], base=task.FEDERATED_BASE)
    task.check_config(cfg)
    assert (cfg.fl.method, cfg.fl.partition, cfg.fl.lr_schedule, cfg.train.lr) == (
        method,
        partition,
        "constant",
        0.001,
    )


def test_round_summary_final_last5_and_max():
    rows = [{"local_accuracy": v, "base_accuracy": None} for v in (10.0, 50.0, 20.0, 30.0, 40.0, 35.0)]
    out = round_summary(rows)
    assert out["local_accuracy"] == 35.0 and out["local_accuracy_max_test_selected"] == 50.0
    assert out["local_accuracy_last5_mean"] == pytest.approx(35.0)
    assert out["local_accuracy_last5_std"] == pytest.approx(float(np.std([50, 20, 30, 40, 35])))  # ddof 0
    assert "base_accuracy" not in out


# ---------------------------------------------------------------- end to end, in process

BASE = [
    f"model.name={TINY_CONFIG}",
    "model.pretrained=none",
    "data.name=imagefolder",
    "data.shots=2",
    "data.num_workers=0",
    "device=cpu",
    "train.batch_size=2",
    "train.precision=fp32",
    "train.lr=0.01",
    "fl.clients=2",
    "fl.partition=pathological_fedotp",
    "fl.lr_schedule=constant",
]
ROUNDS = 3


PERSONAL_KEYS = {"fedpgp": {"U", "V"}, "fedotp": {"local.ctx"}}
GLOBAL_KEYS = {"fedpgp": {"sigma"}, "fedotp": {"global.ctx"}}


def client_personal(folder: Path, k: int) -> dict:
    """Client k's personal tensors of the version the server's checkpoint names, from its state file."""
    rnd = torch.load(folder / "checkpoint.pt", weights_only=True)["strategy"]["personal_round"][k]
    path = folder / "clients" / f"client{k}" / f"personal_round{rnd}.pt"
    return torch.load(path, weights_only=True)["tensors"]


@pytest.fixture(scope="module")
def four_classes(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("four"), classes=("r", "g", "b", "y"), n_train=5, n_test=3
    )


@pytest.fixture(scope="module")
def personal_runs(four_classes, tmp_path_factory):
    """FedPGP base-to-novel and FedOTP, 2 clients, 3 rounds, fraction 0.5 after round 1."""
    runs = {}
    for method, extra in (("fedpgp", ["data.subsample_classes=base", "fedpgp.rank=2"]), ("fedotp", [])):
        overrides = [*BASE, f"data.root={four_classes}", f"fl.method={method}", f"fl.rounds={ROUNDS}",
                     "fl.fraction=0.5", "prompt.n_ctx=4", *extra]  # fmt: skip
        folder, grid = tmp_path_factory.mktemp(method) / "run", LocalGrid(2)
        runs[method] = (folder, overrides, run_inprocess(folder, overrides, grid), grid)
    return runs


def direct_metrics(folder: Path) -> dict:
    """Local/Base/Novel/global of the final round, by hand, from the checkpoint's global tensors and
    the clients' state files."""
    from omegaconf import OmegaConf

    from coop.data import build_dataset, subsample_classes
    from coop.model.weights import load_clip

    cfg = OmegaConf.load(folder / "config.yaml")
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    part = json.loads((folder / "partition.json").read_text())
    clip = load_clip(cfg.model.name, pretrained="none")
    ds = task.load_data(cfg)
    method = task.build_method(clip, ds.classnames, cfg)
    tokens = method.image_tokens
    feats, labels = task.features(cfg, clip, ds.test, "cpu", train=False, what="t", tokens=tokens)
    personal = [client_personal(folder, k) for k in range(len(part["client_test"]))]

    def acc(m, x, y):
        with torch.no_grad():
            return 100.0 * float((m.logits(x).argmax(-1) == y).float().mean())

    out = {"local": [], "base": [], "novel": []}
    novel = None
    if cfg.data.subsample_classes == "base":
        nds = subsample_classes(build_dataset(cfg.data.name, cfg.data.root, shots=0, seed=1), "new")
        novel = task.build_method(clip, nds.classnames, cfg)
        nfeats, nlabels = task.features(cfg, clip, nds.test, "cpu", train=False, what="n", tokens=tokens)
    for k, test_idx in enumerate(part["client_test"]):
        tensors = {**ckpt["prompt"], **personal[k]}
        method.load_learnable(tensors, ds.classnames)
        idx = torch.tensor(test_idx)
        out["local"].append(acc(method, feats[0][idx], labels[idx]))
        out["base"].append(acc(method, feats[0], labels))
        if novel is not None:
            novel.load_learnable(tensors, ds.classnames)
            out["novel"].append(acc(novel, nfeats[0], nlabels))
    method.load_learnable({**ckpt["prompt"], **personal[0]}, ds.classnames)
    method.global_only = True
    out["global"] = acc(method, feats[0], labels)
    return out


@pytest.mark.parametrize("method", ["fedpgp", "fedotp"])
def test_personalised_metrics_equal_a_direct_computation(personal_runs, method):
    folder, _, metrics, _ = personal_runs[method]
    rows = list(csv.DictReader((folder / "history.csv").open()))
    assert [int(r["sampled"]) for r in rows] == [2, 1, 1]  # round 1: every client, then fl.fraction
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert set(ckpt["prompt"]) == GLOBAL_KEYS[method]
    p0, p1 = (client_personal(folder, k) for k in (0, 1))
    assert set(p0) == set(p1) == PERSONAL_KEYS[method]
    assert any(not torch.equal(p0[k], p1[k]) for k in PERSONAL_KEYS[method])  # each client its own part

    direct = direct_metrics(folder)
    assert metrics["local_accuracy"] == pytest.approx(sum(direct["local"]) / 2, abs=1e-3)
    assert metrics["local_per_client"] == pytest.approx(direct["local"], abs=1e-3)
    assert metrics["global_accuracy"] == pytest.approx(direct["global"], abs=1e-3)
    assert metrics["accuracy"] == pytest.approx(direct["global"], abs=1e-3)
    assert float(rows[-1]["local_accuracy"]) == pytest.approx(metrics["local_accuracy"], abs=1e-3)
    local = [float(r["local_accuracy"]) for r in rows]
    assert metrics["local_accuracy_last5_mean"] == pytest.approx(float(np.mean(local)), abs=1e-3)
    assert metrics["local_accuracy_last5_std"] == pytest.approx(float(np.std(local)), abs=1e-3)
    assert metrics["local_accuracy_max_test_selected"] == pytest.approx(max(local), abs=1e-3)
    assert "(test-set selection, as the originals print it; not used)" in (folder / "log.txt").read_text()
    if method == "fedpgp":
        b, n, lo = sum(direct["base"]) / 2, sum(direct["novel"]) / 2, metrics["local_accuracy"]
        assert metrics["base_accuracy"] == pytest.approx(b, abs=1e-3)
        assert metrics["novel_accuracy"] == pytest.approx(n, abs=1e-3)
        assert metrics["hm"] == pytest.approx(
            3 / (1 / lo + 1 / b + 1 / n) if min(lo, b, n) > 0 else 0, abs=1e-3
        )
        assert metrics["hm_base_novel"] == pytest.approx(2 * b * n / (b + n) if b * n else 0, abs=1e-3)
    else:
        assert "base_accuracy" not in metrics and rows[-1]["novel_accuracy"] == ""


def history_rows(folder: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k != "time_s"} for r in csv.DictReader((folder / "history.csv").open())
    ]


@pytest.mark.parametrize("method", ["fedpgp", "fedotp"])
def test_crash_inside_a_round_resumes_to_the_same_tensors(personal_runs, tmp_path, method):
    ref_folder, overrides, ref, _ = personal_runs[method]
    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # killed inside round 1, after client 0 trained
        run_inprocess(folder, overrides, LocalGrid(2, crash=("train", 1)))
    assert (
        not (folder / "checkpoint.pt").exists() and (folder / "clients/client0/personal_round1.pt").is_file()
    )
    grid = LocalGrid(2, crash=("train", 3))  # restarted clients; killed once round 2's client trained
    with pytest.raises(KeyboardInterrupt):
        run_inprocess(folder, overrides, grid)
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert ckpt["round"] == 1 and ckpt["strategy"]["personal_round"] == {0: 1, 1: 1}
    stale = int(grid.seen[-1]["config"]["personal-round"]), grid.seen[-1]["node"] - 1
    assert stale[0] == 1 and (folder / f"clients/client{stale[1]}/personal_round2.pt").is_file()  # not used
    with pytest.raises(KeyboardInterrupt):  # the server alone restarts (the nodes' Context.state
        # holds round 2 for that client); killed during round 3's evaluation
        run_inprocess(folder, overrides, LocalGrid(2, crash=("evaluate", 3), contexts=grid.contexts))
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["round"] == 2
    metrics = run_inprocess(folder, overrides, LocalGrid(2))
    ours, theirs = (torch.load(f / "checkpoint.pt", weights_only=True) for f in (folder, ref_folder))
    for key in theirs["prompt"]:
        assert torch.equal(ours["prompt"][key], theirs["prompt"][key]), key
    assert ours["strategy"]["personal_round"] == theirs["strategy"]["personal_round"]
    for k in (0, 1):
        mine, ref_tensors = client_personal(folder, k), client_personal(ref_folder, k)
        assert set(mine) == PERSONAL_KEYS[method]
        for key, t in ref_tensors.items():
            assert torch.equal(mine[key], t), (k, key)
    assert {k: v for k, v in metrics.items() if "accuracy" in k or k == "local_per_client"} == {
        k: v for k, v in ref.items() if "accuracy" in k or k == "local_per_client"
    }
    assert history_rows(folder) == history_rows(ref_folder)


@pytest.mark.parametrize("method", ["fedpgp", "fedotp"])
def test_personal_tensors_never_travel_and_the_checkpoint_names_their_version(personal_runs, method):
    from omegaconf import OmegaConf

    from coop.federated.client import client_config, client_data
    from coop.model.weights import load_clip

    folder, _, _, grid = personal_runs[method]
    trains = [s for s in grid.seen if s["phase"] == "train"]
    evals = [s for s in grid.seen if s["phase"] == "evaluate"]
    assert len(trains) == 4 and len(evals) == 2 * ROUNDS  # round 1: both clients; every round: all evaluate
    for s in trains + evals:
        assert s["down"] == GLOBAL_KEYS[method]  # the server sends the global tensors only
        assert s["up"] <= GLOBAL_KEYS[method]  # and gets the global tensors (or nothing) back
    last: dict[int, int] = {}  # the version each client holds, from the message log alone
    for s in grid.seen[2:]:  # after the two QUERY messages
        pid = s["node"] - 1
        assert s["config"]["personal-round"] == last.get(pid, 0), s
        if s["phase"] == "train":
            last[pid] = s["config"]["server-round"]
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert ckpt["strategy"]["personal_round"] == last
    for pid in (0, 1):  # a client deletes only the files older than the version it last loaded
        loaded = [s["config"]["personal-round"] for s in trains if s["node"] == pid + 1][-1]
        files = sorted(p.name for p in (folder / "clients" / f"client{pid}").iterdir())
        assert files == sorted(f"personal_round{r}.pt" for r in {loaded, last[pid]} - {0})

    def tensor_paths(obj, path=()):  # every tensor anywhere in the checkpoint
        if isinstance(obj, torch.Tensor):
            return [path]
        items = (
            obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
        )
        return [p for k, v in items for p in tensor_paths(v, (*path, k))]

    assert sorted(tensor_paths(ckpt)) == sorted(("prompt", k) for k in GLOBAL_KEYS[method])
    # every client, and the server, start the personal part from the same initial value
    cfg = OmegaConf.load(folder / "config.yaml")
    clip = load_clip(cfg.model.name, pretrained="none")
    server = task.build_method(clip, task.load_data(cfg).classnames, cfg).learnable()
    clients = [client_data(client_config(OmegaConf.to_yaml(cfg), {}), k).initial for k in (0, 1)]
    for key in PERSONAL_KEYS[method]:
        assert torch.equal(clients[0][key], server[key]) and torch.equal(clients[1][key], server[key])


def test_personal_store_refuses_another_runs_file_and_prunes_only_older_rounds(tmp_path):
    from flwr.app import RecordDict

    from coop.federated.client_state import PersonalStateError, PersonalStore

    initial = {"U": torch.zeros(2, 3)}
    writer = PersonalStore(RecordDict(), tmp_path, 0, "run-a")
    for rnd in (1, 2, 3):
        writer.save(rnd, {"U": torch.full((2, 3), float(rnd))})
    assert torch.equal(writer.load(3, initial)["U"], torch.full((2, 3), 3.0))  # Context.state
    restarted = PersonalStore(RecordDict(), tmp_path, 0, "run-a")  # a new process: the files
    assert torch.equal(restarted.load(2, initial)["U"], torch.full((2, 3), 2.0))
    assert torch.equal(writer.load(1, initial)["U"], torch.ones(2, 3))  # not the newer Context.state
    assert torch.equal(restarted.load(0, initial)["U"], initial["U"])
    restarted.prune(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["personal_round2.pt", "personal_round3.pt"]
    with pytest.raises(PersonalStateError, match="is not client 1's round 2 of this run"):
        PersonalStore(RecordDict(), tmp_path, 1, "run-a").load(2, initial)
    with pytest.raises(PersonalStateError, match="is not client 0's round 3 of this run"):
        PersonalStore(RecordDict(), tmp_path, 0, "run-b").load(3, initial)


def test_a_missing_state_file_is_one_line_naming_client_round_and_path(personal_runs, tmp_path):
    import shutil

    from coop.federated.server import FederatedError

    _, overrides, _, _ = personal_runs["fedpgp"]
    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # round 1 checkpointed, then killed inside round 2
        run_inprocess(folder, overrides, LocalGrid(2, crash=("train", 3)))
    shutil.rmtree(folder / "clients")
    message = (
        r"round 2: every sampled client failed \(first: client (\d): PersonalStateError: no personal "
        r"tensors of round 1 at \S+/clients/client\1/personal_round1\.pt"
    )
    with pytest.raises(FederatedError, match=message):
        run_inprocess(folder, overrides, LocalGrid(2))


def test_a_checkpoint_of_another_partition_is_not_resumed(personal_runs, tmp_path):
    """A run resumed after the partition rule or the data changed stops with one line, before
    partition.json is rewritten."""
    from coop.federated.server import FederatedError

    _, overrides, _, _ = personal_runs["fedpgp"]
    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # round 1 checkpointed, then killed inside round 2
        run_inprocess(folder, overrides, LocalGrid(2, crash=("train", 3)))
    ckpt = torch.load(folder / "checkpoint.pt", weights_only=True)
    torch.save({**ckpt, "partition_digest": "0" * 64}, folder / "checkpoint.pt")
    before = (folder / "partition.json").read_text()
    (folder / "partition.json").write_text("old")
    with pytest.raises(FederatedError, match=r"checkpoint\.pt was trained on another partition"):
        run_inprocess(folder, overrides, LocalGrid(2))
    assert (folder / "partition.json").read_text() == "old"
    torch.save(ckpt, folder / "checkpoint.pt")  # the same partition resumes
    run_inprocess(folder, overrides, LocalGrid(2))
    assert (folder / "partition.json").read_text() == before


def test_collect_personal_table(personal_runs, tmp_path, capsys):
    import shutil

    from conftest import REPO, run_tool_in_process

    for method, (folder, _, _, _) in personal_runs.items():
        shutil.copytree(folder, tmp_path / "runs" / method)
    proc = run_tool_in_process(REPO / "tools" / "collect.py", [str(tmp_path / "runs"), "--table", "personal"])
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "runs" / "results_personal.csv").open() as f:
        table = {r["fl.method"]: r for r in csv.DictReader(f)}
    for method, (_, _, metrics, _) in personal_runs.items():
        row = table[method]
        assert float(row["local_accuracy_mean"]) == pytest.approx(metrics["local_accuracy"])
        assert float(row["local_accuracy_last5_mean_mean"]) == pytest.approx(
            metrics["local_accuracy_last5_mean"]
        )
    assert math.isnan(float(table["fedotp"]["novel_accuracy_mean"] or "nan"))
    assert float(table["fedpgp"]["novel_accuracy_mean"]) == pytest.approx(
        personal_runs["fedpgp"][2]["novel_accuracy"]
    )

"""The text methods on a tiny model of every open_clip family, offline, with tiny local tokenizers.

configs/models/*-tiny.json shrink open_clip's own config of one model per family (2 text layers,
width 64; the image tower of the same kind: timm's smallest variant of the family's timm tower,
here with 2 blocks at 4x4 patches, or a 1-block ViT; the Hugging Face text towers: RoBERTa, XLM-R, mT5 and NLLB encoders of 2 layers,
width 32, their transformers config inline). Each method trains two steps on the family's own image features (open_clip's
`encode_image` for timm, FastViT and CoCa towers); CoOp's prompts are checked against the tower's
`encode_text` of the same token sequence; one `tools/train.py` run per family trains CoOp end to end.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from conftest import REPO, build_family, run_tool_in_process, shrunk_timm, small_timm_config, tiny_args

import coop
from coop.config.load import load_config
from coop.methods import build_method
from coop.model.prompt import PromptLearner
from coop.model.tokenizer import PromptTokenizer

pytest.importorskip("transformers")
from coop.model.tiny_tokenizers import make_tiny_tokenizer, unigram, wordpiece  # noqa: E402

# family: (config stem, whether it needs a tiny tokenizer: False for CLIP's BPE)
FAMILIES = {
    "siglip": ("siglip-tiny", True),
    "eva02": ("eva02-tiny", False),
    "pe-core": ("pe-core-tiny", False),
    "metaclip2": ("metaclip2-tiny", True),
    "clipa": ("clipa-tiny", True),
    "mobileclip-s": ("mobileclip-s-tiny", False),
    "coca": ("coca-tiny", False),
    # Hugging Face text towers (coop.model.text_hf), the transformers config inline
    "roberta": ("roberta-tiny", True),
    "xlmr": ("xlmr-tiny", True),
    "mt5": ("mt5-tiny", True),
    "nllb": ("nllb-tiny", True),
}
CLASSES = ["dog", "golden_retriever", "crane (bird)"]
# family: image size of its timm tower here, at 4x4 patches with 2 blocks (`shrunk_timm`): the
# family's kind of tower (RoPE, a class token or none, its pooling) without 12 blocks at 224-384 pixels
SMALL_TIMM = {"siglip": 64, "eva02": 56, "pe-core": 64}

# method: config overrides (text methods; CoOp's positions, CSC, deep prompts, ctx_init)
METHODS = {
    "coop-end": ["method=coop", "prompt.n_ctx=4"],
    "coop-middle": ["method=coop", "prompt.n_ctx=4", "prompt.position=middle"],
    "coop-front-csc": ["method=coop", "prompt.n_ctx=4", "prompt.position=front", "prompt.csc=true"],
    "coop-deep": ["method=coop", "prompt.n_ctx=4", "prompt.depth=2"],
    "coop-init": ["method=coop", "prompt.ctx_init=a photo of a"],
    "cocoop": ["method=cocoop", "prompt.n_ctx=4"],
    "kgcoop": ["method=kgcoop", "prompt.n_ctx=4"],
    "tcp": ["method=tcp", "tcp.layer=1"],
    "dept": ["method=coop", "dept.enabled=true", "prompt.n_ctx=4"],
    "clip_lora": ["method=clip_lora", "lora.towers=[text]", "lora.dropout=0"],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(config path, tokenizer directory or None, our CLIP, open_clip's model): random weights,
    the text tower's LayerNorms and biases randomised so that no term hides."""
    stem, tiny = FAMILIES[request.param]
    config = REPO / "configs" / "models" / f"{stem}.json"
    if request.param in SMALL_TIMM:
        config = small_timm_config(config, tmp_path_factory.mktemp("config"), SMALL_TIMM[request.param])
    tok = tmp_path_factory.mktemp("tok") / "tok" if tiny else None
    if tiny:
        make_tiny_tokenizer(config, tok)  # tools/make_tokenizer.py's
    with shrunk_timm(**trunk(config)):
        clip, oc = build_family(config, tok)
    return config, tok, clip, oc


def trunk(config) -> dict:
    """`shrunk_timm`'s arguments for the family's model config `config` (none for the other towers)."""
    for name, size in SMALL_TIMM.items():
        if config.stem == f"{FAMILIES[name][0]}-{size}":
            return {"depth": 2, "img_size": size}
    return {}


def images(clip, n: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, clip.image_size, clip.image_size, generator=gen)


@pytest.fixture(scope="module")
def family_features(family):
    """6 images and the family's image features of them, encoded once per family (the image towers
    cost most of a text method's test), with a copy of the model's state that the
    tests sharing the model check it against."""
    clip = family[2]
    x = images(clip)
    with torch.no_grad():
        feats = clip.encode_image(x)
    return x, feats, state(clip)


def state(module: torch.nn.Module) -> dict:
    """What a method could change in a frozen model it is given: tensors, modes, flags and hooks."""
    return {
        "tensors": {k: v.clone() for k, v in module.state_dict().items()},
        "modes": [(n, type(m).__name__, m.training) for n, m in module.named_modules()],
        "grad": [(n, p.requires_grad) for n, p in module.named_parameters()],
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in module.named_modules()],
    }


def assert_unchanged(module: torch.nn.Module, before: dict) -> None:
    now = state(module)
    assert now["tensors"].keys() == before["tensors"].keys()
    changed = [k for k, v in before["tensors"].items() if not torch.equal(v, now["tensors"][k])]
    assert not changed, changed
    for what in ("modes", "grad", "hooks"):
        assert now[what] == before[what], what


@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_text_method_trains(family, family_features, method_name):
    """Two SGD steps: the loss is finite and every learned tensor moves; the model the methods share
    is left as it was. CoCoOp's meta-net has E // 16 = 2 hidden units on these tiny models (E = 32),
    and their random towers' image features are nearly parallel (cosine > 0.9): about one
    initialisation in five has both ReLUs off for all 6 images, and then `meta_net.linear1` and
    `meta_net.linear2.weight` get no gradient, in CoCoOp's own code too. The seed draws live units."""
    x, feats, before = family_features
    lora = method_name == "clip_lora"  # CLIP-LoRA attaches its adapters to the tower it is given
    clip = copy.deepcopy(family[2]) if lora else family[2]
    torch.manual_seed(0)  # the learned tensors' initialisation, whatever ran before
    method = build_method(clip, CLASSES, load_config(None, METHODS[method_name]))
    assert feats.shape == (len(x), clip.embed_dim) and bool(feats.isfinite().all())
    trains_two_steps(method, x if lora else feats)  # CLIP-LoRA takes images
    if not lora:
        assert_unchanged(clip, before)


def trains_two_steps(method, inputs: torch.Tensor) -> None:
    """Two SGD steps of `method` on `inputs` (features or images): the loss is finite, every learned
    tensor moves (or gets a gradient at the second step) and no CLIP weight gets a gradient."""
    labels = torch.arange(len(inputs)) % len(method.classnames)
    before = {k: v.detach().clone() for k, v in method.learnable().items()}
    params = [p for p in method.parameters() if p.requires_grad]
    assert before and params
    opt = torch.optim.SGD(params, lr=0.5)
    method.train()
    for _ in range(2):
        loss = method.loss(inputs, labels)[0]
        assert bool(torch.isfinite(loss)), method.name
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is None for p in method.clip.parameters()), (
        f"{method.name}: a frozen weight has a gradient"
    )
    after = method.learnable()
    # A tensor that got a gradient at the second step but did not move: its step is below float
    # resolution. CLIP-LoRA's A matrices start with B = 0 and so get their first gradient then; on
    # the tiny Hugging Face towers (attention nearly uniform at transformers' init) q and k's are ~1e-10.
    learning = [k for k in before if after[k].grad is not None and bool(after[k].grad.any())]
    moved = [k for k in before if not torch.equal(before[k], after[k].detach()) or k in learning]
    assert moved == list(before), f"{method.name}: {set(before) - set(moved)} did not move"


def test_zeroshot_is_open_clips_features(family):
    _, _, clip, oc = family
    cfg = load_config(None, ["method=zeroshot", "zeroshot.templates=a photo of a {}."])
    method = build_method(clip, CLASSES, cfg)
    with torch.no_grad():
        text = method.prepare()
        ref = oc.encode_text(clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES]))
    torch.testing.assert_close(text, torch.nn.functional.normalize(ref, dim=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ["end", "middle", "front"])
def test_coop_prompts_are_open_clips_encode_text_of_their_tokens(family, position):
    """Context vectors set to the embeddings of 4 real tokens: the prompt features equal open_clip's
    `encode_text` of the token sequence with those tokens at the context slots, padded to the
    context length. (Deep prompts replace hidden states inside the tower: no token sequence gives
    them; tests/test_text_families.py checks them against the full-sequence blocks.)"""
    _, _, clip, oc = family
    pt = PromptTokenizer(clip.tokenizer)
    learner = PromptLearner(clip, CLASSES, n_ctx=4, position=position)
    words = torch.tensor(pt.encode("a photo of the")[:4])
    assert len(words) == 4
    with torch.no_grad():
        learner.ctx.copy_(clip.text.token_embedding(words))
        ours = coop.PromptClassifier(clip, learner).text_features()
        ids = learner.token_ids.scatter(1, learner.slots, words.expand(len(CLASSES), -1))
        full = torch.full((len(ids), clip.context_length), pt.pad_id, dtype=ids.dtype)
        full[:, : ids.shape[1]] = ids
        ref = oc.encode_text(full, normalize=False)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_coop_run_end_to_end(family, image_folder, tmp_path):
    """tools/train.py (in-process) trains CoOp with deep prompts on the family's model, offline."""
    path, tok, _, _ = family
    extra = {"model.name": path, "train.epochs": 2, "train.warmup_epochs": 0, "train.batch_size": 6}
    if tok is not None:
        extra["model.tokenizer"] = tok
    out = tmp_path / "run"
    args = tiny_args(image_folder, out, **extra) + ["prompt.n_ctx=4", "prompt.depth=2"]
    with shrunk_timm(**trunk(path)):
        res = run_tool_in_process(REPO / "tools" / "train.py", args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "checkpoint.pt").exists()


@pytest.mark.parametrize(
    "family", ["clipa", "mobileclip-s", "siglip", "roberta", "mt5", "nllb"], indirect=True
)
@pytest.mark.parametrize("position", ["end", "middle"])
def test_cocoop_on_towers_without_the_cut(family, position):
    """Where nothing can be shared (a tower that is not causal, a Hugging Face encoder), CoCoOp runs
    each image's prompts whole, [SOS] included: the features of running them through
    `encode_embeddings`."""
    _, _, clip, _ = family
    assert not clip.text.cuts  # causal towers share the prefix: tests/test_cocoop.py
    cfg = load_config(None, ["method=cocoop", "prompt.n_ctx=4", f"prompt.position={position}"])
    method = build_method(clip, CLASSES, cfg)
    img = torch.randn(2, clip.embed_dim, generator=torch.Generator().manual_seed(1))
    pl = method.prompt_learner
    with torch.no_grad():
        pl.ctx.normal_()
        ours = method.text_features(img)  # (B, n_cls, E)
        shift = method.meta_net(torch.nn.functional.normalize(img, dim=-1))
        for b in range(2):
            prompts, _ = pl(pl.ctx + shift[b])
            ref = clip.text.encode_embeddings(prompts, pl.eos)
            torch.testing.assert_close(ours[b], ref, rtol=1e-5, atol=1e-5)


def test_eval_export_classifier_predict_on_a_siglip_run(image_folder, tmp_path, monkeypatch):
    """A CoOp run on the SigLIP-family model (a tower without the cut, its own tokenizer, a timm
    image tower, here with 2 blocks at 4x4 patches): tools/eval.py, export, load_classifier and
    tools/predict.py work on it and agree, also once its tokenizer directory has moved (as on another
    machine), given its new place."""
    import functools
    import json

    import timm

    from coop.data.images import load_image
    from coop.interop import export_run
    from coop.model.tokenizer import TokenizerError
    from coop.train.checkpoint import load_checkpoint, save_checkpoint

    tok = unigram(tmp_path / "tok", pad="</s>")
    out = tmp_path / "run"
    config = small_timm_config(REPO / "configs" / "models" / "siglip-tiny.json", tmp_path, 64)
    monkeypatch.setattr(timm, "create_model", functools.partial(timm.create_model, **trunk(config)))
    extra = {"model.name": config, "model.tokenizer": tok}
    extra.update({"train.epochs": 2, "train.warmup_epochs": 0, "train.batch_size": 6})
    res = run_tool_in_process(REPO / "tools" / "train.py", tiny_args(image_folder, out, **extra))
    assert res.returncode == 0, res.stderr[-2000:]
    moved = tok.rename(tmp_path / "moved")  # the run's saved model.tokenizer no longer exists
    exported = export_run(out, tmp_path / "prompts.safetensors")
    csv = tmp_path / "predictions.csv"
    calls = {
        "eval.py": [out / "checkpoint.pt", "device=cpu"],
        "predict.py": [exported, image_folder / "test", "--out", csv, "--device", "cpu"],
    }
    for tool, args in calls.items():  # without --tokenizer: one line that names it
        res = run_tool_in_process(REPO / "tools" / tool, args)
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.count("\n") == 1 and f"model.tokenizer={tok}: no such directory" in res.stderr
        assert "--tokenizer DIR" in res.stderr, tool
    with pytest.raises(TokenizerError, match="no such directory"):
        coop.load_classifier(exported)
    res = run_tool_in_process(REPO / "tools" / "eval.py", [*calls["eval.py"], "--tokenizer", moved])
    assert res.returncode == 0, res.stderr[-2000:]
    accuracy = json.loads((out / "metrics.json").read_text())["accuracy"]
    assert json.loads(res.stdout)["accuracy"] == pytest.approx(accuracy)
    clf = coop.load_classifier(exported, tokenizer=moved)
    paths = sorted((image_folder / "test").glob("*/*.png"))
    images = torch.stack([clf.transform(load_image(p)) for p in paths])
    labels = torch.tensor([clf.classnames.index(p.parent.name) for p in paths])
    probs = clf.predict(images)
    assert 100.0 * float((probs.argmax(-1) == labels).float().mean()) == pytest.approx(accuracy)
    res = run_tool_in_process(REPO / "tools" / "predict.py", [*calls["predict.py"], "--tokenizer", moved])
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(csv.read_text().splitlines()) == len(paths) + 1

    # Another model's tokenizer that fits the tower (BERT-like; the tower pools the last position):
    # the run and the export recorded theirs, so eval, predict and load_classifier refuse it.
    other = wordpiece(tmp_path / "other")
    refusal = "not the one {} was trained with (vocab_size 88 here, 103 there)"
    for tool, args in calls.items():
        res = run_tool_in_process(REPO / "tools" / tool, [*args, "--tokenizer", other])
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
        assert refusal.format(args[0]) in res.stderr, tool
    with pytest.raises(TokenizerError, match=re.escape(refusal.format(out))):
        coop.load_classifier(out, tokenizer=other)
    res = run_tool_in_process(REPO / "tools" / "eval.py", [*calls["eval.py"], "--tokenizer", ""])
    assert res.returncode == 2 and res.stderr.startswith("error: model.tokenizer= is empty"), res.stderr
    with pytest.raises(TokenizerError, match="^model.tokenizer is empty"):
        coop.load_classifier(exported, tokenizer="")
    # A run from before runs recorded their tokenizer: a warning, and the same accuracy.
    ckpt = load_checkpoint(out / "checkpoint.pt", training_state=True)
    del ckpt["tokenizer"]
    save_checkpoint(out / "checkpoint.pt", ckpt)
    res = run_tool_in_process(REPO / "tools" / "eval.py", [*calls["eval.py"], "--tokenizer", moved], log=True)
    assert res.returncode == 0 and json.loads(res.stdout)["accuracy"] == pytest.approx(accuracy)
    assert "does not record its tokenizer (made before coop recorded it)" in res.stderr


@pytest.mark.filterwarnings("ignore:'penalty' was deprecated:FutureWarning")
def test_feature_methods_on_the_towers_image_features(family):
    """The linear probe, Tip-Adapter and Tip-Adapter-F on the family's own image features (open_clip's
    `encode_image` for timm, FastViT and CoCa towers): fitted, tuned on a val set, and (-F) trained."""
    _, _, clip, _ = family
    x = images(clip, 12)
    with torch.no_grad():
        feats = clip.encode_image(x)
    labels = torch.arange(12) % len(CLASSES)
    train, val = (feats[None, :6], labels[:6]), (feats[6:], labels[6:])
    for name in ("linear_probe", "tip_adapter", "tip_adapter_f"):
        method = build_method(clip, CLASSES, load_config(None, [f"method={name}"]))
        method.fit(train)
        chosen = method.tune(train, val)
        assert "val_accuracy" in chosen, name
        with torch.no_grad():
            logits = method.logits(feats[6:], method.prepare())
        assert logits.shape == (6, len(CLASSES)) and bool(logits.isfinite().all()), name
    before = method.adapter.detach().clone()  # Tip-Adapter-F's keys train
    opt = torch.optim.SGD([method.adapter], lr=0.5)
    loss = method.loss(feats[:6], labels[:6])[0]
    loss.backward()
    opt.step()
    assert bool(torch.isfinite(loss)) and not torch.equal(before, method.adapter.detach())


@pytest.mark.parametrize("family", ["metaclip2"], indirect=True)
def test_mmrl_trains_on_metaclip2(family):
    """MetaCLIP 2: mT5's tokenizer (no [SOS], the text tokens enter at position 0, before block 2)
    and open_clip's ViT, which our image tower reproduces: two steps on images."""
    clip = family[2]
    cfg = load_config(None, ["method=mmrl", "mmrl.layers=[2]", "mmrl.vision_layers=[1]", "mmrl.rep_dim=16"])
    torch.manual_seed(0)
    method = build_method(clip, CLASSES, cfg)
    assert method.n_sos == 0
    trains_two_steps(method, images(clip))


@pytest.mark.parametrize("family", ["siglip"], indirect=True)
def test_siglip_logit_bias_leaves_the_class_softmax_unchanged(family):
    """open_clip's SigLIP logits, logit_scale.exp() * cos + logit_bias, differ from ours (no bias) by
    one constant per image: the softmax over classes, and so the cross-entropy, are the same."""
    _, _, clip, oc = family
    texts = [f"a photo of a {c.replace('_', ' ')}." for c in CLASSES]
    method = build_method(
        clip, CLASSES, load_config(None, ["method=zeroshot", "zeroshot.templates=a photo of a {}."])
    )
    x = images(clip, 4)
    with torch.no_grad():
        img, txt, scale, bias = oc(x, clip.tokenize(texts))
        theirs = scale * img @ txt.T + bias
        ours = method.logits(clip.encode_image(x), method.prepare())
    assert float(bias.detach()) != 0 and not torch.allclose(theirs, ours, atol=1e-3)
    torch.testing.assert_close(theirs.softmax(-1), ours.softmax(-1), rtol=1e-5, atol=1e-6)

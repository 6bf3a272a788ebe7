"""CLIP-LoRA: logits and every adapter gradient against the reference (LoRA added to the weights,
full 77-token prompts, open_clip's modules), merged weights in open_clip's own forward, frozen
weights that never drift, dropout on the branch only, ViT-L-14's layer counts, the recipe and its
errors, precision, and a tiny run end to end (resumed with a DataLoader worker: bit-identical)."""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_CONFIG, interrupted_at, tiny_args
from test_image_encoder import build as build_openclip
from test_image_encoder import randomise, shrunk_config
from test_vision_language import WIDE_VISION

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import build_method
from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
from coop.model.clip import CLIP
from coop.model.errors import ModelError
from coop.model.lora import LoRAAdapters, LoRAError, resolve_layers
from coop.reference.clip_lora import clip_lora_logits
from coop.results.published import FEW_SHOT_16, lookup
from coop.train.evaluation import evaluate_checkpoint
from coop.train.runner import train_run
from coop.train.schedule import build_optimizer

CLASSES = ["red thing", "green_thing", "t-shirt"]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


@pytest.fixture(scope="module")
def models():
    """Random open_clip models and ours: a shrunk ViT-B-16 (vision width 128, text 64, QuickGELU
    off) and the tiny wide-vision config of the MaPLe tests (vision 128, text 64)."""
    vit_b = build_openclip(shrunk_config("ViT-B-16", layers=2, text_layers=2))
    torch.manual_seed(0)
    wide = randomise(open_clip.CLIP(**WIDE_VISION), seed=1)
    return {name: (oc, CLIP.from_openclip(oc, name=name)) for name, oc in (("vit-b", vit_b), ("wide", wide))}


def build(clip, *overrides: str, seed: int = 0, classes=CLASSES):
    torch.manual_seed(seed)
    cfg = load_config(None, ["method=clip_lora", f"model.name={TINY_CONFIG}", *overrides])
    return build_method(clip, classes, cfg)


def randomise_adapters(method, seed: int = 0) -> None:
    """A and B away from their initialisation (B = 0), so that every term and gradient matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in method.learnable().values():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))


# Class names that share their first word: the shared prefix reaches into them ("[SOS] a photo of
# a red"), and one name ends there, so the prefix stops at its [EOS].
SAME_START = ["red thing", "red", "red car"]
CASES = {
    "all": [],
    "same-start": [],
    "subset": ["lora.towers=[text]", "lora.targets=[q,v]", "lora.layers=[1]", "lora.rank=3", "lora.alpha=2"],
    "vision-half-up": ["lora.towers=[vision]", "lora.layers=half-up"],
}


@pytest.mark.parametrize("model, case", [("vit-b", c) for c in CASES] + [("wide", "all")])
def test_logits_and_every_gradient_match_the_reference(models, model, case):
    """The subsets (one tower, some targets, some blocks, other rank and alpha) on the shrunk ViT-B."""
    oc, clip = models[model]
    classes = SAME_START if case == "same-start" else CLASSES
    m = build(clip, *CASES[case], classes=classes)
    assert m.prefix == (6 if case == "same-start" else 5)
    m.eval()  # dropout off: the reference has none
    randomise_adapters(m)
    tensors = m.learnable()
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images, labels = torch.randn(2, 3, size, size, generator=gen), torch.tensor([0, 2])
    ids = clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in classes])  # (3, 77)
    scale = float(m.settings["lora_alpha"]) / m.settings["lora_rank"] ** 0.5
    ref = clip_lora_logits(oc, images, ids, tensors, scale)
    loss, ours = m.loss(images, labels)
    assert relative_error(ours, ref) < 1e-5
    ref_loss = F.cross_entropy(ref, labels)
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    names = list(tensors)
    our_grads = torch.autograd.grad(loss, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
    for name, a, b in zip(names, our_grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, name
    if case == "all" and model == "vit-b":  # grad checkpointing in both towers: the same gradients
        m.grad_checkpointing = clip.text.grad_checkpointing = True
        try:
            again = torch.autograd.grad(m.loss(images, labels)[0], list(tensors.values()))
        finally:
            m.grad_checkpointing = clip.text.grad_checkpointing = False
        for a, b in zip(again, our_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_what_is_adapted_and_learned(models):
    _, clip = models["vit-b"]
    m = build(clip)
    tensors = m.learnable()
    blocks = {"text": 2, "vision": 2}
    want = {f"{t}.{i}.{p}_{ab}" for t, n in blocks.items() for i in range(n) for p in "qkv" for ab in "AB"}
    assert set(tensors) == want
    width = {"text": 64, "vision": 128}
    for name, p in tensors.items():
        tower, _, rest = name.split(".")
        assert p.shape == ((2, width[tower]) if rest.endswith("_A") else (width[tower], 2)), name
    assert all(float(p.detach().abs().sum()) == 0 for n, p in tensors.items() if n.endswith("_B"))
    bound = (1 / 128) ** 0.5  # kaiming_uniform(a=sqrt(5)) on (r, W): U(-1/sqrt(W), 1/sqrt(W))
    a = tensors["vision.0.q_A"].detach()
    assert 0.5 * bound < float(a.abs().max()) <= bound
    # an untrained adapter (B = 0) is the frozen model: zero-shot CLIP's logits
    images = torch.randn(2, 3, clip.image_size, clip.image_size)
    with torch.no_grad():
        m.eval()
        m.adapters.detach()  # the frozen CLIP's own forward, on the full 77-token ids
        text = clip.encode_text(
            clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in CLASSES])
        )
        frozen = clip.encode_image(images)
        m.adapters.attach()
        zero_shot = clip.logit_scale.exp() * F.normalize(frozen, dim=-1) @ F.normalize(text, dim=-1).T
        torch.testing.assert_close(m.logits(images), zero_shot, rtol=1e-5, atol=1e-5)
    loss, _ = m.loss(images, torch.tensor([0, 1]))
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in clip.parameters())  # nothing of CLIP
    assert {n for n, p in m.named_parameters() if p.grad is not None} == {
        f"adapters.modules_of.{n}" for n in want
    }


def test_merged_weights_in_open_clips_forward_and_no_drift(models):
    """Evaluation unmerged equals the weights merged into open_clip's own model; training steps,
    train/eval switches and merging never change CLIP's frozen weights (the original's in-place
    merge and unmerge does: W + D - D is not W in floating point)."""
    oc, clip = models["wide"]
    frozen = {k: v.clone() for k, v in clip.state_dict().items()}
    m = build(clip)
    optimizer = build_optimizer(m.param_groups(), load_config(None, ["method=clip_lora"]).train)
    images, labels = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0])
    for _ in range(3):  # AdamW steps, in training mode (dropout on)
        m.train()
        loss, _ = m.loss(images, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        m.eval()
        with torch.no_grad():
            m.logits(images)
    assert all(float(p.detach().abs().sum()) > 0 for n, p in m.learnable().items() if n.endswith("_B"))
    merged = copy.deepcopy(oc)
    weights = m.adapters.merged_weights()  # one packed in_proj per adapted block: 3 text + 3 vision
    missing, unexpected = merged.load_state_dict(weights, strict=False)
    assert len(weights) == 6 and not unexpected and len(missing) == len(merged.state_dict()) - 6
    with torch.no_grad():
        ids = clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in CLASSES])
        text, image = merged.encode_text(ids), merged.encode_image(images)
        want = merged.logit_scale.exp() * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T
        ours = m.logits(images)
    assert relative_error(ours, want) < 1e-5
    after = clip.state_dict()
    assert set(after) == set(frozen) and all(torch.equal(after[k], v) for k, v in frozen.items())
    m.adapters.detach()  # the module's CLIP is shared with other tests


def test_dropout_acts_on_the_low_rank_branch_only(models):
    _, clip = models["wide"]
    m = build(clip, "lora.dropout=0.9")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        m.eval()
        untrained = m.logits(images)
        m.train()
        # B = 0: only the branch's input is dropped (training runs the text prefix per class: the
        # same function, another order of float sums)
        torch.testing.assert_close(m.logits(images), untrained, rtol=1e-5, atol=1e-5)
        randomise_adapters(m)
        m.eval()
        evaluated = m.logits(images)
        assert torch.equal(m.logits(images), evaluated)  # eval: deterministic, no dropout
        m.train()
        assert not torch.allclose(m.logits(images), evaluated)
        # one mask per target: equal q and k adapters give different q and k updates in training
        lora = next(module for _, _, module in m.adapters.named_adapters())
        lora.k_A.copy_(lora.q_A)
        lora.k_B.copy_(lora.q_B)
        d = lora.width
        delta = lora(torch.randn(4, 5, d))  # (4, 5, 3d)
        assert not torch.equal(delta[..., :d], delta[..., d : 2 * d])
        lora.eval()
        delta = lora(torch.randn(4, 5, d))
        assert torch.equal(delta[..., :d], delta[..., d : 2 * d])
    m.adapters.detach()


def test_vit_l_14_layer_counts_and_the_originals_tables():
    """ViT-L-14 (24 vision, 12 text blocks; widths shrunk): every block of both towers is adapted,
    and half-up / half-bottom give the original's ViT-L/14 and text index lists."""
    cfg = shrunk_config("ViT-L-14", layers=24, text_layers=12)
    oc = build_openclip(cfg)
    clip = CLIP.from_openclip(oc, name="ViT-L-14-small")
    assert (clip.visual.layers, len(clip.text.blocks)) == (24, 12)
    adapters = LoRAAdapters(clip, ["text", "vision"], ["q", "k", "v"], "all")
    counts = {t: len(adapters.modules_of[t]) for t in adapters.towers}
    assert counts == {"text": 12, "vision": 24} and len(adapters.tensors()) == (12 + 24) * 6
    assert resolve_layers("half-up", 24, "vision") == list(range(12, 24))
    assert resolve_layers("half-bottom", 24, "vision") == list(range(12))
    assert resolve_layers("half-up", 12, "text") == [6, 7, 8, 9, 10, 11]
    with pytest.raises(
        LoRAError, match=r"lora.layers=\[12\] must be distinct 0-based block indices of the text tower's 12"
    ):
        LoRAAdapters(clip, ["text"], ["q"], [12])


def test_recipe_names_and_errors(tmp_path):
    cfg = load_config(None, ["method=clip_lora"])
    t = cfg.train
    assert (t.optimizer, t.lr, t.weight_decay, list(t.betas), t.batch_size) == (
        "adamw",
        2e-4,
        1e-2,
        [0.9, 0.999],
        32,
    )
    assert (t.schedule, t.min_lr, t.warmup_epochs, t.iterations_per_shot, t.epochs) == (
        "cosine_iter",
        1e-6,
        0,
        500,
        None,
    )
    assert list(t.crop_scale) == [0.08, 1.0] and t.augment
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.layers) == (2, 1.0, 0.25, "all")
    assert run_name(cfg).split("/")[3] == "clip_lora_r2_a1_drop0.25_text+vision_qkv_all"
    assert load_config(None, ["method=clip_lora", "train.epochs=3"]).train.iterations_per_shot is None
    shipped = load_config(str(REPO / "configs" / "clip_lora" / "vit_b16.yaml"))
    cfg.data.name = "imagenet"
    assert shipped == cfg
    for override, match in (
        ("lora.rank=0", "lora.rank must be an integer >= 1"),
        ("lora.dropout=1.0", r"lora.dropout must be a number in \[0, 1\)"),
        (
            "lora.towers=[text,audio]",
            "lora.towers must be a non-empty list of distinct values of text, vision",
        ),
        ("lora.targets=[o]", "lora.targets must be a non-empty list of distinct values of q, k, v"),
        (
            "lora.layers=top",
            "lora.layers must be one of all, half-up, half-bottom or a non-empty list of distinct integers >= 0, got 'top'",
        ),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, ["method=clip_lora", override])
        assert "\n" not in str(e.value)


def test_precision(models):
    _, clip = models["wide"]
    m = build(clip)
    randomise_adapters(m)
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    m.eval()
    with torch.no_grad():
        fp32 = m.logits(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # train.precision=amp
            bf16 = m.logits(images)
    assert bf16.dtype == torch.float32 and relative_error(bf16, fp32) < 5e-2
    m.to_half()  # train.precision=fp16: CLIP half, A and B fp32 as in the original
    try:
        assert clip.logit_scale.dtype == torch.half
        assert all(p.dtype == torch.float32 for p in m.learnable().values())
        m.train()
        loss, logits = m.loss(images.half(), labels)
        loss.backward()
        assert logits.dtype == torch.float32 and torch.isfinite(loss)
        assert all(p.grad.dtype == torch.float32 for p in m.learnable().values())
    finally:
        clip.float()
        m.adapters.detach()


def test_non_vit_towers_are_refused(tmp_path):
    import json

    from coop.model.weights import load_clip

    resnet = dict(
        WIDE_VISION, vision_cfg={"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8}
    )
    path = tmp_path / "rn-tiny.json"
    path.write_text(json.dumps(resnet))
    rn = load_clip(str(path), pretrained=None)
    with pytest.raises(
        ModelError, match="method=clip_lora adapts the image tower .lora.towers., and model rn-tiny"
    ):
        build_method(rn, CLASSES, load_config(None, ["method=clip_lora", f"model.name={path}"]))
    text_only = build_method(rn, CLASSES, load_config(None, ["method=clip_lora", "lora.towers=[text]"]))
    assert set(t.split(".")[0] for t in text_only.learnable()) == {"text"}
    text_only.adapters.detach()


def test_end_to_end_resumed_with_a_worker_is_bit_identical(image_folder, tmp_path, monkeypatch):
    """A tiny run of 7 iterations (3 epochs of 3, 3 and 1 steps, augmented, dropout on); killed after its
    first epoch and resumed with a DataLoader worker, it ends bit-identical; the checkpoint holds
    only the adapters, and scoring it again gives the same accuracy."""
    extra = {"method": "clip_lora", "train.epochs": "null", "train.iterations": 7, "train.lr": 0.01}
    out = tmp_path / "run"
    metrics = train_run(load_config(None, tiny_args(image_folder, out, **extra)))
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 3 and all(k.split(".")[0] in ("text", "vision") for k in ckpt["prompt"])
    assert len(ckpt["prompt"]) == (3 + 2) * 6 and metrics["lora_rank"] == 2
    assert evaluate_checkpoint(out / "checkpoint.pt")["accuracy"] == metrics["accuracy"]

    resumed = tmp_path / "resumed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(load_config(None, tiny_args(image_folder, resumed, **extra)))
    again = train_run(load_config(None, tiny_args(image_folder, resumed, **extra, **{"data.num_workers": 1})))
    final = torch.load(resumed / "checkpoint.pt", weights_only=True)["prompt"]
    assert all(torch.equal(final[k], v) for k, v in ckpt["prompt"].items())
    assert (
        again["accuracy"] == metrics["accuracy"] and again["final_train_loss"] == metrics["final_train_loss"]
    )


def test_published_figures_are_consistent():
    *per, mean = FEW_SHOT_16["clip_lora"][1]
    assert sum(per) / len(per) == pytest.approx(mean, abs=0.06)  # the paper's mean, to its rounding
    figure = lookup("clip_lora", "few_shot", "average")
    assert figure.value == 83.0 and not figure.checked and "Table 1" in figure.source
    assert lookup("clip_lora", "few_shot", "fgvc_aircraft").value == 54.7

"""VPT, IVLP and MaPLe: prompts from a phrase with fewer learnable tokens, what trains, the
recipes and their errors, and tiny runs end to end (train, kill -9 and resume, eval, base-to-new,
eval.targets, one table with coop and maple rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import open_clip
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_CONFIG, kill_at_first_checkpoint, randomise_prompts, run_tool_in_process
from test_image_encoder import randomise
from test_protocols import data_root  # noqa: F401  (a fixture)

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import build_method
from coop.model.clip import CLIP
from coop.model.errors import ModelError
from coop.model.prompt import PromptClassifier, PromptError, PromptLearner
from coop.model.weights import load_clip
from coop.reference.coop import reference_inputs
from coop.reference.vision_prompts import ivlp_logits, maple_logits, vpt_logits
from coop.results.tables import dataset_table, load_runs
from coop.train.evaluation import evaluate_checkpoint
from coop.train.grid import load_grid
from coop.train.runner import train_run
from coop.train.sweep import plan

CLASSES = ["red thing", "green_thing", "t-shirt"]
TRAIN = [sys.executable, str(REPO / "tools" / "train.py")]
# Vision width 128 (2 heads) against text width 64, so a mixed-up coupling cannot go unnoticed.
WIDE_VISION = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 128, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 3},
}


@pytest.fixture(scope="module")
def vl_models():
    """A random open_clip model of `WIDE_VISION` (every LayerNorm and bias randomised) and ours."""
    torch.manual_seed(0)
    oc = randomise(open_clip.CLIP(**WIDE_VISION), seed=0)
    return oc, CLIP.from_openclip(oc, name="vl-tiny")


@pytest.fixture(scope="module")
def wide_clip(vl_models):
    return vl_models[1]


def tiny(out, *extra: str) -> list[str]:
    """Overrides of a tiny CPU run into `out` (plus `extra`)."""
    base = [f"model.name={TINY_CONFIG}", "model.pretrained=none", "data.num_workers=0", "data.shots=4"]
    return [*base, "train.batch_size=4", "train.lr=0.05", "device=cpu", f"output_dir={out}", *extra]


def tiny_cfg(out, *extra: str):
    return load_config(None, tiny(out, *extra))


def vl_cfg(method: str, *overrides: str):
    return load_config(None, [f"method={method}", f"model.name={TINY_CONFIG}", *overrides])


def build(clip, method: str, *overrides: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_method(clip, CLASSES, vl_cfg(method, *overrides))


def encode(clip, texts):
    with torch.no_grad():
        return clip.encode_text(clip.tokenize(texts))


# --- the text side: a phrase with fewer learnable tokens ----------------------------------------


def test_phrase_with_fewer_learnable_tokens(tiny_clip):
    """n_ctx=2 with "a photo of a": `[V1][V2] of a {class}.`, V1 V2 from "a" "photo"; the initial
    prompt is the phrase itself, so its features equal CLIP's on the text, at the end and front."""
    tok = tiny_clip.tokenizer
    embedding = tiny_clip.text.token_embedding.weight
    for position, text in (("end", "a photo of a {}."), ("front", "{} a photo of a.")):
        pl = PromptLearner(tiny_clip, CLASSES, n_ctx=2, ctx_init="a photo of a", position=position)
        assert pl.ctx.shape == (2, 64) and (pl.n_ctx, pl.n_phrase) == (2, 4)
        torch.testing.assert_close(pl.ctx.detach(), embedding[tok.encode("a photo")])
        with torch.no_grad():
            feats = PromptClassifier(tiny_clip, pl).text_features()
        want = encode(tiny_clip, [text.format(c.replace("_", " ")) for c in CLASSES])
        torch.testing.assert_close(feats, want, rtol=1e-5, atol=1e-5)
        first = 1 if position == "end" else 1 + len(tok.encode(CLASSES[0]))
        assert pl.slots[0].tolist() == [first, first + 1]
        ids = tok([text.format(CLASSES[0])])[0]
        assert pl.token_ids[0].tolist() == ids[: pl.token_ids.shape[1]].tolist()
    with pytest.raises(PromptError, match="position=middle is not defined"):
        PromptLearner(tiny_clip, CLASSES, n_ctx=2, ctx_init="a photo of a", position="middle")
    with pytest.raises(PromptError, match="n_ctx=5 conflicts with ctx_init"):
        PromptLearner(tiny_clip, CLASSES, n_ctx=5, ctx_init="a photo of a")
    assert PromptLearner(tiny_clip, CLASSES, ctx_init="a photo of a").n_ctx == 4  # unset: as before
    # IVLP's and MaPLe's rule: the phrase initialises the context only for n_ctx <= 4
    random_ctx = PromptLearner(tiny_clip, CLASSES, n_ctx=5, ctx_init="a photo of a", phrase_max_ctx=4)
    assert random_ctx.ctx_init is None and random_ctx.token_ids[0, 1:6].tolist() == tok.encode("X X X X X")
    coop = build_method(
        tiny_clip, CLASSES, load_config(None, ["prompt.n_ctx=2", "prompt.ctx_init=a photo of a"])
    )
    assert coop.prompt_learner.n_phrase == 4  # CoOp follows the same meaning


# --- ours against the references, logits and gradients ------------------------------------------


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


REFERENCE_CASES = {
    "vpt": ["vision.n_ctx=3"],
    "ivlp": ["vision.n_ctx=3"],  # 2 text tokens of "a photo of a" ([V1][V2] of a), 3 vision tokens
    "ivlp-front-csc": ["prompt.n_ctx=3", "prompt.ctx_init=null", "prompt.position=front", "prompt.csc=true"],
    "maple": [],
}


@pytest.mark.parametrize(
    "case, depth",
    [(case, depth) for case in REFERENCE_CASES for depth in (1, 3) if case != "ivlp-front-csc" or depth == 3],
)
def test_methods_match_the_references(vl_models, case, depth):
    """Each method's logits, loss and the gradient of every learned tensor equal the reference's
    (full 77-token text, open_clip's modules, prompts concatenated step by step)."""
    oc, clip = vl_models
    method = case.split("-")[0]
    depths = [f"prompt.depth={depth}"] + ([f"vision.depth={depth}"] if method != "maple" else [])
    m = build(clip, method, *depths, *REFERENCE_CASES[case])
    tensors = m.learnable()
    gen = torch.Generator().manual_seed(depth)
    with torch.no_grad():  # away from the initialisation, so that every term matters
        for t in tensors.values():
            t.add_(0.5 * torch.randn(t.shape, generator=gen))
    images = torch.randn(2, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 2])
    if method == "vpt":
        ids = clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES])
        ref = vpt_logits(oc, images, ids, m.vision_prompts())
    else:
        pl = m.prompt_learner
        ids, name_lens, slots = reference_inputs(oc, pl)
        if pl.position == "front":  # the prompt text itself: "{class} X X X." with X learnable
            ids = clip.tokenize([f"{c.replace('_', ' ')} X X X." for c in CLASSES])
            slots = torch.zeros(ids.shape, dtype=torch.bool)
            for row, c in enumerate(name_lens):
                slots[row, 1 + c : 4 + c] = True
        if method == "ivlp":
            ref = ivlp_logits(oc, images, ids, slots, pl.ctx, pl.deep_ctx, m.vision_prompts())
        else:
            projections = [m.proj, *m.compound_prompt_projections]
            ref = maple_logits(oc, images, ids, slots, pl.ctx, pl.deep_ctx, projections)
    loss, ours = m.loss(images, labels)
    assert relative_error(ours, ref) < 1e-5
    ref_loss = F.cross_entropy(ref, labels)
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    names = list(tensors)
    our_grads = torch.autograd.grad(loss, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
    for name, a, b in zip(names, our_grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, name


# --- what trains, the coupling, precision ------------------------------------------------------


@pytest.mark.parametrize(
    "method, overrides, learned",
    [
        ("vpt", ["vision.n_ctx=3", "vision.depth=3"], {"vision_ctx", "vision_deep_ctx"}),
        (
            "ivlp",
            ["prompt.depth=2", "vision.n_ctx=3", "vision.depth=2"],
            {"ctx", "deep_ctx", "vision_ctx", "vision_deep_ctx"},
        ),
        (
            "maple",
            ["prompt.depth=3"],
            {"ctx", "deep_ctx", "proj.weight", "proj.bias"}
            | {f"compound_prompt_projections.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")},
        ),
    ],
)
def test_exactly_the_prompts_train(wide_clip, method, overrides, learned):
    m = build(wide_clip, method, *overrides)
    tensors = m.learnable()
    assert set(tensors) == learned and all(t.requires_grad for t in tensors.values())
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    loss, logits = m.loss(images, labels)
    assert logits.shape == (2, 3) and logits.dtype == torch.float32
    loss.backward()
    with_grad = {n for n, p in m.named_parameters() if p.grad is not None}
    assert len(with_grad) == len(learned)
    assert all(p.grad is None and not p.requires_grad for p in m.clip.parameters())  # nothing of CLIP
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in tensors.values())
    if method != "vpt":  # MaPLe's image side reaches the text prompts, IVLP's does not
        for t in tensors.values():
            t.grad = None
        m.image_features(images).sum().backward()
        reached = m.prompt_learner.ctx.grad is not None and m.prompt_learner.deep_ctx.grad.abs().sum() > 0
        assert reached == (method == "maple")


def test_maple_coupling_and_fp16_layout(wide_clip):
    m = build(wide_clip, "maple", "prompt.depth=3")
    clones = m.compound_prompt_projections
    assert m.proj.weight.shape == (128, 64)  # Linear(W_text=64 -> W_vision=128)
    assert torch.equal(clones[0].weight, clones[1].weight) and torch.equal(clones[0].bias, clones[1].bias)
    assert not torch.equal(m.proj.weight, clones[0].weight)  # its own default initialisation
    randomise_prompts(m.prompt_learner, 1)
    prompts = m.vision_prompts()
    assert len(prompts) == 3 and all(p.shape == (2, 128) for p in prompts)
    torch.testing.assert_close(prompts[0], m.prompt_learner.ctx @ m.proj.weight.T + m.proj.bias)
    torch.testing.assert_close(prompts[2], clones[1](m.prompt_learner.deep_ctx[1]))
    # train.grad_checkpointing (both towers recompute their blocks): the same gradients
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    tensors = list(m.learnable().values())
    plain = torch.autograd.grad(m.loss(images, labels)[0], tensors)
    m.grad_checkpointing = m.clip.text.grad_checkpointing = True  # what engine.setup does for the run
    try:
        again = torch.autograd.grad(m.loss(images, labels)[0], tensors)
    finally:
        m.clip.text.grad_checkpointing = False
    for a, b in zip(again, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # PREC=fp16 as in the original: CLIP, ctx and proj half; deeper prompts and clones fp32
    m.to_half()
    try:
        pl = m.prompt_learner
        assert pl.ctx.dtype == pl.token_embeds.dtype == m.proj.weight.dtype == torch.half
        assert m.clip.logit_scale.dtype == torch.half
        assert pl.deep_ctx.dtype == clones[0].weight.dtype == torch.float32
        loss, logits = m.loss(images.half(), labels)
        loss.backward()
        assert logits.dtype == torch.float32 and torch.isfinite(loss)
        assert pl.ctx.grad.dtype == torch.half and pl.deep_ctx.grad.dtype == torch.float32
        ivlp = build(wide_clip, "ivlp", "prompt.depth=2", "vision.depth=2")
        ivlp.to_half()
        assert ivlp.prompt_learner.ctx.dtype == torch.half and ivlp.vision.ctx.dtype == torch.float32
    finally:
        wide_clip.float()  # the module's model is shared with other tests


# --- recipes, names, grids and errors ----------------------------------------------------------


def test_recipes_names_and_grids(tmp_path):
    vpt, ivlp, maple = (load_config(None, [f"method={m}"]) for m in ("vpt", "ivlp", "maple"))
    assert (vpt.vision.n_ctx, vpt.vision.depth, vpt.train.lr, vpt.train.epochs, vpt.train.batch_size) == (
        8,
        12,
        0.0025,
        5,
        4,
    )
    assert (ivlp.prompt.n_ctx, ivlp.prompt.ctx_init, ivlp.prompt.depth) == (2, "a photo of a", 12)
    assert (ivlp.vision.n_ctx, ivlp.vision.depth, ivlp.train.lr) == (2, 12, 0.0035)
    assert (maple.prompt.n_ctx, maple.prompt.depth, maple.train.lr, maple.train.epochs) == (2, 9, 0.0035, 5)
    assert maple.train.precision == "amp" and maple.train.warmup_lr == 1e-5
    # the phrase stays with an explicit n_ctx (the originals set both; it applies for n_ctx <= 4)
    assert load_config(None, ["method=maple", "prompt.n_ctx=4"]).prompt.ctx_init == "a photo of a"
    assert run_name(vpt).split("/")[3] == "vpt_vctx8_vdepth12"
    assert run_name(ivlp).split("/")[3] == "ivlp_nctx2_cscfalse_posend_depth12_vctx2_vdepth12"
    assert run_name(maple).split("/")[3] == "maple_nctx2_cscfalse_posend_depth9"
    shipped = {
        "vpt/vit_b16_c2_ep5_batch4_4.yaml": vpt,
        "ivlp/vit_b16_c2_ep5_batch4_2+2ctx.yaml": ivlp,
        "maple/vit_b16_c2_ep5_batch4_2ctx.yaml": maple,
    }
    for path, defaults in shipped.items():
        defaults.data.name = "imagenet"  # the files name a dataset; every other key is the default
        assert load_config(str(REPO / "configs" / path)) == defaults, path
    xd = load_config(str(REPO / "configs" / "maple" / "vit_b16_c2_ep5_batch4_2ctx_cross_datasets.yaml"))
    assert (xd.prompt.depth, xd.train.lr, xd.train.epochs) == (3, 0.0026, 2)
    narrow = {"base_to_new": ["data.name=[dtd]"], "few_shot": ["data.name=[dtd]", "data.shots=[1,16]"]}
    for protocol in ("base_to_new", "few_shot", "cross_dataset", "domain_generalization"):
        path = str(REPO / "configs" / "protocols" / f"{protocol}.yaml")
        grid = load_grid(path, ["method=[vpt,ivlp,maple]", *narrow.get(protocol, ["data.seed=[1]"])])
        runs = plan(grid, tmp_path, check_data=False)
        assert len({r.folder for r in runs}) == len(runs)
        for method in ("vpt", "ivlp", "maple"):
            cfg = load_config(None, next(r.overrides for r in runs if f"method={method}" in r.overrides))
            assert cfg.method == method and cfg.train.epochs == 5 and cfg.train.batch_size == 4


def test_errors_are_one_line(tiny_clip, tmp_path):
    resnet = dict(
        WIDE_VISION, vision_cfg={"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 8}
    )
    path = tmp_path / "rn-tiny.json"
    path.write_text(json.dumps(resnet))
    rn = load_clip(str(path), pretrained=None)
    with pytest.raises(
        ModelError, match="method=vpt prompts the image tower, and model rn-tiny.s image tower is a ResNet"
    ):
        build_method(rn, CLASSES, load_config(None, ["method=vpt", f"model.name={path}"]))
    assert build_method(rn, CLASSES, load_config(None, [f"model.name={path}"])).name == "coop"  # as today
    with pytest.raises(
        ConfigError, match=r"vision.depth must be in 1..2 \(the image tower's layers\), got 3"
    ):
        build(tiny_clip, "ivlp", "prompt.depth=2", "vision.depth=3")
    with pytest.raises(ConfigError, match="prompt.depth=3 is above the image tower's 2 layers"):
        build(tiny_clip, "maple", "prompt.depth=3")
    with pytest.raises(PromptError, match="prompt.csc=true is not defined for maple"):
        build(tiny_clip, "maple", "prompt.depth=2", "prompt.csc=true")
    with pytest.raises(ConfigError, match="vision.n_ctx must be an integer >= 1 or null, got 0"):
        vl_cfg("vpt", "vision.n_ctx=0")
    with pytest.raises(ConfigError, match="vision.depth=3 conflicts with prompt.depth=9"):
        vl_cfg("maple", "vision.depth=3")
    with pytest.raises(ConfigError, match="train.aug_views=2 caches image features"):
        train_run(tiny_cfg(tmp_path / "aug", "method=vpt", "vision.depth=2", "train.aug_views=2"))
    res = run_tool_in_process(Path(TRAIN[1]), ["method=maple", "vision.n_ctx=3"])  # a real run: test_train
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert (
        res.returncode == 2 and len(lines) == 1 and "vision.n_ctx=3 conflicts with prompt.n_ctx=2" in lines[0]
    )
    assert "Traceback" not in res.stderr


# --- end to end ------------------------------------------------------------------------------


SETTINGS = {
    "vpt": ["vision.n_ctx=2", "vision.depth=2"],
    "ivlp": ["prompt.depth=2", "vision.depth=2"],
    "maple": ["prompt.depth=2"],
    "coop": ["prompt.ctx_init=a photo of a"],
}


def learned(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]


def test_vision_language_end_to_end(data_root, tmp_path):  # noqa: F811
    """Each method trains on the base half of the generated ImageNet, evaluates on its new half and
    on ImageNet-A; eval.py's function scores the checkpoint again; MaPLe killed with SIGKILL and
    resumed with a DataLoader worker ends bit-identical; one table holds coop and maple."""
    root = tmp_path / "runs"
    common = ["data.name=imagenet", f"data.root={data_root}", "data.subsample_classes=base"]
    common += ["eval.targets=[imagenet_a]", "train.epochs=3"]
    metrics = {}
    for method, settings in SETTINGS.items():
        out = root / method
        metrics[method] = train_run(tiny_cfg(out, *common, f"method={method}", *settings))
        assert metrics[method]["n_test"] == 6 and metrics[method]["epochs"] == 3  # 2 base classes x 3
        new = json.loads((out / "eval_imagenet_new.json").read_text())
        target = json.loads((out / "eval_imagenet_a.json").read_text())
        assert new["n_test"] == 6 and new["trained_on"] == target["trained_on"] == "imagenet"
        assert len(target["per_class_accuracy"]) == 2
        assert evaluate_checkpoint(out / "checkpoint.pt")["accuracy"] == metrics[method]["accuracy"]
    assert set(learned(root / "vpt")) == {"vision_ctx", "vision_deep_ctx"}
    assert learned(root / "maple")["proj.weight"].shape == (64, 64)
    assert metrics["maple"]["n_ctx"] == 2 and metrics["ivlp"]["vision_depth"] == 2

    # kill -9 during training, then resume with a DataLoader worker: the same run
    out = tmp_path / "killed"
    overrides = tiny(out, *common, "method=maple", *SETTINGS["maple"])
    kill_at_first_checkpoint(TRAIN + overrides, out)
    killed_at = torch.load(out / "checkpoint.pt", weights_only=True)["epoch"]
    assert killed_at < 3, "the kill came too late to test resuming"
    resumed = train_run(tiny_cfg(out, *common, "method=maple", *SETTINGS["maple"], "data.num_workers=1"))
    for key, t in learned(root / "maple").items():
        assert torch.equal(learned(out)[key], t), key
    assert resumed["accuracy"] == metrics["maple"]["accuracy"]
    assert resumed["final_train_loss"] == metrics["maple"]["final_train_loss"]

    table = dataset_table(load_runs(root), "accuracy")  # what tools/collect.py --table datasets prints
    assert {"coop", "maple"} <= set(table["method"]) and "imagenet_a_mean" in table.columns

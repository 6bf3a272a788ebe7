"""CoPrompt against a written-out reference of its `trainers/coprompt.py` (logits, loss and every
gradient, on CLIP's and the timm towers' tiny models), the sampled description per step, the two
views and Dassl's RandAugment, the refusals, and a tiny run end to end (kill -9, resume, eval)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import PIL.ImageEnhance
import PIL.ImageOps
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_CONFIG, kill_at_first_checkpoint, tiny_args
from PIL import Image
from test_bench import load_tool
from test_protocols import data_root  # noqa: F401  (a fixture)
from test_vision_families import family  # noqa: F401  (a fixture)
from test_vision_language import vl_models  # noqa: F401  (a fixture)

import coop.methods.coprompt
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.data.base import DataError
from coop.data.images import ImageDataset, Views
from coop.data.randaugment import OPERATIONS, RandAugment, randaugment_transform
from coop.methods import build_method
from coop.methods.coprompt import coprompt_loss, step_index
from coop.methods.descriptions import description_features
from coop.model.errors import ModelError
from coop.reference.coop import reference_inputs
from coop.reference.coprompt import coprompt_loss as reference_loss
from coop.reference.coprompt import gpt_clip_classifier
from coop.train.evaluation import evaluate_checkpoint
from coop.train.runner import train_run

CLASSES = ["red thing", "green_thing", "t-shirt"]
TRAIN = [sys.executable, str(REPO / "tools" / "train.py")]


def sentences(classes, counts) -> dict[str, list[str]]:
    """Made-up descriptions: `counts[c]` sentences for class c (we ship no third-party ones)."""
    words = ["bright", "small", "striped", "round", "old"]
    return {
        c: [f"a {words[k % 5]} {c.replace('_', ' ')} number {k}." for k in range(n)]
        for c, n in zip(classes, counts, strict=True)
    }


def write_descriptions(path, classes, counts=(3, 3, 3)):
    path.write_text(json.dumps(sentences(classes, counts)))
    return path


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def build(clip, desc, *overrides: str, classes=CLASSES):
    torch.manual_seed(0)
    cfg = load_config(None, ["method=coprompt", f"data.descriptions={desc}", *overrides])
    return build_method(clip, classes, cfg)


def check_against_reference(oc, clip, m, size: int, seed: int) -> None:
    """Our loss, logits and gradients against the reference's, with the step's sampled index."""
    tensors = m.learnable()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the initialisation, so that every term matters
        for t in tensors.values():
            t.add_(0.5 * torch.randn(t.shape, generator=gen))
    x1, x2 = torch.randn(2, 2, 3, size, size, generator=gen).unbind(0)
    labels = torch.tensor([0, 2])
    m.train()
    m.start_step(1, 4)
    index = step_index(1, 1, 4, 3)
    loss, ours = m.loss(torch.stack([x1, x2], dim=1), labels)
    pl = m.prompt_learner
    ids, _, slots = reference_inputs(oc, pl)
    names = [c.replace("_", " ") for c in CLASSES]
    ori = gpt_clip_classifier(oc, [sentences(names, (3, 3, 3))[c] for c in names])
    ref_loss, ref = reference_loss(
        oc, x1, x2, labels, ids, slots, pl.ctx, pl.deep_ctx, [m.proj, *m.compound_prompt_projections],
        tensors, ori, index, weight=m.weight, distill=m.distill,
    )  # fmt: skip
    assert relative_error(ours, ref) < 1e-5
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5 * max(1.0, abs(float(ref_loss.detach())))
    assert m.last_terms["text"] > 0 and m.last_terms["image"] > 0
    grads = torch.autograd.grad(loss, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
    for key, a, b in zip(tensors, grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, key


@pytest.mark.parametrize("depth, distill", [(1, "cosine"), (3, "cosine"), (3, "mse")])
def test_matches_the_reference_on_clip(vl_models, tmp_path, depth, distill):  # noqa: F811
    """Logits, loss and the gradient of every learned tensor (prompts, couplings, both adapters)
    equal the original's computation written out: 77-token text, prompts concatenated step by step,
    adapters from their weights, one description index for all classes, the frozen tower on view 2."""
    oc, clip = vl_models
    desc = write_descriptions(tmp_path / "d.json", CLASSES)
    m = build(clip, desc, f"prompt.depth={depth}", f"coprompt.distill={distill}", "coprompt.weight=2.5")
    assert {"adapter_image.fc.0.weight", "adapter_text.fc.2.weight", "proj.weight"} <= set(m.learnable())
    assert m.adapter_image.fc[0].weight.shape == (8, 32)  # E // 4
    check_against_reference(oc, clip, m, 32, seed=depth)


@pytest.mark.parametrize("family", ["eva02", "pe-core"], indirect=True)  # CLIP's BPE: the text reference's
def test_matches_the_reference_on_timm_towers(family, tmp_path):  # noqa: F811
    """The same on EVA02's and PE-Core's timm towers (timm's own forward in the reference)."""
    clip, oc = family[4], family[5]
    desc = write_descriptions(tmp_path / "d.json", CLASSES)
    m = build(clip, desc, "prompt.depth=2", "coprompt.weight=3.0")
    check_against_reference(oc, clip, m, clip.image_size, seed=5)


# --- the sampled description, the two views, RandAugment -------------------------------------


def test_sampled_description_per_step(tiny_clip, tiny_openclip, tmp_path):
    """Sentence features equal open_clip's (normalised, per sentence); the step's index comes from
    (seed, epoch, step) alone, uniformly; with equal counts it picks the original's
    `ori_embedding[i]`, with unequal counts sentence i mod each class's count."""
    names = [c.replace("_", " ") for c in CLASSES]
    described = sentences(names, (2, 3, 1))
    got = description_features(tiny_clip, [described[c] for c in names])
    feats, counts = got.sentences, got.counts
    assert feats.shape == (3, 3, 32) and counts.tolist() == [2, 3, 1]
    for c, name in enumerate(names):
        want = gpt_clip_classifier(tiny_openclip, [described[name]])[:, 0]  # (S_c, E)
        torch.testing.assert_close(feats[c, : counts[c]], want, rtol=1e-5, atol=1e-5)
        assert not feats[c, counts[c] :].any()
    for i in range(4):
        picked = got.pick(i)
        for c in range(3):
            assert torch.equal(picked[c], feats[c, i % int(counts[c])])
    equal = description_features(tiny_clip, [sentences(names, (3, 3, 3))[c] for c in names])
    stacked = gpt_clip_classifier(tiny_openclip, [sentences(names, (3, 3, 3))[c] for c in names])
    torch.testing.assert_close(equal.pick(2), stacked[2], rtol=1e-5, atol=1e-5)

    draws = [step_index(7, e, s, 5) for e in range(4) for s in range(50)]
    assert draws == [step_index(7, e, s, 5) for e in range(4) for s in range(50)]  # a replay draws the same
    assert np.bincount(draws, minlength=5).min() > 20  # every sentence, about 40 times each
    assert [step_index(8, 0, s, 5) for s in range(20)] != draws[:20]  # another seed, other draws

    m = build(tiny_clip, write_descriptions(tmp_path / "d.json", CLASSES, (2, 5, 3)), "prompt.depth=2")
    m.start_step(3, 11)
    assert m.step_sentence == step_index(1, 3, 11, 5)  # data.seed=1, S = the largest count


def test_two_views_and_randaugment(image_folder):
    """Views stacks k seeded draws of the train transform; Dassl's RandAugment resizes to the square
    without a crop and runs its operations at magnitude m / 30 of their ranges."""
    items = [
        type("D", (), {"path": str(p), "label": 0})() for p in sorted(image_folder.glob("train/*/*.png"))[:2]
    ]
    tf = randaugment_transform(24, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    ds = ImageDataset(items, Views(tf, 2), seed=3)
    x, _, _ = ds[0]
    assert x.shape == (2, 3, 24, 24) and not torch.equal(x[0], x[1])
    assert torch.equal(ImageDataset(items, Views(tf, 2), seed=3)[0][0], x)  # seeded per image
    assert not torch.equal(ImageDataset(items, Views(tf, 2), seed=4)[0][0], x)

    img = Image.fromarray((np.random.RandomState(0).rand(20, 30, 3) * 255).astype(np.uint8))
    values = [(10 / 30) * (hi - lo) + lo for _, lo, hi in OPERATIONS]
    assert [round(v, 3) for v in values] == [
        0.333, 0.333, 0.333, 10.0, 5.333, 85.333, 36.667, 0.7, 0.7, 0.7, 0.7, 0.1, 0.1, 13.333, 33.333, 33.333,
    ]  # fmt: skip
    expected = {
        1: PIL.ImageOps.equalize(img),
        2: PIL.ImageOps.invert(img),
        4: PIL.ImageOps.posterize(img, 5),
        5: PIL.ImageOps.solarize(img, 85.333),
        8: PIL.ImageEnhance.Contrast(img).enhance(0.7),
    }
    for i, want in expected.items():
        assert np.array_equal(np.asarray(OPERATIONS[i][0](img, values[i])), np.asarray(want)), i
    for op, v in zip(OPERATIONS, values, strict=True):
        assert op[0](img, v).size == img.size
    torch.manual_seed(0)
    assert RandAugment(2, 10)(img).size == (30, 20)
    with pytest.raises(ValueError, match="0..30"):
        RandAugment(2, 31)


def test_loss_formula(tmp_path):
    """coprompt_loss: CE + W (1 - mean cos(t, d) + 1 - mean cos(v, v0)), or MSE of the normalised."""
    gen = torch.Generator().manual_seed(0)
    t, d, v, v0 = (torch.randn(n, 6, generator=gen) for n in (4, 4, 3, 3))
    logits, labels = torch.randn(3, 4, generator=gen), torch.tensor([1, 0, 3])
    total, terms = coprompt_loss(logits, labels, t, d, v, v0, weight=2.0)
    unit = [x / x.norm(dim=-1, keepdim=True) for x in (t, d, v, v0)]
    text = 1 - (unit[0] * unit[1]).sum(-1).mean()
    image = 1 - (unit[2] * unit[3]).sum(-1).mean()
    torch.testing.assert_close(total, F.cross_entropy(logits, labels) + 2.0 * (text + image))
    mse, _ = coprompt_loss(logits, labels, t, d, v, v0, weight=2.0, distill="mse")
    want = ((unit[0] - unit[1]) ** 2).mean() + ((unit[2] - unit[3]) ** 2).mean()
    torch.testing.assert_close(mse, terms["ce"] + 2.0 * want)


# --- refusals, recipe, end to end ---------------------------------------------------------------


def test_refusals_before_the_run_folder(image_folder, tmp_path):
    desc = write_descriptions(tmp_path / "d.json", ["red_thing", "green_thing", "blue_thing"])
    cases = [
        ({}, ConfigError, "method=coprompt distils toward class descriptions: set data.descriptions"),
        (
            {"data.descriptions": desc, "model.name": "RN50"},
            ModelError,
            "method=coprompt prompts the image tower",
        ),
        ({"data.descriptions": desc, "prompt.depth": 5}, ConfigError, "prompt.depth must be in 1..3"),
    ]
    for k, (extra, error, message) in enumerate(cases):
        out = tmp_path / f"run{k}"
        cfg = load_config(
            None, tiny_args(image_folder, out, method="coprompt", **{"prompt.depth": 2, **extra})
        )
        with pytest.raises(error) as e:
            train_run(cfg)
        assert message in str(e.value) and "\n" not in str(e.value) and not out.exists(), k
    with pytest.raises(
        ConfigError, match="dept.enabled=true wraps method=coop|cocoop|kgcoop|maple, got method=coprompt"
    ):
        load_config(None, ["method=coprompt", "dept.enabled=true"])  # DePT replaces the host's loss
    # a class the file does not describe: one line naming it (read at the first training step)
    partial = write_descriptions(tmp_path / "p.json", ["red_thing", "green_thing"], (2, 2))
    cfg = load_config(
        None,
        tiny_args(
            image_folder,
            tmp_path / "p",
            method="coprompt",
            **{"prompt.depth": 2, "data.descriptions": partial},
        ),
    )
    with pytest.raises(DataError, match="has no sentences for class 'blue_thing'$"):
        train_run(cfg)


def test_recipe():
    dtd = load_config(None, ["method=coprompt", "data.name=dtd"])
    assert (dtd.prompt.n_ctx, dtd.prompt.depth, dtd.coprompt.weight, dtd.train.epochs) == (2, 12, 8.0, 8)
    assert (dtd.train.lr, dtd.train.batch_size, dtd.train.transform, dtd.prompt.ctx_init) == (
        0.0035, 4, "randaugment", "a photo of a",
    )  # fmt: skip
    food = load_config(None, ["method=coprompt", "data.name=food101"])
    assert (food.prompt.n_ctx, food.prompt.depth, food.coprompt.weight, food.train.epochs) == (4, 9, 0.5, 5)
    plain = load_config(None, ["method=coprompt", "data.name=imagefolder"])
    assert (plain.prompt.depth, plain.coprompt.weight, plain.coprompt.image_ratio) == (9, 1.0, 0.1)
    xd = load_config(str(REPO / "configs" / "coprompt" / "coprompt_cross_datasets.yaml"))
    assert (xd.data.name, xd.prompt.depth, xd.prompt.n_ctx, xd.coprompt.weight) == ("imagenet", 12, 4, 8.0)


def learned(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]


def test_end_to_end_resume_after_kill(image_folder, tmp_path, monkeypatch):
    """A tiny run with a descriptions file: draws each step's sentence from (seed, epoch, step),
    trains (the adapters too), evaluates its checkpoint again; killed with SIGKILL after its first
    checkpoint and resumed with a DataLoader worker, it ends bit-identical."""
    desc = write_descriptions(tmp_path / "d.json", ["red_thing", "green_thing", "blue_thing"], (2, 4, 3))
    extra = {"method": "coprompt", "data.descriptions": desc, "prompt.depth": 2, "train.epochs": 2}
    out = tmp_path / "run"
    drawn = []
    real = coop.methods.coprompt.step_index
    monkeypatch.setattr(coop.methods.coprompt, "step_index", lambda *a: drawn.append(a) or real(*a))
    metrics = train_run(load_config(None, tiny_args(image_folder, out, **extra)))
    assert drawn == [(1, epoch, step, 4) for epoch in range(2) for step in range(3)]  # 12 images, batch 4
    assert metrics["epochs"] == 2 and metrics["coprompt_weight"] == 1.0 and metrics["n_ctx"] == 2
    tensors = learned(out)
    assert tensors["adapter_text.fc.0.weight"].shape == (8, 32)
    assert evaluate_checkpoint(out / "checkpoint.pt")["accuracy"] == metrics["accuracy"]

    killed = tmp_path / "killed"
    kill_at_first_checkpoint(TRAIN + tiny_args(image_folder, killed, **extra), killed)
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["epoch"] < 2, "the kill came too late"
    resumed = train_run(
        load_config(None, tiny_args(image_folder, killed, **{**extra, "data.num_workers": 1}))
    )
    for key, t in tensors.items():
        assert torch.equal(learned(killed)[key], t), key
    assert resumed["final_train_loss"] == metrics["final_train_loss"]


def test_run_name_has_the_weight():
    cfg = load_config(None, ["method=coprompt", "data.name=dtd", "data.descriptions=d.json"])
    assert run_name(cfg).split("/")[3] == "coprompt_nctx2_cscfalse_posend_depth12_w8"


def test_bench_matches_the_reference(tmp_path, capsys):
    """tools/bench/bench_coprompt.py on the tiny model: our step's loss and every gradient equal the
    reference's; the reference runs 77 tokens per class, ours fewer; the step's memory is measured."""
    out_json = tmp_path / "coprompt.json"
    args = ["--model", str(TINY_CONFIG), "--classes", "4", "--batch", "2", "--set", "prompt.depth=2"]
    assert load_tool("bench_coprompt").main([*args, "--no-memory", "--json", str(out_json)]) == 0
    assert "speed-up:" in capsys.readouterr().out
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["classes"] == 4 and step["reference_text"] == 4 * 77 and step["ours_text"] < 4 * 77
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert {"adapter_image.fc.0.weight", "adapter_text.fc.2.weight", "proj.weight"} <= set(step["grad_diff"])
    child = argparse.Namespace(
        device="cpu", model=str(TINY_CONFIG), memory_classes=4, batch=2, set=["prompt.depth=2"]
    )
    assert load_tool("bench_vl").step_memory(child, "coprompt", grad_checkpointing=True) >= 0


def test_new_classes_and_other_datasets_need_no_descriptions(data_root, tmp_path):  # noqa: F811
    """Trained on ImageNet's base half with sentences for those two classes only, a run scores the
    new half and ImageNet-A (eval.targets) with its prompts and adapters: the descriptions only train."""
    desc = write_descriptions(tmp_path / "d.json", ["red thing", "green thing"], (2, 3))
    out = tmp_path / "run"
    overrides = ["method=coprompt", f"data.descriptions={desc}", "prompt.depth=2", "train.epochs=2"]
    overrides += ["data.name=imagenet", f"data.root={data_root}", "data.subsample_classes=base"]
    overrides += ["eval.targets=[imagenet_a]", f"model.name={TINY_CONFIG}", "model.pretrained=none"]
    overrides += [
        "data.shots=2",
        "data.num_workers=0",
        "train.batch_size=2",
        "device=cpu",
        f"output_dir={out}",
    ]
    metrics = train_run(load_config(None, overrides))
    assert metrics["n_test"] == 6  # 2 base classes x 3
    new = json.loads((out / "eval_imagenet_new.json").read_text())
    target = json.loads((out / "eval_imagenet_a.json").read_text())
    assert new["n_test"] == 6 and target["n_test"] == 4 and target["trained_on"] == "imagenet"

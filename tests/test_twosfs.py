"""2SFS (method=2sfs) against the written-out original (`coop.reference.twosfs`).

1. What trains: the original's own LayerNorm walk on open_clip's model selects exactly our tensors
   (ln_pre, ln_post and ln_final listed but frozen), for each tower choice and start block.
2. Stage one's logits, loss and every LayerNorm gradient, the head's initial rows, stage two's loss
   and head gradient, and the selective classifier (head rows for the training classes, the
   adapted text tower for the others), on the tiny CLIP, SigLIP, EVA02 and PE-Core models and the Hugging
   Face text towers of RoBERTa and mT5; BitFit against the original's bias walk, LoRA against
   CLIP-LoRA's reference.
3. The schedule: two per-iteration cosines, as two CosineAnnealingLRs step them.
4. End to end on the image folder: both stages in one run folder, a base-to-new evaluation (the
   head for the base classes, the adapted text tower for the new ones), a run stopped at each
   epoch (before and after the switch) resumes bit-identical; and the refusals, in one line, before the run folder exists.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    TINY_CONFIG,
    build_family,
    interrupted_at,
    make_image_folder,
    shrunk_timm,
    tiny_args,
)

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.methods import build_method
from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
from coop.model.errors import ModelError
from coop.reference import twosfs as ref
from coop.reference.clip_lora import clip_lora_logits
from coop.train.runner import train_run
from coop.train.schedule import Schedule

CLASSES = ["red thing", "green_thing", "t-shirt"]
NEW = ["blue car", "dog"]
FAMILIES = {"clip": "coop-tiny", "siglip": "siglip-tiny", "eva02": "eva02-tiny", "pe-core": "pe-core-tiny"}
HF = {"roberta": "roberta-tiny", "mt5": "mt5-tiny"}  # Hugging Face text towers (mT5: T5LayerNorm)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def randomise_image_norms(oc) -> None:
    """The image tower's LayerNorms away from (1, 0), so that every gradient term matters."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in oc.visual.modules():
            if isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
                module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=gen))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=gen))


def family(name: str, tmp_path):
    tok = None
    if name == "siglip":
        from coop.model.tiny_tokenizers import unigram

        tok = unigram(tmp_path / "tok", pad="</s>")
    if name in HF:
        from coop.model.tiny_tokenizers import make_tiny_tokenizer

        tok = tmp_path / "tok"
        make_tiny_tokenizer(REPO / "configs" / "models" / f"{HF[name]}.json", tok)
    with shrunk_timm(depth=2) if name in ("eva02", "pe-core") else contextlib.nullcontext():  # 2 of 12 blocks
        return build_family({**FAMILIES, **HF}[name], tok, edit=randomise_image_norms)


def method_for(clip, classes=CLASSES, *overrides):
    torch.manual_seed(0)
    return build_method(
        clip, classes, load_config(None, ["method=2sfs", f"model.name={TINY_CONFIG}", *overrides])
    )


def oc_name(oc, name: str) -> str:
    """Our tensor name -> open_clip's parameter name (CLIP keeps its text tower at the root)."""
    return name[len("text.") :] if name.startswith("text.") and not hasattr(oc, "text") else name


def full_ids(clip, classes):
    return clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in classes])  # 77 tokens


@pytest.mark.parametrize(
    "towers, starts", [("both", (0, 0)), ("text", (0, 0)), ("vision", (0, 0)), ("both", (1, 1))]
)
def test_the_originals_walk_selects_our_tensors(tmp_path, towers, starts):
    clip, oc = family("clip", tmp_path)
    listed = {"both": "[text,vision]", "text": "[text]", "vision": "[vision]"}[towers]
    starts_set = [f"twosfs.text_start={starts[0]}", f"twosfs.vision_start={starts[1]}"]
    m = method_for(clip, CLASSES, f"twosfs.towers={listed}", *starts_set)
    ours = {k for k in m.learnable() if k not in ("head", "stage")}
    model = copy.deepcopy(oc)
    listed_params = {id(p) for p in ref.trainable_norms(model, towers, starts[1], starts[0])}
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {oc_name(oc, k) for k in ours}
    # the walk lists the towers' outer LayerNorms (ln_pre only from block 0) and leaves them frozen
    outer = [p for n, p in model.named_parameters() if {"ln_pre", "ln_post", "ln_final"} & set(n.split("."))]
    assert any(id(p) in listed_params for p in outer) and not any(p.requires_grad for p in outer)


@pytest.mark.parametrize("towers, starts", [("both", (0, 0)), ("text", (1, 0)), ("vision", (0, 1))])
def test_bitfit_is_the_originals_bias_walk_and_its_gradients(tmp_path, towers, starts):
    """peft=bitfit: the original's `trainable_bias_params` on open_clip's model picks our tensors
    (block biases but not the packed in_proj_bias; ln_post and ln_final, ln_pre from block 0);
    stage one's loss and every bias gradient against open_clip's forward."""
    clip, oc = family("clip", tmp_path)
    listed = {"both": "[text,vision]", "text": "[text]", "vision": "[vision]"}[towers]
    starts_set = [f"twosfs.text_start={starts[0]}", f"twosfs.vision_start={starts[1]}"]
    m = method_for(clip, CLASSES, "twosfs.peft=bitfit", f"twosfs.towers={listed}", *starts_set)
    tensors = {k: v for k, v in m.learnable().items() if k not in ("head", "stage")}
    ref.trainable_biases(oc, towers, starts[1], starts[0])
    params = dict(oc.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == {oc_name(oc, k) for k in tensors}
    assert not any("in_proj_bias" in k for k in tensors) and any("ln_final" in k for k in tensors) == (
        towers != "vision"
    )
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the same random biases on both sides
        for k, p in tensors.items():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            params[oc_name(oc, k)].copy_(p)
    images = torch.randn(2, 3, clip.image_size, clip.image_size, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2])
    m.train()
    loss = m.loss(images, labels)[0]
    ref_loss = F.cross_entropy(ref.stage_one_logits(oc, images, full_ids(clip, CLASSES)), labels)
    assert abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    ours = torch.autograd.grad(loss, list(tensors.values()))
    theirs = torch.autograd.grad(ref_loss, [params[oc_name(oc, k)] for k in tensors])
    for key, a, b in zip(tensors, ours, theirs, strict=True):
        assert relative_error(a, b) < 1e-4, key


def test_lora_stage_one_is_clip_loras_step(tmp_path):
    """peft=lora: CLIP-LoRA's adapters (lora.*) on twosfs.towers, stage one's logits those of
    `coop.reference.clip_lora` (dropout off), the switch freezes them and the head trains."""
    clip, oc = family("clip", tmp_path)
    m = method_for(clip, CLASSES, "twosfs.peft=lora", "twosfs.towers=[vision]", "lora.rank=3")
    tensors = {k: v for k, v in m.learnable().items() if k not in ("head", "stage")}
    assert tensors and all(k.startswith("vision.") for k in tensors)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in tensors.values():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    m.eval()
    images = torch.randn(2, 3, clip.image_size, clip.image_size, generator=torch.Generator().manual_seed(1))
    want = clip_lora_logits(oc, images, full_ids(clip, CLASSES), tensors, m.adapters.scale)
    assert relative_error(m.loss(images, torch.tensor([0, 1]))[1], want) < 1e-5
    m.start_stage_two()
    assert not any(p.requires_grad for p in tensors.values()) and m.head.requires_grad


def test_start_blocks_leave_the_lower_norms_out(tmp_path):
    clip, _ = family("clip", tmp_path)
    m = method_for(clip, CLASSES, "twosfs.text_start=1", "twosfs.vision_start=1")
    names = [k for k in m.learnable() if k not in ("head", "stage")]
    assert names and not any(".resblocks.0." in k for k in names)


@pytest.mark.parametrize("name", sorted(FAMILIES) + sorted(HF))
def test_both_stages_and_the_selective_classifier_match_the_reference(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    clip, oc = family(name, tmp_path)
    m = method_for(clip)
    size = clip.image_size
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2])
    ids = full_ids(clip, CLASSES)
    norms = {k: v for k, v in m.learnable().items() if k not in ("head", "stage")}
    if name in HF:  # the original's walk knows no Hugging Face tower: our selection, in its forward
        for p in oc.parameters():
            p.requires_grad_(False)
        names = [oc_name(oc, k) for k in norms]
        assert {n.split(".")[-2] for n in names if n.startswith("text.")} <= {"LayerNorm", "layer_norm"}
        for n in names:
            dict(oc.named_parameters())[n].requires_grad_(True)
    elif hasattr(oc.visual, "trunk"):  # the timm rule, and the original's walk on the text tower
        for p in oc.parameters():
            p.requires_grad_(False)
        names = ref.timm_trunk_norms(oc) + [n for n, _ in oc.named_parameters() if ".resblocks." in n]
        names = [n for n in names if n.startswith("visual.") or n.split(".")[-2] in ("ln_1", "ln_2")]
        for n in names:
            dict(oc.named_parameters())[n].requires_grad_(True)
    else:
        ref.trainable_norms(oc)
        names = [n for n, p in oc.named_parameters() if p.requires_grad]
    params = dict(oc.named_parameters())
    assert sorted(names) == sorted(oc_name(oc, k) for k in norms)

    # stage one: logits, loss and every LayerNorm gradient
    m.train()
    loss, logits = m.loss(images, labels)
    ref_logits = ref.stage_one_logits(oc, images, ids)
    ref_loss = F.cross_entropy(ref_logits, labels)
    assert relative_error(logits, ref_logits) < 1e-5 and abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    ours = torch.autograd.grad(loss, list(norms.values()))
    theirs = torch.autograd.grad(ref_loss, [params[oc_name(oc, k)] for k in norms])
    for key, a, b in zip(norms, ours, theirs, strict=True):
        assert relative_error(a, b) < 1e-4, key

    # the switch: the head's rows, then stage two's loss and the head's gradient
    m.start_stage_two()
    head = ref.initial_head(oc, ids)
    assert relative_error(m.head, head) < 1e-5
    assert not any(p.requires_grad for p in norms.values()) and m.head.requires_grad
    with torch.no_grad():
        shifted = head + 0.1 * torch.randn(head.shape, generator=torch.Generator().manual_seed(2))
        m.head.copy_(shifted)
    loss, logits = m.loss(images, labels)
    theirs_head = shifted.clone().requires_grad_(True)
    ref_logits = ref.stage_two_logits(oc, theirs_head, images)
    ref_loss = F.cross_entropy(ref_logits, labels)
    assert relative_error(logits, ref_logits) < 1e-5 and abs(float(loss.detach() - ref_loss.detach())) < 1e-5
    (ours,) = torch.autograd.grad(loss, [m.head])
    (theirs,) = torch.autograd.grad(ref_loss, [theirs_head])
    assert relative_error(ours, theirs) < 1e-5

    # selective inference on training and new classes, in a mixed order
    scored = [NEW[0], CLASSES[2], NEW[1], CLASSES[0]]
    other = method_for(clip, scored)
    other.load_trained({k: v.detach() for k, v in m.learnable().items()}, CLASSES)
    other.eval()
    with torch.no_grad():
        classifier = F.normalize(other.prepare(), dim=-1)
        want = ref.selective_classifier(oc, shifted, CLASSES, scored, lambda cs: full_ids(clip, cs))
        assert relative_error(classifier, want) < 1e-5
        ref_logits = oc.logit_scale.exp() * ref.normalised(oc.encode_image(images)) @ want.t()
        assert relative_error(other.logits(images), ref_logits) < 1e-5


def test_the_schedule_is_two_cosines_as_torch_steps_them():
    total, restart, lr = 17, 10, 2e-4
    schedule = Schedule("cosine_iter", lr, epochs=6, steps_per_epoch=3, warmup_epochs=0, min_lr=1e-6)
    schedule = Schedule(**{**schedule.__dict__, "steps": total, "restart": restart})
    p = torch.zeros(1, requires_grad=True)
    want = []
    for steps in (restart, total - restart):
        opt = torch.optim.AdamW([p], lr=lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps, eta_min=1e-6)
        for _ in range(steps):
            want.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    got = [schedule.lr_at(t // 3, t % 3) for t in range(total)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.fixture(scope="module")
def four_classes(tmp_path_factory):
    return make_image_folder(
        tmp_path_factory.mktemp("four"), classes=("red_thing", "green_thing", "blue_thing", "yellow_thing")
    )


def two_stage_args(folder, out, **extra):
    # 2 base classes x 4 shots = 8 images, batch 3: 3 steps per epoch (the last of 2); T = 8, S = 4
    return tiny_args(
        folder,
        out,
        **{
            "method": "2sfs",
            "train.epochs": "null",
            "train.iterations": 8,
            "train.batch_size": 3,
            "train.lr": 0.01,
            "data.subsample_classes": "base",
            **extra,
        },
    )


def test_two_stages_in_one_run_and_base_to_new(four_classes, tmp_path):
    out = tmp_path / "run"
    metrics = train_run(load_config(None, two_stage_args(four_classes, out)))
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert int(ckpt["prompt"]["stage"]) == 2 and ckpt["method_state"] == {"steps": 8}
    assert metrics["epochs"] == 3 and (out / "eval_imagefolder_new.json").is_file()
    history = [line.split(",") for line in (out / "history.csv").read_text().splitlines()[1:]]
    assert float(history[1][3]) == pytest.approx(
        1e-6 + (0.01 - 1e-6) * 0.5 * (1 + torch.cos(torch.tensor(3.0) * torch.pi / 4).item())
    )

    cfg = load_config(None, two_stage_args(four_classes, out))
    from coop.train.engine import setup

    for subset in ("base", "new"):
        cfg.data.subsample_classes = subset
        s = setup(cfg, ckpt)
        m = s.method.eval()
        with torch.no_grad():
            classifier = m.prepare()
            if subset == "base":  # the head's rows, the training classes' own
                assert m.on_training_classes and torch.equal(classifier, ckpt["prompt"]["head"])
            else:  # the adapted text tower (its trained LayerNorms), not the frozen one
                assert not m.on_training_classes and torch.equal(classifier, m.encode())
                fresh = setup(cfg).method.eval()
                assert not torch.allclose(fresh.encode(), classifier)
        norms = [k for k in ckpt["prompt"] if k not in ("head", "stage")]
        assert all(torch.equal(m.learnable()[k], ckpt["prompt"][k]) for k in norms)


def test_stopped_at_each_epoch_resumes_bit_identical(four_classes, tmp_path):
    """Epoch 1 ends in stage one (3 steps), epoch 2 in stage two (the switch at step 4 inside it)."""
    whole = train_run(load_config(None, two_stage_args(four_classes, tmp_path / "whole")))
    want = torch.load(tmp_path / "whole" / "checkpoint.pt", weights_only=True)["prompt"]
    for epoch in (1, 2):
        out = tmp_path / f"stopped-{epoch}"
        with interrupted_at(epoch), pytest.raises(KeyboardInterrupt):
            train_run(load_config(None, two_stage_args(four_classes, out)))
        stage = int(torch.load(out / "checkpoint.pt", weights_only=True)["prompt"]["stage"])
        assert stage == epoch  # 1 before the switch, 2 after it
        resumed = train_run(load_config(None, two_stage_args(four_classes, out)))
        final = torch.load(out / "checkpoint.pt", weights_only=True)["prompt"]
        assert final.keys() == want.keys() and all(torch.equal(final[k], v) for k, v in want.items())
        assert resumed["final_train_loss"] == whole["final_train_loss"]
        assert resumed["accuracy"] == whole["accuracy"]


@pytest.mark.parametrize(
    "extra, error, words",
    [
        ({"model.name": REPO / "configs" / "models" / "mobileclip-s-tiny.json"}, ModelError, "image tower"),
        ({"twosfs.text_start": 5}, ConfigError, "twosfs.text_start=5"),
        ({"twosfs.peft": "lora", "lora.layers": "[7]"}, ConfigError, "lora.layers"),
        ({"train.precision": "fp16"}, ConfigError, "train.precision=fp16"),
    ],
)
def test_refusals_in_one_line_before_the_run_folder(image_folder, tmp_path, extra, error, words):
    out = tmp_path / "never"
    with pytest.raises(error) as e:
        train_run(load_config(None, tiny_args(image_folder, out, method="2sfs", **extra)))
    assert "\n" not in str(e.value) and words in str(e.value)
    assert not out.exists()


def test_text_only_runs_on_a_cnn_image_tower(image_folder, tmp_path):
    """twosfs.towers=[text] leaves the image tower frozen: MobileCLIP-S's FastViT then runs."""
    extra = {
        "model.name": REPO / "configs" / "models" / "mobileclip-s-tiny.json",
        "method": "2sfs",
        "twosfs.towers": "[text]",
        "train.epochs": "null",
        "train.iterations": 3,
    }
    metrics = train_run(load_config(None, tiny_args(image_folder, tmp_path / "run", **extra)))
    prompt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["prompt"]
    assert all(k.startswith("text.") for k in prompt if k not in ("head", "stage"))
    assert metrics["n_test"] > 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["twosfs_towers"] == "text"


def test_run_names_say_what_stage_one_tunes():
    from coop.config.run_names import run_name

    names = {
        peft: run_name(load_config(None, ["method=2sfs", f"twosfs.peft={peft}", "twosfs.towers=[text]"]))
        for peft in ("ln", "bitfit", "lora")
    }
    assert names["ln"].endswith("/2sfs_ln_text_s0.6_from0-0/seed1")
    assert names["bitfit"].endswith("/2sfs_bitfit_text_s0.6_from0-0/seed1")
    assert names["lora"].endswith("/2sfs_lora_text_s0.6_r2_a1_drop0.25_qkv_all/seed1")

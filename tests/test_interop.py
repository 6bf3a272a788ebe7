"""Prompts in and out: the originals' Dassl checkpoints imported, exported runs, load_classifier.

Every import test writes a checkpoint file the way the original codebase's Dassl trainer does
(`torch.save` of {"state_dict", "epoch", "optimizer", "scheduler", "val_result"}, with the
warm-up scheduler's successor pickled as an object, and the original state-dict names, buffers
and frozen CLIP weights), imports it, and checks the run's logits against `coop.reference.coop` and
`coop.reference.vision_prompts` computed from the file's own tensors on the open_clip model.
"""

from __future__ import annotations

import csv
import itertools
import json
from types import SimpleNamespace

import open_clip
import pytest
import torch
from conftest import REPO, make_image_folder, randomise_text_tower, run_tool_in_process, tiny_args
from torch import nn

import coop
from coop.config.load import load_config
from coop.data.images import load_image
from coop.interop import (
    ImportShapeError,
    MappingError,
    OriginalCheckpointError,
    export_run,
    import_checkpoint,
    read_export,
)
from coop.methods import TransferError
from coop.reference.coop import cocoop_logits, coop_text_features, reference_inputs
from coop.reference.vision_prompts import _clip_logits, ivlp_logits, maple_logits, vpt_logits
from coop.results.tables import load_runs
from coop.train.checkpoint import load_checkpoint
from coop.train.engine import setup
from coop.train.evaluation import evaluate_checkpoint
from coop.train.run_features import eval_features
from coop.train.runner import train_run

# Vision width 96 against text width 64, so that a transposed coupling or a swapped tower shows.
WIDE = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 96, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 3},
}
W, V, E, N_CLS = 64, 96, 32, 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(open_clip model, its config JSON, its weights file, an image folder, 4 test images)."""
    root = tmp_path_factory.mktemp("interop")
    config = root / "interop-wide.json"
    config.write_text(json.dumps(WIDE))
    open_clip.add_model_config(config)
    torch.manual_seed(0)
    oc = randomise_text_tower(open_clip.create_model("interop-wide", pretrained=None)).eval()
    weights = root / "weights.pt"
    torch.save(oc.state_dict(), weights)
    folder = make_image_folder(root / "images")
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return SimpleNamespace(oc=oc, config=config, weights=weights, folder=folder, images=images)


def overrides(m, *extra):
    return [f"model.name={m.config}", f"model.pretrained={m.weights}", "data.name=imagefolder",
            f"data.root={m.folder}", "data.num_workers=0", "device=cpu", *extra]  # fmt: skip


def dassl_file(path, state_dict, epoch=5):
    """A checkpoint as Dassl's save_checkpoint writes it, with an SGD state and a warm-up scheduler
    whose successor (a torch LR scheduler holding the optimizer) is pickled as an object."""
    p = nn.Parameter(torch.randn(2, 3))
    opt = torch.optim.SGD([p], lr=0.002, momentum=0.9, weight_decay=5e-4)
    p.grad = torch.ones_like(p)
    opt.step()
    successor = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epoch)
    scheduler = {"successor": successor, "warmup_epoch": 1, "cons_lr": 1e-5, "last_epoch": epoch}
    state = {"state_dict": state_dict, "epoch": epoch, "optimizer": opt.state_dict(), "scheduler": scheduler,
             "val_result": None}  # fmt: skip
    torch.save(state, path)
    return path


SEEDS = itertools.count(1)  # every tensor of every file differs


def rand(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(next(SEEDS)))


FROZEN = {  # a few of the frozen CLIP weights a whole-model state dict holds
    "image_encoder.conv1.weight": (V, 3, 16, 16),
    "image_encoder.transformer.resblocks.0.attn.in_proj_weight": (3 * V, V),
    "text_encoder.positional_embedding": (77, W),
    "text_encoder.transformer.resblocks.1.ln_1.weight": (W,),
    "logit_scale": (),
}


def original_state(method):
    """The original's state dict for `method` (names, buffers, frozen weights), random values."""
    buffers = {"token_prefix": rand(N_CLS, 1, W), "token_suffix": rand(N_CLS, 72, W)}
    whole = {k: rand(*s) for k, s in FROZEN.items()}
    if method in ("coop", "kgcoop"):
        sd = {"ctx": rand(N_CLS, 4, W) if method == "coop" else rand(4, W), **buffers}
        if method == "kgcoop":  # created by KgCoOp's prompt learner, never used in its forward
            sd |= {
                "bias_vectors": rand(1, 512),
                "meta_net.linear1.weight": rand(512, 512),
                "meta_net.linear1.bias": rand(512),
            }
        return sd
    if method == "cocoop":
        return {"ctx": rand(4, W), "meta_net.linear1.weight": rand(E // 16, E), "meta_net.linear1.bias": rand(E // 16),
                "meta_net.linear2.weight": rand(W, E // 16), "meta_net.linear2.bias": rand(W), **buffers}  # fmt: skip
    vision = {"image_encoder.VPT": rand(2, V), "image_encoder.transformer.resblocks.1.VPT_shallow": rand(2, V),
              "image_encoder.transformer.resblocks.2.VPT_shallow": rand(2, V)}  # fmt: skip
    if method == "vpt":
        return {**whole, **vision}
    learner = {f"prompt_learner.{k}": t for k, t in buffers.items()} | {"prompt_learner.ctx": rand(2, W)}
    if method == "maple":
        coupling = {
            "prompt_learner.compound_prompts_text.0": rand(2, W),
            "prompt_learner.compound_prompts_text.1": rand(2, W),
        }
        for name in ["proj", "compound_prompt_projections.0", "compound_prompt_projections.1"]:
            coupling |= {
                f"prompt_learner.{name}.weight": rand(V, W) / 8,
                f"prompt_learner.{name}.bias": rand(V) / 8,
            }
        return {**whole, **learner, **coupling}
    text = {f"text_encoder.transformer.resblocks.{i}.VPT_shallow": rand(2, W) for i in (1, 2)}
    sd = {**whole, **learner, **text, **vision}
    if method == "promptsrc":  # its frozen copy of the image tower
        sd["prompt_learner.ZS_image_encoder.conv1.weight"] = rand(V, 3, 16, 16)
    return sd


def linear(weight, bias):
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
    return layer


def text_layout(clf, ctx):
    """The reference's view of a prompt: our learner's layout settings with the file's context."""
    pl = clf.method.prompt_learner
    return SimpleNamespace(ctx=ctx, n_ctx=pl.n_ctx, position=pl.position, csc=pl.csc, ctx_init=pl.ctx_init,
                           classnames=pl.classnames, deep_ctx=None, depth=1)  # fmt: skip


def reference(method, sd, m, clf):
    """The original's logits (B, n_cls), computed on open_clip's modules from the file's tensors."""
    oc, images = m.oc, m.images
    get = lambda k: sd.get(k, sd.get(f"prompt_learner.{k}"))  # noqa: E731
    if method in ("coop", "kgcoop"):
        text = coop_text_features(oc, text_layout(clf, get("ctx")))
        return _clip_logits(oc, oc.encode_image(images), text)
    if method == "cocoop":
        meta = nn.Sequential(linear(sd["meta_net.linear1.weight"], sd["meta_net.linear1.bias"]), nn.ReLU(),
                             linear(sd["meta_net.linear2.weight"], sd["meta_net.linear2.bias"]))  # fmt: skip
        return cocoop_logits(oc, text_layout(clf, get("ctx")), meta, oc.encode_image(images))[0]
    if method == "maple":
        ids, _, slots = reference_inputs(oc, text_layout(clf, get("ctx")))
        deep = torch.stack([get(f"compound_prompts_text.{i}") for i in (0, 1)])
        names = ["proj", "compound_prompt_projections.0", "compound_prompt_projections.1"]
        projections = [linear(get(f"{n}.weight"), get(f"{n}.bias")) for n in names]
        return maple_logits(oc, images, ids, slots, get("ctx"), deep, projections)
    vision = [sd["image_encoder.VPT"]] + [
        sd[f"image_encoder.transformer.resblocks.{i}.VPT_shallow"] for i in (1, 2)
    ]
    if method == "vpt":
        texts = [f"a photo of a {c.replace('_', ' ')}." for c in clf.classnames]
        return vpt_logits(oc, images, open_clip.get_tokenizer("interop-wide")(texts), vision)
    ids, _, slots = reference_inputs(oc, text_layout(clf, get("ctx")))
    deep = torch.stack([sd[f"text_encoder.transformer.resblocks.{i}.VPT_shallow"] for i in (1, 2)])
    return ivlp_logits(oc, images, ids, slots, get("ctx"), deep, vision)


IMPLIED = {  # what config.yaml must say after the import
    "coop": {"prompt.n_ctx": 4, "prompt.csc": True, "prompt.depth": 1},
    "cocoop": {"prompt.n_ctx": 4, "prompt.csc": False},
    "kgcoop": {"prompt.n_ctx": 4, "prompt.csc": False},
    "vpt": {"vision.n_ctx": 2, "vision.depth": 3},
    "ivlp": {"prompt.n_ctx": 2, "prompt.depth": 3, "vision.n_ctx": 2, "vision.depth": 3},
    "maple": {"prompt.n_ctx": 2, "prompt.depth": 3, "prompt.ctx_init": "a photo of a"},
    "promptsrc": {"prompt.n_ctx": 2, "prompt.depth": 3, "vision.n_ctx": 2, "vision.depth": 3},
}


@pytest.mark.parametrize("method", list(IMPLIED))
def test_import_gives_the_originals_logits(model, tmp_path, method):
    sd = original_state(method)
    path = dassl_file(tmp_path / "model.pth.tar-5", sd)
    folder = import_checkpoint(method, path, tmp_path / "run", overrides(model), evaluate=False)
    cfg = load_config(str(folder / "config.yaml"))
    for key, value in IMPLIED[method].items():
        assert cfg[key.split(".")[0]][key.split(".")[1]] == value, key
    ckpt = load_checkpoint(folder / "checkpoint.pt")
    assert (
        ckpt["finished"]
        and ckpt["epoch"] == 5
        and ckpt["classnames"] == ["blue_thing", "green_thing", "red_thing"]
    )
    assert ckpt["imported"]["from"] == method
    clf = coop.load_classifier(folder)
    with torch.no_grad():
        expected = reference(method, sd, model, clf)
    torch.testing.assert_close(clf.logits(model.images), expected, rtol=1e-4, atol=1e-4)


def test_import_evaluates_and_every_tool_reads_the_folder(model, tmp_path):
    path = dassl_file(tmp_path / "model.pth.tar-50", original_state("kgcoop"), epoch=50)
    folder = import_checkpoint(
        "kgcoop", path, tmp_path / "run", overrides(model, "eval.targets=[imagefolder]")
    )
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["method"] == "kgcoop" and metrics["n_test"] == 12 and metrics["epochs"] == 50
    assert (folder / "eval_imagefolder.json").is_file()
    again = evaluate_checkpoint(folder / "checkpoint.pt")  # tools/eval.py's path
    assert again["accuracy"] == metrics["accuracy"]
    runs = load_runs(tmp_path)  # tools/collect.py's
    assert list(runs["complete"]) == [True] and runs["method"][0] == "kgcoop"
    tensors, card = read_export(export_run(folder, tmp_path / "kgcoop.safetensors"))
    assert card["method"] == "kgcoop" and set(tensors) == {"ctx"}
    with pytest.raises(Exception, match="already holds a run"):
        import_checkpoint("kgcoop", path, folder, overrides(model))


def test_bad_files_are_one_line(model, tmp_path):
    class Code:  # a pickle that would run code when loaded
        def __reduce__(self):
            return (print, ("ran code from the file",))

    evil = tmp_path / "evil.pth.tar"
    torch.save({"state_dict": {"ctx": torch.zeros(4, W)}, "epoch": 1, "extra": Code()}, evil)
    with pytest.raises(OriginalCheckpointError, match="needs arbitrary unpickling .* refused") as e:
        import_checkpoint("coop", evil, tmp_path / "a", overrides(model))
    assert "\n" not in str(e.value)

    unknown = dassl_file(tmp_path / "u.pth.tar", {"ctx": rand(4, W), "adapter.fc.0.weight": rand(8, 8)})
    with pytest.raises(
        MappingError, match=r"'adapter.fc.0.weight' is not a name that a coop checkpoint holds$"
    ):
        import_checkpoint("coop", unknown, tmp_path / "b", overrides(model))
    wrong = dassl_file(tmp_path / "w.pth.tar", original_state("ivlp"))
    with pytest.raises(
        MappingError,
        match=r"VPT_shallow' is not a name that a maple checkpoint holds \(ivlp/promptsrc checkpoints hold it",
    ):
        import_checkpoint("maple", wrong, tmp_path / "c", overrides(model))

    bad = {**original_state("cocoop"), "ctx": rand(16, 48), "meta_net.linear2.bias": rand(48)}
    shapes = dassl_file(tmp_path / "s.pth.tar", bad)
    with pytest.raises(ImportShapeError) as e:
        import_checkpoint("cocoop", shapes, tmp_path / "d", overrides(model), evaluate=False)
    lines = str(e.value).splitlines()[1:]
    assert lines == ["ctx is (16, 48), interop-wide's text width is 64",
                     "meta_net.linear2.bias is (48,), interop-wide's text width is 64"]  # fmt: skip
    assert not (tmp_path / "d").exists()
    csc = dassl_file(tmp_path / "csc.pth.tar", {"ctx": rand(5, 4, W)})
    with pytest.raises(
        ImportShapeError,
        match=r"ctx is \(5, 4, 64\): class-specific context for 5 classes, the config has 3$",
    ):
        import_checkpoint("coop", csc, tmp_path / "e", overrides(model), evaluate=False)


def test_import_tool(model, tmp_path):
    path = dassl_file(tmp_path / "model.pth.tar-5", original_state("vpt"))
    res = run_tool_in_process(REPO / "tools" / "import_checkpoint.py",
                              ["--from", "vpt", path, "--out", tmp_path / "run", "--no-eval", *overrides(model)])  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1])["from"] == "vpt"
    res = run_tool_in_process(REPO / "tools" / "import_checkpoint.py",
                              ["--from", "vpt", tmp_path / "missing", "--out", tmp_path / "r2", *overrides(model)])  # fmt: skip
    assert res.returncode == 2 and res.stderr.strip().startswith("error: checkpoint not found")


# --- export, load_classifier, predict ------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(image_folder, tmp_path_factory):
    """A finished tiny CoOp run (shared context) and its export."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_run(load_config(None, tiny_args(image_folder, out, **{"train.epochs": 2})))
    exported = export_run(out, out.parent / "prompts.safetensors")
    return SimpleNamespace(run=out, exported=exported, folder=image_folder)


def test_export_round_trip_equals_eval(trained):
    tensors, card = read_export(trained.exported)
    ckpt = load_checkpoint(trained.run / "checkpoint.pt")
    assert card["method"] == "coop" and card["classnames"] == ckpt["classnames"]
    assert card["model.pretrained"] == "none" and card["config"] == ckpt["config"]
    assert set(tensors) == {"ctx"} and torch.equal(tensors["ctx"], ckpt["prompt"]["ctx"])

    # eval.py's computation: the run rebuilt from its checkpoint, the cached test features
    s = setup(load_config(None, [], base=ckpt["config"]), ckpt)
    feats, labels = eval_features(s)
    with torch.no_grad():
        expected = s.method.logits(feats[0], s.method.prepare())
    clf = coop.load_classifier(trained.exported)
    images = torch.stack([clf.transform(load_image(item.path)) for item in s.dataset.test])
    torch.testing.assert_close(clf.logits(images), expected, rtol=1e-5, atol=1e-5)
    probs = clf.predict(images)
    assert probs.shape == (12, 3) and torch.allclose(probs.sum(-1), torch.ones(12))
    accuracy = 100.0 * float((probs.argmax(-1) == labels).float().mean())
    assert accuracy == pytest.approx(evaluate_checkpoint(trained.run / "checkpoint.pt")["accuracy"])
    assert clf.classnames == ckpt["classnames"]

    other = coop.load_classifier(trained.run, classnames=["cat", "dog"])  # shared context transfers
    assert other.predict(images).shape == (12, 2) and other.classnames == ["cat", "dog"]


def test_predict_tool_and_refusals(trained, tmp_path):
    out = tmp_path / "predictions.csv"
    (trained.folder / "test" / "broken.png").write_bytes(b"not an image")
    try:
        res = run_tool_in_process(REPO / "tools" / "predict.py",
                                  [trained.exported, trained.folder / "test", "--out", out, "--topk", 2, "--device", "cpu"])  # fmt: skip
    finally:
        (trained.folder / "test" / "broken.png").unlink()
    assert res.returncode == 0, res.stderr
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["path", "class_1", "prob_1", "class_2", "prob_2"]
    assert len(rows) == 14 and rows[1][0] == "blue_thing/0.png" and rows[5] == ["broken.png"]
    assert "images" in res.stderr  # the progress bar
    assert all(float(r[2]) >= float(r[4]) for r in rows[1:] if len(r) == 5)

    csc = tmp_path / "csc"
    train_run(load_config(None, tiny_args(trained.folder, csc, **{"train.epochs": 2, "prompt.csc": "true"})))
    with pytest.raises(TransferError, match="class-specific context"):
        coop.load_classifier(csc, classnames=["cat", "dog"])
    res = run_tool_in_process(
        REPO / "tools" / "export.py", [csc / "checkpoint.pt", "--out", tmp_path / "p.safetensors"]
    )
    assert res.returncode == 0 and json.loads(res.stdout)["tensors"] == {"ctx": [3, 4, 64]}
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(Exception, match="cannot read .* as safetensors"):
        coop.load_classifier(tmp_path / "x.safetensors")

"""HiCroPL against `coop.reference.hicropl`, the original's step written out on open_clip's modules
(full 77-token text pass, its per-layer Parameter lists, the mapping written into them with
`.data.copy_`, each attention spelled out): logits, loss, gradients, the mapped prompts and two
Adam steps agree to float precision on the tiny CLIP and the tiny timm towers; the description
features; evaluation maps once without touching the learned tensors; a tiny run end to end on an
image folder with a descriptions file written here, killed and resumed bit-identically; refusals."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY_CONFIG, kill_at_first_checkpoint, tiny_args
from test_protocols import data_root  # noqa: F401  (a fixture: a CoOp DATA folder)
from test_vision_families import family, offline  # noqa: F401  (fixtures: the shrunk timm families)
from torch import nn

import coop.reference.hicropl as reference
from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data import DataError
from coop.methods import build_method
from coop.methods.descriptions import description_features
from coop.methods.hicropl import HiCroPL
from coop.model.errors import ModelError
from coop.reference.coop import reference_inputs
from coop.train.preflight import check_model_limits
from coop.train.runner import train_run

CLASSNAMES = ["red_thing", "green thing", "blue whale", "a dog"]
SENTENCES = {
    "red thing": ["A red thing is red.", "Red things look warm and bright in a photo."],
    "green thing": ["Green, like grass."],
    "blue whale": ["The largest animal.", "A blue whale swims in the sea.", "It is blue and very long."],
    "a dog": ["A dog has four legs.", "Dogs bark."],
}
MAPPING = ("text2visual_net", "visual2text_net", "attn_pooling_text_nets", "attn_pooling_visual_nets")


def write_descriptions(folder: Path, sentences=SENTENCES) -> Path:
    path = folder / "descriptions.json"
    path.write_text(json.dumps(sentences))
    return path


def build(clip, descriptions: Path, *extra: str) -> HiCroPL:
    overrides = ["method=hicropl", "model.pretrained=none", "prompt.depth=2", "hicropl.cross_layer=1"]
    method = build_method(
        clip, CLASSNAMES, load_config(None, [*overrides, f"data.descriptions={descriptions}", *extra])
    )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # every tensor away from its initialisation (the proxies start as copies)
        for t in method.learnable().values():
            t.add_(0.3 * torch.randn(t.shape, generator=gen))
    return method


def reference_state(method: HiCroPL):
    """The original's per-layer Parameter lists and mapping modules, copied from ours."""
    pl = method.prompt_learner
    text = nn.ParameterList([nn.Parameter(pl.ctx.detach().clone())])
    text.extend(nn.Parameter(t.detach().clone()) for t in pl.deep_ctx)
    visual = nn.ParameterList(nn.Parameter(v.detach().clone()) for v in method.cross_prompts_visual)
    nets = SimpleNamespace(
        **{name: copy.deepcopy(getattr(method, name)) for name in MAPPING},
        text_proxy_token=method.text_proxy_token.detach().clone(),
        visual_proxy_token=method.visual_proxy_token.detach().clone(),
    )
    for name in MAPPING:
        getattr(nets, name).requires_grad_(True)  # trainable in the original, yet never reached
    return text, visual, nets


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Equal to float precision: the largest difference relative to the largest entry."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max()) < tol


def test_description_features_are_the_originals(tiny_openclip, tiny_clip):
    sentences = [SENTENCES[c.replace("_", " ")] for c in CLASSNAMES]
    ours = description_features(tiny_clip, sentences).mean
    want = reference.gpt_clip_classifier(tiny_openclip, sentences)
    assert ours.dtype == torch.float32 and torch.allclose(ours, want, atol=2e-6)
    normalised_last = unit(
        torch.stack([tiny_openclip.encode_text(torch.zeros(1, 77, dtype=torch.long))[0]] * 4)
    )
    assert (ours - normalised_last).abs().max() > 1e-3  # not a degenerate constant


def check_step(clip, oc, descriptions: Path, images: torch.Tensor, *extra: str) -> None:
    method = build(clip, descriptions, *extra)
    labels = torch.tensor([0, 3, 1])[: len(images)]
    text, visual, nets = reference_state(method)
    ids, _, slots = reference_inputs(oc, method.prompt_learner)
    fixed = reference.gpt_clip_classifier(oc, [SENTENCES[c.replace("_", " ")] for c in CLASSNAMES])
    cross, lambd = method.cross_layer, method.weight

    # evaluation: one mapping, into copies: the first test batch of the original
    before = {k: t.detach().clone() for k, t in method.learnable().items()}
    with torch.no_grad():
        ours_eval = method.logits(images)
        _, ref_eval = reference.hicropl_forward(
            oc,
            images,
            None,
            ids,
            slots,
            nets,
            copy.deepcopy(text),
            copy.deepcopy(visual),
            fixed,
            cross,
            lambd,
        )
    assert torch.allclose(ours_eval, ref_eval, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(t, before[k]) for k, t in method.learnable().items())

    trained = [method.prompt_learner.ctx, method.prompt_learner.deep_ctx, method.cross_prompts_visual]
    assert {id(p) for p in method.parameters() if p.requires_grad} == set(map(id, trained))
    ours_opt = torch.optim.Adam(trained, lr=0.01, eps=1e-3, weight_decay=5e-4)
    ref_params = [*text, *visual]
    ref_opt = torch.optim.Adam(ref_params, lr=0.01, eps=1e-3, weight_decay=5e-4)
    for step in range(2):
        ours, logits = method.loss(images, labels)
        ref, ref_logits = reference.hicropl_forward(
            oc, images, labels, ids, slots, nets, text, visual, fixed, cross, lambd
        )
        assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5), step
        assert torch.allclose(ours, ref, rtol=1e-5), step
        # the mapped prompts the step ran with
        assert close(method.cross_prompts_visual, torch.stack(list(visual))), step
        assert close(method.prompt_learner.deep_ctx, torch.stack(list(text[1:]))), step
        ours_opt.zero_grad()
        ref_opt.zero_grad()
        ours.backward()
        ref.backward()
        mapping = [p for name in MAPPING for p in getattr(nets, name).parameters()]
        assert all(p.grad is None for p in mapping)  # the original's mappers get no gradient
        ref_grads = {
            "ctx": text[0].grad,
            "deep_ctx": torch.stack([t.grad for t in text[1:]]),
            "cross_prompts_visual": torch.stack([v.grad for v in visual]),
        }
        for name, p in zip(ref_grads, trained, strict=True):
            b = ref_grads[name]
            assert close(p.grad, b, 1e-4), (step, name)
        ours_opt.step()
        ref_opt.step()
    assert close(method.prompt_learner.ctx, text[0])
    assert not torch.equal(method.cross_prompts_visual, before["cross_prompts_visual"])
    for name in method.mapping_tensors():  # stored, never trained
        assert torch.equal(method.learnable()[name], before[name]), name


def test_step_equals_the_originals_on_tiny_clip(tiny_openclip, tiny_clip, tmp_path):
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    check_step(tiny_clip, tiny_openclip, write_descriptions(tmp_path), images, "prompt.n_ctx=3")


def test_step_equals_the_originals_on_timm_towers(family, tmp_path):  # noqa: F811
    """EVA02's and PE-Core's timm image towers (shrunk) against the reference; SigLIP's (its own
    tokenizer, which the reference's CLIP BPE cannot read) trains a step through both towers."""
    name, _, _, _, clip, oc = family
    size = clip.image_size
    images = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    if name != "siglip":
        check_step(clip, oc, write_descriptions(tmp_path), images)
        return
    method = build(clip, write_descriptions(tmp_path))
    loss, logits = method.loss(images, torch.tensor([0, 2]))
    loss.backward()
    assert torch.isfinite(loss) and logits.shape == (2, len(CLASSNAMES))
    pl = method.prompt_learner
    assert all(t.grad.abs().max() > 0 for t in (pl.ctx, pl.deep_ctx, method.cross_prompts_visual))


def test_refusals_in_one_line_before_the_run(tmp_path, image_folder):
    descriptions = write_descriptions(tmp_path)
    base = ["method=hicropl", f"model.name={TINY_CONFIG}", "prompt.depth=2", "hicropl.cross_layer=1"]

    def refused(error, *extra):
        cfg = load_config(None, [*base, f"data.descriptions={descriptions}", *extra])
        with pytest.raises(error) as e:
            check_model_limits(cfg)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "hicropl.cross_layer=2 must be in 1..prompt.depth-1=1" in refused(
        ConfigError, "hicropl.cross_layer=2"
    )
    assert "prompt.depth=3 is above the image tower's 2 layers" in refused(
        ConfigError, "prompt.depth=3", "hicropl.cross_layer=1"
    )
    assert "vision.n_ctx=4 conflicts with prompt.n_ctx" in refused(ConfigError, "vision.n_ctx=4")
    assert "prompt.csc=true" in refused(ConfigError, "prompt.csc=true")
    cnn = REPO / "configs" / "models" / "mobileclip-s-tiny.json"
    assert refused(ModelError, f"model.name={cnn}").startswith("method=hicropl prompts the image tower")
    with pytest.raises(ConfigError, match="needs data.descriptions=FILE"):
        check_model_limits(load_config(None, base))
    with pytest.raises(DataError, match="does not exist"):
        check_model_limits(load_config(None, [*base, f"data.descriptions={tmp_path / 'none.json'}"]))
    # a run: refused before its folder exists
    out = tmp_path / "run"
    args = tiny_args(image_folder, out, method="hicropl", **{"prompt.depth": 2, "hicropl.cross_layer": 2})
    with pytest.raises(ConfigError):
        train_run(load_config(None, [*args, f"data.descriptions={descriptions}"]))
    assert not out.exists()


def test_bench_hicropl_matches_the_reference_and_measures_memory(tmp_path, capsys):
    from test_bench import load_tool

    bench = load_tool("bench_hicropl")
    out_json = tmp_path / "hicropl.json"
    args = ["--model", str(TINY_CONFIG), "--classes", "4", "--batch", "2", "--no-memory"]
    args += ["--set", "prompt.depth=2", "--set", "hicropl.cross_layer=1", "--json", str(out_json)]
    assert bench.main(args) == 0
    assert "speed-up:" in capsys.readouterr().out
    step = json.loads(out_json.read_text())["steps"][0]
    # the shared prefix [SOS][v1..v16] once, then each prompt's own tokens up to [EOS]
    assert step["reference_text"] == 4 * 77 and step["ours_text"] < step["reference_text"] / 4
    assert step["bound"] > 1 and step["loss_diff"] < 1e-5
    assert set(step["grad_diff"]) == {"ctx", "deep_ctx", "cross_prompts_visual"}
    assert max(step["grad_diff"].values()) < 1e-4
    # the memory child's measurement, in this process
    child = SimpleNamespace(device="cpu", model=str(TINY_CONFIG), memory_classes=4, batch=2)
    child.set = ["prompt.depth=2", "hicropl.cross_layer=1"]
    assert bench.step_memory(child, grad_checkpointing=True) >= 0


def test_published_mean_is_the_readmes():
    from coop.results.published import lookup
    from coop.results.tables import harmonic_mean

    row = [lookup("hicropl", "base_to_new", "average", m) for m in ("accuracy", "new_accuracy", "hm")]
    assert [f.value for f in row] == [85.89, 77.99, 81.75] and all(f.checked for f in row)
    assert harmonic_mean(85.89, 77.99) == pytest.approx(81.75, abs=0.006)


def test_fp16_keeps_the_originals_dtypes(tiny_openclip, tmp_path):
    """train.precision=fp16 as the original's PREC=fp16: every prompt, mapper, pooling and proxy
    tensor half; the description features fp32; the loss in fp32; a step reaches the prompts."""
    import coop

    clip = coop.CLIP.from_openclip(copy.deepcopy(tiny_openclip))  # its own copy: it becomes half
    method = build(clip, write_descriptions(tmp_path), "prompt.n_ctx=2")
    described = method.descriptions.clone()
    method.to_half()
    assert all(t.dtype == torch.half for t in method.learnable().values())
    assert method.descriptions.dtype == torch.float32 and torch.equal(method.descriptions, described)
    images = torch.randn(2, 3, 32, 32).half()
    loss, logits = method.loss(images, torch.tensor([0, 2]))
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == logits.dtype == torch.float32
    assert method.cross_prompts_visual.grad.dtype == torch.half
    assert method.cross_prompts_visual.grad.abs().max() > 0


def test_base_to_new_end_to_end_killed_and_resumed_bit_identically(data_root, tmp_path):  # noqa: F811
    """Trained on ImageNet's base half (a descriptions file written here), scored on its new half and
    on ImageNet-A's classes with their own description features; re-evaluating the checkpoint gives
    the same accuracy (an evaluation maps into copies); tools/train.py killed with SIGKILL after its
    first checkpoint and resumed ends with the same tensors, loss and accuracy."""
    from coop.train.evaluation import evaluate_checkpoint

    sentences = {
        f"{c} thing": [f"a {c} thing.", f"something {c}."] for c in ("red", "green", "blue", "yellow")
    }
    common = [f"model.name={TINY_CONFIG}", "model.pretrained=none", "method=hicropl", "data.name=imagenet"]
    common += [f"data.root={data_root}", "data.subsample_classes=base", "eval.targets=[imagenet_a]"]
    common += ["data.shots=4", "data.num_workers=0", "train.batch_size=4", "train.epochs=2", "device=cpu"]
    common += ["prompt.depth=2", "prompt.n_ctx=2", "hicropl.cross_layer=1", "train.lr=0.01"]
    common += [f"data.descriptions={write_descriptions(tmp_path, sentences)}"]
    whole = tmp_path / "whole"
    metrics = train_run(load_config(None, [*common, f"output_dir={whole}"]))
    assert (
        metrics["epochs"] == 2 and metrics["hicropl_cross_layer"] == 1 and metrics["hicropl_weight"] == 12.0
    )
    assert json.loads((whole / "eval_imagenet_new.json").read_text())["n_test"] == 6
    assert len(json.loads((whole / "eval_imagenet_a.json").read_text())["per_class_accuracy"]) == 2
    assert evaluate_checkpoint(whole / "checkpoint.pt")["accuracy"] == metrics["accuracy"]

    out = tmp_path / "killed"
    kill_at_first_checkpoint(
        [sys.executable, str(REPO / "tools" / "train.py"), *common, f"output_dir={out}"], out
    )
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] < 2, "killed too late"
    resumed = train_run(load_config(None, [*common, f"output_dir={out}"]))
    final = torch.load(out / "checkpoint.pt", weights_only=True)["prompt"]
    want = torch.load(whole / "checkpoint.pt", weights_only=True)["prompt"]
    assert {"ctx", "deep_ctx", "cross_prompts_visual", "text_proxy_token"} <= set(want)
    assert final.keys() == want.keys() and all(torch.equal(final[k], v) for k, v in want.items())
    assert resumed["final_train_loss"] == metrics["final_train_loss"]
    assert resumed["accuracy"] == metrics["accuracy"]

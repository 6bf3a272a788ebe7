"""MMRL: our towers with representation tokens against the reference on open_clip modules (loss,
logits and the gradient of every learned tensor; tokenizers without a start token), the layer lists of each tower (ViT-L-14's 12
text and 24 image blocks), split logits at evaluation, the recipe and its per-dataset table, and a
tiny run end to end (base-to-new, ImageNet-A, interrupted and resumed with a worker)."""

from __future__ import annotations

import argparse
import copy
import json

import open_clip
import pytest
import torch
from conftest import REPO, TINY_CONFIG, build_family, interrupted_at
from test_image_encoder import build, randomise, shrunk_config
from test_protocols import data_root  # noqa: F401  (a fixture)

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import run_name
from coop.methods import build_method
from coop.methods.base import TransferError
from coop.model.clip import CLIP
from coop.model.inserted import InsertedTokens
from coop.model.packing import pack
from coop.reference.mmrl import mmrl_frozen_text, mmrl_step, mmrl_text_features
from coop.train.evaluation import evaluate_checkpoint
from coop.train.runner import train_run

CLASSES = ["red thing", "green_thing", "t-shirt", "a much longer class name"]
# Vision width 128 (2 heads) against text width 64, and 2 image blocks against 3 text blocks.
TINY_WIDE = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 128, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 3},
}
TOL = 2e-5  # fp32, relative to the largest entry


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def mmrl(clip: CLIP, *overrides: str, classes=CLASSES, seed: int = 0):
    torch.manual_seed(seed)
    cfg = load_config(None, ["method=mmrl", "model.pretrained=none", "mmrl.rep_dim=48", *overrides])
    method = build_method(clip, classes, cfg)
    with torch.no_grad():  # the biases start at equal copies; spread every tensor so none hides
        for p in method.learnable().values():
            p.add_(0.05 * torch.randn_like(p))
    return method


def reference_step(oc, method, images, labels):
    learned = method.learnable()

    def pairs(side: str, n: int) -> list:
        return [(learned[f"rep_to_{side}.{j}.weight"], learned[f"rep_to_{side}.{j}.bias"]) for j in range(n)]

    ids = method.clip.tokenize([method.template.format(c.replace("_", " ")) for c in method.classnames])
    return mmrl_step(
        oc,
        images,
        labels,
        ids,
        mmrl_frozen_text(oc, ids),
        learned["rep_tokens"],
        pairs("text", len(method.text_blocks)),
        pairs("vision", len(method.vision_blocks)),
        learned["proj_rep"],
        method.text_blocks,
        method.vision_blocks,
        method.alpha,
        method.reg_weight,
        after=method.n_sos,
    )


@pytest.mark.parametrize(
    "case, overrides",
    [
        ("vit-b-16", ["mmrl.layers=[2,3]", "mmrl.vision_layers=[2,3]"]),
        ("tiny-wide", ["mmrl.layers=[2,3]", "mmrl.vision_layers=[1,2]", "mmrl.n_tokens=3"]),
        ("metaclip2-mt5", ["mmrl.layers=[1,2]", "mmrl.vision_layers=[1]"]),
        ("metaclip2-mt5", ["mmrl.layers=[2]", "mmrl.vision_layers=[1]"]),
    ],
)
def test_loss_logits_and_every_gradient_match_the_reference(case, overrides, tmp_path):
    """A shrunk ViT-B-16 (vision 128 / text 64 wide, 3 + 3 blocks), a tiny model with 2 image
    blocks whose tokens enter at the very first block, and MetaCLIP 2's family with mT5's tokenizer
    (no [SOS]: the text tokens enter at position 0, where the first text token sees them, of block
    1, or of block 2 after a block with no shared prefix; its [EOS], found by id, moves K to the
    right): ours (packed text with [SOS] +
    tokens as the shared prefix; frozen image pass sharing the blocks before the insertion)
    against the reference's 77+K text and 1+P+K image sequences and its second, full image pass."""
    if case == "metaclip2-mt5":
        pytest.importorskip("transformers")
        from coop.model.tiny_tokenizers import unigram

        edit = lambda oc: randomise(oc.visual, seed=1)  # noqa: E731
        clip, oc = build_family("metaclip2-tiny", unigram(tmp_path / "tok"), edit=edit)
    else:
        cfg = shrunk_config("ViT-B-16", text_layers=3) if case == "vit-b-16" else TINY_WIDE
        oc = build(cfg) if case == "vit-b-16" else randomise(open_clip.CLIP(**cfg), seed=1)
        clip = CLIP.from_openclip(oc, name=case)
    method = mmrl(clip, *overrides, "mmrl.reg_weight=3.0", "mmrl.alpha=0.6")
    assert method.n_sos == (0 if case == "metaclip2-mt5" else 1)
    size = clip.image_size
    gen = torch.Generator().manual_seed(0)
    images, labels = torch.randn(3, 3, size, size, generator=gen), torch.tensor([0, 3, 1])
    tensors = method.learnable()

    ours, fused = method.loss(images, labels)
    grads = torch.autograd.grad(ours, list(tensors.values()))
    ref, logits, logits_rep = reference_step(oc, method, images, labels)
    ref_grads = torch.autograd.grad(ref, list(tensors.values()))
    assert abs(float(ours.detach() - ref.detach())) < TOL * abs(float(ref.detach()))
    assert relative_error(fused, 0.6 * logits + 0.4 * logits_rep) < TOL
    for name, g, want in zip(tensors, grads, ref_grads, strict=True):
        assert want.abs().max() > 0, name  # every learned tensor gets a gradient
        assert relative_error(g, want) < 1e-4, name
    with torch.no_grad():
        assert relative_error(method.logits(images), 0.6 * logits + 0.4 * logits_rep) < TOL
    # the regularisers matter: lambda = 0 gives another loss
    method.reg_weight = 0.0
    assert abs(float(method.loss(images, labels)[0].detach() - ours.detach())) > 1e-3


def test_text_tokens_at_the_start_on_a_tower_without_the_causal_mask(tmp_path):
    """SigLIP's family (T5's tokenizer: no [SOS]; no causal mask; pooled at the last position):
    the text tokens enter at position 0 of block 0 and replace positions 0..K-1 at block 1, and
    the text features are the reference's over the whole 64+K sequence, read at its last position.
    (Without the mask, where they enter changes nothing: positions are added before, and attention
    without a mask does not see order. MMRL on SigLIP's timm image tower: tests/test_vision_families.py.)"""
    pytest.importorskip("transformers")
    from coop.model.tiny_tokenizers import unigram

    clip, oc = build_family("siglip-tiny", unigram(tmp_path / "tok", pad="</s>"))
    assert not clip.text.cuts
    ids = clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES])  # (n_cls, 64)
    gen = torch.Generator().manual_seed(0)
    tokens, layers = [torch.randn(2, clip.width, generator=gen) for _ in range(2)], [0, 1]
    x = clip.text.token_embedding(ids)
    with torch.no_grad():
        inserted = InsertedTokens(tokens, layers, after=0)
        ours = clip.text.encode_with_shared_prefix(
            x[:1, :0], x, clip.text.pool_positions(ids), inserted=inserted
        )
        want = mmrl_text_features(oc, ids, tokens, layers, after=0)
        plain = oc.encode_text(ids)
    assert relative_error(ours, want) < TOL
    assert relative_error(plain, want) > 1e-2  # the tokens matter


def test_new_classes_score_with_the_class_token_logits_training_classes_with_the_fusion(tiny_clip):
    base = mmrl(tiny_clip, classes=CLASSES[:3])
    tensors = {k: v.detach().clone() for k, v in base.learnable().items()}
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for classes, fused in ((["t-shirt", "red thing"], True), (["t-shirt", "blue thing"], False)):
        other = mmrl(tiny_clip, classes=classes, seed=5)
        other.load_trained(tensors, CLASSES[:3])
        with torch.no_grad():
            logits, logits_rep, *_ = other.all_logits(images)
            want = other.fuse(logits, logits_rep) if fused else logits
            assert other.on_training_classes is fused
            torch.testing.assert_close(other.logits(images), want)
            assert not torch.allclose(logits, other.fuse(logits, logits_rep))
    with pytest.raises(TransferError, match="rep_tokens"):
        mmrl(tiny_clip, "mmrl.rep_dim=16").load_trained(tensors, CLASSES[:3])


def test_each_tower_has_its_own_layer_list_vit_l_14():
    """ViT-L-14: 12 text and 24 image blocks; the defaults are 6..12 and 12..24 (the original's one
    list, 6..12, would leave the upper half of the image tower without tokens)."""
    cfg = shrunk_config("ViT-L-14", layers=24, text_layers=12)
    clip = CLIP.from_openclip(build(cfg), name="ViT-L-14-small")
    method = mmrl(clip, "mmrl.n_tokens=2")
    assert [i + 1 for i in method.text_blocks] == list(range(6, 13))
    assert [i + 1 for i in method.vision_blocks] == list(range(12, 25))
    assert len(method.rep.to_text) == 7 and len(method.rep.to_vision) == 13
    assert method.rep.to_vision[0].weight.shape == (clip.visual.width, 48)
    assert method.rep.to_text[0].weight.shape == (clip.width, 48)
    # the copies start equal, as the original's clones do
    fresh = build_method(clip, CLASSES, load_config(None, ["method=mmrl", "model.pretrained=none"])).rep
    for copies in (fresh.to_vision, fresh.to_text):
        assert all(
            torch.equal(f.weight, copies[0].weight) and torch.equal(f.bias, copies[0].bias) for f in copies
        )
    loss, _ = method.loss(torch.randn(2, 3, clip.image_size, clip.image_size), torch.tensor([0, 1]))
    assert torch.isfinite(loss)
    explicit = mmrl(clip, "mmrl.layers=[6,7,8,9,10,11,12]", "mmrl.vision_layers=[18,24]")
    assert explicit.vision_blocks == [17, 23] and len(explicit.rep.to_vision) == 2
    with pytest.raises(ConfigError, match=r"mmrl.layers=\[13\] names block 13, and the tower has 12"):
        mmrl(clip, "mmrl.layers=[13]")


def test_recipe_dataset_table_and_errors():
    b2n = load_config(str(REPO / "configs" / "mmrl" / "vit_b16.yaml"), ["data.name=stanford_cars"])
    assert (b2n.train.optimizer, b2n.train.lr, b2n.train.weight_decay) == ("adamw", 0.001, 0.0005)
    assert (b2n.train.batch_size, b2n.train.epochs, list(b2n.train.crop_scale)) == (4, 10, [0.5, 1.0])
    assert (b2n.train.warmup_epochs, b2n.train.warmup_lr, b2n.mmrl.reg_weight) == (1, 1e-5, 7.0)
    assert load_config(None, ["method=mmrl", "data.name=stanford_cars"]).mmrl.reg_weight == 7.0
    euro = load_config(None, ["method=mmrl", "data.name=eurosat"])
    assert (euro.mmrl.reg_weight, euro.mmrl.rep_dim) == (0.01, 2048)
    b2n_euro = load_config(str(REPO / "configs" / "mmrl" / "vit_b16.yaml"), ["data.name=eurosat"])
    assert b2n_euro.mmrl.rep_dim == 2048  # the documented base-to-new command: the table's d_r
    imagenet = load_config(None, ["method=mmrl", "data.name=imagenet"])
    assert (imagenet.train.batch_size, imagenet.train.epochs, imagenet.mmrl.reg_weight) == (32, 5, 0.5)
    assert load_config(None, ["method=mmrl", "data.name=dtd", "mmrl.reg_weight=2"]).mmrl.reg_weight == 2
    fs = load_config(str(REPO / "configs" / "mmrl" / "vit_b16_few_shot.yaml"), ["data.name=dtd"])
    assert (fs.train.batch_size, fs.train.epochs, fs.mmrl.reg_weight) == (32, 50, 6.0)
    xd = load_config(str(REPO / "configs" / "mmrl" / "vit_b16_cross_datasets.yaml"))
    assert (xd.data.name, xd.train.epochs, xd.train.warmup_epochs, xd.train.batch_size) == (
        "imagenet",
        1,
        0,
        32,
    )
    assert (xd.mmrl.reg_weight, xd.mmrl.rep_dim) == (0.2, 512)  # the script's command line wins
    assert run_name(euro).split("/")[3] == "mmrl_k5_dr2048_lauto_vlauto_a0.7_lam0.01"
    for bad, match in (
        ("mmrl.layers=[3,2]", "mmrl.layers"),
        ("mmrl.alpha=2", "mmrl.alpha"),
        ("mmrl.n_tokens=0", "mmrl.n_tokens"),
        ("mmrl.reg_weight=-1", "mmrl.reg_weight"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(None, ["method=mmrl", bad])


def test_half_precision_layout_and_bf16_autocast(tiny_clip):
    method = mmrl(tiny_clip)
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    fp32, _ = method.loss(images, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16, _ = method.loss(images, labels)
    assert abs(float(bf16 - fp32)) < 0.05 * abs(float(fp32))
    half = mmrl(CLIP.from_openclip(open_clip.create_model(str(TINY_CONFIG.stem), pretrained=None)))
    half.to_half()
    assert half.rep.tokens.dtype == torch.float16 and half.proj_rep.dtype == torch.float32
    assert half.clip.visual.proj.dtype == torch.float16


def test_teacher_text_in_the_towers_precision(tiny_openclip):
    """t_zs as the original's zero-shot CLIP computes it: under fp16 the half tower's features
    normalised in half (the original leaves that CLIP half under PREC=fp16), not the fp32 features
    of the same weights; under bf16 autocast (amp) the fp32 tower's, autocast off."""
    half = mmrl(CLIP.from_openclip(copy.deepcopy(tiny_openclip)))
    half.to_half()
    ids = half.clip.tokenize([half.template.format(c.replace("_", " ")) for c in CLASSES])
    with torch.no_grad():
        x = half.clip.text(ids)  # (n_cls, E), fp16
        written = (x / x.norm(dim=-1, keepdim=True)).float()
        y = copy.deepcopy(half.clip.text).float()(ids)  # the same weights in fp32
        fp32 = y / y.norm(dim=-1, keepdim=True)
    t_zs = half.frozen_text()
    assert x.dtype == torch.float16 and t_zs.dtype == torch.float32
    assert torch.equal(t_zs, written)
    assert (t_zs - fp32).abs().max() > 1e-4  # fp16 rounding, not fp32's
    amp = mmrl(CLIP.from_openclip(copy.deepcopy(tiny_openclip)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t_amp = amp.frozen_text()
    assert torch.allclose(t_amp, mmrl_frozen_text(tiny_openclip, ids), atol=1e-6)


def learned(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]


def test_end_to_end_base_to_new_transfer_and_resume(data_root, tmp_path, monkeypatch):  # noqa: F811
    common = [f"model.name={TINY_CONFIG}", "model.pretrained=none", "method=mmrl", "data.name=imagenet"]
    common += [f"data.root={data_root}", "data.subsample_classes=base", "eval.targets=[imagenet_a]"]
    common += ["data.shots=4", "data.num_workers=0", "train.batch_size=4", "train.epochs=3", "device=cpu"]
    out = tmp_path / "run"
    metrics = train_run(load_config(None, [*common, f"output_dir={out}"]))
    assert metrics["epochs"] == 3 and metrics["mmrl_reg_weight"] == 0.5  # ImageNet's lambda
    assert json.loads((out / "eval_imagenet_new.json").read_text())["n_test"] == 6
    assert len(json.loads((out / "eval_imagenet_a.json").read_text())["per_class_accuracy"]) == 2
    assert set(learned(out)) == {"rep_tokens", "proj_rep"} | {
        f"rep_to_{side}.{j}.{p}"
        for side, n in (("text", 3), ("vision", 2))
        for j in range(n)
        for p in ("weight", "bias")
    }
    assert evaluate_checkpoint(out / "checkpoint.pt")["accuracy"] == metrics["accuracy"]

    resumed = tmp_path / "resumed"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        train_run(load_config(None, [*common, f"output_dir={resumed}"]))
    again = train_run(load_config(None, [*common, f"output_dir={resumed}", "data.num_workers=1"]))
    for key, t in learned(out).items():
        assert torch.equal(learned(resumed)[key], t), key
    assert again["final_train_loss"] == metrics["final_train_loss"]


def test_bench_vl_mmrl_matches_the_reference(tmp_path, capsys):
    from test_bench import load_tool

    out_json = tmp_path / "vl.json"
    args = ["--method", "mmrl", "--model", str(TINY_CONFIG), "--classes", "4", "--batch", "2", "--no-memory"]
    assert load_tool("bench_vl").main([*args, "--json", str(out_json)]) == 0
    assert "speed-up:" in capsys.readouterr().out
    step = json.loads(out_json.read_text())["steps"][0]
    assert step["reference_text"] == 4 * (77 + 5) and step["ours_text"] < step["reference_text"] / 4
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4
    assert {"rep_tokens", "proj_rep", "rep_to_text.2.bias", "rep_to_vision.1.weight"} <= set(
        step["grad_diff"]
    )
    # --reference-memory's child process: the official step with MMRL's own inputs (ids, t_zs)
    child = argparse.Namespace(device="cpu", model=str(TINY_CONFIG), memory_classes=4, batch=2, set=[])
    assert load_tool("bench_vl").step_memory(child, "mmrl", grad_checkpointing=False, reference=True) >= 0


def test_a_packing_after_a_longer_prefix_is_the_packing_built_for_it():
    lengths = torch.tensor([3, 7, 2, 5])
    grown = pack(lengths, prefix=1, groups=2, chunk=8).with_prefix(6)
    want = pack(lengths, prefix=6, groups=2, chunk=8)
    assert grown.prefix == 6 and torch.equal(grown.mask, want.mask) and torch.equal(grown.slot, want.slot)

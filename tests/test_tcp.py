"""TCP against its reference on OpenCLIP's modules (logits and every learned gradient, classes of
mixed token lengths; tokenizers without a start token), transfer to other classes, recipe and
config errors."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, build_family
from omegaconf import OmegaConf

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.methods import build_method
from coop.methods.tcp import PROMPT_TEMPLATES, TEACHER_TEMPLATES
from coop.reference.tcp import tcp_loss, tcp_teacher, tcp_text_features

CLASSES = ["abyssinian", "great_pyrenees", "crane (bird)", "a very long compound class name of a cat"]


def tcp(clip, classes=CLASSES, dataset="oxford_pets", layer=2, weight=8.0, seed=3):
    cfg = load_config(
        None, ["method=tcp", f"data.name={dataset}", f"tcp.layer={layer}", f"tcp.weight={weight}"]
    )
    torch.manual_seed(0)
    method = build_method(clip, classes, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # ctx and the meta-net at non-trivial values: every term matters
        for t in method.learnable().values():
            t.copy_(0.5 * torch.randn(t.shape, generator=gen))
    return method


def reference(oc, method, dataset, classes, images, labels, tokenizer=None, placeholder="X"):
    """(loss, logits) of the reference; `tokenizer` and "x" placeholders for a family's tokenizer."""
    teacher = tcp_teacher(oc, classes, TEACHER_TEMPLATES[dataset], tokenizer)
    meta = {
        k.removeprefix("meta_net."): t for k, t in method.learnable().items() if k.startswith("meta_net.")
    }
    pl = method.prompt_learner
    template = PROMPT_TEMPLATES[dataset].replace("X", placeholder)
    text = tcp_text_features(
        oc, classes, template, teacher, pl.ctx, meta, method.layer, tokenizer, sos=bool(pl.n_sos)
    )
    return tcp_loss(oc, images, labels, text, teacher, method.weight)


def assert_equal_to_reference(method, ref, images, labels):
    """Logits, loss and the gradient of every learned tensor equal the reference's."""
    loss, logits = method.loss(images, labels)
    want_loss, want_logits = ref
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    params = [t for t in method.learnable().values()]
    assert len(params) == 5  # ctx and the meta-net's two linear layers
    grads = torch.autograd.grad(loss, params)
    want = torch.autograd.grad(want_loss, params)
    for name, g, w in zip(method.learnable(), grads, want, strict=True):
        assert w.abs().sum() > 0, name
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("dataset", "layer"), [("oxford_pets", 2), ("ucf101", 1), ("stanford_cars", 2)])
def test_logits_and_gradients_equal_reference(tiny_clip, tiny_openclip, dataset, layer):
    """Mixed-length class names, the dataset's template after the context (pets: ", a type of pet.";
    UCF101: "a photo of a" as the placeholders; cars: no full stop), the shared prefix cut at `layer`."""
    method = tcp(tiny_clip, dataset=dataset, layer=layer)
    lengths = {len(tiny_clip.tokenizer.encode(c.replace("_", " "))) for c in CLASSES}
    assert len(lengths) >= 3  # the packed rows really differ in length
    images, labels = torch.randn(5, tiny_clip.embed_dim), torch.tensor([0, 1, 2, 3, 1])
    ref = reference(tiny_openclip, method, dataset, CLASSES, images, labels)
    assert_equal_to_reference(method, ref, images, labels)


@pytest.mark.parametrize(
    ("stem", "tokenizer"), [("metaclip2-tiny", "mt5"), ("siglip-tiny", "t5"), ("siglip-tiny", "gemma")]
)
def test_without_a_start_token_equals_reference(stem, tokenizer, tmp_path):
    """Tokenizers without [SOS]: the context slots are positions 0..3, and the class tokens replace
    them at block `layer`. MetaCLIP 2 (mT5's tokenizer, a causal tower pooled at the first </s>):
    [v1..v4] is the prefix shared until `layer`, nothing after it; SigLIP (T5's, padded with </s>;
    SigLIP2's Gemma-like, whose words after the context start with "▁"; no causal mask, pooled at
    the last position): every prompt runs whole."""
    pytest.importorskip("transformers")
    from coop.model.tiny_tokenizers import gemma_like, unigram

    builders = {"mt5": unigram, "t5": lambda p: unigram(p, pad="</s>"), "gemma": gemma_like}
    clip, oc = build_family(stem, builders[tokenizer](tmp_path / "tok"))
    method = tcp(clip, layer=1)
    pl = method.prompt_learner
    assert pl.n_sos == 0 and pl.shared_prefix == 4 and pl.slots.tolist() == [[0, 1, 2, 3]] * len(CLASSES)
    images, labels = torch.randn(5, clip.embed_dim), torch.tensor([0, 1, 2, 3, 1])
    ref = reference(oc, method, "oxford_pets", CLASSES, images, labels, clip.tokenizer, placeholder="x")
    assert_equal_to_reference(method, ref, images, labels)


def test_class_tokens_change_text_from_their_layer_on(tiny_clip, tiny_openclip):
    """The class tokens matter (zeroing the meta-net changes the features), and evaluation logits
    (`prepare` + `logits`) are the training logits."""
    method = tcp(tiny_clip)
    images = torch.randn(3, tiny_clip.embed_dim)
    with torch.no_grad():
        before = method.logits(images, method.prepare())
        torch.testing.assert_close(before, method.loss(images, torch.tensor([0, 1, 2]))[1])
        method.meta_net.linear2.bias.zero_()
        method.meta_net.linear2.weight.zero_()
        after = method.logits(images)
    assert (before - after).abs().max() > 1e-3


def test_other_classes_rebuild_teacher_and_prompts(tiny_clip, tiny_openclip):
    """Learned ctx and meta-net score new classes (another dataset's template and teacher)."""
    trained = tcp(tiny_clip)
    new = ["bengal", "dtd like banded"]
    cfg = load_config(None, ["method=tcp", "data.name=dtd", "tcp.layer=2"])
    other = build_method(tiny_clip, new, cfg)
    other.load_trained({k: t.detach() for k, t in trained.learnable().items()}, CLASSES)
    images, labels = torch.randn(4, tiny_clip.embed_dim), torch.tensor([0, 1, 1, 0])
    _, want = reference(tiny_openclip, other, "dtd", new, images, labels)
    with torch.no_grad():
        torch.testing.assert_close(other.logits(images), want, rtol=1e-5, atol=1e-5)


def test_recipe_and_errors(tiny_clip):
    cfg = load_config(None, ["method=tcp"])
    assert (cfg.train.optimizer, cfg.train.eps, cfg.train.lr, cfg.train.epochs) == ("adam", 1e-3, 0.002, 50)
    assert (cfg.prompt.n_ctx, cfg.tcp.layer, cfg.tcp.weight, cfg.train.batch_size) == (4, 8, 8.0, 32)
    # its train.py sets MAX_EPOCH 25 for ImageNet and SUN397 after every config file
    for dataset, epochs in (("imagenet", 25), ("sun397", 25), ("dtd", 50), ("eurosat", 50)):
        assert load_config(None, ["method=tcp", f"data.name={dataset}"]).train.epochs == epochs, dataset
        spelled = load_config(
            str(REPO / "configs" / "tcp" / "vit_b16_ep100_ctxv1.yaml"), [f"data.name={dataset}"]
        )
        assert spelled.train.epochs == epochs, dataset
    assert load_config(None, ["method=tcp", "data.name=imagenet", "train.epochs=50"]).train.epochs == 50
    with pytest.raises(ConfigError, match="tcp.layer must be in 1..2"):
        build_method(tiny_clip, CLASSES, load_config(None, ["method=tcp"]))  # 3 blocks: 8 is too deep
    with pytest.raises(ConfigError, match="prompt.position=end"):
        build_method(
            tiny_clip, CLASSES, load_config(None, ["method=tcp", "tcp.layer=1", "prompt.position=front"])
        )
    with pytest.raises(ConfigError, match="tcp.layer"):
        load_config(None, ["method=tcp", "tcp.layer=0"])
    assert OmegaConf.select(load_config(None, ["method=tcp", "train.eps=1e-8"]), "train.eps") == 1e-8

"""Parity of our text Transformer with open_clip's encode_text, and load_clip's contracts."""

from __future__ import annotations

import open_clip
import pytest
import torch
from conftest import TINY_CONFIG, build_openclip
from open_clip.tokenizer import SimpleTokenizer

import coop
from coop.model import weights as coop_weights
from coop.model.errors import ModelError
from coop.model.text_encoder import TextTransformer
from coop.model.text_support import TEXT_KEYS
from coop.model.tokenizer import clip_bpe

TEXTS = [
    "a photo of a dog.",
    "x",
    "",
    "an extremely long description " * 20,  # > 77 tokens: truncated, ends with [EOS]
    "St. Bernard, a large (very large) working dog!",
]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# encode_text never reads the image tower: a 1-block one spares building ViT-L/H's (most of the time)
SMALL_VISION = {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16}


# name: the text tower's blocks (None: the config's). ViT-B-32's runs at full size; the others keep
# their own width, heads, embedding size and activation with 2 blocks, since every block computes the
# same (ViT-H-14's 24 blocks of width 1024 took 10 s to build and run on a CPU)
TOWERS = {"ViT-B-32": None, "ViT-B-16-quickgelu": 2, "RN50": 2, "ViT-L-14": 2, "ViT-H-14": 2}


@pytest.mark.parametrize("name", list(TOWERS))
def test_encode_text_matches_open_clip(name):
    """The model's own text tower (ViT-B-32's full size, the others' with 2 blocks) against
    open_clip's encode_text."""
    text_cfg = open_clip.get_model_config(name)["text_cfg"]
    if TOWERS[name] is not None:
        text_cfg["layers"] = TOWERS[name]
    oc = build_openclip(name, vision_cfg=SMALL_VISION, text_cfg=text_cfg)
    clip = coop.CLIP.from_openclip(oc)
    assert clip.text.cfg.quick_gelu == name.endswith("quickgelu")
    assert len(clip.text.blocks) == text_cfg["layers"] and clip.text.cfg.width == text_cfg["width"]
    ids = clip.tokenize(TEXTS)
    assert ids.shape == (len(TEXTS), 77) and ids.dtype == torch.long
    assert int(ids[3].argmax()) == 76  # the long text fills the context
    with torch.no_grad():
        ours = clip.encode_text(ids)
        ref = oc.encode_text(ids)
    assert ours.shape == (len(TEXTS), oc.text_projection.shape[1])
    assert relative_error(ours, ref) < 1e-5


def test_state_dict_keys_equal_open_clip(tiny_openclip, tiny_clip):
    ref = {k for k in tiny_openclip.state_dict() if k.startswith(TEXT_KEYS)}
    assert set(tiny_clip.text.state_dict()) == ref
    # weights are copied: changing ours leaves open_clip's model untouched
    with torch.no_grad():
        tiny_clip.text.ln_final.weight.add_(1.0)
    assert not torch.equal(tiny_clip.text.ln_final.weight, tiny_openclip.ln_final.weight)
    with torch.no_grad():
        tiny_clip.text.ln_final.weight.sub_(1.0)


def test_clips_share_one_bpe_per_context_length(tiny_openclip):
    """CLIP's BPE is read once per context length (~0.2 s each), not once per model built."""
    first, second = coop.CLIP.from_openclip(tiny_openclip), coop.CLIP.from_openclip(tiny_openclip)
    assert first.tokenizer is second.tokenizer is clip_bpe(77)
    short = clip_bpe(16)
    assert short is not first.tokenizer and short.context_length == 16
    assert torch.equal(short(TEXTS), SimpleTokenizer(context_length=16)(TEXTS))


def test_our_text_tower_is_not_initialised_before_its_weights_load(tiny_openclip, monkeypatch):
    """from_openclip builds our text tower on the meta device and fills empty memory with open_clip's
    weights: a random initialisation would be overwritten (ViT-H-14's took a second)."""
    from coop.model import clip as clip_module

    built = []

    def building(cfg, name=None):
        tower = TextTransformer(cfg, name)
        built.append({t.device.type for t in tower.state_dict().values()})
        return tower

    monkeypatch.setattr(clip_module, "TextTransformer", building)
    clip = coop.CLIP.from_openclip(tiny_openclip)
    assert built == [{"meta"}]
    ours, ref = clip.text.state_dict(), tiny_openclip.state_dict()
    assert all(v.device.type == "cpu" and torch.equal(v, ref[k]) for k, v in ours.items())


def test_clip_is_frozen_and_image_path(tiny_openclip, tiny_clip):
    assert not any(p.requires_grad for p in tiny_clip.parameters())
    tiny_clip.train()
    assert not tiny_clip.training
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        # our ImageTransformer against open_clip's forward (tests/test_image_encoder.py has the rest)
        assert relative_error(tiny_clip.encode_image(images), tiny_openclip.encode_image(images)) < 1e-5
    assert torch.equal(tiny_clip.logit_scale, tiny_openclip.logit_scale.detach())


def _tiny_cfg(**text_overrides):
    import json

    cfg = json.loads(TINY_CONFIG.read_text())
    cfg["text_cfg"].update(text_overrides)
    return cfg


def test_non_standard_text_tower_is_rejected():
    """One case here; tests/test_text_families.py covers every family and every refusal."""
    model = open_clip.CLIP(**_tiny_cfg(ls_init_value=0.1))
    with pytest.raises(ModelError, match="layer scale"):
        coop.CLIP.from_openclip(model)


def test_load_clip_config_json_and_local_file(tmp_path):
    torch.manual_seed(0)
    clip = coop.load_clip(str(TINY_CONFIG))
    ckpt = tmp_path / "weights.pt"
    oc = build_openclip(TINY_CONFIG.stem, seed=3)
    torch.save(oc.state_dict(), ckpt)
    loaded = coop.load_clip(str(TINY_CONFIG), pretrained=str(ckpt))
    assert torch.equal(loaded.text.ln_final.weight, oc.ln_final.weight)
    assert not torch.equal(clip.text.ln_final.weight, loaded.text.ln_final.weight)
    ids = loaded.tokenize(["a photo of a cat."])
    with torch.no_grad():
        assert relative_error(loaded.encode_text(ids), oc.encode_text(ids)) < 1e-5


def test_load_clip_bad_names():
    with pytest.raises(ModelError, match="unknown open_clip model 'ViT-Q-99'"):
        coop.load_clip("ViT-Q-99")
    with pytest.raises(ModelError, match="missing.json"):
        coop.load_clip("missing.json")
    with pytest.raises(ModelError, match="neither a file nor an open_clip tag"):
        coop.load_clip("RN50", pretrained="no-such-tag")


def test_offline_tag_gives_one_clear_error(monkeypatch):
    monkeypatch.setattr(coop_weights, "try_to_load_from_cache", lambda *a, **k: None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        coop_weights.WeightsUnavailableError, match="not in the local cache.*local weights file"
    ):
        coop.load_clip("RN50", pretrained="openai")


def test_openai_tag_gets_quickgelu(monkeypatch, tmp_path):
    """OpenAI weights were trained with QuickGELU; a plain 'RN50' name must still get it. RN50 and its
    twin keep their configs here with a 1-block-per-stage ResNet and 2 text blocks (the names and
    the tag are what is checked; the full RN50 took 4 s to build twice, save and load)."""
    for name in ("RN50", "RN50-quickgelu"):
        cfg = open_clip.get_model_config(name)  # a copy
        cfg["vision_cfg"] = {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "patch_size": None}
        cfg["text_cfg"]["layers"] = 2
        monkeypatch.setitem(open_clip.factory._MODEL_CONFIGS, name, cfg)
    oc = build_openclip("RN50-quickgelu")
    assert len(oc.transformer.resblocks) == 2 and oc.visual.image_size == 64
    ckpt = tmp_path / "rn50_openai.pt"
    torch.save(oc.state_dict(), ckpt)
    monkeypatch.setattr(coop_weights, "_cached_or_download", lambda *a: str(ckpt))
    clip = coop.load_clip("RN50", pretrained="openai")
    assert clip.text.cfg.quick_gelu
    ids = clip.tokenize(TEXTS)
    with torch.no_grad():
        assert relative_error(clip.encode_text(ids), oc.encode_text(ids)) < 1e-5

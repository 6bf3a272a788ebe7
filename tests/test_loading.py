"""load_clip with local weight files: OpenAI's TorchScript archives, plain state dicts, missing files."""

from __future__ import annotations

import json
import logging

import open_clip
import pytest
import torch
from conftest import TINY_CONFIG, randomise_text_tower
from torch import nn

import coop
from coop.model import weights as coop_weights
from coop.model.errors import ModelError

# OpenAI's key layout infers heads as width // 64, so the tiny model uses 64-wide heads.
OPENAI_TINY = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 128, "heads": 2, "layers": 2},
}
TEXTS = ["a photo of a dog.", "St. Bernard, a large (very large) working dog!", ""]

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def register_config(folder, name: str, cfg: dict) -> str:
    """Write an OpenCLIP model-config JSON and return its path (registered under `name`)."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    return str(path)


class _Weights(nn.Module):
    """A module whose only content is tensors under dotted names; scripting needs a forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def save_torchscript(state: dict[str, torch.Tensor], path) -> None:
    """Save `state` the way OpenAI's CLIP files hold it: a TorchScript module with those keys."""
    root = _Weights()
    for key, value in state.items():
        *parents, leaf = key.split(".")
        module = root
        for part in parents:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        if value.is_floating_point():
            module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
        else:
            module.register_buffer(leaf, value)
    torch.jit.save(torch.jit.script(root), str(path))


@pytest.fixture(scope="module")
def openai_file(tmp_path_factory):
    """A tiny CLIP saved like OpenAI's ViT-B-16.pt: TorchScript, fp16 weights, three size entries."""
    folder = tmp_path_factory.mktemp("openai")
    torch.manual_seed(0)
    model = randomise_text_tower(open_clip.CLIP(**OPENAI_TINY, quick_gelu=True), seed=1)
    state = {k: v.half() for k, v in model.state_dict().items()}
    state.update(
        input_resolution=torch.tensor(32), context_length=torch.tensor(77), vocab_size=torch.tensor(49408)
    )
    path = folder / "ViT-tiny.pt"
    save_torchscript(state, path)
    name = register_config(folder, "coop-tiny-openai", OPENAI_TINY)  # plain config: GELU
    return name, path


def test_openai_torchscript_file_gets_quickgelu_and_matches_open_clip(openai_file, tmp_path):
    name, path = openai_file
    clip = coop.load_clip(name, pretrained=str(path))
    assert clip.text.cfg.quick_gelu

    # open_clip's own reading of OpenAI's files: the architecture inferred from the state dict.
    state = torch.jit.load(str(path), map_location="cpu").state_dict()
    ref = open_clip.model.build_model_from_openai_state_dict(state, quick_gelu=True).float().eval()
    ids = clip.tokenize(TEXTS)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert relative_error(clip.encode_text(ids), ref.encode_text(ids)) < 1e-5
        assert torch.allclose(clip.encode_image(images), ref.encode_image(images), atol=1e-6)
        gelu = open_clip.CLIP(**OPENAI_TINY).eval()
        gelu.load_state_dict(ref.state_dict())
        assert relative_error(clip.encode_text(ids), gelu.encode_text(ids)) > 1e-4  # QuickGELU matters
    assert torch.equal(clip.logit_scale, ref.logit_scale.detach())

    plain = tmp_path / "plain.pt"
    torch.save(ref.state_dict(), plain)
    assert coop_weights.is_torchscript(path) and not coop_weights.is_torchscript(plain)


def test_torchscript_file_of_another_architecture_is_one_clear_error(openai_file):
    _, path = openai_file
    with pytest.raises(ModelError, match=r"cannot load the weights in .*ViT-tiny.pt into model coop-tiny"):
        coop.load_clip(str(TINY_CONFIG), pretrained=str(path))


def test_plain_state_dict_names_the_activation(tmp_path, caplog):
    cfg = json.loads(TINY_CONFIG.read_text())
    gelu_name = register_config(tmp_path, "coop-tiny-twin", cfg)
    quick_name = register_config(tmp_path, "coop-tiny-twin-quickgelu", {**cfg, "quick_gelu": True})
    torch.manual_seed(0)
    weights = tmp_path / "weights.bin"
    torch.save(randomise_text_tower(open_clip.CLIP(**cfg)).state_dict(), weights)

    with caplog.at_level(logging.INFO, logger="coop.model.weights"):
        clip = coop.load_clip(gelu_name, pretrained=str(weights))
    lines = [r.getMessage() for r in caplog.records if "GELU" in r.getMessage()]
    assert not clip.text.cfg.quick_gelu
    assert len(lines) == 1 and "runs these weights with GELU" in lines[0]
    assert "model.name=coop-tiny-twin-quickgelu" in lines[0]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="coop.model.weights"):
        assert coop.load_clip(quick_name, pretrained=str(weights)).text.cfg.quick_gelu
        coop.load_clip(str(TINY_CONFIG), pretrained=str(weights))  # no -quickgelu twin: nothing to say
    assert not [r for r in caplog.records if "GELU" in r.getMessage()]


def test_missing_weights_file_is_one_line_without_network(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("a missing file must not reach for the network")

    monkeypatch.setattr(coop_weights, "_hub_reachable", no_network)
    monkeypatch.setattr(coop_weights, "try_to_load_from_cache", no_network)
    missing = tmp_path / "clip" / "ViT-B-16.pt"
    for pretrained in (str(missing), "ViT-B-16.pt"):
        with pytest.raises(FileNotFoundError, match="weights file not found: .*ViT-B-16.pt") as info:
            coop.load_clip(str(TINY_CONFIG), pretrained=pretrained)
        assert "\n" not in str(info.value)
        with pytest.raises(FileNotFoundError, match="weights file not found"):
            coop_weights.pretrained_available(str(TINY_CONFIG), pretrained)

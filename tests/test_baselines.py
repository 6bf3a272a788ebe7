"""The baselines' last differences from their original code: CoOp's own ensemble (ZeroshotCLIP2),
KgCoOp's templates, base-to-new refusals before training, PromptFL's client-sampling count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_args
from omegaconf import OmegaConf
from test_methods import CLASSES, direct_text_features

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.config.run_names import method_settings
from coop.methods import build_method, resolve_templates
from coop.methods.zeroshot import IMAGENET_TEMPLATES_SELECT

SELECT = [  # CoOp's trainers/imagenet_templates.py, IMAGENET_TEMPLATES_SELECT
    "itap of a {}.",
    "a bad photo of the {}.",
    "a origami {}.",
    "a photo of the large {}.",
    "a {} in a video game.",
    "art of the {}.",
    "a photo of the small {}.",
]


def test_coop_ensemble_is_zeroshotclip2(tiny_clip, tiny_openclip):
    assert list(IMAGENET_TEMPLATES_SELECT) == SELECT
    assert resolve_templates("coop_ensemble", "dtd") == [*SELECT, "{} texture."]
    assert resolve_templates("coop_ensemble", "eurosat") == [*SELECT, "a centered satellite photo of {}."]
    assert resolve_templates("coop_ensemble", "imagenet") == SELECT  # ImageNet's own is not added
    assert len(resolve_templates("ensemble", "dtd")) == 80  # CLIP's 80 stay available

    cfg = load_config(None, ["method=zeroshot", "zeroshot.templates=coop_ensemble", "data.name=dtd"])
    assert method_settings(cfg) == "zeroshot_coop_ensemble"
    method = build_method(tiny_clip, CLASSES, cfg)
    templates = [*SELECT, "{} texture."]
    total = sum(
        direct_text_features(tiny_openclip, [t.format(c.replace("_", " ")) for c in CLASSES])
        for t in templates
    )
    torch.testing.assert_close(method.prepare(), F.normalize(total / 8, dim=-1), rtol=1e-5, atol=1e-6)
    assert method.describe() == {"templates": "coop_ensemble", "template": "8 templates"}


def test_kgcoop_defaults_to_its_own_templates(tiny_clip, tiny_openclip):
    cfg = load_config(None, ["method=kgcoop", "data.name=dtd"])
    assert cfg.kgcoop.templates == "kgcoop"
    assert resolve_templates("kgcoop", "dtd") == ["a photo of a {}, a type of texture."]
    for dataset in ("eurosat", "oxford_pets", "imagenet", "textile"):  # the same as CoOp's elsewhere
        assert resolve_templates("kgcoop", dataset) == resolve_templates("coop", dataset)
    method = build_method(tiny_clip, CLASSES, cfg)
    expected = direct_text_features(
        tiny_openclip, [f"a photo of a {c.replace('_', ' ')}, a type of texture." for c in CLASSES]
    )
    torch.testing.assert_close(method.clip_features(), expected, rtol=1e-5, atol=1e-6)
    assert method.describe()["kgcoop_templates"] == "kgcoop"

    dtd = load_config(None, ["method=kgcoop", "data.name=dtd", "kgcoop.templates=coop"])
    assert build_method(tiny_clip, CLASSES, dtd).templates == ["{} texture."]
    with pytest.raises(ConfigError, match="kgcoop.templates='texture' is not one of"):
        build_method(tiny_clip, CLASSES, load_config(None, ["method=kgcoop", "kgcoop.templates=texture"]))


@pytest.mark.parametrize(
    ("extra", "first"),
    [({"method": "linear_probe"}, "method=linear_probe"), ({"prompt.csc": "true"}, "prompt.csc=true")],
)
def test_base_to_new_refused_before_training(tmp_path, image_folder, extra, first):
    from coop.train.runner import train_run

    out = tmp_path / "run"
    cfg = load_config(None, tiny_args(image_folder, out, **{"data.subsample_classes": "base", **extra}))
    with pytest.raises(ConfigError) as e:
        train_run(cfg)
    message = str(e.value)
    assert "\n" not in message and message.startswith(first) and "data.subsample_classes=base" in message
    assert not out.exists()  # nothing trained, nothing written: a rerun is refused the same way


def test_client_sampling_rounds_the_fraction():
    from coop.federated.strategy import sample_clients

    assert int(0.29 * 100) == 28  # what int() gave
    assert len(sample_clients(1, 1, 100, 0.29)) == 29
    assert len(sample_clients(1, 1, 10, 0.35)) == 4  # 3.5 -> 4 (round half to even)
    assert len(sample_clients(1, 1, 10, 0.04)) == 1  # at least one
    assert len(sample_clients(1, 1, 64, 0.999)) == 64  # every client


def test_kgcoop_cfg_without_key_defaults_to_kgcoop(tiny_clip):
    """A config without kgcoop.templates (e.g. built by hand) means KgCoOp's own templates too."""
    cfg = OmegaConf.create(
        {
            "method": "kgcoop",
            "data": {"name": "dtd"},
            "prompt": {"n_ctx": 4, "ctx_init": None, "position": "end", "csc": False, "depth": 1},
        }
    )
    assert build_method(tiny_clip, CLASSES, cfg).templates == ["a photo of a {}, a type of texture."]

"""Every method × every tiny family model (configs/models/*.json): preflight (`Method.check_towers`
on the towers built on the meta device) refuses exactly the pairs that cannot run, in one line
naming the method and the model, and every tool that starts runs refuses them before the run
folder exists. The meta towers' verdicts are the real towers'.

The pairs refused are what an audit found by building each accepted pair and running one step
(docs/models.md has the same view for every open_clip model): before preflight checked the kinds of
tower, MMRL and FedOTP on CoCa failed at their first step, and CLIP-LoRA's vision adapters and
FedOTP on a CNN tower (MobileCLIP-S's FastViT) after the model was built.
"""

from __future__ import annotations

import dataclasses
import json

import open_clip
import pytest
import torch
from conftest import REPO, make_image_folder, run_tool_in_process
from open_clip.model import _build_vision_tower

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.federated import task
from coop.methods import METHODS
from coop.model.clip import _image_tower
from coop.model.errors import ModelError
from coop.model.support import TowerLayers
from coop.model.text_hf import hf_tower_config
from coop.model.tiny_tokenizers import make_tiny_tokenizer
from coop.model.weights import resolve_model_name
from coop.train.preflight import check_model_limits

CONFIGS = sorted((REPO / "configs" / "models").glob("*.json"))
STEMS = [p.stem for p in CONFIGS]
LABELS = [f"method={n}" for n in METHODS] + [f"fl.method={n}" for n in task.FL_METHODS]
# keys within the tiny towers (1-3 blocks), so that only the kinds of tower decide
WITHIN = ["prompt.depth=1", "vision.depth=1", "vision.n_ctx=2", "tcp.layer=1", "data.shots=1"]
# set, as CoPrompt needs it (the file is read when it trains)
WITHIN.append("data.descriptions=descriptions.json")

CNN = "image tower is timm's FastVit, a convolutional tower: it has no token sequence"
COCA = "image tower pools by attention (CoCa): its ln_post and projection act on the pool's outputs"
PROMPTS = "prompts the image tower"
TOKENS = "reads features of the image tower's tokens"
INSERTS = "inserts tokens at the text tower's layers"
HF = "text tower (Hugging Face '{}') takes no inserted tokens (MMRL's)"
HF_TEXT = {"roberta-tiny": "roberta-base", "xlmr-tiny": "xlm-roberta-base", "mt5-tiny": "google/mt5-base"}
HF_TEXT["nllb-tiny"] = "facebook/nllb-200-distilled-600M"
REFUSED = {  # (model, method): what the method needs, why the model's tower cannot give it
    ("coca-tiny", "method=mmrl"): (TOKENS, COCA),
    ("coca-tiny", "fl.method=fedotp"): (TOKENS, COCA),
    **{
        ("mobileclip-s-tiny", f"method={m}"): (PROMPTS, CNN)
        for m in ("vpt", "ivlp", "maple", "promptsrc", "mmrl", "hicropl", "coprompt")
    },
    ("mobileclip-s-tiny", "method=clip_lora"): ("adapts the image tower (lora.towers)", CNN),
    ("mobileclip-s-tiny", "method=2sfs"): (
        "tunes the LayerNorms of the image tower's blocks (twosfs.towers)",
        CNN,
    ),
    ("mobileclip-s-tiny", "fl.method=fedotp"): ("matches prompts to the image tower's patch tokens", CNN),
    **{(stem, "method=mmrl"): (INSERTS, HF.format(hub)) for stem, hub in HF_TEXT.items()},
}


# what a method needs beyond WITHIN: HiCroPL crosses between two layers, takes both towers' prompts
# from prompt.* and reads descriptions
NEEDS = {
    "method=hicropl": ["prompt.depth=2", "hicropl.cross_layer=1", "vision.n_ctx=null", "vision.depth=null"]
}


def described(folder) -> str:
    """data.descriptions= a file of sentences for CLASSES written here (hicropl reads one)."""
    path = folder / "descriptions.json"
    path.write_text(
        json.dumps({c: [f"a {c} in a photo."] for c in ("red_thing", "green_thing", "blue_thing")})
    )
    return f"data.descriptions={path}"


def run_config(stem: str, label: str, *extra: str):
    """(method class, config) of `label` on the tiny model `stem`."""
    key, _, name = label.partition("=")
    fl = key == "fl.method"
    args = [f"model.name={REPO / 'configs' / 'models' / stem}.json", "model.pretrained=none", *WITHIN, label]
    args += NEEDS.get(label, [])
    cfg = load_config(None, [*args, *extra], base=task.FEDERATED_BASE if fl else None)
    return (task.FL_METHODS if fl else METHODS)[name], cfg


def expected_message(stem: str, label: str) -> str:
    need, why = REFUSED[stem, label]
    return f"{label} {need}, and model {stem}'s {why}"


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("stem", STEMS)
def test_preflight_refuses_exactly_the_pairs_that_cannot_run(stem, label, tmp_path):
    method, cfg = run_config(stem, label, described(tmp_path))
    if (stem, label) not in REFUSED:
        if label in NEEDS and TowerLayers.of_model(cfg.model.name).image < 2:  # one image block: no crossing
            with pytest.raises(ConfigError, match="prompt.depth=2 is above the image tower's 1 layers"):
                check_model_limits(cfg, method)
            return
        check_model_limits(cfg, method)
        return
    with pytest.raises(ModelError) as e:
        check_model_limits(cfg, method)
    message = str(e.value)
    assert message.startswith(expected_message(stem, label)) and "\n" not in message


@pytest.mark.parametrize("path", CONFIGS, ids=STEMS)
def test_the_meta_towers_verdicts_are_the_real_towers(path):
    """The image tower built for real (random weights) gives the same TowerLayers, and its final
    tokens exist exactly where the towers say they do."""
    name = resolve_model_name(str(path))
    cfg = open_clip.get_model_config(name)
    torch.manual_seed(0)
    real, refusal = _image_tower(_build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"]), name)
    meta = TowerLayers.of_model(str(path))
    if path.stem in HF_TEXT:  # the text tower's blocks from its transformers config (inline here)
        text = hf_tower_config(name).layers
        assert meta.text_refusal.startswith(f"model {name}'s {HF.format(HF_TEXT[path.stem])}")
    else:
        text = int(cfg["text_cfg"]["layers"])
        assert meta.text_refusal is None
    towers = TowerLayers.of_tower(text, real, refusal, name)
    assert towers == dataclasses.replace(meta, text_refusal=None)
    if towers.image_refusal is not None:
        return
    hidden = torch.randn(1, 3, real.width)  # (B, T, W)
    if towers.token_refusal is None:
        assert real.final_tokens(hidden).shape == (1, 3, real.width)
    else:
        with pytest.raises(ModelError) as e:
            real.final_tokens(hidden)
        assert towers.token_refusal.endswith(str(e.value).removeprefix("the image tower "))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("images"))


@pytest.mark.parametrize("stem, label", sorted(REFUSED))
def test_the_tools_refuse_before_the_run_folder(stem, label, folder, tmp_path):
    """tools/train.py, or tools/federated.py for fl.method: exit 2, one line, no run folder."""
    federated = label.startswith("fl.")
    if federated:
        pytest.importorskip("flwr")
    out = tmp_path / "run"
    data = ["data.name=imagefolder", f"data.root={folder}", "data.num_workers=0", f"output_dir={out}"]
    model = [f"model.name={REPO / 'configs' / 'models' / stem}.json", "model.pretrained=none"]
    if stem in HF_TEXT:  # its tokenizer, else preflight stops at the (uncached) tokenizer first
        make_tiny_tokenizer(REPO / "configs" / "models" / f"{stem}.json", tmp_path / "tok")
        model.append(f"model.tokenizer={tmp_path / 'tok'}")
    args = [*model, *WITHIN, label, *data]
    tool = REPO / "tools" / ("federated.py" if federated else "train.py")
    res = run_tool_in_process(tool, args)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
    assert errors[0].startswith(f"error: {expected_message(stem, label)}")
    assert not out.exists()


def test_a_sweep_refuses_the_point_before_any_run_folder(tmp_path):
    out = tmp_path / "runs"
    model = f"model.name={REPO / 'configs' / 'models' / 'coca-tiny'}.json"
    args = ["--out", out, "method=[coop,mmrl]", model, "model.pretrained=none", "data.shots=1"]
    why = expected_message("coca-tiny", "method=mmrl")
    res = run_tool_in_process(REPO / "tools" / "sweep.py", [*args, "--dry-run"])  # lists it as refused
    assert res.returncode == 2 and res.stderr.strip() == "error: 1 of 2 points are refused (listed above)"
    assert res.stdout.splitlines()[1].startswith("refused ") and f"({why}" in res.stdout.splitlines()[1]
    res = run_tool_in_process(REPO / "tools" / "sweep.py", args)
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-2000:]
    assert errors[0].startswith(f"error: point method=mmrl: {why}")
    assert not out.exists()


def test_a_text_tower_that_does_not_load_is_refused_before_the_run_folder(folder, tmp_path):
    """No method runs on a model whose text tower we do not reproduce (here: layer scale): preflight
    says so (`coop.model.text_support.text_support`, on the meta device), not the build."""
    config = json.loads((REPO / "configs" / "models" / "coop-tiny.json").read_text())
    config["text_cfg"]["ls_init_value"] = 0.1
    path = tmp_path / "text-ls-tiny.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "run"
    data = ["data.name=imagefolder", f"data.root={folder}", "data.num_workers=0", f"output_dir={out}"]
    res = run_tool_in_process(
        REPO / "tools" / "train.py", [f"model.name={path}", "model.pretrained=none", *data]
    )
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr[-2000:]
    assert errors == ["error: model text-ls-tiny's text tower is not reproduced here: layer scale"]
    assert not out.exists()

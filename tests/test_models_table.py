"""The support matrix of open_clip's models (`coop.model.support`, `tools/models.py`): docs/models.md is
its current output, the README states its count, its rows hold known facts, and its verdicts on towers
built on the meta device are those on the same towers built for real."""

from __future__ import annotations

import runpy
import subprocess
import sys

import open_clip
import pytest
import torch
from conftest import REPO, run_tool_in_process
from open_clip.model import _build_vision_tower

from coop.methods import METHODS
from coop.model.clip import _image_tower
from coop.model.support import (
    CLIP_BPE,
    FAMILY_NAMES,
    family_of,
    openclip_models,
    support_table,
    vision_support,
)
from coop.model.text_support import NoValues
from coop.results.model_table import coverage, method_verdicts, models_document
from coop.versions import untested

TOOL = REPO / "tools" / "models.py"
# docs/models.md and the README's count are made with the tested open_clip release (its model list)
UNTESTED = untested("open_clip_torch")


@pytest.fixture(scope="module")
def rows():
    return support_table()


@pytest.fixture(scope="module")
def row(rows):
    return {r.name: r for r in rows}


@pytest.fixture(scope="module")
def methods():
    """tools/models.py's methods (those of tools/train.py and tools/federated.py) with their recipes."""
    return runpy.run_path(str(TOOL))["method_checks"]()


@pytest.mark.skipif(UNTESTED is not None, reason=str(UNTESTED))
def test_docs_models_md_is_the_tools_current_output(rows, methods):
    assert models_document(rows, methods) == (REPO / "docs" / "models.md").read_text(), (
        "docs/models.md is stale: python tools/models.py --write docs/models.md"
    )


def test_method_verdicts_are_the_methods_own_checks(row, methods):
    """CoCa: every method but MMRL and FedOTP (image tokens after an attention pool); a CNN tower
    (RN50, FastViT): no method that prompts, adapts or reads the image tower; a model whose text
    tower is refused: none. Each refusal is the one preflight gives, naming method and model."""
    coca = method_verdicts(row["coca_ViT-B-32"], methods)
    assert [m for m, why in coca.items() if why] == ["method=mmrl", "fl.method=fedotp"]
    assert coca["method=mmrl"].startswith(
        "method=mmrl reads features of the image tower's tokens, and model coca_ViT-B-32's image tower "
        "pools by attention (CoCa)"
    )
    image = ["vpt", "ivlp", "maple", "promptsrc", "clip_lora", "mmrl", "hicropl", "2sfs", "coprompt"]
    for cnn in ("RN50", "MobileCLIP-S1", "convnext_base"):
        refused = [m for m, why in method_verdicts(row[cnn], methods).items() if why]
        assert refused == [f"method={m}" for m in METHODS if m in image] + ["fl.method=fedotp"]
    assert method_verdicts(row["ViT-B-16"], methods) == dict.fromkeys(methods)
    assert method_verdicts(row["ViT-B-16-SigLIP"], methods) == dict.fromkeys(methods)  # MAP: timm's tokens
    roberta = method_verdicts(row["roberta-ViT-B-32"], methods)  # a Hugging Face text tower
    assert [m for m, why in roberta.items() if why] == ["method=mmrl"]
    assert roberta["method=mmrl"].startswith(
        "method=mmrl inserts tokens at the text tower's layers, and model roberta-ViT-B-32's text tower "
        "(Hugging Face 'roberta-base') takes no inserted tokens (MMRL's)"
    )


def test_one_model_by_name_or_config_file():
    """`tools/models.py NAME_OR_JSON`: the model's row, then every method's verdict; an unknown name
    or a missing file is one line."""
    res = run_tool_in_process(TOOL, [REPO / "configs" / "models" / "coca-tiny.json"])
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[2].startswith("| `coca-tiny` | CoCa | yes | yes | mmrl, fedotp | CLIP BPE |")
    verdicts = {line.split("`")[1]: line.split(" | ")[1] for line in lines[4:] if line.startswith("| `")}
    assert [m for m, runs in verdicts.items() if runs == "no"] == ["method=mmrl", "fl.method=fedotp"]
    assert len(verdicts) == len(METHODS) + 4 and "| `method=coop` | yes |  |" in lines
    for bad, message in [
        (
            "ViT-Q-99",
            "error: unknown open_clip model 'ViT-Q-99' (see open_clip.list_models(), or pass a config .json)",
        ),
        ("no/such.json", "error: model config file not found: no/such.json"),
    ]:
        res = run_tool_in_process(TOOL, [bad])
        errors = [line for line in res.stderr.splitlines() if line.strip()]
        assert res.returncode == 2 and errors == [message]


@pytest.mark.skipif(UNTESTED is not None, reason=str(UNTESTED))
def test_the_readme_first_paragraph_states_the_tools_count(rows):
    first = (REPO / "README.md").read_text().split("\n\n")[1]
    assert coverage(rows) in " ".join(first.split()), (
        f"the README's first paragraph should say: {coverage(rows)}"
    )


def test_every_model_open_clip_ships_has_one_row_and_every_family_a_model(rows, tiny_name):
    names = [r.name for r in rows]
    assert names == openclip_models() and len(set(names)) == len(names) == len(rows)
    assert tiny_name in open_clip.list_models() and tiny_name not in names  # a config added later
    assert {"ViT-B-16", "RN50", "roberta-ViT-B-32", "ViT-B-16-SigLIP"} <= set(names)
    assert {r.family for r in rows} == set(FAMILY_NAMES), "a family rule that matches no model"


def test_rows_hold_known_facts(row):
    b16 = row["ViT-B-16"]
    assert (b16.family, b16.text, b16.vision, b16.tokenizer) == ("CLIP", None, None, CLIP_BPE)
    assert {"openai", "laion2b_s34b_b88k"} <= set(b16.pretrained)
    siglip = row["ViT-B-16-SigLIP"]
    assert (siglip.family, siglip.text, siglip.tokenizer) == ("SigLIP", None, "timm/ViT-B-16-SigLIP")
    assert siglip.vision is None and siglip.pretrained == ("webli",)  # timm's ViT trunk, walked
    assert row["EVA02-B-16"].vision is None and row["PE-Core-B-16"].vision is None
    assert row["ViT-B-16-SigLIP2"].family == "SigLIP2"
    roberta = row["roberta-ViT-B-32"]
    assert roberta.family == "HF text" and roberta.tokenizer == "roberta-base"
    # transformers' own modules run its text tower (coop.model.text_hf); its image tower is a ViT
    assert roberta.text is None and roberta.vision is None
    assert all(r.text is None for r in row.values() if r.family == "HF text")
    assert row["RN50"].text is None and "is a ResNet (a CNN): it has no tokens" in row["RN50"].vision
    for cnn, trunk in [("convnext_base", "ConvNeXt"), ("MobileCLIP-S1", "FastVit")]:
        assert f"timm's {trunk}, a convolutional tower: it has no token sequence" in row[cnn].vision
    assert "timm's SwinTransformer, not a ViT or EVA trunk" in row["swin_base_patch4_window7_224"].vision
    assert "layer scale" in row["ViT-M-16-alt"].vision
    assert row["coca_ViT-B-32"].vision is None and row["coca_ViT-B-32"].text is None  # attention pool
    clipa = row["ViT-L-14-CLIPA"]
    assert (clipa.family, clipa.text, clipa.tokenizer) == ("CLIPA", None, "bert-base-uncased")
    assert clipa.vision is None  # average pool, no ln_pre: our ViT covers it
    worldwide = row["ViT-H-14-worldwide"]
    assert (worldwide.family, worldwide.text, worldwide.vision) == ("MetaCLIP 2 worldwide", None, None)
    # overlapping rules: the first family that matches
    assert row["coca_roberta-ViT-B-32"].family == "CoCa" and row["nllb-clip-base-siglip"].family == "HF text"
    assert row["swin_base_patch4_window7_224"].family == "other timm"
    assert family_of("my-ViT", {"vision_cfg": {"width": 64}}) == "CLIP"


@pytest.mark.parametrize("name", ["ViT-S-32", "ViT-M-16-alt", "RN50"])
def test_the_verdict_on_the_meta_tower_is_the_real_towers(name):
    """Built for real (random weights, CPU), the tower gets the same verdict, and the tower built on
    the meta device with the value-setting ops skipped has the same parameters and buffers."""
    cfg = open_clip.get_model_config(name)
    args = (cfg["embed_dim"], cfg["vision_cfg"], cfg.get("quick_gelu", False))
    torch.manual_seed(0)
    real = _build_vision_tower(*args)
    with torch.device("meta"), NoValues():
        meta = _build_vision_tower(*args)
    assert {k: v.shape for k, v in meta.state_dict().items()} == {
        k: v.shape for k, v in real.state_dict().items()
    }
    assert vision_support(name) == _image_tower(real, name)[1]


def test_unknown_names_and_families_are_one_line():
    assert vision_support("ViT-Q-99") == "unknown open_clip model 'ViT-Q-99'"
    res = run_tool_in_process(TOOL, ["--family", "Nope"])
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 2 and errors == [f"error: family 'Nope' is not one of {', '.join(FAMILY_NAMES)}"]
    res = run_tool_in_process(TOOL, ["--family", "CLIPA", "--write", "x.md"])
    assert (
        res.returncode == 2 and "--write writes every model" in res.stderr and "Traceback" not in res.stderr
    )


def test_the_tool_prints_one_family_with_its_refusals():
    """MobileCLIP: the ViT towers (MobileCLIP-B, MobileCLIP2-B/-L-14) take vision prompts, the FastViT
    ones are refused in one line each."""
    cmd = [sys.executable, str(TOOL), "--family", "MobileCLIP", "--why"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("| model | family | text prompts | vision prompts | methods that do not run |")
    body = lines[2:]
    assert len(body) == 9 and all("| MobileCLIP | yes |" in line for line in body)
    taken = {line.split("`")[1] for line in body if "| MobileCLIP | yes | yes |" in line}
    assert taken == {"MobileCLIP-B", "MobileCLIP2-B", "MobileCLIP2-L-14"}
    refused = [line for line in body if "| MobileCLIP | yes | no |" in line]
    assert len(refused) == 6 and all("timm's FastVit, a convolutional tower" in line for line in refused)
    methods = "vpt, ivlp, maple, promptsrc, clip_lora, mmrl, hicropl, 2sfs, coprompt, fedotp"
    assert all(f"| no | {methods} |" in line for line in refused)
    assert sum("| MobileCLIP | yes | yes |  |" in line for line in body) == 3  # every method runs


def test_a_meta_build_skips_torch_inits_own_initialisers():
    """torch.nn.init's overridable initialisers (kaiming_uniform_, constant_, ...) reach a mode whole,
    their tensor as a keyword, and the mode is off for the ops they call: NoValues answers them
    itself on a meta tensor, so no mode below it (nor any op inside them) runs; on a real tensor
    they still set values."""
    seen = []

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name.endswith("_") and not name.startswith("__"):  # in-place ops, not `tensor.is_meta`
                seen.append(name)
            return func(*args, **(kwargs or {}))

    meta = torch.empty(4, 3, device="meta")
    with Seen(), NoValues():
        for init in (torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_, torch.nn.init.normal_):
            assert init(meta) is meta
        assert torch.nn.init.constant_(meta, 1.0) is meta
    assert seen == []
    real = torch.zeros(4, 3)
    with NoValues():
        torch.nn.init.constant_(real, 2.0)
    assert torch.equal(real, torch.full((4, 3), 2.0))

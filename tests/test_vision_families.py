"""The methods that put tokens into the image tower, on the three kinds of timm tower open_clip builds.

Families (configs/models/*-tiny.json with the image tower shrunk to 2 blocks of width 192 at 4x4
patches, `shrunk_timm`; the family's own text tower and tokenizer; random weights, offline):

    siglip   timm's SigLIP ViT (vit_base_patch16_siglip_224): no class token, attention (MAP) pool
    eva02    eva02_tiny_patch14_224: RoPE, a class token, class-token pool
    pe-core  vit_pe_core_tiny_patch16_384: RoPE, a class token, attention (MAP) pool

VPT, IVLP, MaPLe, PromptSRC, MMRL and FedOTP each train two steps on each family (finite loss, the
learned tensors move, no frozen weight gets a gradient); MaPLe, VPT and MMRL equal their references
(timm's own forward, the added tokens as extra prefix tokens); `vision.pool_prompts`; FedOTP's patch tokens
are the tokens after the prefix; vision prompts on a tower without tokens are refused before the
run folder exists; PromptSRC (with GPA) on SigLIP runs through `train_run`, killed with SIGKILL and
resumed, bit-identical; MMRL and MaPLe run end to end on the other two families.
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, build_family, kill_at_first_checkpoint, make_image_folder, shrunk_timm, tiny_args
from test_bench import load_tool
from test_families_e2e import trains_two_steps
from test_image_timm import randomise
from test_mmrl import mmrl
from test_mmrl import reference_step as mmrl_reference_step

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.federated import task
from coop.methods import build_method
from coop.model.errors import ModelError
from coop.reference.coop import reference_inputs
from coop.reference.vision_prompts import maple_logits, vpt_logits
from coop.train.runner import train_run

pytest.importorskip("transformers")
from coop.model.tiny_tokenizers import unigram  # noqa: E402

# family: (tiny config stem, timm architecture (None: the config's), patch size, needs a tokenizer)
FAMILIES = {
    "siglip": ("siglip-tiny", "vit_base_patch16_siglip_224", 16, True),
    "eva02": ("eva02-tiny", None, 14, False),
    "pe-core": ("pe-core-tiny", None, 16, False),
}
SHRINK = {"depth": 2, "embed_dim": 192, "num_heads": 3}
CLASSES = ["dog", "golden_retriever", "crane (bird)"]

# method: overrides (small depths; the tiny towers have 2 blocks)
METHODS = {
    "vpt": ["method=vpt", "vision.n_ctx=2", "vision.depth=2"],
    "ivlp": ["method=ivlp", "prompt.depth=2", "vision.depth=2"],
    "maple": ["method=maple", "prompt.depth=2"],
    "promptsrc": ["method=promptsrc", "prompt.depth=2", "vision.depth=2", "promptsrc.templates=coop"],
    "mmrl": ["method=mmrl", "mmrl.layers=[2]", "mmrl.vision_layers=[1,2]", "mmrl.rep_dim=16"],
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def shrunk_config(name: str, folder) -> tuple:
    """(config path, image size, timm kwargs) of family `name` shrunk: a copy of its tiny config
    under another name (open_clip's registry keeps the real one), its image size 4x4 patches."""
    stem, arch, patch, _ = FAMILIES[name]
    cfg = json.loads((REPO / "configs" / "models" / f"{stem}.json").read_text())
    size = 4 * patch
    cfg["vision_cfg"]["image_size"] = size
    if arch is not None:
        cfg["vision_cfg"]["timm_model_name"] = arch
    path = folder / f"{name}-shrunk.json"
    path.write_text(json.dumps(cfg))
    return path, size, {**SHRINK, "img_size": size}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, config path, tokenizer dir or None, timm kwargs, our CLIP, open_clip's model)."""
    folder = tmp_path_factory.mktemp(request.param)
    path, _, kwargs = shrunk_config(request.param, folder)
    tok = unigram(folder / "tok", pad="</s>") if FAMILIES[request.param][3] else None
    with shrunk_timm(**kwargs):
        clip, oc = build_family(path, tok, edit=lambda model: randomise(model.visual, 0))
    return request.param, path, tok, kwargs, clip, oc


def images(clip, n: int = 4, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, clip.image_size, clip.image_size, generator=gen)


def test_the_families_are_the_three_kinds(family):
    name, _, _, _, clip, _ = family
    tower = clip.visual
    assert clip.image_forward == "coop-timm" and tower.layers == 2 and tower.width == 192
    assert tower.n_prefix == (0 if name == "siglip" else 1)  # SigLIP: no class token
    assert tower.rotary == (name != "siglip")
    assert tower.trunk.global_pool == ("token" if name == "eva02" else "map")


@pytest.mark.parametrize("method_name", sorted(METHODS))
def test_vision_method_trains(family, method_name):
    clip = family[4]
    torch.manual_seed(0)
    method = build_method(clip, CLASSES, load_config(None, METHODS[method_name]))
    trains_two_steps(method, images(clip))


def test_fedotp_trains_on_the_patch_tokens(family):
    """FedOTP's features are every token (B, N+P, E); it matches the P patches, after the N prefix
    tokens: changing a prefix row leaves its logits alone, changing a patch row does not."""
    clip = family[4]
    method = task.build_method(
        clip, CLASSES, load_config(None, ["fl.method=fedotp"], base=task.FEDERATED_BASE)
    )
    with torch.no_grad():
        tokens = clip.encode_image(images(clip), tokens=True)  # (B, N+P, E)
    n = clip.visual.n_prefix
    assert tokens.shape[1] == n + 16 and method.n_prefix == n
    with torch.no_grad():
        text = method.prepare()
        logits = method.logits(tokens, text)
        for row, changes in (
            (n - 1, False),
            (n, True),
        ):  # the last prefix token (none on SigLIP), the first patch
            if row < 0:
                continue
            edited = tokens.clone()
            edited[:, row] = torch.randn_like(edited[:, row])
            assert (not torch.equal(method.logits(edited, text), logits)) == changes, row
    trains_two_steps(method, tokens)


@pytest.mark.parametrize("family", ["siglip"], indirect=True)
def test_fedotp_runs_federated_on_a_tower_without_a_class_token(family, tmp_path):
    """FedOTP through Flower's Message API in one process (tests/test_personal_fl.py's grid), on
    SigLIP's tower: its cached features are every token, all of them patches; one round, 2 clients."""
    pytest.importorskip("flwr")
    from flwr.supercore.task_identity import TaskIdentity
    from test_personal_fl import BASE, LocalGrid, run_inprocess

    _, path, tok, kwargs = family[:4]
    data = make_image_folder(tmp_path / "four", classes=("r", "g", "b", "y"), n_train=5, n_test=3)
    overrides = [o for o in BASE if not o.startswith("model.name=")]
    overrides += [f"model.name={path}", f"model.tokenizer={tok}", f"data.root={data}", "fl.method=fedotp"]
    overrides += ["fl.rounds=1", "prompt.n_ctx=4"]
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0  # a ServerApp's, as there
    try:
        with shrunk_timm(**kwargs):
            metrics = run_inprocess(tmp_path / "run", overrides, LocalGrid(2))
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
    assert 0 <= metrics["local_accuracy"] <= 100 and len(metrics["local_per_client"]) == 2
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert set(ckpt["prompt"]) == {"global.ctx"} and bool(ckpt["prompt"]["global.ctx"].isfinite().all())


def test_pool_prompts_changes_an_attention_pool_only(family):
    """`vision.pool_prompts=true` hands the prompts to the pool: other features on a MAP tower
    (SigLIP, PE-Core), the same on a class-token tower (EVA02)."""
    name, clip = family[0], copy.deepcopy(family[4])
    x, feats = images(clip), {}
    for pool in (False, True):
        torch.manual_seed(0)
        cfg = load_config(None, [*METHODS["vpt"], f"vision.pool_prompts={str(pool).lower()}"])
        method = build_method(clip, CLASSES, cfg)
        assert clip.visual.pool_prompts is pool
        with torch.no_grad():
            feats[pool] = method.image_features(x)
    assert torch.equal(feats[False], feats[True]) == (name == "eva02")


def test_pool_prompts_is_refused_for_a_method_that_adds_no_image_tokens():
    with pytest.raises(ConfigError) as e:
        train_run(load_config(None, ["method=coop", "vision.pool_prompts=true", "model.pretrained=none"]))
    assert "\n" not in str(e.value) and "method=coop adds none" in str(e.value)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def test_maple_and_vpt_match_their_references(family):
    """MaPLe (CLIP's BPE: EVA02, PE-Core) and VPT (every family) against the references on open_clip's
    model: timm's own forward with the prompts as prefix tokens; full-length text prompts (MaPLe),
    open_clip's `encode_text` of "a photo of a {class}." (VPT). Logits, loss and the gradient of
    every learned tensor."""
    name, clip, oc = family[0], family[4], family[5]
    cases = ["vpt"] if name == "siglip" else ["vpt", "maple"]  # the text reference reads CLIP's BPE
    x, labels = images(clip, 2, seed=1), torch.tensor([0, 2])
    for case in cases:
        torch.manual_seed(0)
        m = build_method(clip, CLASSES, load_config(None, METHODS[case]))
        tensors = m.learnable()
        with torch.no_grad():  # away from the initialisation, so that every term matters
            for t in tensors.values():
                t.add_(0.5 * torch.randn(t.shape, generator=torch.Generator().manual_seed(2)))
        if case == "vpt":  # the reference's own text side: open_clip's encode_text of the template
            ids = clip.tokenize([f"a photo of a {c.replace('_', ' ')}." for c in CLASSES])
            ref = vpt_logits(oc, x, ids, m.vision_prompts())
        else:
            pl = m.prompt_learner
            ids, _, slots = reference_inputs(oc, pl)
            projections = [m.proj, *m.compound_prompt_projections]
            ref = maple_logits(oc, x, ids, slots, pl.ctx, pl.deep_ctx, projections)
        loss, ours = m.loss(x, labels)
        assert relative_error(ours, ref) < 1e-5, case
        ref_loss = F.cross_entropy(ref, labels)
        ours_grads = torch.autograd.grad(loss, list(tensors.values()))
        ref_grads = torch.autograd.grad(ref_loss, list(tensors.values()))
        for key, a, b in zip(tensors, ours_grads, ref_grads, strict=True):
            assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, (case, key)


def test_mmrl_matches_its_reference(family):
    """MMRL's loss, fused logits and every gradient against `coop.reference.mmrl.mmrl_step` on timm's
    own forward: its tokens after the prefix (first on SigLIP), f_cls the tower's own pool (MAP on
    SigLIP and PE-Core), f_rep from the K rows after the final norms."""
    clip, oc = family[4], family[5]
    method = mmrl(clip, *METHODS["mmrl"][1:], "mmrl.reg_weight=3.0", "mmrl.alpha=0.6", classes=CLASSES)
    x, labels = images(clip, 3, seed=1), torch.tensor([0, 2, 1])
    tensors = method.learnable()
    ours, fused = method.loss(x, labels)
    ref, logits, logits_rep = mmrl_reference_step(oc, method, x, labels)
    assert abs(float(ours.detach() - ref.detach())) < 1e-5 * abs(float(ref.detach()))
    assert relative_error(fused, 0.6 * logits + 0.4 * logits_rep) < 1e-5
    grads = torch.autograd.grad(ours, list(tensors.values()))
    ref_grads = torch.autograd.grad(ref, list(tensors.values()))
    for key, a, b in zip(tensors, grads, ref_grads, strict=True):
        assert b.abs().max() > 0 and relative_error(a, b) < 1e-4, key


@pytest.mark.parametrize("family", ["eva02", "pe-core"], indirect=True)  # CLIP's BPE: the text reference's
def test_bench_vl_runs_on_the_tower(family, tmp_path, capsys):
    """tools/bench/bench_vl.py --model on a timm tower: MaPLe's step equals the reference's, and the
    image tokens of the bound are the tower's own (class token + 16 patches) plus the 2 prompts."""
    path, kwargs = family[1], family[3]
    out = tmp_path / "vl.json"
    args = ["--method", "maple", "--model", str(path), "--classes", "4", "--batch", "2"]
    with shrunk_timm(**kwargs):
        assert (
            load_tool("bench_vl").main([*args, "--set", "prompt.depth=2", "--no-memory", "--json", str(out)])
            == 0
        )
    step = json.loads(out.read_text())["steps"][0]
    assert step["image"] == 2 * (1 + 16 + 2)
    assert step["loss_diff"] < 1e-5 and max(step["grad_diff"].values()) < 1e-4


@pytest.mark.parametrize("model", ["mobileclip-s-tiny", "RN50"])
def test_vision_prompts_on_a_tower_without_tokens_are_refused_before_the_run_folder(model, tmp_path):
    name = str(REPO / "configs" / "models" / f"{model}.json") if model.endswith("tiny") else model
    out = tmp_path / "run"
    args = [*METHODS["maple"], f"model.name={name}", "model.pretrained=none", f"output_dir={out}"]
    cfg = load_config(None, args)  # no weights: the method's check, not theirs, is what refuses
    with pytest.raises(ModelError) as e:
        train_run(cfg)
    assert str(e.value).startswith("method=maple prompts the image tower, and model ")
    assert "\n" not in str(e.value) and not out.exists()


# --- through train_run: tools/train.py's path --------------------------------------------------

E2E = {"siglip": "promptsrc", "eva02": "mmrl", "pe-core": "maple"}
LAUNCH = (
    "import json, runpy, sys; sys.path.insert(0, 'tests'); from conftest import shrunk_timm; "
    "kwargs = json.loads(sys.argv.pop(1)); sys.argv[0] = 'tools/train.py'\n"
    "with shrunk_timm(**kwargs): runpy.run_path('tools/train.py', run_name='__main__')"
)


def run_overrides(family, image_folder, out, *extra: str) -> list[str]:
    name, path, tok = family[:3]
    args = {"model.name": path, "train.epochs": 3, "train.warmup_epochs": 0, "train.batch_size": 4}
    if tok is not None:
        args["model.tokenizer"] = tok
    return tiny_args(image_folder, out, **args) + [*METHODS[E2E[name]], *extra]


def learned(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)["prompt"]


def test_a_vision_method_runs_end_to_end(family, image_folder, tmp_path):
    """One method per family through `train_run` (what tools/train.py runs): PromptSRC with GPA on
    SigLIP is also killed with SIGKILL after its first checkpoint and resumed, bit-identical."""
    name, kwargs = family[0], family[3]
    out = tmp_path / "run"
    with shrunk_timm(**kwargs):
        metrics = train_run(load_config(None, run_overrides(family, image_folder, out)))
    assert metrics["epochs"] == 3 and metrics["n_test"] == 12
    if name != "siglip":
        return
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-c", LAUNCH, json.dumps(kwargs), *run_overrides(family, image_folder, killed)]
    kill_at_first_checkpoint(cmd, killed)
    assert torch.load(killed / "checkpoint.pt", weights_only=True)["epoch"] < 3, "killed too late"
    with shrunk_timm(**kwargs):
        resumed = train_run(load_config(None, run_overrides(family, image_folder, killed)))
    for key, t in learned(out).items():
        assert torch.equal(learned(killed)[key], t), key
    assert resumed["accuracy"] == metrics["accuracy"]
    assert resumed["final_train_loss"] == metrics["final_train_loss"]

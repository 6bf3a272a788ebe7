"""The ten open_clip models whose text tower is a Hugging Face model (RoBERTa, XLM-R, mT5, NLLB),
through `coop.model.text_hf.HFTextTower`, against open_clip's own `HFTextEncoder`.

Each model is built by open_clip from its own config (pooler, projection, CoCa's decoder) with a
tiny transformers config of its architecture (2 layers, width 32; open_clip builds the encoder from
it as from the hub's config) and a tiny image tower, random weights with every bias and norm
weight randomised; prompts come from tiny local tokenizers of each family (coop/model/tiny_tokenizers.py).
"""

from __future__ import annotations

import copy
import json

import open_clip
import pytest
import torch
from conftest import REPO
from transformers import AutoConfig

import coop
import coop.model.errors
from coop.model.text_hf import building_with, openclip_text_cfg
from coop.model.text_support import text_support
from coop.model.tiny_tokenizers import nllb_like, roberta_like, unigram, xlmr_like
from coop.model.tokenizer import PromptTokenizer

HF = [n for n in open_clip.list_models() if open_clip.get_model_config(n)["text_cfg"].get("hf_model_name")]
# the architecture of each hub config (model_type): the tiny model config of that family, whose
# text_cfg.hf_config is a 2-layer, width-32 transformers config of it, and its tokenizer's builder
TINY_CONFIGS = {
    "roberta": "roberta-tiny",
    "xlm-roberta": "xlmr-tiny",
    "mt5": "mt5-tiny",
    "m2m_100": "nllb-tiny",
}
BUILDERS = {"roberta": roberta_like, "xlm-roberta": xlmr_like, "mt5": unigram, "m2m_100": nllb_like}


def tiny_config(arch: str) -> dict:
    return json.loads((REPO / "configs" / "models" / f"{TINY_CONFIGS[arch]}.json").read_text())


HUB_TYPES = {
    "roberta-base": "roberta",
    "xlm-roberta": "xlm-roberta",
    "google/mt5": "mt5",
    "facebook/nllb": "m2m_100",
}
FAMILIES = {"roberta": "roberta-ViT-B-32", "xlm-roberta": "xlm-roberta-base-ViT-B-32"}
FAMILIES.update({"mt5": "mt5-base-ViT-B-32", "m2m_100": "nllb-clip-base"})


def architecture(name: str) -> str:
    hub = open_clip.get_model_config(name)["text_cfg"]["hf_model_name"]
    return next(t for prefix, t in HUB_TYPES.items() if hub.startswith(prefix))


def shrunk(name: str, seed: int = 0) -> torch.nn.Module:
    """open_clip's model `name` built from its config with a tiny transformers config and image tower."""
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    config = AutoConfig.for_model(**tiny_config(architecture(name))["text_cfg"]["hf_config"])
    vision = {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16}
    args = dict(embed_dim=32, vision_cfg=vision, text_cfg=openclip_text_cfg(cfg["text_cfg"]))
    torch.manual_seed(seed)
    with building_with(config):
        if "multimodal_cfg" in cfg:
            vision["output_tokens"] = True
            mm = {**cfg["multimodal_cfg"], "width": 32, "heads": 2, "layers": 1}
            model = open_clip.CoCa(multimodal_cfg=mm, **args)
        else:
            model = open_clip.CustomTextCLIP(**args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.text.parameters():
            if p.dim() == 1:  # biases and norm weights: no term hides
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-tokenizers")
    return {arch: open_clip.tokenizer.HFTokenizer(str(make(root / arch))) for arch, make in BUILDERS.items()}


def ours_and_open_clip(name: str, tokenizers):
    oc = shrunk(name)
    return coop.CLIP.from_openclip(oc, tokenizer=tokenizers[architecture(name)], name=name), oc


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())  # callers pass tensors without grad


TEXTS = [
    "a photo of a dog.",
    "a golden retriever",
    "crane (bird)",
    "x",
    "a photo of the long class name st bernard.",
]


def test_the_ten_models():
    assert len(HF) == 10 and {architecture(n) for n in HF} == set(BUILDERS)
    assert all(text_support(n) is None for n in HF)


@pytest.mark.parametrize("name", HF)
def test_encode_text_and_prompt_embeddings_equal_open_clip(name, tokenizers):
    """Token ids (`encode_text`) and the same rows as prompt embeddings (`encode_embeddings`, cut to
    the longest row) give open_clip's encode_text."""
    clip, oc = ours_and_open_clip(name, tokenizers)
    ids = clip.tokenize(TEXTS)
    text = clip.text
    eos = text.pool_positions(ids)
    assert bool((ids.gather(1, eos[:, None]) == PromptTokenizer(clip.tokenizer).eos_id).all())
    x = text.token_embedding(ids[:, : text.cut_length(eos, ids.shape[1])])
    with torch.no_grad():
        ref = oc.encode_text(ids, normalize=False)
        plain, embedded = clip.encode_text(ids), text.encode_embeddings(x, eos)
    assert torch.equal(plain, ref)
    assert relative_error(embedded, ref) < 1e-5
    assert x.shape[1] < ids.shape[1]  # the masked padding was cut


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_prompts_are_the_tokenizers_rows(arch, tokenizers):
    """ctx_init "a photo of a": the initial prompts give open_clip's features of "a photo of a {name}."
    as the family's tokenizer writes it (<s>/language code .. </s>, or .. </s>)."""
    clip, oc = ours_and_open_clip(FAMILIES[arch], tokenizers)
    names = ["dog", "golden retriever", "crane (bird)"]
    learner = coop.PromptLearner(clip, names, ctx_init="a photo of a")
    with torch.no_grad():
        ours = coop.PromptClassifier(clip, learner).text_features()
        ref = oc.encode_text(clip.tokenize([f"a photo of a {n}." for n in names]), normalize=False)
    assert relative_error(ours, ref) < 1e-5
    lead = PromptTokenizer(clip.tokenizer).lead
    assert learner.n_sos == len(lead) == (arch != "mt5")


def phrase_rows(learner, phrases: torch.Tensor, pad: int, length: int) -> torch.Tensor:
    """The learner's rows with the context slots holding the ids `phrases` ((M,) or (n_cls, M)),
    padded to `length`: what open_clip reads for prompts whose context is those tokens' embeddings."""
    ids = learner.token_ids.clone()
    ids.scatter_(1, learner.slots, phrases.expand(len(ids), -1))
    return torch.cat([ids, ids.new_full((len(ids), length - ids.shape[1]), pad)], dim=1)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
@pytest.mark.parametrize("position", ["end", "middle", "front"])
@pytest.mark.parametrize("csc", [False, True])
def test_layouts_with_real_tokens_equal_open_clip(arch, position, csc, tokenizers):
    """CoOp's three layouts, shared and class-specific context: with the context set to real tokens'
    embeddings, the prompt features equal open_clip's encode_text of those token rows."""
    clip, oc = ours_and_open_clip(FAMILIES[arch], tokenizers)
    learner = coop.PromptLearner(
        clip, ["dog", "golden retriever", "crane (bird)"], n_ctx=4, position=position, csc=csc
    )
    gen = torch.Generator().manual_seed(3)
    phrases = torch.randint(4, 60, (3, 4) if csc else (4,), generator=gen)
    with torch.no_grad():
        learner.ctx.copy_(clip.text.token_embedding(phrases))
        ours = coop.PromptClassifier(clip, learner).text_features()
        ref = oc.encode_text(phrase_rows(learner, phrases, clip.text.cfg.pad_id, 77), normalize=False)
    assert relative_error(ours, ref) < 1e-5


def open_clip_layers(oc) -> torch.nn.ModuleList:
    t = oc.text.transformer
    return t.encoder.layer if hasattr(t, "embeddings") else t.block if hasattr(t, "block") else t.layers


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_deep_prompts_equal_open_clip_with_the_tokens_written_in(arch, tokenizers):
    """Depth 3, class-specific deep context in the middle: open_clip's encoder with the deep tokens
    written over the context slots' hidden states before its layers 1 and 2 (here, in the test)."""
    clip, oc = ours_and_open_clip(FAMILIES[arch], tokenizers)
    assert clip.text.cfg.layers == 2
    learner = coop.PromptLearner(clip, ["dog", "crane (bird)"], n_ctx=2, position="middle", csc=True, depth=2)
    phrases = torch.tensor([[5, 9], [7, 11]])
    with torch.no_grad():
        learner.ctx.copy_(clip.text.token_embedding(phrases))
        learner.deep_ctx.normal_(generator=torch.Generator().manual_seed(4))
    slots, deep = learner.slots, learner.deep_ctx[0]  # (n_cls, M), (n_cls, M, W) before layer 1

    def write(module, args):
        return (args[0].scatter(1, slots.unsqueeze(-1).expand(-1, -1, args[0].shape[-1]), deep), *args[1:])

    handle = open_clip_layers(oc)[1].register_forward_pre_hook(write)
    try:
        with torch.no_grad():
            ref = oc.encode_text(phrase_rows(learner, phrases, clip.text.cfg.pad_id, 77), normalize=False)
    finally:
        handle.remove()
    classifier = coop.PromptClassifier(clip, learner)
    ours = classifier.text_features()
    assert relative_error(ours.detach(), ref) < 1e-5
    ours.square().sum().backward()
    assert learner.ctx.grad.abs().sum() > 0 and learner.deep_ctx.grad.abs().sum() > 0
    assert all(p.grad is None for p in clip.parameters())
    with torch.no_grad():
        assert (
            relative_error(clip.encode_text(phrase_rows(learner, phrases, clip.text.cfg.pad_id, 77)), ref)
            > 1e-3
        )


def test_grad_checkpointing_gives_the_same_gradients(tokenizers):
    clip, _ = ours_and_open_clip(FAMILIES["roberta"], tokenizers)
    learner = coop.PromptLearner(clip, ["dog", "crane (bird)"], depth=2)
    classifier = coop.PromptClassifier(clip, learner)
    grads = []
    for recompute in (False, True):
        clip.text.grad_checkpointing = recompute
        learner.zero_grad()
        classifier.text_features().square().sum().backward()
        grads.append(learner.deep_ctx.grad.clone())
    clip.text.grad_checkpointing = False
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
    assert "forward" not in vars(clip.text.blocks[0])


def hub_named(tmp_path, name: str = "roberta-ViT-B-32") -> str:
    """Model `name`'s config registered under its name + "-uncached", its text tower a hub model no
    cache holds (what a shipped model is offline on a machine that never fetched its config)."""
    cfg = open_clip.get_model_config(name)
    cfg["text_cfg"]["hf_model_name"] = "no-such-org/no-such-roberta"
    path = tmp_path / f"{name}-uncached.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    return path.stem


def test_real_weights_offline_say_what_is_missing_in_one_line(tokenizers, tmp_path, monkeypatch):
    """A hub model's tower needs its transformers config (open_clip builds the encoder from it):
    offline and not cached, one line naming the model and the hub name, before the weights and
    before anything is built; `hf_tower_config` (checks before a run) says the same."""
    from coop.model.text_hf import hf_tower_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tmp_path / "tok"
    tokenizers["roberta"].save_pretrained(directory)
    name = hub_named(tmp_path)
    with pytest.raises(coop.model.errors.ModelError) as err:
        coop.load_clip(name, pretrained="laion2b_s12b_b32k", tokenizer=str(directory))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model {name}'s text tower is the Hugging Face model")
    assert "'no-such-org/no-such-roberta'" in message and "offline" in message
    with pytest.raises(coop.model.errors.ModelError) as err:
        hf_tower_config(name)
    assert str(err.value) == message


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_tiny_configs_load_offline(arch, tokenizers, tmp_path, monkeypatch):
    """configs/models/{roberta,xlmr,mt5,nllb}-tiny.json: the transformers config inline
    (`text_cfg.hf_config`) and a local tokenizer directory, nothing from the hub; the model's pooler
    and projection are its config's."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tmp_path / "tok"
    tokenizers[arch].save_pretrained(directory)
    path = REPO / "configs" / "models" / f"{TINY_CONFIGS[arch]}.json"
    clip = coop.load_clip(str(path), tokenizer=str(directory))
    text_cfg = tiny_config(arch)["text_cfg"]
    assert clip.text.cfg.pool == text_cfg["hf_pooler_type"]
    assert clip.text.cfg.projection == text_cfg.get("hf_proj_type", "mlp")
    assert (clip.text.cfg.layers, clip.text.cfg.width) == (2, 32)
    learner = coop.PromptLearner(clip, ["dog", "crane (bird)"], ctx_init="a photo of a")
    with torch.no_grad():
        ours = coop.PromptClassifier(clip, learner).text_features()
        ref = clip.encode_text(clip.tokenize(["a photo of a dog.", "a photo of a crane (bird)."]))
    assert relative_error(ours, ref) < 1e-5


def test_the_tower_holds_open_clips_weights_once(tokenizers):
    """The tower takes the encoder's modules over rather than copying them: a model's text weights
    are in memory once at load (a copy doubled them: 2.2 GB more in fp32 for XLM-R large's 560M)."""
    clip, oc = ours_and_open_clip(FAMILIES["roberta"], tokenizers)
    ours = {t.data_ptr() for t in clip.text.state_dict().values()}
    theirs = {t.data_ptr() for t in oc.text.state_dict().values()}
    assert ours == theirs and len(ours) > 10


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_lora_on_the_encoders_q_k_v_equals_open_clip_with_the_merged_weights(arch, tokenizers):
    """CLIP-LoRA's updates, added by forward hooks on the encoder's q/k/v Linears (RoBERTa's
    query/key/value, T5's q/k/v, NLLB's q_proj/k_proj/v_proj), give open_clip's encode_text with
    W + s B A loaded into its own encoder; detached, the frozen model again."""
    from coop.model.lora import LoRAAdapters

    clip, oc = ours_and_open_clip(FAMILIES[arch], tokenizers)
    adapters = LoRAAdapters(clip, ["text"], ["q", "k", "v"], "all", rank=2, alpha=1.0, dropout=0.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    merged = adapters.merged_weights()
    assert len(merged) == 3 * clip.text.cfg.layers
    ids = clip.tokenize(TEXTS)
    with torch.no_grad():
        frozen = clip.encode_text(ids)
        adapters.attach()
        ours = clip.encode_text(ids)
        adapters.detach()
        assert torch.equal(clip.encode_text(ids), frozen)
        oc.text.load_state_dict(merged, strict=False)
        ref = oc.encode_text(ids, normalize=False)
    assert relative_error(ours, ref) < 1e-5 and relative_error(frozen, ref) > 1e-3


def test_mmrl_is_refused_in_one_line_when_built(tokenizers):
    """MMRL inserts tokens at a layer; transformers' encoder fixes the sequence before its layers."""
    from coop.config.load import load_config
    from coop.methods import build_method

    clip, _ = ours_and_open_clip(FAMILIES["roberta"], tokenizers)
    cfg = load_config(None, ["method=mmrl", "mmrl.layers=[1]", "mmrl.vision_layers=null"])
    with pytest.raises(coop.model.errors.ModelError) as err:
        build_method(clip, ["dog", "cat"], cfg)
    assert str(err.value).startswith(
        "method=mmrl inserts tokens at the text tower's layers, and model roberta-ViT-B-32's text tower "
        "(Hugging Face RobertaModel"
    )
    assert "inserted tokens" in str(err.value) and "\n" not in str(err.value)


def test_weights_file_loads_into_the_tiny_config(tokenizers, tmp_path, monkeypatch):
    """open_clip's state dict of a model with a Hugging Face text tower, saved to a file, loads
    through `load_clip(config json, pretrained=file)` (open_clip's keys, `text.transformer.*` and
    `text.proj.*`): our features are open_clip's."""
    from conftest import build_openclip

    from coop.model.weights import resolve_model_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tmp_path / "tok"
    tokenizers["m2m_100"].save_pretrained(directory)
    path = str(REPO / "configs" / "models" / "nllb-tiny.json")
    oc = build_openclip(resolve_model_name(path), seed=3)
    torch.save(oc.state_dict(), tmp_path / "weights.pt")
    clip = coop.load_clip(path, pretrained=str(tmp_path / "weights.pt"), tokenizer=str(directory))
    ids = clip.tokenize(TEXTS)
    with torch.no_grad():
        assert torch.equal(clip.encode_text(ids), oc.encode_text(ids, normalize=False))
        fresh = coop.load_clip(path, tokenizer=str(directory)).encode_text(ids)
    assert relative_error(fresh, oc.encode_text(ids, normalize=False).detach()) > 1e-3


def test_nllb_run_evaluates_exports_and_predicts(image_folder, tmp_path, monkeypatch):
    """A CoOp run with deep prompts on nllb-tiny (its transformers config inline, the language code
    as [SOS], pooled at it), offline: tools/eval.py gives the run's accuracy, and the exported
    prompts predict through tools/predict.py."""
    from conftest import run_tool_in_process, tiny_args

    from coop.interop import export_run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok, out = nllb_like(tmp_path / "tok"), tmp_path / "run"
    extra = {"model.name": REPO / "configs" / "models" / "nllb-tiny.json", "model.tokenizer": tok}
    extra.update({"train.epochs": 2, "train.warmup_epochs": 0, "train.batch_size": 6})
    res = run_tool_in_process(
        REPO / "tools" / "train.py", [*tiny_args(image_folder, out, **extra), "prompt.depth=2"]
    )
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_tool_in_process(REPO / "tools" / "eval.py", [out / "checkpoint.pt", "device=cpu"])
    assert res.returncode == 0, res.stderr[-2000:]
    accuracy = json.loads((out / "metrics.json").read_text())["accuracy"]
    assert json.loads(res.stdout)["accuracy"] == pytest.approx(accuracy)
    exported, csv = export_run(out, tmp_path / "prompts.safetensors"), tmp_path / "predictions.csv"
    args = [exported, image_folder / "test", "--out", csv, "--device", "cpu"]
    res = run_tool_in_process(REPO / "tools" / "predict.py", args)
    assert res.returncode == 0, res.stderr[-2000:]
    assert len(csv.read_text().splitlines()) == len(list((image_folder / "test").glob("*/*.png"))) + 1


def test_towers_we_cannot_run_are_refused_in_one_line(tmp_path):
    """open_clip's MaxPooler (it raises on open_clip's own integer mask), by config name before
    anything is built; a tower open_clip builds without a projection to another width, when built."""
    from open_clip.hf_model import HFTextEncoder
    from transformers import RobertaConfig

    text_cfg = {**tiny_config("roberta")["text_cfg"], "hf_pooler_type": "max_pooler"}
    path = tmp_path / "max-pooled.json"
    path.write_text(json.dumps({**tiny_config("roberta"), "text_cfg": text_cfg}))
    open_clip.add_model_config(path)
    reason = text_support("max-pooled")
    assert (
        reason
        == "model max-pooled's text tower pools with open_clip's MaxPooler, which fails on its own mask"
    )
    with pytest.raises(coop.model.errors.ModelError, match="^model max-pooled's text tower pools"):
        coop.load_clip(str(path))
    config = RobertaConfig(**tiny_config("roberta")["text_cfg"]["hf_config"])
    encoder = HFTextEncoder("roberta-base", 16, config=config, pooler_type="mean_pooler", proj_type=None)
    with pytest.raises(coop.model.errors.ModelError, match="^model odd's text tower has no projection"):
        coop.model.text_hf.HFTextTower(encoder, "odd")


def test_nllb_prompts_start_with_the_tokenizers_language_code(tmp_path):
    """NLLB's rows begin with the source-language code, which the [CLS] pooler reads: a tokenizer
    loaded for French (`src_lang`) puts fra_Latn there, and so do the prompts."""
    directory = str(nllb_like(tmp_path / "tok"))
    french = open_clip.tokenizer.HFTokenizer(directory, src_lang="fra_Latn")
    code = french.tokenizer.convert_tokens_to_ids("fra_Latn")
    assert int(french(["a dog"])[0, 0]) == code
    oc = shrunk("nllb-clip-base")
    clip = coop.CLIP.from_openclip(oc, tokenizer=french, name="nllb-clip-base")
    learner = coop.PromptLearner(clip, ["dog", "crane (bird)"], ctx_init="a photo of a")
    assert PromptTokenizer(french).lead == [code] and bool((learner.token_ids[:, 0] == code).all())
    with torch.no_grad():
        ours = coop.PromptClassifier(clip, learner).text_features()
        ref = oc.encode_text(french(["a photo of a dog.", "a photo of a crane (bird)."]), normalize=False)
    assert relative_error(ours, ref) < 1e-5


VISION_METHODS = {  # the tiny image tower has 1 block
    "maple": ["method=maple", "prompt.depth=1"],
    "ivlp": ["method=ivlp", "prompt.depth=2", "vision.depth=1"],
    "promptsrc": ["method=promptsrc", "prompt.depth=2", "vision.depth=1"],
    "vpt": ["method=vpt", "vision.depth=1"],
    "clip_lora": ["method=clip_lora", "lora.towers=[text,vision]", "lora.dropout=0"],
}


@pytest.mark.parametrize("arch", ["roberta", "mt5"])
@pytest.mark.parametrize("method_name", sorted(VISION_METHODS))
def test_methods_with_vision_prompts_train(arch, method_name, tokenizers):
    """The models with a Hugging Face text tower load, so their ViT image tower takes vision
    prompts (docs/models.md counts them): MaPLe, IVLP, PromptSRC, VPT and CLIP-LoRA on both towers
    train two steps on images (finite loss, learned tensors move, no CLIP weight gets a gradient)."""
    from test_families_e2e import trains_two_steps

    from coop.config.load import load_config
    from coop.methods import build_method

    clip, _ = ours_and_open_clip(FAMILIES[arch], tokenizers)
    method = build_method(
        clip, ["dog", "cat", "crane (bird)"], load_config(None, VISION_METHODS[method_name])
    )
    images = torch.randn(3, 3, clip.image_size, clip.image_size, generator=torch.Generator().manual_seed(6))
    trains_two_steps(method, images)


def test_nearest_words_compare_with_the_embeddings_the_encoder_is_given(tokenizers):
    """NLLB scales its word embeddings by sqrt(width) in the embedding's forward: the table prompts
    are compared with is that scaled one, so a context set from a phrase finds its own tokens at
    Euclidean distance 0."""
    from coop.results.nearest_words import embedding_table, nearest_words

    clip, _ = ours_and_open_clip(FAMILIES["m2m_100"], tokenizers)
    learner = coop.PromptLearner(clip, ["dog"], ctx_init="a photo of a")
    table = embedding_table(clip.text.token_embedding)
    assert torch.equal(table[:5], clip.text.token_embedding(torch.arange(5)))
    rows = [r for r in nearest_words(learner, table, clip.tokenizer, 1) if r["metric"] == "euclidean"]
    assert [r["word"] for r in rows] == ["▁a", "▁photo", "▁of", "▁a"] and all(r["score"] < 1e-3 for r in rows)


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_tower_config_on_the_meta_device_is_the_loaded_towers(arch, tokenizers, tmp_path, monkeypatch):
    """`hf_tower_config`: what a check before building reads (vocabulary rows, padding id, pooler,
    projection, layers) equals the loaded tower's `cfg`; nothing from the hub."""
    from coop.model.text_hf import hf_tower_config
    from coop.model.weights import resolve_model_name

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tmp_path / "tok"
    tokenizers[arch].save_pretrained(directory)
    path = str(REPO / "configs" / "models" / f"{TINY_CONFIGS[arch]}.json")
    meta = hf_tower_config(resolve_model_name(path))
    assert meta == coop.load_clip(path, tokenizer=str(directory)).text.cfg
    assert meta.pad_id == PromptTokenizer(tokenizers[arch]).pad_id and meta.vocab_size == 400

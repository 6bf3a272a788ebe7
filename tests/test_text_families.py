"""Every open_clip model whose text tower is open_clip's TextTransformer: our tower against open_clip's.

Each model's config is built with its text tower shrunk (2 layers, width 64, 2 heads, a 1,000-token
vocabulary; the rest of the tower as configured: mask, pooling, activation, LayerNorm eps,
projection, context length, CoCa's class token) and a tiny image tower, random weights with
LayerNorm weights and biases randomised. Token ids follow the family's layout: CLIP's [SOS] ..
[EOS] (the highest id) then padding, MetaCLIP 2's [EOS] id, SigLIP's and CLIPA's whole context.
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
from conftest import randomise_text_tower

import coop
from coop.model.errors import ModelError
from coop.model.text_full import encode_full
from coop.model.text_support import text_support

VOCAB = 1000
NAMES = open_clip.list_models()
HF = [n for n in NAMES if open_clip.get_model_config(n)["text_cfg"].get("hf_model_name")]
TOWERS = [n for n in NAMES if n not in HF]


def family(name: str) -> str:
    """What decides the text computation: mask, pooling, class token (plus [EOS] id)."""
    t = open_clip.get_model_config(name)["text_cfg"]
    if t.get("embed_cls"):
        return "coca"
    pool = t.get("pool_type", "argmax")
    causal = "bidirectional" if t.get("no_causal_mask") else "causal"
    return f"{causal}-{pool}" + (f"-{t['eos_id']}" if pool == "eos" else "")


def shrunk(name: str, seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    """open_clip's model for `name` with its text tower shrunk and a tiny image tower."""
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    cfg["text_cfg"].update(layers=2, width=64, heads=2, vocab_size=vocab)
    vision = {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16}
    vision.update({k: v for k, v in cfg["vision_cfg"].items() if k in ("output_tokens",)})
    args = dict(
        embed_dim=32, vision_cfg=vision, text_cfg=cfg["text_cfg"], quick_gelu=cfg.get("quick_gelu", False)
    )
    torch.manual_seed(seed)
    if "multimodal_cfg" in cfg:
        mm = {**cfg["multimodal_cfg"], "width": 64, "heads": 2, "layers": 1, "vocab_size": vocab}
        model = open_clip.CoCa(multimodal_cfg=mm, **args)
    elif cfg.get("custom_text"):
        model = open_clip.CustomTextCLIP(**args)
    else:
        model = open_clip.CLIP(**args)
    return randomise_text_tower(model, seed).eval()


def family_ids(text: coop.model.text_encoder.TextTransformer, seed: int = 0) -> torch.Tensor:
    """(7, context) ids with the family's [EOS]/padding layout: lengths 1..context, one row full and
    one a token short of it, one row with the padding id inside its text (CoCa's mask reads ids),
    one without [EOS] when [EOS] is an id (`pool="eos"`: pooled at 0)."""
    cfg = text.cfg
    ctx, gen = cfg.context_length, torch.Generator().manual_seed(seed)
    eos, pad = (cfg.eos_id, 1 if cfg.eos_id != 1 else 0) if cfg.pool == "eos" else (VOCAB - 1, 0)
    ids = torch.randint(3, VOCAB - 2, (7, ctx), generator=gen)
    ids[:, 0] = VOCAB - 2  # [SOS]
    for row, n in enumerate([1, 3, 7, ctx // 2, ctx - 2, ctx - 1, 5]):  # [EOS] positions
        ids[row, n] = eos
        ids[row, n + 1 :] = pad
    ids[6, 2] = pad  # a padding id inside the text
    if cfg.pool == "eos":
        ids[6, 5] = pad  # no [EOS] at all
    return ids


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", TOWERS)
def test_encode_text_matches_open_clip(name):
    oc = shrunk(name)
    clip = coop.CLIP.from_openclip(oc, name=name)
    ids = family_ids(clip.text)
    with torch.no_grad():
        ours, ref = clip.encode_text(ids), oc.encode_text(ids, normalize=False)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-5, family(name)
    assert text_support(name) is None


FAMILIES = {}
for _name in TOWERS:
    FAMILIES.setdefault(family(_name), _name)  # one model per family


def test_families_cover_the_issue():
    assert set(FAMILIES) == {
        "causal-argmax",
        "causal-eos-1",
        "causal-eos-2",
        "bidirectional-argmax",
        "bidirectional-last",
        "coca",
    }
    assert len(TOWERS) == 134 and len(HF) == 10


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_prompt_paths_equal_open_clip(fam):
    """Prompt embeddings through `encode_with_shared_prefix` (with a 3-token prefix) and
    `encode_embeddings`: the packed, cut pass on causal towers pooled at [EOS], the whole context
    otherwise; both equal open_clip's encode_text of the same ids."""
    name = FAMILIES[fam]
    oc = shrunk(name)
    text = coop.CLIP.from_openclip(oc, name=name).text
    ids = family_ids(text)
    ids = ids[text.pool_positions(ids) >= 3]  # rows whose pooled token follows the prefix
    if fam == "coca":
        ids = ids[(ids[:, 1:3] != 0).all(1)]  # from embeddings, CoCa's padding is what follows [EOS]
    ids[:, 1:3] = ids[0, 1:3]  # a shared prefix [SOS] t1 t2
    eos = text.pool_positions(ids)
    assert text.cuts == (fam.startswith("causal") or fam == "coca") and len(ids) >= 3
    length = text.cut_length(eos, ids.shape[1])
    assert text.cuts or length == ids.shape[1]
    x = text.token_embedding(ids[:, :length])
    with torch.no_grad():
        ref = oc.encode_text(ids, normalize=False)
        shared = text.encode_with_shared_prefix(x[:1, :3], x[:, 3:], eos)
        plain = text.encode_embeddings(x, eos)
    assert relative_error(shared, ref) < 1e-5
    assert relative_error(plain, ref) < 1e-5
    if not text.cuts:
        with pytest.raises(ValueError, match=f"^model {name}'s text tower .* sees every token"):
            text.encode_embeddings(x[:, :10], eos)
        with pytest.raises(ValueError, match=f"^model {name}'s text tower .*: a prefix computed once needs"):
            text.prefix_keys_values(x[:1, :3])
    else:  # rows cut short of what the tower reads
        with pytest.raises(ValueError, match="reads .* tokens of these rows"):
            text.encode_embeddings(x[:, : int(eos.max())], eos)


def text_rows(text, ids: torch.Tensor, first: int) -> torch.Tensor:
    """The rows of `ids` whose pooled token lies at `first` or later (and, for CoCa, whose text
    holds no padding id: from embeddings, CoCa's padding is what follows [EOS])."""
    ids = ids[text.pool_positions(ids) >= first]
    if text.cfg.embed_cls:
        ids = ids[(ids[:, 1:first] != text.cfg.pad_id).all(1)]
    return ids


@pytest.mark.parametrize("fam", ["causal-argmax", "bidirectional-argmax", "bidirectional-last", "coca"])
def test_prompt_learner_on_every_family(fam):
    """CoOp's check on each family that CLIP's tokenizer fits: with ctx_init "a photo of a" at the
    end, the initial prompt features equal open_clip's features of "a photo of a {name}.";
    towers without the cut keep the whole context."""
    oc = shrunk(FAMILIES[fam], vocab=49408)
    clip = coop.CLIP.from_openclip(oc)
    names = ["dog", "great white shark", "St. Bernard"]
    learner = coop.PromptLearner(clip, names, ctx_init="a photo of a")
    cut = learner.token_ids.shape[1] < clip.context_length
    assert cut == clip.text.cuts
    with torch.no_grad():
        ours = coop.PromptClassifier(clip, learner).text_features()
        ref = oc.encode_text(clip.tokenize([f"a photo of a {n}." for n in names]), normalize=False)
    assert relative_error(ours, ref) < 1e-5


@pytest.mark.parametrize("fam", ["causal-argmax", "coca", "bidirectional-last"])
def test_deep_tokens_packed_equal_the_full_pass(fam):
    """Deep tokens at context slots 1..3, inside a shared 4-token prefix: shared ones, and per-row
    ones (TCP's) that end the sharing at their block (`_unshare_prefix`); the packed pass equals
    the full-sequence blocks (`encode_with_attention`)."""
    text = coop.CLIP.from_openclip(shrunk(FAMILIES[fam])).text
    ids = text_rows(text, family_ids(text), 5)
    ids[:, 1:5] = ids[0, 1:5]
    eos = text.pool_positions(ids)
    x = text.token_embedding(ids[:, : text.cut_length(eos, ids.shape[1])])
    n, width = len(ids), text.cfg.width
    slots = torch.tensor([[1, 2, 3]]).expand(n, -1)
    gen = torch.Generator().manual_seed(1)
    for deep in ({1: torch.randn(n, 3, width, generator=gen)}, torch.randn(1, 1, 3, width, generator=gen)):
        with torch.no_grad():
            packed = text.encode_with_shared_prefix(x[:1, :4], x[:, 4:], eos, deep, slots)
            full = text.encode_with_attention(x, eos, deep, slots)[0]
            plain = text.encode_embeddings(x, eos)
        assert relative_error(packed, full) < 1e-5
        assert relative_error(packed, plain) > 1e-3  # the tokens count


@pytest.mark.parametrize("fam", ["causal-argmax", "coca", "bidirectional-last"])
def test_attention_weights_follow_the_mask(fam):
    """`encode_with_attention`: open_clip's features, and weights that are 0 exactly where the
    tower's mask hides a key (causal; CoCa's class token; none)."""
    oc = shrunk(FAMILIES[fam])
    text = coop.CLIP.from_openclip(oc).text
    ids = text_rows(text, family_ids(text), 3)
    eos = text.pool_positions(ids)
    x = text.token_embedding(ids[:, : text.cut_length(eos, ids.shape[1])])
    with torch.no_grad():
        feats, weights = text.encode_with_attention(x, eos)
        ref = oc.encode_text(ids, normalize=False)
    assert relative_error(feats, ref) < 1e-5
    length = x.shape[1] + text.cfg.embed_cls
    assert weights.shape == (2, len(ids), 2, length, length)
    seen = weights[0, :, 0] > 0  # (N, L, L) in block 0, head 0
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if fam == "bidirectional-last":
        assert bool(seen.all())
    elif fam == "causal-argmax":
        assert torch.equal(seen, causal.expand_as(seen))
    else:  # CoCa: a key is seen through the token after [EOS]; the class token sees itself only when full
        for row in range(len(ids)):
            keys = torch.arange(length) <= eos[row] + 1
            keys[-1] = bool(eos[row] == text.cfg.context_length - 1)
            assert torch.equal(seen[row], causal & keys)


@pytest.mark.parametrize(
    "text_cfg, reason",
    [
        ({"ls_init_value": 0.1}, "layer scale"),
        ({"qk_norm": True}, "custom attention block"),
        ({"pool_type": "none"}, "pooling 'none'"),
        ({"embed_cls": True, "no_causal_mask": True}, "class token without the causal mask"),
    ],
)
def test_towers_we_do_not_reproduce_are_refused(text_cfg, reason, tmp_path):
    """Built (from_openclip) and by name (text_support): the same one line."""
    cfg = {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16},
        "text_cfg": {"width": 32, "heads": 2, "layers": 1, "vocab_size": VOCAB, **text_cfg},
        "custom_text": True,
    }
    model = open_clip.CustomTextCLIP(**{k: v for k, v in cfg.items() if k != "custom_text"})
    with pytest.raises(ModelError, match=reason) as err:
        coop.CLIP.from_openclip(model, name="odd")
    assert str(err.value).startswith("model odd's text tower") and "\n" not in str(err.value)
    path = tmp_path / "odd-tower.json"
    path.write_text(__import__("json").dumps(cfg))
    open_clip.add_model_config(path)
    assert text_support("odd-tower") == str(err.value).replace("model odd's", "model odd-tower's")


@pytest.mark.parametrize("fam", ["bidirectional-argmax", "bidirectional-last", "coca"])
def test_one_query_last_block_equals_the_full_block(fam):
    """The full-sequence pass computes only the pooled token in its last block (`Block.forward_at`):
    the features and the gradients equal those of the whole last block."""
    text = coop.CLIP.from_openclip(shrunk(FAMILIES[fam])).text
    ids = family_ids(text)
    eos, keys = text.pool_positions(ids), ids != text.cfg.pad_id
    x = text.token_embedding(ids).detach().requires_grad_(True)
    outs = []
    for one_query in (True, False):
        out = encode_full(text, x, eos, keys=keys, one_query=one_query)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        outs.append((out.detach(), grad))
    assert relative_error(outs[0][0], outs[1][0]) < 1e-5
    assert relative_error(outs[0][1], outs[1][1]) < 1e-5


def test_grad_checkpointing_of_the_full_pass():
    """Under `grad_checkpointing` the full-sequence blocks are recomputed: the same gradients."""
    text = coop.CLIP.from_openclip(shrunk(FAMILIES["bidirectional-last"])).text
    ids = family_ids(text)
    x = text.token_embedding(ids).detach().requires_grad_(True)
    grads = []
    for recompute in (False, True):
        text.grad_checkpointing = recompute
        (grad,) = torch.autograd.grad(text.encode_embeddings(x, text.pool_positions(ids)).square().sum(), x)
        grads.append(grad)
    text.grad_checkpointing = False
    assert relative_error(grads[1], grads[0]) < 1e-6


@pytest.mark.parametrize("fam", ["causal-eos-2", "coca"])
def test_rows_after_several_prefixes(fam):
    """CoCoOp's path: G prefixes computed once (`prefix_keys_values`), the same rows after each
    (`encode_after_prefixes`), equal to each group's prompts run on their own."""
    text = coop.CLIP.from_openclip(shrunk(FAMILIES[fam])).text
    ids = text_rows(text, family_ids(text), 4)
    eos = text.pool_positions(ids)
    x = text.token_embedding(ids[:, : text.cut_length(eos, ids.shape[1])])  # (N, L, W)
    prefixes = torch.randn(3, 3, text.cfg.width, generator=torch.Generator().manual_seed(2))  # (G, P, W)
    with torch.no_grad():
        ours = text.encode_after_prefixes(text.prefix_keys_values(prefixes), x[None, :, 3:], eos)  # (G, N, E)
        for g in range(3):
            rows = torch.cat([prefixes[g].expand(len(x), -1, -1), x[:, 3:]], dim=1)
            assert relative_error(ours[g], text.encode_embeddings(rows, eos)) < 1e-5

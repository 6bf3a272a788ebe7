"""Text towers of every open_clip family for `tools/bench/bench_text.py --model NAME` (random weights).

    oc, clip = build_family_models("ViT-B-16-SigLIP", device)
    steps = family_steps(oc, classifier)          # {"reference": open_clip's full context, "coop": ours}

The prompts are tokenised with CLIP's tokenizer (the families' own tokenizers load from the hub):
a vocabulary smaller than CLIP's is widened to 49,408 rows, and a tower pooled at an [EOS] id
(MetaCLIP 2 worldwide) looks for CLIP's [EOS] id, 49,407. Neither changes what the tower computes
per token. The image tower is replaced by a tiny ViT, as it plays no part in the text side, unless
`image_tower=True` (`tools/bench/bench_vl.py`, whose methods prompt it).

The reference assembles CoOp's prompts at the full context (`coop.reference.coop.coop_layout`) and runs
them through open_clip's own text modules as its `TextTransformer.forward` does after the token
embedding: positions (and CoCa's class token with its padding mask), the blocks with the tower's
mask, ln_final, open_clip's `text_global_pool`, the projection.
"""

from __future__ import annotations

import copy

import open_clip
import torch
from _bench import prompt_steps
from open_clip.transformer import text_global_pool
from torch import nn

import coop
from coop.reference.coop import coop_layout, reference_inputs

CLIP_VOCAB, CLIP_EOS = 49408, 49407
TINY_VISION = {"image_size": 32, "patch_size": 16, "width": 32, "layers": 1, "head_width": 16}


def clip_shaped(name: str) -> bool:
    """Whether `name` is an `open_clip.CLIP` with CLIP's causal, argmax-pooled tower (the path
    `bench_text.py` has always benchmarked)."""
    cfg = open_clip.get_model_config(name) or {}
    t = cfg.get("text_cfg", {})
    plain = not (cfg.get("custom_text") or t.get("hf_model_name") or t.get("no_causal_mask"))
    return plain and t.get("pool_type", "argmax") == "argmax"


def build_family_models(name: str, device: torch.device, seed: int = 0, image_tower: bool = False):
    """(open_clip model, coop.CLIP) for model `name` with CLIP's tokenizer (see the module
    docstring), the same random weights, frozen, on `device`; with `image_tower` the model's own
    image tower, else a tiny ViT."""
    cfg = copy.deepcopy(open_clip.get_model_config(name))
    text = cfg["text_cfg"]
    text["vocab_size"] = max(text.get("vocab_size", CLIP_VOCAB), CLIP_VOCAB)
    if text.get("pool_type") == "eos":
        text["eos_id"], text["vocab_size"] = CLIP_EOS, CLIP_VOCAB
    vision = cfg["vision_cfg"] if image_tower else dict(TINY_VISION)
    args = dict(embed_dim=cfg["embed_dim"], vision_cfg=vision, text_cfg=text)
    args["quick_gelu"] = cfg.get("quick_gelu", False)
    torch.manual_seed(seed)
    if "multimodal_cfg" in cfg:
        args["vision_cfg"]["output_tokens"] = True
        mm = {**cfg["multimodal_cfg"], "layers": 1, "vocab_size": text["vocab_size"]}
        oc = open_clip.CoCa(multimodal_cfg=mm, **args)
    elif cfg.get("custom_text"):
        oc = open_clip.CustomTextCLIP(**args)
    else:
        oc = open_clip.CLIP(**args)
    oc = oc.eval().to(device).requires_grad_(False)
    return oc, coop.CLIP.from_openclip(copy.deepcopy(oc), name=name)  # a timm trunk is taken over: a copy


def openclip_text(oc: nn.Module, x: torch.Tensor, ids: torch.Tensor, slots, deep) -> torch.Tensor:
    """open_clip's text tower on token embeddings x (n, L, W) of ids (n, L), with deep prompts
    replacing the hidden states at `slots` (n, L) bool before blocks 1..len(deep)."""
    t = oc.text if hasattr(oc, "text") else oc
    pool = getattr(t, "pool_type", getattr(oc, "text_pool_type", "argmax"))
    eos_id = getattr(t, "eos_id", getattr(oc, "text_eos_id", None))
    cls = getattr(t, "cls_emb", None)
    n, length, width = x.shape
    mask = t.attn_mask
    if cls is not None:
        x = torch.cat([x, cls.expand(n, 1, -1)], 1)  # (n, L+1, W)
        mask = mask[: length + 1, : length + 1] + t._build_additive_mask(ids, length + 1, x.dtype)
    x = x + t.positional_embedding[: x.shape[1]]
    n_deep = 0 if deep is None else len(deep)
    for i, block in enumerate(t.transformer.resblocks):
        if 1 <= i <= n_deep:
            tokens = deep[i - 1] if deep[i - 1].dim() == 3 else deep[i - 1].unsqueeze(0).expand(n, -1, -1)
            x = x.masked_scatter(slots.unsqueeze(-1).expand(-1, -1, width), tokens.reshape(-1, width))
        x = block(x, attn_mask=mask)
    if cls is not None:
        pooled = t.ln_final(x[:, -1])
    else:
        pooled = text_global_pool(t.ln_final(x), ids, pool, eos_token_id=eos_id)
    proj = t.text_projection
    if proj is None:
        return pooled
    return proj(pooled) if isinstance(proj, nn.Linear) else pooled @ proj


def family_steps(oc: nn.Module, classifier: coop.PromptClassifier, chunk: int | None = None) -> dict:
    """{"reference": open_clip's full-context computation, "coop": ours}, each one forward +
    backward of sum(features^2) into the prompt tensors; the reference in slices of `chunk` classes."""
    learner = classifier.prompt_learner
    t = oc.text if hasattr(oc, "text") else oc
    ids, name_lens, slots = reference_inputs(oc, learner)

    def rows_features(rows: slice) -> torch.Tensor:
        n = len(ids[rows])
        ctx = learner.ctx[rows] if learner.csc else learner.ctx.unsqueeze(0).expand(n, -1, -1)
        x = coop_layout(learner, t.token_embedding(ids[rows]), ctx, name_lens[rows])
        deep = learner.deep_ctx
        if deep is not None and learner.csc:
            deep = deep[:, rows]
        return openclip_text(oc, x, ids[rows], slots[rows], deep)

    return prompt_steps(classifier, rows_features, chunk)

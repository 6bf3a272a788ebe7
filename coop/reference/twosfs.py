"""Reference 2SFS on OpenCLIP's own modules, the way FarinaMatteo/rethinking_fewshot_vlms computes it.

The original's stage one (`fs/twostage.py` `train_epoch`) runs the whole model on every step:
every class's prompt "a photo of a {class}." at the tower's full context through
`model.encode_text`, the batch through `model.encode_image`, cosine logits at
`logit_scale.exp()`, cross-entropy; what trains is chosen by `fs/utils/model_utils.py`
`trainable_norm_params`, written out here as it is (`trainable_norms`: its module walk, which yields
ln_pre, ln_post and ln_final twice and so freezes them again). Its stage two is the
`SingleStreamClassifier`: a head initialised with the normalised text features of the training
classes, trained on the normalised image features (`stage_two_logits`), and its `infer`, which
stacks the head's rows for the classes it has and the text features of the others
(`selective_classifier`). Nothing here shares code with `coop.methods.twosfs` or our towers: it is
the ground truth of tests/test_twosfs.py and the original-style side of tools/bench/bench_twosfs.py.

The original supports open_clip's ViT towers only (its walk asserts `visual.transformer`); on a timm
image tower (SigLIP, EVA, PE-Core) `timm_trunk_norms` extends its rule the way coop does: the
`nn.LayerNorm`s inside `visual.trunk.blocks.{i}` for i >= start.
"""

from __future__ import annotations

import torch
from torch import nn


def named_modules_with_index(model: nn.Module):
    """The original's walk: (name, module, block index), ln_post / ln_final / ln_pre once with
    their own index and once more, like every module outside the resblocks, with -1."""
    vision_blocks = len(model.visual.transformer.resblocks)
    text_blocks = (
        len(model.transformer.resblocks)
        if hasattr(model, "transformer")
        else len(model.text.transformer.resblocks)
    )
    for name, module in model.named_modules():
        if "ln_post" in name:
            yield name, module, vision_blocks
        if "ln_final" in name:
            yield name, module, text_blocks
        if "ln_pre" in name:
            yield name, module, 0
        split = name.split("resblocks.")
        if len(split) == 1:
            yield name, module, -1
        else:
            yield name, module, int(split[-1].split(".")[0])


def trainable_norms(model: nn.Module, modality: str = "both", vision_start: int = 0, text_start: int = 0):
    """The original's `trainable_norm_params`: sets requires_grad on `model` as it does and returns
    its list (which holds ln_pre/ln_post/ln_final, left with requires_grad=False)."""
    params = []
    for name, module, block in named_modules_with_index(model):
        tower = "vision" if "visual" in name else "text"
        start = vision_start if tower == "vision" else text_start
        if isinstance(module, nn.LayerNorm) and block >= start and modality in ("both", tower):
            params.extend(module.parameters())
            module.requires_grad_(True)
        else:
            module.requires_grad_(False)
    return params


def trainable_biases(model: nn.Module, modality: str = "both", vision_start: int = 0, text_start: int = 0):
    """The original's `trainable_bias_params` (BitFit): every parameter frozen, then the `bias` of
    every module its walk (`named_modules_with_index`) gives a block index >= the tower's start."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for name, module, block in named_modules_with_index(model):
        tower = "vision" if "visual" in name else "text"
        start = vision_start if tower == "vision" else text_start
        if hasattr(module, "bias") and block >= start and modality in ("both", tower):
            module.bias.requires_grad_(True)
            params.append(module.bias)
    return params


def timm_trunk_norms(model: nn.Module, start: int = 0) -> list[str]:
    """Names of the LayerNorm weights and biases inside `visual.trunk.blocks.{i}`, i >= start."""
    names = []
    for i, block in enumerate(model.visual.trunk.blocks):
        if i < start:
            continue
        for mod_name, module in block.named_modules():
            if isinstance(module, nn.LayerNorm):
                names += [f"visual.trunk.blocks.{i}.{mod_name}.{p}" for p, _ in module.named_parameters()]
    return names


def normalised(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def stage_one_logits(model: nn.Module, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, n_cls): logit_scale.exp() * norm(encode_image) @ norm(encode_text).T on full prompts."""
    text = normalised(model.encode_text(ids))
    image = normalised(model.encode_image(images))
    return model.logit_scale.exp() * image @ text.t()


def initial_head(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """`SingleStreamClassifier._init_classifier`: the normalised text features, as a new tensor."""
    with torch.no_grad():
        return normalised(model.encode_text(ids)).float()


def stage_two_logits(model: nn.Module, head: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """`SingleStreamClassifier.forward(x, no_grad_backbone=True)`."""
    with torch.no_grad():
        x = model.visual(images)
    x = normalised(x)
    return model.logit_scale.exp() * x @ normalised(head).t()


def selective_classifier(
    model: nn.Module, head: torch.Tensor, trained: list[str], categories: list[str], ids_of
) -> torch.Tensor:
    """`SingleStreamClassifier.infer`'s classifier for `categories`: the head's row of every
    category in `trained`, `encode_text(ids_of(missing))` for the others, stacked and normalised."""
    cat2id = {c: i for i, c in enumerate(trained)}
    missing = [c for c in categories if c not in cat2id]
    with torch.no_grad():
        new = dict(zip(missing, model.encode_text(ids_of(missing)), strict=True)) if missing else {}
    rows = [new[c] if c in new else head[cat2id[c]] for c in categories]
    return normalised(torch.stack(rows))

"""The originals' state-dict names, mapped to the learned tensors a coop checkpoint stores.

Which module each original saves (Dassl's `register_model`), and so the names in its file:

    coop, cocoop, kgcoop      the prompt learner alone: `ctx`, buffers `token_prefix`, `token_suffix`
                              (CoCoOp adds `meta_net.linear1.*`, `meta_net.linear2.*`; KgCoOp adds
                              `bias_vectors` and `meta_net.linear1.*`, which its forward never uses)
    vpt, ivlp, maple,         the whole model: `prompt_learner.*`, the frozen `image_encoder.*` and
    promptsrc                 `text_encoder.*` (their `VPT` / `VPT_shallow` prompts inside), `logit_scale`
                              (PromptSRC adds the frozen `prompt_learner.ZS_image_encoder.*`)

    original (after an optional "prompt_learner." prefix)         ours
    ctx  (M, W) or (n_cls, M, W)                                  ctx
    compound_prompts_text.{i}, i = 0..J-2          (maple)        deep_ctx[i]
    text_encoder.transformer.resblocks.{i}.VPT_shallow, i = 1..J-1 (ivlp, promptsrc)  deep_ctx[i-1]
    image_encoder.VPT                              (vpt, ivlp, promptsrc)   vision_ctx
    image_encoder.transformer.resblocks.{i}.VPT_shallow, i = 1..J-1         vision_deep_ctx[i-1]
    proj.*, compound_prompt_projections.{i}.*      (maple)        the same names
    meta_net.linear1.*, meta_net.linear2.*         (cocoop)       the same names

Dropped: the class-name buffers (`token_prefix`, `token_suffix`, `token_midfix`: rebuilt from the
class names), the frozen CLIP weights, and KgCoOp's unused tensors. Any other name is an error.
"""

from __future__ import annotations

import re

import torch

from coop.interop.dassl import InteropError

CONTEXT = ("coop", "cocoop", "kgcoop", "ivlp", "maple", "promptsrc")  # methods with text context `ctx`
VISION = ("vpt", "ivlp", "promptsrc")  # methods with VPT-style vision prompts
IMPORTABLE = ("coop", "cocoop", "kgcoop", "vpt", "ivlp", "maple", "promptsrc")

# (pattern on the name after "prompt_learner.", methods, our name, first layer index). Stacked
# entries (`deep_ctx`, `vision_deep_ctx`, layer index in the first group) start at that index:
# MaPLe's compound prompts count from 0, the VPT_shallow blocks from 1 (block 0 takes `ctx`).
MAPPED = (
    (r"ctx", CONTEXT, "ctx", None),
    (r"compound_prompts_text\.(\d+)", ("maple",), "deep_ctx", 0),
    (r"text_encoder\.transformer\.resblocks\.(\d+)\.VPT_shallow", ("ivlp", "promptsrc"), "deep_ctx", 1),
    (r"image_encoder\.VPT", VISION, "vision_ctx", None),
    (r"image_encoder\.transformer\.resblocks\.(\d+)\.VPT_shallow", VISION, "vision_deep_ctx", 1),
    (r"proj\.(weight|bias)", ("maple",), "proj.{0}", None),
    (
        r"compound_prompt_projections\.(\d+)\.(weight|bias)",
        ("maple",),
        "compound_prompt_projections.{0}.{1}",
        None,
    ),
    (r"meta_net\.(linear[12])\.(weight|bias)", ("cocoop",), "meta_net.{0}.{1}", None),
)

DROPPED = (
    (r"token_(prefix|suffix|midfix)", IMPORTABLE),  # frozen class-name embeddings
    (r"logit_scale", IMPORTABLE),
    (r"(image_encoder|text_encoder)\.(?!.*VPT).*", IMPORTABLE),  # the frozen CLIP towers
    (r"ZS_image_encoder\..*", ("promptsrc",)),  # PromptSRC's frozen copy of the image tower
    (r"bias_vectors", ("kgcoop",)),  # created, never used by KgCoOp's forward
    (r"meta_net\.linear1\.(weight|bias)", ("kgcoop",)),
)


class MappingError(InteropError):
    """A name in the original checkpoint is neither mapped nor known to be droppable."""


def _match(rules, name: str):
    for rule in rules:
        m = re.fullmatch(rule[0], name)
        if m:
            return rule, m
    return None, None


def map_names(
    method: str, state: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Our learned tensors (fp32) from an original state dict, and their original names.

    Args:
        method: the original trainer (one of `IMPORTABLE`).
        state: the original state dict ("module." already stripped).
        where: the file, for messages.

    Returns:
        (tensors by our name, our name -> the original name(s) it came from).

    Raises:
        MappingError: a name is not one `method` saves (one line naming it, and the methods that
            do save it), or the deep prompts skip a layer.
    """
    if method not in IMPORTABLE:
        raise MappingError(f"--from {method!r} is not one of {', '.join(IMPORTABLE)}")
    tensors, origin, stacks = {}, {}, {}
    for full, tensor in state.items():
        name = full.removeprefix("prompt_learner.")
        rule, m = _match(MAPPED, name)
        if rule is not None and method in rule[1]:
            ours, first = rule[2], rule[3]
            if first is not None:
                stacks.setdefault((ours, first), {})[int(m.group(1))] = (full, tensor)
            else:
                ours = ours.format(*m.groups())
                tensors[ours], origin[ours] = tensor.detach().float(), full
            continue
        drop, _ = _match(DROPPED, name)
        if drop is not None and method in drop[1]:
            continue
        owners = sorted(set(rule[1]) if rule is not None else set())
        hint = f" ({'/'.join(owners)} checkpoints hold it: check --from)" if owners else ""
        raise MappingError(f"{where}: '{full}' is not a name that a {method} checkpoint holds{hint}")
    for (ours, first), layers in stacks.items():
        expected = list(range(first, first + len(layers)))
        if sorted(layers) != expected:
            names = ", ".join(layers[i][0] for i in sorted(layers))
            raise MappingError(
                f"{where}: the deep prompts {names} skip a layer (expected indices {expected})"
            )
        try:
            tensors[ours] = torch.stack([layers[i][1].detach().float() for i in expected])  # (J-1, M, W)
        except RuntimeError:
            shapes = ", ".join(f"{layers[i][0]} {tuple(layers[i][1].shape)}" for i in expected)
            raise MappingError(f"{where}: the deep prompts differ in shape: {shapes}") from None
        origin[ours] = ", ".join(layers[i][0] for i in expected)
    ctx = tensors.get("ctx")
    if ctx is not None and ctx.dim() not in (2, 3):
        raise MappingError(f"{where}: '{origin['ctx']}' is {tuple(ctx.shape)}, not (M, W) or (n_cls, M, W)")
    return tensors, origin


def implied_overrides(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The `key=value` settings the tensors fix: M and csc from `ctx`, the depths from the deep
    prompts, the vision token count. The class-token position is not in the file (`prompt.position`)."""
    out = []
    ctx = tensors.get("ctx")
    if ctx is not None:
        out += [f"prompt.n_ctx={ctx.shape[-2]}", f"prompt.csc={str(ctx.dim() == 3).lower()}"]
        deep = tensors.get("deep_ctx")
        out.append(f"prompt.depth={1 + (0 if deep is None else len(deep))}")
    vision = tensors.get("vision_ctx")
    if vision is not None:
        deep = tensors.get("vision_deep_ctx")
        out += [f"vision.n_ctx={vision.shape[0]}", f"vision.depth={1 + (0 if deep is None else len(deep))}"]
    return out

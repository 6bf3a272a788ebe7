"""The two sides of one training step for tools/bench/bench_vl.py: each method built with its recipe (ours),
the official computation's loss as a function of the images and labels (the reference), and the
tokens per step of both with the speed-up they bound.

Which computation the reference follows for each method is described in tools/bench/bench_vl.py.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import IMAGENET_CLASSNAMES, build_models, imagenet_method
from _bench_families import build_family_models, clip_shaped

from coop.config.checks import ConfigError
from coop.config.load import load_config
from coop.data.descriptions import load_descriptions
from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
from coop.model.text_support import text_config
from coop.model.weights import resolve_model_name
from coop.reference.clip_lora import clip_lora_logits
from coop.reference.coop import reference_inputs
from coop.reference.coprompt import coprompt_loss, gpt_clip_classifier
from coop.reference.mmrl import mmrl_frozen_text, mmrl_step
from coop.reference.promptsrc import promptsrc_fixed_embeddings, promptsrc_loss
from coop.reference.vision_prompts import ivlp_logits, maple_logits, vpt_logits

METHODS = ("maple", "ivlp", "vpt", "promptsrc", "clip_lora", "mmrl", "coprompt")
DESCRIPTIONS_PER_CLASS = 5  # CoPrompt's bench: made-up sentences per class (we ship no real ones)


def bench_descriptions(classnames: list[str]) -> Path:
    """A descriptions file for `classnames` (`DESCRIPTIONS_PER_CLASS` made-up sentences each, about
    as long as a language model's), written once per process into the temporary folder."""
    path = Path(tempfile.gettempdir()) / f"coop-bench-descriptions-{os.getpid()}-{len(classnames)}.json"
    if not path.exists():
        sentences = {
            c: [
                f"A photo of a {c}, which has a distinctive shape, colour and texture number {k}."
                for k in range(DESCRIPTIONS_PER_CLASS)
            ]
            for c in classnames
        }
        path.write_text(json.dumps(sentences))
    return path


def check_bench(model: str, method: str, extra=()) -> None:
    """One line, before anything is built, for a model the bench cannot run: unknown, a missing
    config JSON, a refused text tower (ModelError); an image tower without tokens for a method that
    prompts it (RN50; ModelError); a key of the method's recipe beyond the towers, such as MaPLe's
    depth 9 on a 2-block tiny config (ConfigError; the bench refuses it rather than change the
    recipe: `--set prompt.depth=N`)."""
    name = resolve_model_name(model)
    text_config(name)
    from coop.train.preflight import check_model_limits  # the tools' layer may import train

    made_up = ["data.descriptions=made-up.json"] if method == "coprompt" else []  # written by `build`
    cfg = load_config(
        overrides=[f"method={method}", "data.name=imagenet", f"model.name={model}", *made_up, *extra]
    )
    try:
        check_model_limits(cfg)
    except ConfigError as e:
        raise ConfigError(
            f"{e} (method={method}'s recipe on model {name}: lower it with --set KEY=VALUE)"
        ) from None


def build_towers(model: str, device: torch.device, seed: int = 0):
    """(open_clip model, coop.CLIP) with the same random weights, frozen, on `device`: CLIP-shaped
    models as open_clip builds them; the other families (SigLIP, EVA, PE-Core, ...) with their own
    image tower and CLIP's tokenizer (`_bench_families.build_family_models`: their own tokenizers
    load from the hub).

    Args:
        model: an open_clip model name or a model-config JSON path.
    """
    name = resolve_model_name(model)
    if clip_shaped(name):
        return build_models(name, device, seed)
    return build_family_models(name, device, seed, image_tower=True)


def image_tokens(tower) -> int:
    """Tokens per image of an `ImageTower` (prefix tokens and patches), from its own embedding."""
    size = tower.image_size if isinstance(tower.image_size, int) else tower.image_size[0]
    device = next(tower.parameters()).device
    with torch.no_grad():
        return tower.embed(torch.zeros(1, 3, size, size, device=device))[0].shape[1]


def build(method: str, clip, n_classes: int, grad_checkpointing: bool = False, extra=()):
    """`method` with its recipe and `extra` key=value overrides on the first `n_classes` ImageNet names;
    CLIP-LoRA's adapters moved away from their initialisation (B = 0 gives A no gradient)."""
    if method in ("coprompt", "hicropl"):  # their descriptions, encoded once, untimed, on both sides
        extra = [f"data.descriptions={bench_descriptions(list(IMAGENET_CLASSNAMES[:n_classes]))}", *extra]
    built = imagenet_method(
        clip, method, n_classes, [f"train.grad_checkpointing={grad_checkpointing}", *extra]
    )
    if method == "clip_lora":
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in built.learnable().values():
                t.copy_(0.02 * torch.randn(t.shape, generator=gen))
    return built


def reference_loss(name: str, oc, method, terms: dict):
    """The official computation's training loss as a function of (images, labels).

    What it prepares once is prepared here, untimed: the tokenised 77-token prompts
    (`coop.reference.coop.reference_inputs`), MMRL's ids and t_zs (`mmrl_inputs`).
    PromptSRC: its whole loss (`coop.reference.promptsrc.promptsrc_loss`: full 77-token prompts, the frozen
    image tower on the same images every step), with the fixed text embeddings of its templates
    computed once here, untimed, as its code does at build time; the unweighted terms go into
    `terms`. MMRL: its whole loss (`mmrl_step`). The other methods: cross-entropy on
    `reference_step`'s logits.
    """
    if name == "mmrl":
        return mmrl_reference(oc, method, *mmrl_inputs(oc, method))
    if name == "coprompt":
        return coprompt_reference(oc, method)
    inputs = reference_inputs(oc, method.prompt_learner) if hasattr(method, "prompt_learner") else None
    if name != "promptsrc":
        logits = reference_step(name, oc, method, inputs)
        return lambda images, labels: F.cross_entropy(logits(images).float(), labels)
    pl = method.prompt_learner
    ids, _, slots = inputs
    fixed = promptsrc_fixed_embeddings(oc, method.classnames, method.templates)
    weights = {k: v for k, v in method.weights.items() if k != "kl_weight"}  # the official KL weight is 1

    def step(images, labels):
        vision = method.vision_prompts()
        loss, parts = promptsrc_loss(
            oc, images, labels, ids, slots, pl.ctx, pl.deep_ctx, vision, fixed, **weights
        )
        terms.update({k: float(v.detach()) for k, v in parts.items()})
        return loss

    return step


def coprompt_reference(oc, method):
    """The original CoPrompt step's loss as a function of (images (B, 2, 3, H, W), labels), on
    `method`'s tensors: its 77-token prompts tokenised and its description embeddings
    (`gpt_clip_classifier`) computed once here, untimed, as its code does at build time; the
    sentence index is ours of the step (0 unless `start_step` drew another)."""
    pl = method.prompt_learner
    ids, _, slots = reference_inputs(oc, pl)
    sentences = load_descriptions(method.descriptions_file, method.classnames)
    ori = gpt_clip_classifier(oc, sentences)
    projections = [method.proj, *method.compound_prompt_projections]
    tensors = method.learnable()
    return lambda images, labels: coprompt_loss(
        oc, images[:, 0], images[:, 1], labels, ids, slots, pl.ctx, pl.deep_ctx, projections, tensors, ori,
        method.step_sentence, method.weight, method.image_ratio, method.text_ratio, method.distill,
    )[0]  # fmt: skip


def mmrl_inputs(oc, method) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (n_cls, 77), t_zs) of MMRL's template, prepared once, untimed, as its code does at build."""
    ids = method.clip.tokenize([method.template.format(c.replace("_", " ")) for c in method.classnames])
    ids = ids.to(method.device)
    return ids, mmrl_frozen_text(oc, ids)


def mmrl_reference(oc, method, ids, text_zs):
    """The original MMRL step's loss as a function of (images, labels), on `method`'s tensors."""
    t = method.learnable()

    def pairs(side: str, n: int) -> list:
        return [(t[f"rep_to_{side}.{j}.weight"], t[f"rep_to_{side}.{j}.bias"]) for j in range(n)]

    to_text, to_vision = pairs("text", len(method.text_blocks)), pairs("vision", len(method.vision_blocks))
    return lambda images, labels: mmrl_step(
        oc,
        images,
        labels,
        ids,
        text_zs,
        t["rep_tokens"],
        to_text,
        to_vision,
        t["proj_rep"],
        method.text_blocks,
        method.vision_blocks,
        method.alpha,
        method.reg_weight,
    )[0]


def mmrl_token_bound(method, clip, batch: int) -> dict:
    """MMRL's tokens per step, as token-blocks / blocks (K more from the first listed block on):
    text, reference n_cls x (77+K) against ours, each row's own tokens plus [SOS] and the K tokens
    once; image, the student pass on both sides plus the frozen forward (1/3 of a training pass),
    over all blocks in the reference, after the shared blocks in ours."""
    t, v = clip.text.cfg, clip.visual
    k, n_cls = method.n_tokens, len(method.classnames)
    t0, v0 = method.text_blocks[0], method.vision_blocks[0]
    context = t.context_length
    v_tokens = image_tokens(v)
    ref_text = n_cls * (context * t.layers + k * (t.layers - t0)) / t.layers
    ours_text = int(method.eos.sum()) + 1 + k * (t.layers - t0) / t.layers
    student = batch * (v_tokens * v.layers + k * (v.layers - v0)) / v.layers
    ref_image = student + batch * v_tokens / 3
    ours_image = student + batch * v_tokens * (v.layers - v0) / v.layers / 3
    text_cost, image_cost = t.layers * t.width**2, v.layers * v.width**2
    bound = (ref_text * text_cost + ref_image * image_cost) / (
        ours_text * text_cost + ours_image * image_cost
    )
    return {
        "reference_text": round(ref_text),
        "ours_text": round(ours_text),
        "reference_image": round(ref_image),
        "image": round(ours_image),
        "token_ratio": (ref_text + ref_image) / (ours_text + ours_image),
        "bound": bound,
    }


def reference_step(name: str, oc, method, inputs):
    """The official computation's logits function of the images, for `method`'s tensors."""
    if name == "clip_lora":  # 77 tokens per class, LoRA added to the weights; ids once, untimed
        ids = method.clip.tokenize(
            [CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in method.classnames]
        )
        ids, tensors, scale = ids.to(method.device), method.learnable(), method.adapters.scale
        return lambda images: clip_lora_logits(oc, images, ids, tensors, scale)
    if name == "vpt":  # text features are frozen and computed once, as in the VPT trainer
        text = method.fixed_text_features
        return lambda images: vpt_logits(oc, images, None, method.vision_prompts(), text_features=text)
    pl = method.prompt_learner
    ids, _, slots = inputs
    if name == "ivlp":
        return lambda images: ivlp_logits(
            oc, images, ids, slots, pl.ctx, pl.deep_ctx, method.vision_prompts()
        )
    projections = [method.proj, *method.compound_prompt_projections]
    return lambda images: maple_logits(oc, images, ids, slots, pl.ctx, pl.deep_ctx, projections)


def clip_lora_text_tokens(method, clip) -> tuple[int, int]:
    """CLIP-LoRA's text tokens per step (without dropout): the reference runs every prompt at the
    tower's full context; ours the shared prefix once, then each prompt's own tokens up to its
    pooled token, on a tower with the cut, else every prompt whole (SigLIP's)."""
    n_cls, length = method.token_ids.shape
    reference = n_cls * clip.text.cfg.context_length
    if not clip.text.cuts:
        return reference, n_cls * length
    return reference, method.prefix + int((method.eos + 1 - method.prefix).sum())


def token_bound(name: str, method, clip, batch: int) -> dict:
    """Tokens per step of both sides and the speed-up they bound (tokens x layers x width^2)."""
    if name == "mmrl":
        return mmrl_token_bound(method, clip, batch)
    tower = clip.visual
    tokens = image_tokens(tower)
    prompts = method.vision_prompts() if hasattr(method, "vision_prompts") else [torch.zeros(0)]
    image = batch * (tokens + prompts[0].shape[0])
    if name in ("promptsrc", "coprompt"):  # both sides also run the frozen tower forward: ~1/3 of a
        image += batch * tokens // 3  # training pass (CoPrompt's on the second view)
    n_cls = len(method.classnames)
    context = clip.text.cfg.context_length  # the reference pads every prompt to it
    if name == "vpt":  # neither side runs the text tower per step
        ref_text = ours_text = 0
    elif name == "clip_lora":  # the shared prefix once, then every prompt's own tokens up to [EOS]
        ref_text, ours_text = clip_lora_text_tokens(method, clip)
    else:
        ref_text, ours_text = n_cls * context, int((method.prompt_learner.eos + 1).sum())
    t, v = clip.text.cfg, tower
    text_cost, image_cost = t.layers * t.width**2, v.layers * v.width**2
    bound = (ref_text * text_cost + image * image_cost) / (ours_text * text_cost + image * image_cost)
    ratio = (ref_text + image) / (ours_text + image)
    return {
        "reference_text": ref_text,
        "ours_text": ours_text,
        "image": image,
        "token_ratio": ratio,
        "bound": bound,
    }

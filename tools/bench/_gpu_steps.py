"""The vision-language sections of tools/bench/gpu_check.py: time and peak memory of one training step of
MaPLe, CLIP-LoRA, MMRL, 2SFS, CoPrompt and HiCroPL, ours (with and without grad checkpointing) against the reference.

What each section measures is described in tools/bench/gpu_check.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import build_models, free, imagenet_method, peak_fields, precision_context, reset_peak, sync

# --tiny: the test suite's model, so that every section runs on a CPU in seconds
TINY_MODEL = str(Path(__file__).resolve().parents[2] / "configs/models/coop-tiny.json")

# --- MaPLe: one vision-language training step -----------------------------------------------

MAPLE_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1,
             "set": ("prompt.depth=2",)},
}  # fmt: skip


def per_model(table: dict, steps, device, tiny: bool) -> list[dict]:
    """`steps(model, sizes, device)` rows for each model of `table`'s full or tiny sizes, freeing
    the device between models."""
    sizes = {"warmup": 0 if tiny else 1, **table["tiny" if tiny else "full"]}  # --tiny: one cold step
    rows = []
    for model in sizes["models"]:
        rows += steps(model, sizes, device)
        free(device)
    return rows


def check_maple(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one MaPLe step (forward + backward), ours and the reference."""
    return per_model(MAPLE_SIZES, maple_steps, device, tiny)


def step_batch(clip, sizes: dict, device, views: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images (with a view axis for a method that takes `views` > 1: CoPrompt's 2) and labels
    of one step of `sizes["batch"]` over `sizes["classes"]`."""
    gen = torch.Generator(device).manual_seed(0)
    size = clip.image_size
    axis = (views,) if views > 1 else ()
    images = torch.randn(sizes["batch"], *axis, 3, size, size, device=device, generator=gen)
    return images, torch.randint(sizes["classes"], (sizes["batch"],), device=device, generator=gen)


def maple_steps(model: str, sizes: dict, device) -> list[dict]:
    from coop.reference.coop import reference_inputs
    from coop.reference.vision_prompts import maple_logits

    oc, clip = build_models(model, device)
    method = imagenet_method(clip, "maple", sizes["classes"], sizes["set"])
    images, labels = step_batch(clip, sizes, device)
    pl = method.prompt_learner
    ids, _, slots = reference_inputs(oc, pl)
    projections = [method.proj, *method.compound_prompt_projections]

    def reference():
        logits = maple_logits(oc, images, ids, slots, pl.ctx, pl.deep_ctx, projections)
        return F.cross_entropy(logits.float(), labels)

    return timed_steps(model, method, clip, reference, images, labels, sizes, device)


def timed_steps(model: str, method, clip, reference, images, labels, sizes: dict, device) -> list[dict]:
    """Best time and peak memory of one step (bf16 autocast, forward + backward): ours without and
    with grad checkpointing in both towers, then `reference()` (which returns its loss)."""

    def ours():
        return method.loss(images, labels)[0]

    return step_rows(model, method, clip, ours, reference, sizes, device)


def step_rows(model: str, method, clip, ours, reference, sizes: dict, device) -> list[dict]:
    """Best time and peak memory of one training step (`ours()` / `reference()` return the loss),
    ours with and without grad checkpointing, under bf16 autocast."""
    rows = []
    for side, checkpointing, step in (("coop", False, ours), ("coop, grad checkpointing", True, ours),
                                      ("reference", False, reference)):  # fmt: skip
        method.grad_checkpointing = clip.text.grad_checkpointing = checkpointing  # both towers, as the engine
        best = float("inf")
        warmup = sizes.get("warmup", 1)  # `per_model`: none for --tiny (the suite's CPU run)
        for i in range(warmup + sizes["repeats"]):  # warm-up steps, then the timed ones
            method.zero_grad(set_to_none=True)
            sync(device)
            start = reset_peak(device)
            t0 = time.perf_counter()
            with precision_context(device, "bf16"):
                loss = step()
            loss.backward()
            sync(device)
            if i >= warmup:
                best = min(best, time.perf_counter() - t0)
        row = {"model": Path(model).stem, "side": side, "classes": sizes["classes"], "batch": sizes["batch"]}
        row["ms"] = best * 1000
        row |= peak_fields(device, start)
        rows.append(row)
    clip.text.grad_checkpointing = False
    return rows


def print_maple(rows: list[dict]) -> None:
    print("one MaPLe training step (n_ctx 2, depth 9, bf16 autocast)")
    print_maple_rows(rows)


def print_maple_rows(rows: list[dict]) -> None:
    """One line per (model, side): time and peak memory of the step."""
    for r in rows:
        mem = (
            "n/a (no CUDA)"
            if r["peak_mib"] is None
            else f"peak {r['peak_mib']:.0f} MiB (step: +{r['step_mib']:.0f} MiB)"
        )
        print(
            f"  {r['model']:<16} {r['side']:<25} {r['classes']} classes, batch {r['batch']}: {r['ms']:8.1f} ms, {mem}"
        )


# --- CLIP-LoRA: one training step of both adapted towers -----------------------------------------

CLIP_LORA_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 32, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1,
             "set": ()},
}  # fmt: skip


def check_clip_lora(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one CLIP-LoRA step, ours (with and without grad checkpointing) and
    the reference, per model."""
    return per_model(CLIP_LORA_SIZES, clip_lora_steps, device, tiny)


def clip_lora_steps(model: str, sizes: dict, device) -> list[dict]:
    from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
    from coop.reference.clip_lora import clip_lora_logits

    oc, clip = build_models(model, device)
    method = imagenet_method(clip, "clip_lora", sizes["classes"], sizes["set"])
    images, labels = step_batch(clip, sizes, device)
    texts = [CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in method.classnames]
    ids, tensors, scale = clip.tokenize(texts).to(device), method.learnable(), method.adapters.scale

    def reference():
        return F.cross_entropy(clip_lora_logits(oc, images, ids, tensors, scale).float(), labels)

    return timed_steps(model, method, clip, reference, images, labels, sizes, device)


# --- 2SFS: one stage-one step (the LayerNorms of both towers) -------------------------------------

TWOSFS_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 32, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1, "set": ()},
}  # fmt: skip


def check_twosfs(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one 2SFS stage-one step, ours (with and without grad checkpointing)
    and the reference (`coop.reference.twosfs`: 77 tokens per class through open_clip's encode_text),
    per model."""
    return per_model(TWOSFS_SIZES, twosfs_steps, device, tiny)


def twosfs_steps(model: str, sizes: dict, device) -> list[dict]:
    from coop.methods.clip_lora import CLIP_LORA_TEMPLATE
    from coop.reference.twosfs import stage_one_logits, trainable_norms

    oc, clip = build_models(model, device)
    method = imagenet_method(clip, "2sfs", sizes["classes"], sizes["set"])
    images, labels = step_batch(clip, sizes, device)
    texts = [CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in method.classnames]
    ids = clip.tokenize(texts).to(device)
    trainable_norms(oc)  # the original's LayerNorms on open_clip's model (ours is a copy)

    def reference():
        oc.zero_grad(set_to_none=True)
        return F.cross_entropy(stage_one_logits(oc, images, ids).float(), labels)

    return timed_steps(model, method, clip, reference, images, labels, sizes, device)


def print_twosfs(rows: list[dict]) -> None:
    print("one 2SFS stage-one step (the LayerNorms of both towers' blocks, bf16 autocast)")
    print_maple_rows(rows)


def print_clip_lora(rows: list[dict]) -> None:
    print("one CLIP-LoRA training step (rank 2, q|k|v of every block of both towers, bf16 autocast)")
    print_maple_rows(rows)


# --- MMRL: one training step with representation tokens in both towers --------------------------

MMRL_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1,
             "set": ()},
}  # fmt: skip


def check_mmrl(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one MMRL step (its whole loss, forward + backward), ours and the reference."""
    return per_model(MMRL_SIZES, mmrl_steps, device, tiny)


def mmrl_steps(model: str, sizes: dict, device) -> list[dict]:
    from coop.reference.mmrl import mmrl_frozen_text, mmrl_step

    oc, clip = build_models(model, device)
    method = imagenet_method(clip, "mmrl", sizes["classes"], sizes["set"])
    images, labels = step_batch(clip, sizes, device)
    ids = clip.tokenize([method.template.format(c) for c in method.classnames]).to(device)
    text_zs, t = mmrl_frozen_text(oc, ids), method.learnable()  # once, untimed, as the original
    pairs = {
        side: [(t[f"rep_to_{side}.{j}.weight"], t[f"rep_to_{side}.{j}.bias"]) for j in range(n)]
        for side, n in (("text", len(method.text_blocks)), ("vision", len(method.vision_blocks)))
    }

    def reference():
        return mmrl_step(
            oc, images, labels, ids, text_zs, t["rep_tokens"], pairs["text"], pairs["vision"],
            t["proj_rep"], method.text_blocks, method.vision_blocks, method.alpha, method.reg_weight,
        )[0]  # fmt: skip

    return timed_steps(model, method, clip, reference, images, labels, sizes, device)


def print_mmrl(rows: list[dict]) -> None:
    print("one MMRL training step (K 5, d_r 512, its whole loss, bf16 autocast)")
    print_maple_rows(rows)


# --- CoPrompt: MaPLe's step on one view, the adapters, the frozen tower on the other -------------

COPROMPT_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1,
             "set": ("prompt.depth=2",)},
}  # fmt: skip


def check_coprompt(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one CoPrompt step (its whole loss on two views), ours and the reference."""
    return per_model(COPROMPT_SIZES, coprompt_steps, device, tiny)


def coprompt_steps(model: str, sizes: dict, device) -> list[dict]:
    from _bench_vl import build, reference_loss  # its made-up descriptions, encoded once, untimed

    oc, clip = build_models(model, device)
    method = build("coprompt", clip, sizes["classes"], extra=sizes["set"])
    images, labels = step_batch(clip, sizes, device, views=method.train_views)
    reference = reference_loss("coprompt", oc, method, {})
    method.sentences()  # ours once, untimed, as the reference's
    step = lambda: reference(images, labels)  # noqa: E731
    return timed_steps(model, method, clip, step, images, labels, sizes, device)


def print_coprompt(rows: list[dict]) -> None:
    print("one CoPrompt training step (ImageNet's recipe: n_ctx 4, depth 12, W 8; two views, bf16 autocast)")
    print_maple_rows(rows)


# --- HiCroPL: one training step with the prompts mapped between the towers -------------------------

HICROPL_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (TINY_MODEL,), "classes": 20, "batch": 2, "repeats": 1,
             "set": ("prompt.depth=2", "hicropl.cross_layer=1")},
}  # fmt: skip


def check_hicropl(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one HiCroPL step (the mapping, both towers, its whole loss), ours and
    the reference."""
    return per_model(HICROPL_SIZES, hicropl_steps, device, tiny)


def hicropl_steps(model: str, sizes: dict, device) -> list[dict]:
    from _bench_vl import build
    from bench_hicropl import reference_step

    oc, clip = build_models(model, device)
    method = build("hicropl", clip, sizes["classes"], extra=sizes["set"])  # descriptions encoded here
    images, labels = step_batch(clip, sizes, device)
    step = reference_step(oc, method)
    return timed_steps(model, method, clip, lambda: step(images, labels), images, labels, sizes, device)


def print_hicropl(rows: list[dict]) -> None:
    print("one HiCroPL training step (its recipe: n_ctx 16, depth 12, crossing at 6; bf16 autocast)")
    print_maple_rows(rows)


# --- timm towers: MaPLe and CLIP-LoRA on EVA02, SigLIP2 and PE-Core ---------------------------------

TINY_TIMM = tuple(str(Path(TINY_MODEL).with_name(f"{s}-tiny.json")) for s in ("eva02", "siglip", "pe-core"))
TIMM_SIZES = {
    "maple": {
        "full": {"models": ("EVA02-B-16", "ViT-B-16-SigLIP2", "PE-Core-B-16"), "classes": 1000, "batch": 4,
                 "repeats": 3, "set": ()},
        "tiny": {"models": TINY_TIMM, "classes": 20, "batch": 2, "repeats": 1, "set": ("prompt.depth=2",)},
    },
    "clip_lora": {
        "full": {"models": ("EVA02-B-16", "ViT-B-16-SigLIP2", "PE-Core-B-16"), "classes": 1000, "batch": 32,
                 "repeats": 3, "set": ()},
        "tiny": {"models": TINY_TIMM, "classes": 20, "batch": 2, "repeats": 1, "set": ()},
    },
}  # fmt: skip


def check_timm(method: str, device, tiny: bool) -> list[dict]:
    """Time and peak memory of one `method` step ("maple" or "clip_lora") on each timm tower, ours
    (with and without grad checkpointing) and the reference, built as tools/bench/bench_vl.py builds them
    (`_bench_vl`: the family's own image tower, CLIP's tokenizer; the reference's image side is
    timm's own forward)."""
    return per_model(TIMM_SIZES[method], lambda m, sizes, d: timm_steps(method, m, sizes, d), device, tiny)


def timm_steps(method: str, model: str, sizes: dict, device) -> list[dict]:
    """The three rows of `timed_steps`, or one row saying why `method` does not run on `model`'s
    towers when the method or its reference cannot be built there (e.g. CLIP-LoRA before its
    adapters reach timm's attention)."""
    from _bench_vl import build, build_towers, reference_loss

    oc, clip = build_towers(model, device)
    try:
        built = build(method, clip, sizes["classes"], extra=sizes["set"])
        reference = reference_loss(method, oc, built, {})
    except (AttributeError, NotImplementedError, TypeError, ValueError) as e:  # ModelError, ConfigError
        why = f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0]}"
        return [
            {
                "model": Path(model).stem,
                "classes": sizes["classes"],
                "batch": sizes["batch"],
                "unsupported": why,
            }
        ]
    images, labels = step_batch(clip, sizes, device)
    step = lambda: reference(images, labels)  # noqa: E731
    return timed_steps(model, built, clip, step, images, labels, sizes, device)


def print_timm(method: str):
    """The printer of `check_timm(method, ...)`'s rows."""
    title = {"maple": "MaPLe (n_ctx 2, depth 9)", "clip_lora": "CLIP-LoRA (rank 2, both towers)"}[method]

    def print_rows(rows: list[dict]) -> None:
        print(f"one {title} training step on timm towers (bf16 autocast)")
        supported = [r for r in rows if "unsupported" not in r]
        for r in rows:
            if "unsupported" in r:
                print(f"  {r['model']:<16} not supported: {r['unsupported']}")
        print_maple_rows(supported)

    return print_rows

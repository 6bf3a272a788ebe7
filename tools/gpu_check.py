"""GPU check: parity with the reference, text speed-up, peak memory and epoch time on one GPU.

    python tools/gpu_check.py [--out DIR] [--quick] [--device cuda:0]      # or: make gpu-check

One script, about 5 minutes on one H100/H200-class GPU, everything on the same device and with
random weights (offline). It checks, against the reference CoOp computation (`coop.reference`):

  parity     ViT-B/16, 100 ImageNet classes, M = 16, class at the end and in the middle (shared
             context): text features and ctx gradients in fp32 (tolerance: max |diff| / max |ref|
             <= 1e-4 for features, <= 1e-3 for gradients; TF32 is switched off) and under bf16
             autocast (ours and the reference both in bf16, each against the fp32 reference;
             ours must stay within 3x the reference's own bf16 error, floor 2e-2);
  text speed forward + backward of the text side, ours vs reference, at 100 and 1,000 classes,
             M = 4 and 16, class at the end, shared context, fp32 and bf16 (best of 3 after a
             warm-up call);
  text bound the same text side per layout (end, middle, front; M = 4 and 16; 100 and 1,000
             classes; fp32, the sides alternating, as tools/bench_text.py): shared prefix P, the
             bound 77 / (mean tokens per prompt - P) and the speed-up as a share of it;
  memory     peak GPU memory (torch.cuda.max_memory_allocated) of one 1,000-class training step,
             M = 16, batch 32: ours, ours with grad checkpointing, and the reference;
  epoch      one 16-shot ImageNet-sized epoch: 16,000 synthetic 224x224 images (tensors already
             on the GPU), batch 32, 1,000 classes, bf16 autocast; the aug_views=0 path (image tower
             forward every step + prompt step) and the cached-features path (prompt step on
             precomputed features), plus the one-off cost of the cache. Image decoding,
             augmentation and host-to-device copies are NOT included: the images are synthetic;
  maple      one MaPLe training step (recipe: n_ctx 2, depth 9) on ViT-B/16 and ViT-L/14, 1,000
             classes, batch 4, bf16 autocast: ours with and without grad checkpointing, and the
             reference computed the official way (`coop.reference.maple_logits`: 77 tokens per
             class through open_clip's modules); time (best of 3 after a warm-up step) and peak
             torch.cuda.max_memory_allocated of the step;
  clip_lora  the same for one CLIP-LoRA step (rank-2 q|k|v adapters in every block of both towers),
             1,000 classes, batch 32 (its recipe): ours against `coop.reference.clip_lora`
             (77 tokens per class, LoRA added to the weights, as its original computes it).
  mmrl       the same for one MMRL training step (recipe: K 5, d_r 512, blocks 6..12 of the text
             tower and L/2..L of the image tower, its loss with the frozen image pass): ours with
             and without grad checkpointing, and the reference the official way
             (`coop.reference.mmrl.mmrl_step`: 77+K tokens per class, two full image passes).
  ddp        where several GPUs are visible: one run on 1 GPU vs on all of them (tools/bench_ddp.py:
             torchrun, NCCL, ViT-B/16, CoOp on cached features and MaPLe on pixels, epoch times).

Writes `gpu_check.json` into --out (default: the current folder) and prints a table. Without
CUDA it prints one line and exits 0. `--quick` uses 3,200 images for the epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (  # noqa: E402
    alternate,
    build_models,
    imagenet_method,
    imagenet_prompts,
    max_rel_diff,
    precision_context,
    sync,
    text_bound,
    text_sides,
    text_steps,
    time_text,
)

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # --tiny: the test suite's model, so that the whole script runs on a CPU in seconds
    "full": {"model": "ViT-B-16", "parity": 100, "speed": (100, 1000), "n_ctx": (4, 16), "memory": 1000,
             "images": 16000, "repeats": 3},
    "tiny": {"model": str(REPO / "configs/models/coop-tiny.json"), "parity": 10, "speed": (10,),
             "n_ctx": (4,), "memory": 20, "images": 64, "repeats": 1},
}  # fmt: skip
BATCH = 32
TOL = {"fp32_features": 1e-4, "fp32_grad": 1e-3, "bf16_factor": 3.0, "bf16_floor": 2e-2}
PRECISIONS = ("fp32", "bf16")


def check_parity(oc, clip, n_classes: int, device) -> list[dict]:
    """Features and ctx gradients of ours vs the reference, fp32 and bf16, end and middle."""
    rows = []
    for position in ("end", "middle"):
        learner, classifier = imagenet_prompts(clip, n_classes, 16, position)
        sides = text_sides(oc, classifier)
        res = {(s, p): time_text(f, learner, device, p, repeats=1, warmup=0) for s, f in sides.items()
               for p in PRECISIONS}  # fmt: skip
        _, ref_out, ref_grad = res["reference", "fp32"]
        f32 = {"features": max_rel_diff(res["coop", "fp32"][1], ref_out),
               "grad": max_rel_diff(res["coop", "fp32"][2], ref_grad)}  # fmt: skip
        rows.append({"position": position, "precision": "fp32", "classes": n_classes, **f32,
                     "ok": f32["features"] <= TOL["fp32_features"] and f32["grad"] <= TOL["fp32_grad"]})  # fmt: skip
        row = {"position": position, "precision": "bf16", "classes": n_classes}
        for what, i in (("features", 1), ("grad", 2)):
            row[what] = max_rel_diff(res["coop", "bf16"][i], (ref_out, ref_grad)[i - 1])
            row[f"reference_{what}"] = max_rel_diff(res["reference", "bf16"][i], (ref_out, ref_grad)[i - 1])
        limit = {
            w: max(TOL["bf16_factor"] * row[f"reference_{w}"], TOL["bf16_floor"])
            for w in ("features", "grad")
        }
        row["ok"] = all(row[w] <= limit[w] for w in limit)
        rows.append(row)
    return rows


def check_speed(oc, clip, classes, n_ctxs, device, repeats: int) -> list[dict]:
    """Forward + backward time of the text side, ours vs reference (end, shared context)."""
    rows = []
    for n in classes:
        for n_ctx in n_ctxs:
            learner, classifier = imagenet_prompts(clip, n, n_ctx, "end")
            sides = text_sides(oc, classifier)
            for precision in PRECISIONS:
                t = {s: time_text(f, learner, device, precision, repeats)[0] for s, f in sides.items()}
                rows.append({"classes": n, "n_ctx": n_ctx, "precision": precision,
                             "reference_ms": 1000 * t["reference"], "coop_ms": 1000 * t["coop"],
                             "speedup": t["reference"] / t["coop"]})  # fmt: skip
            del learner, classifier, sides
            free(device)
    return rows


# -- the text side at its token bound, per layout ------------------------------------------------

BOUND_POSITIONS = ("end", "middle", "front")
REFERENCE_CHUNK = 100  # classes per reference slice: 1,000 classes at once need ~30 GB in fp32


def check_text_bound(oc, clip, classes, n_ctxs, device, repeats: int) -> list[dict]:
    """Speed-up of the text side over the reference as a share of the token bound, per layout.

    Forward + backward in fp32, shared context, the sides alternating (`_bench.alternate`); the
    bound is 77 / (mean tokens per prompt - shared prefix), as tools/bench_text.py prints it.
    """
    rows = []
    for n in classes:
        for n_ctx in n_ctxs:
            for position in BOUND_POSITIONS:
                learner, classifier = imagenet_prompts(clip, n, n_ctx, position)
                steps = text_steps(oc, classifier, REFERENCE_CHUNK)
                t = alternate(steps, learner.prompt_tensors, device, "fp32", repeats)
                bound = text_bound(learner)
                speedup = t["reference"]["wall"] / t["coop"]["wall"]
                rows.append({"classes": n, "n_ctx": n_ctx, "position": position, "prefix": bound["prefix"],
                             "bound": bound["bound"], "reference_ms": 1000 * t["reference"]["wall"],
                             "coop_ms": 1000 * t["coop"]["wall"], "speedup": speedup,
                             "share": speedup / bound["bound"], "repeats": repeats})  # fmt: skip
                del learner, classifier, steps, t
                free(device)
    return rows


def print_text_bound(rows: list[dict]) -> None:
    best = f", best of {rows[0]['repeats']} after a warm-up round" if rows else ""
    print(f"text forward+backward against the token bound (fp32, shared context{best})")
    print(f"  {'classes':>7} {'M':>3} {'position':>8} {'prefix':>6} {'bound':>7} {'reference':>11} {'coop':>9}"
          f" {'speed-up':>8} {'share':>6}")  # fmt: skip
    for r in rows:
        print(f"  {r['classes']:>7} {r['n_ctx']:>3} {r['position']:>8} {r['prefix']:>6} {r['bound']:>6.1f}x"
              f" {r['reference_ms']:>8.1f} ms {r['coop_ms']:>6.1f} ms {r['speedup']:>7.1f}x {r['share']:>6.0%}")  # fmt: skip


def train_step(classifier, optimizer, x, y, device, encode: bool = False, text=None) -> float:
    """One CoOp step under bf16 autocast: (image tower), logits, cross-entropy, SGD.

    `text`: a callable giving the text features (default: ours). The loss is read back every
    step, as the training loop does (its NaN guard and running loss), so timings include that sync.
    """
    with precision_context(device, "bf16"):
        if encode:
            with torch.no_grad():
                x = classifier.clip.encode_image(x)
        logits = classifier.logits(x, None if text is None else text())
        loss = F.cross_entropy(logits.float(), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def reset_peak(device) -> int:
    """Reset CUDA's peak-memory counter; the bytes allocated now (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_fields(device, start: int) -> dict:
    """Peak CUDA memory since the last reset, and its growth over `start` bytes, in MiB (None off CUDA)."""
    if device.type != "cuda":
        return {"peak_mib": None, "step_mib": None}
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mib": peak / 2**20, "step_mib": (peak - start) / 2**20}


def check_memory(oc, clip, n_classes: int, device) -> list[dict]:
    """Peak memory of one training step (after one warm-up step) on precomputed image features."""
    learner, classifier = imagenet_prompts(clip, n_classes, 16, "end")
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(BATCH, clip.embed_dim, device=device, generator=gen)
    y = torch.randint(n_classes, (BATCH,), device=device, generator=gen)
    opt = torch.optim.SGD(learner.parameters(), lr=0.002, momentum=0.9)
    reference = text_sides(oc, classifier)["reference"]
    rows = []
    for name, checkpointing, text in (("coop", False, None), ("coop, grad checkpointing", True, None),
                                      ("reference", False, reference)):  # fmt: skip
        clip.text.grad_checkpointing = checkpointing
        train_step(classifier, opt, x, y, device, text=text)
        sync(device)
        row = {"side": name, "classes": n_classes, "n_ctx": 16, "batch": BATCH, "precision": "bf16"}
        start = reset_peak(device)
        train_step(classifier, opt, x, y, device, text=text)
        sync(device)
        row |= peak_fields(device, start)
        rows.append(row)
    clip.text.grad_checkpointing = False
    return rows


def run_epoch(classifier, optimizer, inputs, labels, device, encode: bool, max_steps: int | None = None):
    """(seconds, steps) of one shuffled epoch over `inputs` (images, or features when not encode)."""
    order = torch.randperm(len(inputs), device=device)
    steps = len(inputs) // BATCH if max_steps is None else min(max_steps, len(inputs) // BATCH)
    sync(device)
    start = time.perf_counter()
    for b in range(steps):
        idx = order[b * BATCH : (b + 1) * BATCH]
        train_step(classifier, optimizer, inputs[idx], labels[idx], device, encode)
    sync(device)
    return time.perf_counter() - start, steps


def check_epoch(clip, n_classes: int, n_images: int, device) -> dict:
    """One epoch of `n_images` synthetic images: encoding every step vs cached features."""
    learner, classifier = imagenet_prompts(clip, n_classes, 16, "end")
    opt = torch.optim.SGD(learner.parameters(), lr=0.002, momentum=0.9)
    gen = torch.Generator(device).manual_seed(0)
    size = clip.image_size
    images = torch.empty(n_images, 3, size, size, device=device)
    for chunk in images.split(1000):
        chunk.normal_(generator=gen)  # normalised pixels: what the transform would hand over
    labels = torch.randint(n_classes, (n_images,), device=device, generator=gen)

    run_epoch(classifier, opt, images, labels, device, encode=True, max_steps=3)  # warm-up
    t_images, steps_images = run_epoch(classifier, opt, images, labels, device, encode=True)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad(), precision_context(device, "bf16"):
        feats = torch.cat([clip.encode_image(chunk).float() for chunk in images.split(250)])
    sync(device)
    t_cache = time.perf_counter() - start
    del images
    run_epoch(classifier, opt, feats, labels, device, encode=False, max_steps=3)  # warm-up
    t_feats, steps_feats = run_epoch(classifier, opt, feats, labels, device, encode=False)
    free(device)
    return {
        "images": n_images, "image_size": size, "classes": n_classes, "n_ctx": 16, "batch": BATCH,
        "precision": "bf16",
        "aug_views0_s": t_images, "aug_views0_steps": steps_images,
        "cache_s": t_cache,
        "cached_s": t_feats, "cached_steps": steps_feats,
        "speedup": t_images / t_feats,
    }  # fmt: skip


def free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_parity(rows: list[dict]) -> None:
    print("parity vs reference (max |diff| / max |ref|)")
    for r in rows:
        ref = (
            f"  [reference bf16: {r['reference_features']:.1e} / {r['reference_grad']:.1e}]"
            if "reference_grad" in r
            else ""
        )
        print(f"  {r['position']:<6} {r['precision']}: features {r['features']:.1e}, ctx grad {r['grad']:.1e}"
              f"{ref}  {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip


def print_speed(rows: list[dict]) -> None:
    print("text forward+backward (end, shared context)")
    print(f"  {'classes':>7} {'M':>3} {'precision':>9} {'reference':>11} {'coop':>9} {'speed-up':>8}")
    for r in rows:
        print(f"  {r['classes']:>7} {r['n_ctx']:>3} {r['precision']:>9} {r['reference_ms']:>8.1f} ms"
              f" {r['coop_ms']:>6.1f} ms {r['speedup']:>7.1f}x")  # fmt: skip


def print_memory(rows: list[dict]) -> None:
    print("peak memory of one training step (bf16 autocast)")
    for r in rows:
        mem = (
            "n/a (no CUDA)"
            if r["peak_mib"] is None
            else f"{r['peak_mib']:.0f} MiB (step: +{r['step_mib']:.0f} MiB)"
        )
        print(f"  {r['side']:<25} {r['classes']} classes, M {r['n_ctx']}, batch {r['batch']}: {mem}")


def print_epoch(e: dict) -> None:
    print(f"one epoch: {e['images']} synthetic {e['image_size']}px images (no decoding/augmentation), "
          f"batch {e['batch']}, {e['classes']} classes, bf16")  # fmt: skip
    print(f"  aug_views=0 (image tower every step): {e['aug_views0_s']:.1f} s, {e['aug_views0_steps']} steps")
    print(f"  feature cache (one-off):              {e['cache_s']:.1f} s")
    print(f"  cached features:                      {e['cached_s']:.1f} s, {e['cached_steps']} steps"
          f"  ({e['speedup']:.1f}x per epoch)")  # fmt: skip


# --- MaPLe: one vision-language training step -----------------------------------------------

MAPLE_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (str(REPO / "configs/models/coop-tiny.json"),), "classes": 20, "batch": 2, "repeats": 1,
             "set": ("prompt.depth=2",)},
}  # fmt: skip


def per_model(table: dict, steps, device, tiny: bool) -> list[dict]:
    """`steps(model, sizes, device)` rows for each model of `table`'s full or tiny sizes, freeing
    the device between models."""
    sizes = table["tiny" if tiny else "full"]
    rows = []
    for model in sizes["models"]:
        rows += steps(model, sizes, device)
        free(device)
    return rows


def check_maple(device, tiny: bool) -> list[dict]:
    """Time and peak memory of one MaPLe step (forward + backward), ours and the reference."""
    return per_model(MAPLE_SIZES, maple_steps, device, tiny)


def step_batch(clip, sizes: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and labels of one step of `sizes["batch"]` over `sizes["classes"]`."""
    gen = torch.Generator(device).manual_seed(0)
    size = clip.image_size
    images = torch.randn(sizes["batch"], 3, size, size, device=device, generator=gen)
    return images, torch.randint(sizes["classes"], (sizes["batch"],), device=device, generator=gen)


def maple_steps(model: str, sizes: dict, device) -> list[dict]:
    from coop.reference import maple_logits, reference_inputs

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
        for i in range(1 + sizes["repeats"]):  # a warm-up step, then the timed ones
            method.zero_grad(set_to_none=True)
            sync(device)
            start = reset_peak(device)
            t0 = time.perf_counter()
            with precision_context(device, "bf16"):
                loss = step()
            loss.backward()
            sync(device)
            if i:
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
            f"  {r['model']:<9} {r['side']:<25} {r['classes']} classes, batch {r['batch']}: {r['ms']:8.1f} ms, {mem}"
        )


# --- CLIP-LoRA: one training step of both adapted towers -----------------------------------------

CLIP_LORA_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 32, "repeats": 3, "set": ()},
    "tiny": {"models": (str(REPO / "configs/models/coop-tiny.json"),), "classes": 20, "batch": 2, "repeats": 1,
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


def print_clip_lora(rows: list[dict]) -> None:
    print("one CLIP-LoRA training step (rank 2, q|k|v of every block of both towers, bf16 autocast)")
    print_maple_rows(rows)


# --- MMRL: one training step with representation tokens in both towers --------------------------

MMRL_SIZES = {
    "full": {"models": ("ViT-B-16", "ViT-L-14"), "classes": 1000, "batch": 4, "repeats": 3, "set": ()},
    "tiny": {"models": (str(REPO / "configs/models/coop-tiny.json"),), "classes": 20, "batch": 2, "repeats": 1,
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


def check_ddp(device) -> list[dict]:
    """1 vs all visible GPUs for one run (tools/bench_ddp.py under torchrun, NCCL), when there
    are several; one row saying why not otherwise."""
    n = torch.cuda.device_count() if device.type == "cuda" else 0
    if n < 2:
        return [{"skipped": f"needs 2 or more GPUs, {n} visible"}]
    rows = Path(tempfile.mkdtemp()) / "bench_ddp.json"
    args = [
        "--device",
        "cuda",
        "--ranks",
        str(n),
        "--model",
        "ViT-B-16",
        "--shots",
        "128",
        "--batch-size",
        "32",
    ]
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("bench_ddp.py")), *args, "--json", str(rows)],
        check=True,
    )
    return json.loads(rows.read_text())


def print_ddp(rows: list[dict]) -> None:
    print("one run across GPUs (tools/bench_ddp.py)")
    for r in rows:
        if "skipped" in r:
            print(f"  skipped: {r['skipped']}")
        else:
            print(f"  {r['workload']:<24} {r['ranks']} ranks  epoch {r['epoch_s']:.3f} s")


PRINTERS = {
    "parity": print_parity,
    "text_speed": print_speed,
    "memory": print_memory,
    "text_bound": print_text_bound,
    "epoch": print_epoch,
    "maple": print_maple,
    "clip_lora": print_clip_lora,
    "mmrl": print_mmrl,
    "ddp": print_ddp,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for gpu_check.json (default: current folder)")
    ap.add_argument("--quick", action="store_true", help="3,200 images for the epoch instead of 16,000")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: tiny model, any device
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device available; nothing checked")
        return 0
    sizes = dict(SIZES["tiny" if args.tiny else "full"])
    if args.quick:
        sizes["images"] = min(sizes["images"], 3200)
    # Exact fp32 for the fp32 parity and timings: no TF32 matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    oc, clip = build_models(sizes["model"], device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {
        "device": str(device), "device_name": name, "torch": torch.__version__,
        "model": Path(sizes["model"]).stem if args.tiny else sizes["model"], "weights": "random (seed 0)",
        "tolerances": TOL,
        "notes": "epoch images are synthetic tensors on the device: no decoding, augmentation or copies",
        "section_s": {}, "errors": {},
    }  # fmt: skip
    print(f"{name} | torch {torch.__version__} | {report['model']} (random weights)\n", flush=True)
    sections = {
        "parity": lambda: check_parity(oc, clip, sizes["parity"], device),
        "text_speed": lambda: check_speed(oc, clip, sizes["speed"], sizes["n_ctx"], device, sizes["repeats"]),
        "text_bound": lambda: check_text_bound(
            oc, clip, sizes["speed"], sizes["n_ctx"], device, sizes["repeats"]
        ),
        "memory": lambda: check_memory(oc, clip, sizes["memory"], device),
        "epoch": lambda: check_epoch(clip, sizes["memory"], sizes["images"], device),
        "maple": lambda: check_maple(device, args.tiny),
        "clip_lora": lambda: check_clip_lora(device, args.tiny),
        "mmrl": lambda: check_mmrl(device, args.tiny),
        "ddp": lambda: check_ddp(device),
    }
    for section, run in sections.items():
        t0 = time.perf_counter()
        try:  # a failing section (e.g. out of memory) must not cost the others' results
            report[section] = run()
        except Exception as e:
            report["errors"][section] = f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0]}"
            print(f"{section}: ERROR {report['errors'][section]}\n", flush=True)
            free(device)
        else:
            PRINTERS[section](report[section])
            print(f"  ({time.perf_counter() - t0:.1f} s)\n", flush=True)
        report["section_s"][section] = time.perf_counter() - t0
        report["total_s"] = time.perf_counter() - start
        report["ok"] = not report["errors"] and all(r["ok"] for r in report["parity"])
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")  # after every section
    print(f"all checks {'passed' if report['ok'] else 'FAILED'}; total {report['total_s']:.0f} s")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The CoOp sections of tools/bench/gpu_check.py: parity, text speed and the token bound of the text side
against the reference, and the peak memory and epoch time of one CoOp training step.

What each section measures, and its tolerances, are described in tools/bench/gpu_check.py.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from _bench import (
    alternate,
    free,
    imagenet_prompts,
    max_rel_diff,
    peak_fields,
    precision_context,
    reset_peak,
    sync,
    text_bound,
    text_sides,
    text_steps,
    time_text,
)

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
    bound is 77 / (mean tokens per prompt - shared prefix), as tools/bench/bench_text.py prints it.
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

"""TPT per image, ours against the original-style reference: the measurements of
tools/bench/bench_tta.py and of gpu_check.py's `tpt` section.

Both sides adapt the same zero-shot host (TPT's own prompt: "a photo of a" learnable, then
"{class}.") on the first N ImageNet class names, from the same image features of V views (random,
as from the frozen image tower, whose forward is the same on both sides and outside the times):

    reference  `coop.reference.tpt.tpt_image`: per image the forward over all classes' 77-token
               prompts with its graph, the backward, and the forward at the updated prompt
    ours       `coop.tta.tpt.TPT.adapt`: the starting prompt's forward and graph built once
               (timed apart: the one-off cost), then per image the backward of the image's own
               gradient through that graph and the forward at the updated prompt, both on the
               exact fast text pass (cut after [EOS], the shared prefix, packed)

The bound: per image ours still runs one backward and one forward of the fast pass, so the
speed-up cannot pass R / (B + F), R the reference's time per image, B and F our backward (through
the kept graph) and forward (no graph) timed alone. The share of the bound reached is what the
rest of an image's work (loss, selection, AdamW, bookkeeping) leaves of it.
"""

from __future__ import annotations

import time

import torch
from _bench import peak_fields, reset_peak, sync
from omegaconf import OmegaConf
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

from coop.methods import build_method
from coop.reference.coop import reference_inputs
from coop.reference.tpt import prompt_forward, tpt_image
from coop.tta.tpt import TPT


def build_tpt(clip, n_classes: int, grad_checkpointing: bool = False) -> TPT:
    """TPT on zero-shot CLIP for the first `n_classes` ImageNet names, TPT's settings."""
    if not 1 <= n_classes <= len(IMAGENET_CLASSNAMES):
        raise ValueError(f"classes must be in 1..{len(IMAGENET_CLASSNAMES)}, got {n_classes}")
    cfg = OmegaConf.create(
        {
            "method": "zeroshot",
            "data": {"name": "imagenet"},
            "zeroshot": {"templates": "coop"},
            "tpt": {"lr": 5e-3, "steps": 1, "selection": 0.1, "weight_decay": 0.01,
                    "ctx_init": "a photo of a", "grad_checkpointing": grad_checkpointing},
        }
    )  # fmt: skip
    host = build_method(clip, list(IMAGENET_CLASSNAMES[:n_classes]), cfg)
    return TPT(host, cfg).to(clip.logit_scale.device)


def view_features(clip, views: int, images: int, device) -> list[torch.Tensor]:
    """`images` sets of V unnormalised image features, seeded."""
    gen = torch.Generator().manual_seed(0)
    return [(3 * torch.randn(views, clip.embed_dim, generator=gen)).to(device) for _ in range(images)]


def timed(fn, device):
    """(wall seconds, process CPU seconds, fn()): CPU time is less disturbed by other processes."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def reference_side(oc, tpt: TPT):
    """(the reference's image call: features -> (logits, tuned ctx), its forward (tensors, x))."""
    pl = tpt.calls.inner.prompt_learner
    forward = prompt_forward(oc, pl, reference_inputs(oc, pl))
    start = {"ctx": pl.ctx}

    def image(x):
        return tpt_image(forward, start, x, tpt.selection, tpt.lr, tpt.steps, tpt.weight_decay)

    return image, forward, start


def per_image(oc, clip, n_classes: int, views: int, images: int, device) -> dict:
    """The best wall and CPU times per image over `images` images (after one warm-up image): the
    reference's, then ours and our two phases (backward through the kept graph, forward, each
    alone) image by image; the reference's phases once; the largest logit difference."""
    tpt = build_tpt(clip, n_classes)
    feats = view_features(clip, views, images + 1, device)
    ref_image, forward, start = reference_side(oc, tpt)
    one_off = timed(tpt._shared_start, device)  # the starting prompt's forward and graph, once
    leaves, text = tpt._shared_start()
    grad_out = torch.randn_like(text)
    theta = {k: v.detach() for k, v in zip(tpt.tuned, leaves, strict=True)}
    calls = {
        "reference": lambda x: ref_image(x),
        "ours": lambda x: tpt.adapt(None, x),
        "backward": lambda x: torch.autograd.grad(text, leaves, grad_out, retain_graph=True),
        "forward": lambda x: _no_grad(lambda: tpt.run(theta, "text")),
    }
    times, logits = {k: ([], []) for k in calls}, {}
    # the reference's images first, then ours with our phases image by image: a phase timed right
    # after the reference's large graph is freed would pay for its memory coming back
    for sides in (["reference"], ["ours", "backward", "forward"]):
        for i, x in enumerate(feats):
            for name in sides:
                wall, cpu, out = timed(lambda call=calls[name], x=x: call(x), device)
                if name in ("reference", "ours"):
                    logits[name, i] = out[0]
                if i:  # the first image warms up
                    times[name][0].append(wall)
                    times[name][1].append(cpu)
    diff = max(
        float((logits["ours", i] - logits["reference", i].float()).abs().max()) for i in range(len(feats))
    )
    tensors = {k: v.detach().clone().requires_grad_(True) for k, v in start.items()}
    ref_graph = timed(lambda: forward(tensors, feats[0])[0].sum(), device)  # the reference's phases
    ref_forward = timed(lambda: _no_grad(lambda: forward(tensors, feats[0][:1])), device)
    row = {"classes": n_classes, "views": views, "images": images, "max_logit_diff": diff,
           "tokens": float((tpt.calls.inner.prompt_learner.eos + 1).float().mean())}  # fmt: skip
    for clock, k in (("wall", 0), ("cpu", 1)):
        t = {name: min(v[k]) for name, v in times.items()}  # the best image: the least disturbed
        r, o = t["reference"], t["ours"]
        ref_backward = r - ref_graph[k] - ref_forward[k]
        bound = r / (t["backward"] + t["forward"])
        row[clock] = {
            "reference_ms": 1e3 * r, "ours_ms": 1e3 * o, "speedup": r / o, "bound": bound,
            "reached": r / o / bound, "one_off_ms": 1e3 * one_off[k],
            "ours_backward_ms": 1e3 * t["backward"], "ours_forward_ms": 1e3 * t["forward"],
            "ref_forward_graph_ms": 1e3 * ref_graph[k], "ref_backward_ms": 1e3 * ref_backward,
            "ref_forward_ms": 1e3 * ref_forward[k],
            "shared_forward_ceiling": r / (ref_backward + ref_forward[k]),
        }  # fmt: skip
    return row


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def memory(oc, clip, n_classes: int, views: int, device) -> list[dict]:
    """One TPT image at `n_classes`: ours (its kept graph included), ours with grad checkpointing,
    the reference. Per side the bytes of the tensors its graph saves for the backward pass and,
    on CUDA, the peak allocated memory while the image runs (`torch.cuda.max_memory_allocated`)."""
    x = view_features(clip, views, 1, device)[0]
    rows = []
    for side in ("ours", "ours, grad checkpointing", "reference"):
        tpt = build_tpt(clip, n_classes, grad_checkpointing=side != "ours")
        storages = {}

        def keep(t: torch.Tensor, storages=storages) -> torch.Tensor:  # every saved storage, once
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        start = reset_peak(device)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            if side == "reference":
                ref_image, _, _ = reference_side(oc, tpt)
                ref_image(x)
            else:
                tpt.adapt(None, x)
        rows.append({"side": side, "classes": n_classes, "saved_mib": sum(storages.values()) / 2**20,
                     **peak_fields(device, start)})  # fmt: skip
        del tpt
    return rows


def print_per_image(row: dict) -> None:
    for clock in ("wall", "cpu"):
        r = row[clock]
        print(
            f"  {row['classes']:>5} classes, {clock:>4}: reference {r['reference_ms']:9.1f} ms/image (forward+graph "
            f"{r['ref_forward_graph_ms']:.1f}, backward {r['ref_backward_ms']:.1f}, forward {r['ref_forward_ms']:.1f}); "
            f"ours {r['ours_ms']:8.1f} ms/image (backward {r['ours_backward_ms']:.1f}, forward "
            f"{r['ours_forward_ms']:.1f}; once: {r['one_off_ms']:.1f})"
        )
        print(
            f"{'':21}speed-up {r['speedup']:.2f}x, bound R / (B + F) = {r['bound']:.2f}x, reached "
            f"{r['reached']:.0%}; the shared forward alone at 77 tokens: {r['shared_forward_ceiling']:.2f}x"
        )
    print(f"{'':21}tokens per prompt {row['tokens']:.1f} of 77; max |logit diff| {row['max_logit_diff']:.1e}")


def check_tpt(oc, clip, classes, images: int, views: int, device) -> dict:
    """gpu_check.py's `tpt` section: `per_image` at each class count, `memory` at the largest."""
    return {
        "per_image": [per_image(oc, clip, n, views, images, device) for n in classes],
        "memory": memory(oc, clip, max(classes), views, device),
    }


def print_tpt(report: dict) -> None:
    print("TPT per image, ours vs the reference (zero-shot host, fp32, random view features)")
    for row in report["per_image"]:
        print_per_image(row)
    print_memory(report["memory"])


def print_memory(rows: list[dict]) -> None:
    for r in rows:
        peak = "n/a (no CUDA)" if r["peak_mib"] is None else f"peak {r['peak_mib']:.0f} MiB"
        print(
            f"  {r['side']:<26} {r['classes']} classes: saved for backward {r['saved_mib']:8.1f} MiB, {peak}"
        )

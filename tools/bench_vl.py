"""Benchmark one VPT, IVLP, MaPLe, PromptSRC, CLIP-LoRA or MMRL training step: ours vs the official way.

    python tools/bench_vl.py --method maple [--model ViT-B-16] [--classes 100 1000] [--batch 4]
                             [--memory-classes 1000] [--no-memory] [--device cpu]

Both sides compute the same step (forward + cross-entropy + backward into every learned tensor)
for the same method, images and labels, in one process, on random weights, with the recipe of
`coop.config.recipes.METHOD_DEFAULTS` for the first N ImageNet class names:

- ours: `Method.loss` of `coop.methods.<method>` (the text tower cut after [EOS], in length
  buckets, with the shared-prefix path; the image tower `coop.model.image_encoder.ImageTransformer`);
- the reference: `coop.reference.{vpt,ivlp,maple}_logits`, as the MaPLe repository computes it:
  every class's full 77-token prompt through open_clip's own text modules every step (VPT's frozen
  text features once, as its code does at build time) and open_clip's own image modules with the
  prompt concatenation written out; CLIP-LoRA: `coop.reference.clip_lora.clip_lora_logits`, every
  class's 77 tokens through open_clip's modules with the low-rank updates added to the q, k, v
  weights, as MaxZanella/CLIP-LoRA computes it (the adapters start away from B = 0 here, and both
  sides run without dropout, so that they compute the same function). MMRL:
  `coop.reference.mmrl.mmrl_step`, as yunncheng/MMRL computes it: 77+K tokens per class, 197+K per
  image, and a second, full image pass for the frozen features (ours shares the blocks before the
  insertion), t_zs once, untimed.

Each side gets `--warmup` untimed steps, then the best of `--repeats` timed steps counts, the two
sides alternating so that both see the same machine load; wall and process CPU times are printed
(CPU time is less disturbed by other processes on a shared machine), the speed-up, the bound the
token counts give (tokens weighted by layers x width^2, the cost of a token's linear layers; the
attention's quadratic term is left out) and the largest differences of loss and gradients.

Memory (`--memory-classes`, default 1000): the peak of one training step of ours (in training
mode: CLIP-LoRA's dropout on, its text prefix per class) with and without
`train.grad_checkpointing`, and with `--reference-memory` of the official step, each in a fresh
process. On CUDA it is `torch.cuda.max_memory_allocated` minus what was allocated before the
step; on a CPU it is the peak resident set size during the step (Linux `VmHWM`, reset through
`/proc/self/clear_refs`) minus the resident size before it, i.e. what the step added to the process.

The reference at 1,000 classes keeps a graph of 77,000 text tokens (about 30 GB in fp32 for
ViT-B/16); it is skipped, with a message, where the device does not have that much free memory.
Small sizes run in seconds: `--model configs/models/coop-tiny.json --classes 5 --batch 2
--set prompt.depth=2` (and `--set vision.depth=2` for vpt and ivlp: the tiny towers are shallow).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import build_models, imagenet_method, max_rel_diff, sync  # noqa: E402

from coop.methods.clip_lora import CLIP_LORA_TEMPLATE  # noqa: E402
from coop.reference import (  # noqa: E402
    ivlp_logits,
    maple_logits,
    promptsrc_fixed_embeddings,
    promptsrc_loss,
    reference_inputs,
    vpt_logits,
)
from coop.reference.clip_lora import clip_lora_logits  # noqa: E402
from coop.reference.mmrl import mmrl_frozen_text, mmrl_step  # noqa: E402

METHODS = ("maple", "ivlp", "vpt", "promptsrc", "clip_lora", "mmrl")
CONTEXT = 77  # tokens per prompt in the reference


def build(method: str, clip, n_classes: int, grad_checkpointing: bool = False, extra=()):
    """`method` with its recipe and `extra` key=value overrides on the first `n_classes` ImageNet names;
    CLIP-LoRA's adapters moved away from their initialisation (B = 0 gives A no gradient)."""
    built = imagenet_method(
        clip, method, n_classes, [f"train.grad_checkpointing={grad_checkpointing}", *extra]
    )
    if method == "clip_lora":
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in built.learnable().values():
                t.copy_(0.02 * torch.randn(t.shape, generator=gen))
    return built


def reference_loss(name: str, oc, method, inputs, terms: dict):
    """The official computation's training loss as a function of (images, labels).

    PromptSRC: its whole loss (`coop.reference.promptsrc_loss`: full 77-token prompts, the frozen
    image tower on the same images every step), with the fixed text embeddings of its templates
    computed once here, untimed, as its code does at build time; the unweighted terms go into
    `terms`. MMRL: its whole loss (`mmrl_step`), t_zs computed once beforehand (`inputs`). The
    other methods: cross-entropy on `reference_step`'s logits.
    """
    if name == "mmrl":
        return mmrl_reference(oc, method, *inputs)
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
    t, v = clip.text.cfg, clip.visual.cfg
    k, n_cls = method.n_tokens, len(method.classnames)
    t0, v0 = method.text_blocks[0], method.vision_blocks[0]
    ref_text = n_cls * (CONTEXT * t.layers + k * (t.layers - t0)) / t.layers
    ours_text = int(method.eos.sum()) + 1 + k * (t.layers - t0) / t.layers
    student = batch * (v.tokens * v.layers + k * (v.layers - v0)) / v.layers
    ref_image = student + batch * v.tokens / 3
    ours_image = student + batch * v.tokens * (v.layers - v0) / v.layers / 3
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


def token_bound(name: str, method, clip, batch: int) -> dict:
    """Tokens per step of both sides and the speed-up they bound (tokens x layers x width^2)."""
    if name == "mmrl":
        return mmrl_token_bound(method, clip, batch)
    tower = clip.visual
    prompts = method.vision_prompts() if hasattr(method, "vision_prompts") else [torch.zeros(0)]
    image = batch * (tower.cfg.tokens + prompts[0].shape[0])
    if name == "promptsrc":  # both sides also run the frozen tower forward: ~1/3 of a training pass
        image += batch * tower.cfg.tokens // 3
    n_cls = len(method.classnames)
    if name == "vpt":  # neither side runs the text tower per step
        ref_text = ours_text = 0
    elif name == "clip_lora":  # the shared prefix once, then every prompt's own tokens up to [EOS]
        ref_text, ours_text = n_cls * CONTEXT, method.prefix + int((method.eos + 1 - method.prefix).sum())
    else:
        ref_text, ours_text = n_cls * CONTEXT, int((method.prompt_learner.eos + 1).sum())
    t, v = clip.text.cfg, tower.cfg
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


def timed(step, method, device) -> tuple[float, float, float, dict]:
    """(wall s, CPU s, loss, {name: gradient}) of one `step()` that returns the loss, backward included."""
    method.zero_grad(set_to_none=True)
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    loss = step()
    loss.backward()
    sync(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    grads = {k: p.grad.detach().clone() for k, p in method.learnable().items() if p.grad is not None}
    return wall, cpu, float(loss.detach()), grads


def reference_fits(text_tokens: int, clip, device) -> tuple[bool, float]:
    """Whether the reference's text graph (`text_tokens` tokens, ~18 W-sized tensors kept per
    block) fits in the free memory of `device`; (fits, estimated GiB)."""
    t = clip.text.cfg
    need = text_tokens * t.layers * 18 * t.width * 4 / 2**30
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] / 2**30
    else:
        free = _available_gib()
    return need < 0.8 * free, need


def _available_gib() -> float:
    """Memory a new allocation can get: Linux's MemAvailable (free pages plus reclaimable cache),
    else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


def compare(args, name: str, oc, clip, n_classes: int, device) -> dict:
    method = build(name, clip, n_classes, extra=args.set)
    method.eval()  # the same function on both sides: no dropout (CLIP-LoRA's only random term)
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images = torch.randn(args.batch, 3, size, size, generator=gen).to(device)
    labels = torch.randint(n_classes, (args.batch,), generator=gen).to(device)
    tokens = token_bound(name, method, clip, args.batch)
    print(
        f"\n{name}, {n_classes} classes, batch {args.batch}: tokens per step, reference "
        f"{tokens['reference_text']} text + {tokens.get('reference_image', tokens['image'])} image, ours {tokens['ours_text']} text + "
        f"{tokens['image']} image ({tokens['token_ratio']:.2f}x the tokens); bound from token counts "
        f"{tokens['bound']:.2f}x (tokens x layers x width^2)"
    )
    fits, need = reference_fits(tokens["reference_text"], clip, device)
    if not fits:
        print(
            f"reference skipped: its graph needs about {need:.0f} GiB, more than this {device.type} has free"
        )
    if name == "mmrl":
        inputs = mmrl_inputs(oc, method)
    else:  # once, untimed
        inputs = reference_inputs(oc, method.prompt_learner) if hasattr(method, "prompt_learner") else None
    ref_terms = {}
    reference = reference_loss(name, oc, method, inputs, ref_terms)
    sides = {"coop": lambda: method.loss(images, labels)[0]}
    if fits:
        sides = {"reference": lambda: reference(images, labels), **sides}
    best = {side: [float("inf"), float("inf")] for side in sides}
    result = {}
    for i in range(args.warmup + args.repeats):  # the sides alternate, so both see the same load
        for side, step in sides.items():
            wall, cpu, loss, grads = timed(step, method, device)
            result[side] = (loss, grads)
            if i >= args.warmup:
                best[side] = [min(best[side][0], wall), min(best[side][1], cpu)]
    row = {"method": name, "classes": n_classes, "batch": args.batch, **tokens}
    row["coop_ms"], row["coop_cpu_ms"] = best["coop"][0] * 1000, best["coop"][1] * 1000
    print(f"coop:      {row['coop_ms']:10.1f} ms  (CPU time {row['coop_cpu_ms']:10.1f} ms)")
    if not fits:
        return row
    row["reference_ms"], row["reference_cpu_ms"] = best["reference"][0] * 1000, best["reference"][1] * 1000
    print(f"reference: {row['reference_ms']:10.1f} ms  (CPU time {row['reference_cpu_ms']:10.1f} ms)")
    row["speedup"] = row["reference_ms"] / row["coop_ms"]
    row["speedup_cpu"] = row["reference_cpu_ms"] / row["coop_cpu_ms"]
    (loss_ref, g_ref), (loss_ours, g_ours) = result["reference"], result["coop"]
    row["loss_diff"] = abs(loss_ref - loss_ours)
    row["grad_diff"] = {k: max_rel_diff(g_ours[k], g_ref[k]) for k in g_ref}
    print(
        f"speed-up: {row['speedup']:.2f}x wall, {row['speedup_cpu']:.2f}x CPU time (bound {tokens['bound']:.2f}x; "
        f"best of {args.repeats} after {args.warmup} warm-up step(s) each, the sides alternating)"
    )
    print(f"loss {loss_ref:.6f} vs {loss_ours:.6f} (|diff| {row['loss_diff']:.1e})")
    worst = max(row["grad_diff"], key=row["grad_diff"].get)
    print(
        f"gradients, max |diff| / max |reference| over {len(g_ref)} tensors: {row['grad_diff'][worst]:.1e} ({worst})"
    )
    if name == "promptsrc":  # the loss terms of the last step of each side
        ours_terms = {k: float(v) for k, v in method.last_terms.items()}
        row["term_diff"] = {k: abs(ours_terms[k] - ref_terms[k]) for k in ref_terms}
        print(
            "loss terms (reference vs ours): "
            + ", ".join(f"{k} {ref_terms[k]:.6f} vs {ours_terms[k]:.6f}" for k in ref_terms)
            + f"; largest |diff| {max(row['term_diff'].values()):.1e}"
        )
    return row


def step_memory(args, name: str, grad_checkpointing: bool, reference: bool = False) -> float | None:
    """MiB one training step adds at its peak (see the module docstring), measured here: ours, or
    with `reference` the official computation's step."""
    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    method = build(name, clip, args.memory_classes, grad_checkpointing, args.set)
    if reference:
        inputs = reference_inputs(oc, method.prompt_learner) if hasattr(method, "prompt_learner") else None
        official = reference_loss(name, oc, method, inputs, {})
    else:
        del oc
    clip.text.grad_checkpointing = grad_checkpointing  # as the engine sets it: both towers
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images = torch.randn(args.batch, 3, size, size, generator=gen).to(device)
    labels = torch.randint(args.memory_classes, (args.batch,), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
        except OSError:
            return None
        before = _status_kib("VmRSS")
    (official(images, labels) if reference else method.loss(images, labels)[0]).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    return (_status_kib("VmHWM") - before) / 2**10


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def memory(args, name: str) -> dict:
    """Peak MiB of a step with and without grad checkpointing (and, with `--reference-memory`, of
    the official step), each in a fresh process."""
    sides = {
        "ours": ["--measure-memory"],
        "ours, grad checkpointing": ["--measure-memory", "--grad-checkpointing"],
    }
    if args.reference_memory:
        sides["reference"] = ["--measure-memory", "--reference"]
    out = {}
    for side, flags in sides.items():
        cmd = [sys.executable, __file__, "--method", name, "--model", args.model, "--batch", str(args.batch)]
        cmd += ["--device", args.device, "--memory-classes", str(args.memory_classes), *flags]
        cmd += [x for item in args.set for x in ("--set", item)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            lines = (done.stderr.strip().splitlines() or ["no output"])[-1]
            out[side] = None
            print(f"memory of {side}: failed ({lines})")
            continue
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    what = (
        "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS added by the step"
    )
    fmt = lambda v: "n/a" if v is None else f"{v:.0f} MiB"  # noqa: E731
    reference = f", the reference {fmt(out['reference'])}" if "reference" in out else ""
    print(
        f"\nmemory of one {name} step, {args.memory_classes} classes, batch {args.batch} ({what}): "
        f"{fmt(out['ours'])} without, {fmt(out['ours, grad checkpointing'])} with grad checkpointing{reference}"
    )
    row = {
        "classes": args.memory_classes,
        "peak_mib": out["ours"],
        "peak_mib_checkpointing": out["ours, grad checkpointing"],
    }
    if "reference" in out:
        row["peak_mib_reference"] = out["reference"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", required=True, choices=METHODS)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument(
        "--classes", type=int, nargs="+", default=[100], help="first N ImageNet names, e.g. 100 1000"
    )
    ap.add_argument("--batch", type=int, default=4, help="images per training step")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--memory-classes", type=int, default=1000, help="classes of the memory measurement")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    ap.add_argument(
        "--reference-memory",
        action="store_true",
        help="also measure the official step's memory (a third process)",
    )
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--measure-memory", action="store_true", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--grad-checkpointing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(
            json.dumps({"peak_mib": step_memory(args, args.method, args.grad_checkpointing, args.reference)})
        )
        return 0

    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    print(
        f"model {args.model} (random weights), fp32, torch {torch.__version__}, {device}, {torch.get_num_threads()} threads"
    )
    report = {"model": args.model, "device": str(device), "steps": []}
    for n_classes in args.classes:
        report["steps"].append(compare(args, args.method, oc, clip, n_classes, device))
    if not args.no_memory:
        del oc, clip
        report["memory"] = memory(args, args.method)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

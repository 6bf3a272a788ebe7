"""Benchmark one VPT, IVLP, MaPLe, PromptSRC, CLIP-LoRA, MMRL or CoPrompt training step: ours vs the official way.

    python tools/bench/bench_vl.py --method maple [--model ViT-B-16] [--classes 100 1000] [--batch 4]
                             [--memory-classes 1000] [--no-memory] [--device cpu]

Both sides compute the same step (forward + cross-entropy + backward into every learned tensor)
for the same method, images and labels, in one process, on random weights, with the recipe of
`coop.config.recipes.METHOD_DEFAULTS` for the first N ImageNet class names:

- ours: `Method.loss` of `coop.methods.<method>` (the text tower cut after [EOS], in length
  buckets, with the shared-prefix path; the image tower `coop.model.image_encoder.ImageTransformer`);
- the reference: `coop.reference.vision_prompts.{vpt,ivlp,maple}_logits`, as the MaPLe repository computes it:
  every class's full 77-token prompt through open_clip's own text modules every step (VPT's frozen
  text features once, as its code does at build time) and open_clip's own image modules with the
  prompt concatenation written out; CLIP-LoRA: `coop.reference.clip_lora.clip_lora_logits`, every
  class's 77 tokens through open_clip's modules with the low-rank updates added to the q, k, v
  weights, as MaxZanella/CLIP-LoRA computes it (the adapters start away from B = 0 here, and both
  sides run without dropout, so that they compute the same function). MMRL:
  `coop.reference.mmrl.mmrl_step`, as yunncheng/MMRL computes it: 77+K tokens per class, 197+K per
  image, and a second, full image pass for the frozen features (ours shares the blocks before the
  insertion), t_zs once, untimed. CoPrompt: `coop.reference.coprompt.coprompt_loss`, as
  ShuvenduRoy/CoPrompt computes it: MaPLe's full-77 step on the first view, the adapters, the frozen
  tower on the second view, its description embeddings once, untimed (from a made-up descriptions
  file: `_bench_vl.bench_descriptions`); `tools/bench/bench_coprompt.py` runs it with its defaults.

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
ViT-B/16); it is skipped, with a message, where the device does not have that much free memory,
and so is a memory measurement (the reference's, or ours without grad checkpointing) whose text
graph would not fit (ours runs the whole context on towers without the causal mask: SigLIP).
`--model` also takes the timm towers (EVA, SigLIP, PE-Core): see `_bench_vl.build_towers`.
Small sizes run in seconds: `--model configs/models/coop-tiny.json --classes 5 --batch 2
--set prompt.depth=2` (and `--set vision.depth=2` for vpt and ivlp: the tiny towers are shallow).
A recipe's key beyond the model's towers (MaPLe's depth 9 on a tiny config) is refused in one line
before anything is built, not lowered behind the user's back; so are an unknown model, a missing
config JSON, a text tower that is refused, and an image tower without tokens (RN50) for a method
that prompts it.
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import max_rel_diff, peak_fields, reset_peak, sync  # noqa: E402
from _bench_vl import METHODS, build, build_towers, check_bench, reference_loss, token_bound  # noqa: E402


def compare_sides(row: dict, best: dict, result: dict, args, fits: bool, keys=None) -> bool:
    """Fill `row` (which holds the token `bound`) with each side's best wall and CPU time in ms,
    the speed-ups, and the loss and per-tensor gradient differences (ours against the reference,
    over `keys`, default the reference's gradients), printing the times; False when the reference
    did not run."""
    row["coop_ms"], row["coop_cpu_ms"] = best["coop"][0] * 1000, best["coop"][1] * 1000
    print(f"coop:      {row['coop_ms']:10.1f} ms  (CPU time {row['coop_cpu_ms']:10.1f} ms)")
    if not fits:
        return False
    row["reference_ms"], row["reference_cpu_ms"] = best["reference"][0] * 1000, best["reference"][1] * 1000
    print(f"reference: {row['reference_ms']:10.1f} ms  (CPU time {row['reference_cpu_ms']:10.1f} ms)")
    row["speedup"] = row["reference_ms"] / row["coop_ms"]
    row["speedup_cpu"] = row["reference_cpu_ms"] / row["coop_cpu_ms"]
    (loss_ref, g_ref), (loss_ours, g_ours) = result["reference"], result["coop"]
    row["loss_diff"] = abs(loss_ref - loss_ours)
    row["grad_diff"] = {k: max_rel_diff(g_ours[k], g_ref[k]) for k in (keys or g_ref)}
    print(
        f"speed-up: {row['speedup']:.2f}x wall, {row['speedup_cpu']:.2f}x CPU time (bound {row['bound']:.2f}x; "
        f"best of {args.repeats} after {args.warmup} warm-up step(s) each, the sides alternating)"
    )
    return True


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


def views(method) -> tuple[int, ...]:
    """The view axis of a training batch: (V,) for a method that takes V views (CoPrompt's 2), else ()."""
    return (method.train_views,) if method.train_views > 1 else ()


def reference_fits(text_tokens: int, clip, device) -> tuple[bool, float]:
    """Whether a text graph of `text_tokens` tokens (~18 W-sized tensors kept per block: the
    reference's, or ours without grad checkpointing) fits in the free memory of `device`; (fits,
    estimated GiB)."""
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
    images = torch.randn(args.batch, *views(method), 3, size, size, generator=gen).to(device)
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
    ref_terms = {}
    reference = reference_loss(name, oc, method, ref_terms)  # its inputs once, untimed
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
    if not compare_sides(row, best, result, args, fits):
        return row
    (loss_ref, g_ref), loss_ours = result["reference"], result["coop"][0]
    print(f"loss {loss_ref:.6f} vs {loss_ours:.6f} (|diff| {row['loss_diff']:.1e})")
    worst = max(row["grad_diff"], key=row["grad_diff"].get)
    print(
        f"gradients, max |diff| / max |reference| over {len(g_ref)} tensors: {row['grad_diff'][worst]:.1e} ({worst})"
    )
    if (
        name == "promptsrc"
    ):  # the loss terms of the last step of each side (PromptSRC's reference reports them)
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
    oc, clip = build_towers(args.model, device)
    method = build(name, clip, args.memory_classes, grad_checkpointing, args.set)
    if reference or not grad_checkpointing:  # a graph too large is skipped, not run out of memory
        tokens = token_bound(name, method, clip, args.batch)["reference_text" if reference else "ours_text"]
        fits, need = reference_fits(tokens, clip, device)
        if not fits:
            print(
                f"its text graph needs about {need:.0f} GiB, more than this {device.type} has free",
                file=sys.stderr,
            )
            return None
    if reference:
        official = reference_loss(name, oc, method, {})
    else:
        del oc
    clip.text.grad_checkpointing = grad_checkpointing  # as the engine sets it: both towers
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images = torch.randn(args.batch, *views(method), 3, size, size, generator=gen).to(device)
    labels = torch.randint(args.memory_classes, (args.batch,), generator=gen).to(device)
    return step_peak_mib(
        lambda: (official(images, labels) if reference else method.loss(images, labels)[0]).backward(), device
    )


def step_peak_mib(step, device) -> float | None:
    """MiB that `step()` (a training step: forward and backward) adds at its peak in this process:
    CUDA's max_memory_allocated, or on a CPU the peak RSS (None where it cannot be reset)."""
    if device.type == "cuda":
        sync(device)
        before = reset_peak(device)
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM)
        except OSError:
            return None
        before = _status_kib("VmRSS")
    step()
    if device.type == "cuda":
        sync(device)
        return peak_fields(device, before)["step_mib"]
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
        if out[side] is None and done.stderr.strip():
            print(f"memory of {side}: skipped ({done.stderr.strip().splitlines()[-1]})")
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

    check_bench(args.model, args.method, args.set)  # before anything is built
    device = torch.device(args.device)
    oc, clip = build_towers(args.model, device)
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
    _cli.run_cli(main)

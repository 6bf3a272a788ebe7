"""Benchmark one HiCroPL training step: ours vs the original's way, at 100 and 1,000 classes.

    python tools/bench/bench_hicropl.py [--model ViT-B-16] [--classes 100 1000] [--batch 4]
                                        [--memory-classes 1000] [--no-memory] [--device cpu]

Both sides compute the same step (the mapping written into the prompts, forward, loss, backward
into ctx, deep_ctx and cross_prompts_visual) from the same state, with HiCroPL's recipe
(`coop.config.recipes.METHOD_DEFAULTS`) for the first N ImageNet class names, random weights:

- ours: `HiCroPL.loss` (the text tower cut after [EOS], in length buckets, the shared prefix before
  the first block; the image tower `coop.model.image_encoder.ImageTransformer`; the frozen image
  tower on the same images; the description features encoded once per run, at build);
- the reference: `coop.reference.hicropl.hicropl_forward`, as zzeoZheng/HiCroPL's `trainers/hicropl.py`
  computes it: every class's full 77-token prompt through open_clip's text modules, open_clip's
  image modules with the prompts written out, the frozen image features from open_clip's
  `encode_image`, the mapping with its attention spelled out. Its description features are the
  same once-per-run tensor (both compute them at build; untimed).

The descriptions are two sentences per class written here ("a photo of a {c}.", "{c}, a kind of
thing."): no third-party text. The state is restored before every call, so the sides compute the
same step; each gets `--warmup` untimed calls, then the best of `--repeats` timed calls counts, the
sides alternating. The bound is the token counts' (tokens x layers x width^2; the attention's
quadratic term left out): text, the reference's n_cls x 77 against our shared prefix [SOS][v1..vM]
once (the deep prompts are the same for every class, so the prefix stays shared at every block)
plus each prompt's own tokens up to [EOS]; image, B x (T + M) for the prompted pass and B x T / 3
for the frozen forward on both sides. The reference at 1,000 classes keeps a graph of
77,000 text tokens (about 30 GB in fp32 for ViT-B/16) and is skipped, with a message, where it
does not fit.

Memory (`--memory-classes`, default 1000): the peak of one step of ours, with and without
`train.grad_checkpointing`, each in a fresh process (`tools/bench/bench_vl.py`'s measure: CUDA's
max_memory_allocated, or the peak RSS a step adds on a CPU). Small sizes run in seconds:
`--model configs/models/coop-tiny.json --classes 5 --set prompt.depth=2 --set hicropl.cross_layer=1`.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench_vl import build, build_towers, check_bench, image_tokens  # noqa: E402
from bench_vl import compare_sides, reference_fits, step_peak_mib, timed  # noqa: E402
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: E402

from coop.reference.coop import reference_inputs  # noqa: E402
from coop.reference.hicropl import hicropl_forward  # noqa: E402

TRAINED = ("ctx", "deep_ctx", "cross_prompts_visual")


def descriptions_file(folder: Path, n_classes: int) -> Path:
    """Two sentences per class for the first `n_classes` ImageNet names, written here."""
    names = IMAGENET_CLASSNAMES[:n_classes]
    path = folder / f"descriptions_{n_classes}.json"
    path.write_text(json.dumps({c: [f"a photo of a {c}.", f"{c}, a kind of thing."] for c in names}))
    return path


def build_hicropl(clip, n_classes: int, folder: Path, grad_checkpointing: bool = False, extra=()):
    return build(
        "hicropl",
        clip,
        n_classes,
        grad_checkpointing,
        [f"data.descriptions={descriptions_file(folder, n_classes)}", *extra],
    )


def token_bound(method, clip, batch: int) -> dict:
    """Tokens per step of both sides and the speed-up they bound (module docstring)."""
    tokens, n_ctx = image_tokens(clip.visual), method.cross_prompts_visual.shape[1]
    image = batch * (tokens + n_ctx) + batch * tokens / 3
    pl, n_cls = method.prompt_learner, len(method.classnames)
    ref_text = n_cls * clip.text.cfg.context_length
    if clip.text.cuts:  # the shared prefix once, then each prompt's own tokens up to [EOS]
        ours_text = pl.shared_prefix + int((pl.eos + 1 - pl.shared_prefix).sum())
    else:  # a tower without the causal cut (SigLIP's) runs every prompt whole
        ours_text = n_cls * pl.token_embeds.shape[1]
    t, v = clip.text.cfg, clip.visual
    text_cost, image_cost = t.layers * t.width**2, v.layers * v.width**2
    bound = (ref_text * text_cost + image * image_cost) / (ours_text * text_cost + image * image_cost)
    return {
        "reference_text": ref_text,
        "ours_text": ours_text,
        "image": round(image),
        "token_ratio": (ref_text + image) / (ours_text + image),
        "bound": bound,
    }


def reference_step(oc, method):
    """The original's loss as a function of (images, labels), on `method`'s own tensors (views of
    them, so that the mapping lands in them and the gradients reach them); inputs once, untimed."""
    pl = method.prompt_learner
    ids, _, slots = reference_inputs(oc, pl)

    def step(images, labels):
        text = [pl.ctx, *pl.deep_ctx.unbind(0)]
        visual = list(method.cross_prompts_visual.unbind(0))
        return hicropl_forward(
            oc, images, labels, ids, slots, method, text, visual, method.descriptions,
            method.cross_layer, method.weight,
        )[0]  # fmt: skip

    return step


def compare(args, oc, clip, n_classes: int, device, folder: Path) -> dict:
    method = build_hicropl(clip, n_classes, folder, extra=args.set)
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images = torch.randn(args.batch, 3, size, size, generator=gen).to(device)
    labels = torch.randint(n_classes, (args.batch,), generator=gen).to(device)
    tokens = token_bound(method, clip, args.batch)
    print(
        f"\nhicropl, {n_classes} classes, batch {args.batch}: tokens per step, reference "
        f"{tokens['reference_text']} text + {tokens['image']} image, ours {tokens['ours_text']} text + "
        f"{tokens['image']} image ({tokens['token_ratio']:.2f}x the tokens); bound {tokens['bound']:.2f}x"
    )
    fits, need = reference_fits(tokens["reference_text"], clip, device)
    sides = {"coop": lambda: method.loss(images, labels)[0]}
    if fits:
        sides = {"reference": reference_step(oc, method), **sides}
        sides["reference"] = (lambda step: lambda: step(images, labels))(sides["reference"])
    else:
        print(
            f"reference skipped: its graph needs about {need:.0f} GiB, more than this {device.type} has free"
        )
    state = {k: t.detach().clone() for k, t in method.learnable().items()}
    best = {side: [float("inf"), float("inf")] for side in sides}
    result = {}
    for i in range(args.warmup + args.repeats):
        for side, step in sides.items():
            with torch.no_grad():  # the same step on both sides: from the same state
                for k, t in method.learnable().items():
                    t.copy_(state[k])
            wall, cpu, loss, grads = timed(step, method, device)
            result[side] = (loss, grads)
            if i >= args.warmup:
                best[side] = [min(best[side][0], wall), min(best[side][1], cpu)]
    row = {"classes": n_classes, "batch": args.batch, **tokens}
    if not compare_sides(row, best, result, args, fits, TRAINED):
        return row
    loss_ref, loss_ours = result["reference"][0], result["coop"][0]
    print(f"loss {loss_ref:.6f} vs {loss_ours:.6f} (|diff| {row['loss_diff']:.1e}); gradients, max |diff| / "
          f"max |reference|: {', '.join(f'{k} {d:.1e}' for k, d in row['grad_diff'].items())}")  # fmt: skip
    return row


def step_memory(args, grad_checkpointing: bool) -> float | None:
    """MiB one training step of ours adds at its peak, measured in this (fresh) process."""
    device = torch.device(args.device)
    _, clip = build_towers(args.model, device)
    with tempfile.TemporaryDirectory() as folder:
        method = build_hicropl(clip, args.memory_classes, Path(folder), grad_checkpointing, args.set)
    clip.text.grad_checkpointing = grad_checkpointing  # as the engine sets it: both towers
    gen = torch.Generator().manual_seed(1)
    size = clip.image_size
    images = torch.randn(args.batch, 3, size, size, generator=gen).to(device)
    labels = torch.randint(args.memory_classes, (args.batch,), generator=gen).to(device)
    return step_peak_mib(lambda: method.loss(images, labels)[0].backward(), device)


def memory(args) -> dict:
    """Peak MiB of our step with and without grad checkpointing, each in a fresh process."""
    out = {}
    for side, flags in {"ours": [], "ours, grad checkpointing": ["--grad-checkpointing"]}.items():
        cmd = [
            sys.executable,
            __file__,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--device",
            args.device,
        ]
        cmd += ["--memory-classes", str(args.memory_classes), "--measure-memory", *flags]
        cmd += [x for item in args.set for x in ("--set", item)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            out[side] = None
            print(f"memory of {side}: failed ({(done.stderr.strip().splitlines() or ['no output'])[-1]})")
            continue
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    what = (
        "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS added by the step"
    )
    fmt = lambda v: "n/a" if v is None else f"{v:.0f} MiB"  # noqa: E731
    print(
        f"\nmemory of one hicropl step, {args.memory_classes} classes, batch {args.batch} ({what}): "
        f"{fmt(out['ours'])} without, {fmt(out['ours, grad checkpointing'])} with grad checkpointing"
    )
    return {
        "classes": args.memory_classes,
        "peak_mib": out["ours"],
        "peak_mib_checkpointing": out["ours, grad checkpointing"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, nargs="+", default=[100, 1000], help="first N ImageNet names")
    ap.add_argument("--batch", type=int, default=4, help="images per training step")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--memory-classes", type=int, default=1000, help="classes of the memory measurement")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--measure-memory", action="store_true", help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--grad-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(json.dumps({"peak_mib": step_memory(args, args.grad_checkpointing)}))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        sample = descriptions_file(Path(folder), 1)
        check_bench(
            args.model, "hicropl", [f"data.descriptions={sample}", *args.set]
        )  # before anything is built
        device = torch.device(args.device)
        oc, clip = build_towers(args.model, device)
        print(
            f"model {args.model} (random weights), fp32, torch {torch.__version__}, {device}, "
            f"{torch.get_num_threads()} threads"
        )
        report = {"model": args.model, "device": str(device), "steps": []}
        for n_classes in args.classes:
            report["steps"].append(compare(args, oc, clip, n_classes, device, Path(folder)))
    if not args.no_memory:
        del oc, clip
        report["memory"] = memory(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    _cli.run_cli(main)

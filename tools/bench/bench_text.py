"""Benchmark the prompt text side: our packed, shared-prefix Transformer vs CoOp's full-77 one.

    python tools/bench/bench_text.py [--model ViT-B-16] [--classes 100] [--n-ctx 4 16]
                               [--position end middle front] [--repeats 3]

Times forward + backward of `PromptClassifier.text_features()` for ImageNet class names (random
weights) against the reference CoOp computation (`coop.reference.coop`, full 77 tokens through
open_clip's own modules) in the same process, for every combination of `--n-ctx` and
`--position`, and prints for each:

- the shared prefix P (tokens every prompt shares and ours computes once: [SOS][v1..vM] at the
  end, [SOS][v1..vM/2] in the middle, [SOS] at the front or with --csc);
- the bound: 77 / (mean tokens per prompt - P), the reference's tokens over those each prompt
  still computes on its own, i.e. the speed-up if time were proportional to tokens;
- the speed-up (wall and process CPU time) and its share of the bound;
- the largest differences of outputs and of every prompt gradient.

Method: the reference's prompts are tokenised once, before timing (as CoOp does at build time);
the two sides alternate, `--warmup` untimed rounds first, then the best of `--repeats` timed
rounds counts for each side. The reference runs `--reference-chunk` classes at a time (the same
work and gradients, the memory of one slice: 1,000 classes at once need ~30 GB). A table of all
settings closes the output. `--memory` measures one step of ours instead: the bytes of the
tensors its graph saves for the backward pass and the growth of the process's peak resident
memory. Small sizes (`--model configs/models/coop-tiny.json --classes 10`)
run in seconds.

`--model NAME` of any open_clip family whose text tower we reproduce (`coop.model.text_support`)
prints that family's bound and speed-up: towers built as `tools/bench/_bench_families.py` says (CLIP's
tokenizer, a tiny image tower), the reference through open_clip's own text modules at the full
context L. Causal towers pooled at [EOS] (CLIP's, EVA, PE-Core, MetaCLIP 2, MobileCLIP-B) keep
the bound L / (mean tokens per prompt - P); the others (SigLIP, CLIPA, MobileCLIP-S*, CoCa) see
every token and run the full context: bound 1x.
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import alternate, build_models, imagenet_prompts, max_rel_diff, text_steps  # noqa: E402
from _bench_families import build_family_models, clip_shaped, family_steps  # noqa: E402
from _cli import run_cli  # noqa: E402

from coop.model.text_support import text_config  # noqa: E402
from coop.model.weights import resolve_model_name  # noqa: E402


def measure(oc, clip, args, n_ctx: int, position: str) -> dict:
    """One setting: both sides side by side; prints its lines and returns its row."""
    learner, classifier = imagenet_prompts(
        clip, args.classes, n_ctx, position, csc=args.csc, depth=args.depth
    )
    text = clip.text
    context = text.cfg.context_length + text.cfg.embed_cls  # what the reference computes per prompt
    lengths = text.row_lengths(learner.eos)  # what ours computes per prompt
    prefix = learner.shared_prefix if text.cuts else 0  # towers without the cut share nothing
    tokens = float(lengths.float().mean())
    bound = {"prefix": prefix, "tokens": tokens, "own": tokens - prefix, "bound": context / (tokens - prefix)}
    print(f"\n== n_ctx {n_ctx}, position {position}{', csc' if args.csc else ''}, depth {args.depth}")
    print(
        f"{clip.text.describe()}, context {context}: tokens per prompt: mean {bound['tokens']:.2f}, "
        f"max {int(lengths.max())} (reference: {context}); shared prefix {bound['prefix']}; own tokens per "
        f"prompt {bound['own']:.2f}; bound {context} / {bound['own']:.2f} = {bound['bound']:.2f}x"
    )
    steps = (text_steps if args.clip_shaped else family_steps)(oc, classifier, args.reference_chunk)
    res = alternate(
        steps, learner.prompt_tensors, torch.device(args.device), "fp32", args.repeats, args.warmup
    )
    ref, ours = res["reference"], res["coop"]
    wall, cpu = ref["wall"] / ours["wall"], ref["cpu"] / ours["cpu"]
    print(
        f"reference CoOp ({context} tokens): {ref['wall'] * 1000:9.1f} ms  (CPU time {ref['cpu'] * 1000:9.1f} ms)"
    )
    print(
        f"coop ({'packed, shared prefix' if text.cuts else 'whole context'}): {ours['wall'] * 1000:7.1f} ms  "
        f"(CPU time {ours['cpu'] * 1000:9.1f} ms)"
    )
    print(
        f"speed-up: {wall:.2f}x wall = {wall / bound['bound']:.0%} of the bound, {cpu:.2f}x CPU time = "
        f"{cpu / bound['bound']:.0%} (best of {args.repeats} after {args.warmup} warm-up call(s) each, "
        "the sides alternating)"
    )
    out_diff = float((ours["result"] - ref["result"]).abs().max())
    grads = {k: max_rel_diff(ours["grads"][k], g) for k, g in ref["grads"].items()}
    print(
        f"max |diff| output: {out_diff:.2e} (scale {float(ref['result'].abs().max()):.2f}); gradients, "
        f"max |diff| / max |reference|: {', '.join(f'{k} {d:.1e}' for k, d in grads.items())}"
    )
    return {"n_ctx": n_ctx, "position": position, "context": context, **bound, "speedup": wall, "speedup_cpu": cpu,
            "reference_ms": 1000 * ref["wall"], "coop_ms": 1000 * ours["wall"]}  # fmt: skip


def memory(clip, args, n_ctx: int, position: str) -> dict:
    """Memory of one forward + backward of ours: what the graph saves and the peak it reaches."""
    learner, classifier = imagenet_prompts(
        clip, args.classes, n_ctx, position, csc=args.csc, depth=args.depth
    )
    storages = {}

    def keep(t: torch.Tensor) -> torch.Tensor:  # every storage saved for the backward pass, once
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = classifier.text_features()
    out.float().square().sum().backward()
    row = {
        "saved_mib": sum(storages.values()) / 2**20,
        "peak_rss_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak)
        / 2**10,  # KiB on Linux
    }
    print(
        f"M={n_ctx}, {position}: tensors saved for backward {row['saved_mib']:.0f} MiB, peak resident memory "
        f"+{row['peak_rss_growth_mib']:.0f} MiB over the process's earlier peak"
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--n-ctx", type=int, nargs="+", default=[4])
    ap.add_argument("--position", nargs="+", default=["end"], choices=("end", "middle", "front"))
    ap.add_argument("--csc", action="store_true", help="class-specific context")
    ap.add_argument("--depth", type=int, default=1, help="prompt depth J (deep prompts for J > 1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per side first")
    ap.add_argument("--reference-chunk", type=int, default=100, help="classes per reference slice")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--memory", action="store_true", help="only the memory of one step of ours, no timing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    name = resolve_model_name(args.model)  # a config JSON is registered under its file stem
    text_config(name)  # a refused text tower (a Hugging Face model): one line, before anything is built
    args.clip_shaped = clip_shaped(name)
    oc, clip = (build_models if args.clip_shaped else build_family_models)(name, torch.device(args.device))
    if args.memory:
        print(f"model {args.model}, {args.classes} ImageNet classes, fp32, one forward + backward of ours")
        for m in args.n_ctx:
            for p in args.position:
                memory(clip, args, m, p)
        return 0
    print(f"model {args.model}, {args.classes} ImageNet classes, fp32, forward + backward")
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    rows = [measure(oc, clip, args, m, p) for m in args.n_ctx for p in args.position]
    best = f"best of {args.repeats} after {args.warmup} warm-up round(s), wall"
    print(f"\n{args.classes} classes, {torch.get_num_threads()} threads, times: {best}")
    print(
        "| setting | prefix | bound | reference | coop | speed-up | share of bound | (CPU time: speed-up, share) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| M={r['n_ctx']}, {r['position']} | {r['prefix']} | {r['context']} / ({r['tokens']:.2f} - {r['prefix']}) = "
            f"{r['bound']:.2f}x | {r['reference_ms']:,.0f} ms | {r['coop_ms']:,.0f} ms | {r['speedup']:.2f}x | "
            f"{r['speedup'] / r['bound']:.0%} | {r['speedup_cpu']:.2f}x, {r['speedup_cpu'] / r['bound']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    run_cli(main)

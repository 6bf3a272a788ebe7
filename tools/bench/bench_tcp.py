"""Benchmark TCP's text step: our packed pass (shared prefix before `tcp.layer`) vs TCP's full-77 one.

    python tools/bench/bench_tcp.py [--model ViT-B-16] [--classes 100] [--layer 8] [--repeats 3]

Times forward + backward of `TCP.text_features()` (ImageNet class names, random weights, the
"a photo of a {}." template) against the reference TCP computation (`coop.reference.tcp`: every
class's 77 tokens through open_clip's own blocks, the class-aware tokens concatenated in before
block `--layer`) in the same process, and checks the features and the gradients of ctx and the
meta-net.

Its own token bound. The reference runs 77 tokens per prompt through all L blocks. Ours runs
S_n = eos_n + 1 tokens of each prompt n, minus what it shares: before `tcp.layer` = l the prefix
[SOS][v1..vM] (P = 1 + M tokens) is computed once for every class; from block l on the context
slots hold class-specific tokens, so only [SOS] is shared (blocks >= l cannot share the prefix).
Per prompt and block that is, on average,

    own = (l (S - P) + (L - l) (S - 1)) / L      bound = 77 / own

the speed-up if time were proportional to tokens. The teacher features (computed once per run by
both) are computed before timing. Small sizes (`--model configs/models/coop-tiny.json --classes
10 --layer 1`) run in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import alternate, build_models, imagenet_method, max_rel_diff  # noqa: E402

from coop.reference.tcp import tcp_text_features  # noqa: E402


def tcp_bound(method, blocks: int, context_length: int = 77) -> dict:
    """TCP's token bound (module docstring): {"tokens", "prefix", "own", "bound"}."""
    pl, layer = method.prompt_learner, method.layer
    tokens = float((pl.eos + 1).float().mean())
    prefix = pl.shared_prefix
    own = (layer * (tokens - prefix) + (blocks - layer) * (tokens - 1)) / blocks
    return {"tokens": tokens, "prefix": prefix, "own": own, "bound": context_length / own}


def steps(oc, method, chunk: int) -> dict:
    """{"reference": TCP's full-77 step, "tcp": ours}, each forward + backward of sum(features^2)."""
    names, pl = method.classnames, method.prompt_learner
    teacher = method.teacher()  # once, outside the timing, as both sides compute it once per run
    meta = {
        k.removeprefix("meta_net."): t for k, t in method.learnable().items() if k.startswith("meta_net.")
    }

    def reference() -> torch.Tensor:
        outs = []
        for c in range(0, len(names), chunk):  # slices: the same work and gradients, less memory
            rows = slice(c, c + chunk)
            out = tcp_text_features(
                oc, names[rows], method.prompt_template, teacher[rows], pl.ctx, meta, method.layer
            )
            out.float().square().sum().backward()
            outs.append(out.detach().float())
        return torch.cat(outs)

    def ours() -> torch.Tensor:
        out = method.text_features()
        out.float().square().sum().backward()
        return out.detach().float()

    return {"reference": reference, "tcp": ours}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--layer", type=int, default=8, help="tcp.layer: the block of the class-aware tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per side first")
    ap.add_argument("--reference-chunk", type=int, default=100, help="classes per reference slice")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    method = imagenet_method(clip, "tcp", args.classes, [f"tcp.layer={args.layer}"])
    blocks = clip.text.cfg.layers
    b = tcp_bound(method, blocks)
    print(f"model {args.model}, {args.classes} ImageNet classes, tcp.layer {args.layer} of {blocks}, fp32")
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads")
    print(
        f"tokens per prompt: mean {b['tokens']:.2f} (reference: 77); shared prefix {b['prefix']} before block "
        f"{args.layer}, [SOS] after; own tokens per prompt and block {b['own']:.2f}; "
        f"bound 77 / {b['own']:.2f} = {b['bound']:.2f}x"
    )
    res = alternate(
        steps(oc, method, args.reference_chunk), method.learnable, device, "fp32", args.repeats, args.warmup
    )
    ref, ours = res["reference"], res["tcp"]
    wall, cpu = ref["wall"] / ours["wall"], ref["cpu"] / ours["cpu"]
    print(f"reference TCP (77 tokens): {ref['wall'] * 1000:9.1f} ms  (CPU time {ref['cpu'] * 1000:9.1f} ms)")
    print(
        f"tcp (packed, shared prefix): {ours['wall'] * 1000:7.1f} ms  (CPU time {ours['cpu'] * 1000:9.1f} ms)"
    )
    print(
        f"speed-up: {wall:.2f}x wall = {wall / b['bound']:.0%} of the bound, {cpu:.2f}x CPU time = "
        f"{cpu / b['bound']:.0%} (best of {args.repeats} after {args.warmup} warm-up call(s) each, alternating)"
    )
    out_diff = float((ours["result"] - ref["result"]).abs().max())
    grads = {k: max_rel_diff(ours["grads"][k], g) for k, g in ref["grads"].items()}
    print(
        f"max |diff| output: {out_diff:.2e} (scale {float(ref['result'].abs().max()):.2f}); gradients, "
        f"max |diff| / max |reference|: {', '.join(f'{k} {d:.1e}' for k, d in grads.items())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

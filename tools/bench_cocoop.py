"""Benchmark one CoCoOp training step: our batched shared-prefix path vs the original's per-image loop.

    python tools/bench_cocoop.py [--model ViT-B-16] [--classes 100] [--batch 8] [--repeats 2]

Both sides compute the same step for the same `ctx` and meta-net, in one process: B image
features (random, as from the frozen image tower; its cost is outside both sides), the meta-net,
the text features of B x n_cls prompts, the logits, cross-entropy and its backward pass into `ctx`
and the meta-net. The reference is `coop.reference.cocoop_logits`, written like CoCoOp's code: a
loop over the images, each running all classes' full 77-token prompts through open_clip's own
modules. Its backward pass runs per image (the batch's mean loss, accumulated image by image: the
same gradients), because a graph over B x n_cls x 77 tokens does not fit in memory (batch 8 x 100
classes needs ~30 GB in fp32: why CoCoOp trains with batch 1). Ours is `CoCoOp.loss`: B prefixes `[SOS][ctx_b]`, each attended to by n_cls suffixes cut
after [EOS], in length buckets, in one pass. Prompts follow CoCoOp's recipe (M = 4 from "a photo
of a", class token at the end; `--position middle` for the other layout), for the first N ImageNet
class names, on random weights. Each side gets `--warmup` untimed steps, then the best of
`--repeats` timed steps counts, the two sides alternating so that both see the same machine load;
the script prints wall and process CPU times (the latter is less disturbed by other processes on a
shared machine), the speed-ups and the largest differences of loss, logits and gradients. Small sizes (`--model configs/models/coop-tiny.json
--classes 10 --batch 2`) run in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import build_models, max_rel_diff, precision_context, sync  # noqa: E402
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: E402

from coop.methods import build_method  # noqa: E402
from coop.reference import cocoop_logits, reference_inputs  # noqa: E402


def build_cocoop(clip, n_classes: int, position: str, seed: int = 0):
    """A CoCoOp method on the first `n_classes` ImageNet names, CoCoOp's recipe for the prompt."""
    if not 1 <= n_classes <= len(IMAGENET_CLASSNAMES):
        raise ValueError(f"classes must be in 1..{len(IMAGENET_CLASSNAMES)}, got {n_classes}")
    cfg = OmegaConf.create(
        {
            "method": "cocoop",
            "data": {"name": "imagenet"},
            "prompt": {
                "n_ctx": None,
                "ctx_init": "a photo of a",
                "position": position,
                "csc": False,
                "depth": 1,
            },
        }
    )
    torch.manual_seed(seed)
    method = build_method(clip, list(IMAGENET_CLASSNAMES[:n_classes]), cfg)
    return method.to(clip.logit_scale.device)


def run_step(step, method, device, precision: str):
    """One `step()` -> (loss, logits), which also runs the backward pass, timed.

    Returns:
        (wall seconds, process CPU seconds, loss, logits, {name: gradient}).
    """
    method.zero_grad(set_to_none=True)
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    with precision_context(device, precision):
        loss, logits = step()
    sync(device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    grads = {k: p.grad.detach().clone() for k, p in method.learnable().items()}
    return wall, cpu, loss.detach().float(), logits.detach().float(), grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--batch", type=int, default=8, help="images per training step")
    ap.add_argument("--position", default="end", choices=("end", "middle"))
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    method = build_cocoop(clip, args.classes, args.position)
    pl = method.prompt_learner
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(args.batch, clip.embed_dim, generator=gen).to(device)
    labels = torch.randint(args.classes, (args.batch,), generator=gen).to(device)
    inputs = reference_inputs(oc, pl)  # tokenised once, outside the timed steps (CoCoOp: at build)
    lengths = (pl.eos + 1).float()
    print(
        f"model {args.model}, {pl.n_cls} ImageNet classes, batch {args.batch}, n_ctx {pl.n_ctx} "
        f"('{pl.ctx_init}'), position {args.position}, {args.precision}"
    )
    print(
        f"tokens per prompt: mean {lengths.mean():.1f}, max {int(lengths.max())}, shared per image "
        f"{pl.shared_prefix} (reference: 77); {args.batch * pl.n_cls} prompts per step"
    )
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")

    def reference_step():  # mean cross-entropy over the batch, backward image by image
        losses, logits = [], []
        for b in range(args.batch):
            logit, _ = cocoop_logits(oc, pl, method.meta_net, images[b : b + 1], inputs)
            loss = F.cross_entropy(logit.float(), labels[b : b + 1]) / args.batch
            loss.backward()
            losses.append(loss.detach())
            logits.append(logit.detach())
        return torch.stack(losses).sum(), torch.cat(logits)

    def our_step():
        loss, logits = method.loss(images, labels)
        loss.backward()
        return loss, logits

    sides = {"reference": reference_step, "coop": our_step}
    best = {name: [float("inf"), float("inf")] for name in sides}  # wall, CPU
    for i in range(args.warmup + args.repeats):  # the sides alternate, so both see the same load
        for name, step in sides.items():
            wall, cpu, *result = run_step(step, method, device, args.precision)
            if i >= args.warmup:
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
            if name == "reference":
                loss_ref, out_ref, g_ref = result
            else:
                loss_ours, out_ours, g_ours = result
    (t_ref, c_ref), (t_ours, c_ours) = best["reference"], best["coop"]
    print(
        f"reference CoCoOp (per-image loop, 77 tokens): {t_ref * 1000:9.1f} ms  (CPU time {c_ref * 1000:9.1f} ms)"
    )
    print(
        f"coop (batched, shared prefix per image):      {t_ours * 1000:9.1f} ms  (CPU time {c_ours * 1000:9.1f} ms)"
    )
    print(
        f"speed-up: {t_ref / t_ours:.2f}x wall, {c_ref / c_ours:.2f}x CPU time (forward+backward; best of "
        f"{args.repeats} after {args.warmup} warm-up step(s) each, the sides alternating)"
    )
    print(
        f"loss {float(loss_ref):.6f} vs {float(loss_ours):.6f}; max |diff| logits "
        f"{float((out_ours - out_ref).abs().max()):.2e} (scale {float(out_ref.abs().max()):.2f})"
    )
    diffs = ", ".join(f"{k} {max_rel_diff(g_ours[k], g_ref[k]):.1e}" for k in g_ref)
    print(f"gradients, max |diff| / max |reference|: {diffs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

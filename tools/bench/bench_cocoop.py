"""Benchmark one CoCoOp training step: our batched shared-prefix path vs the original's per-image loop.

    python tools/bench/bench_cocoop.py [--model ViT-B-16] [--classes 100] [--batch 8] [--repeats 2]

Both sides compute the same step for the same `ctx` and meta-net, in one process: B image
features (random, as from the frozen image tower; its cost is outside both sides), the meta-net,
the text features of B x n_cls prompts, the logits, cross-entropy and its backward pass into `ctx`
and the meta-net. The reference is `coop.reference.coop.cocoop_logits`, written like CoCoOp's code: a
loop over the images, each running all classes' full 77-token prompts through open_clip's own
modules. Its backward pass runs per image (the batch's mean loss, accumulated image by image: the
same gradients), because a graph over B x n_cls x 77 tokens does not fit in memory (batch 8 x 100
classes needs ~30 GB in fp32: why CoCoOp trains with batch 1). Ours is `CoCoOp.loss`: B prefixes
`[SOS][ctx_b]`, each attended to by the n_cls class suffixes cut after [EOS] and packed into one
sequence (`coop.model.packing`), in one pass. Prompts follow CoCoOp's recipe (M = 4 from "a photo of
a", class token at the end; `--position middle` or `front` for the other layouts), for the first
N ImageNet class names, on random weights. Each side gets `--warmup` untimed steps, then the best
of `--repeats` timed steps counts, the two sides alternating so that both see the same machine
load; the script prints the shared prefix P per image, the bound 77 / (mean tokens per prompt -
P) (the reference's tokens per prompt over ours), wall and process CPU times (the latter is less
disturbed by other processes on a shared machine), the speed-ups and their share of the bound,
and the largest differences of loss, logits and gradients. Small sizes (`--model
configs/models/coop-tiny.json --classes 10 --batch 2`) run in seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import alternate, build_models, max_rel_diff, text_bound  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: E402

from coop.methods import build_method  # noqa: E402
from coop.reference.coop import cocoop_logits, reference_inputs  # noqa: E402


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, default=100, help="first N ImageNet class names")
    ap.add_argument("--batch", type=int, default=8, help="images per training step")
    ap.add_argument("--position", default="end", choices=("end", "middle", "front"))
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
    bound = text_bound(pl)
    print(
        f"model {args.model}, {pl.n_cls} ImageNet classes, batch {args.batch}, n_ctx {pl.n_ctx} "
        f"('{pl.ctx_init}'), position {args.position}, {args.precision}"
    )
    print(
        f"tokens per prompt: mean {bound['tokens']:.2f}, max {int(pl.eos.max()) + 1} (reference: 77); shared "
        f"prefix per image {bound['prefix']}; own tokens per prompt {bound['own']:.2f}; bound 77 / "
        f"{bound['own']:.2f} = {bound['bound']:.2f}x; {args.batch * pl.n_cls} prompts per step"
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
        return torch.stack(losses).sum(), torch.cat(logits).float()

    def our_step():
        loss, logits = method.loss(images, labels)
        loss.backward()
        return loss.detach(), logits.detach().float()

    res = alternate({"reference": reference_step, "coop": our_step}, method.learnable, device, args.precision,
                    args.repeats, args.warmup)  # fmt: skip
    ref, ours = res["reference"], res["coop"]
    (loss_ref, out_ref), (loss_ours, out_ours) = ref["result"], ours["result"]
    wall, cpu = ref["wall"] / ours["wall"], ref["cpu"] / ours["cpu"]
    print(
        f"reference CoCoOp (per-image loop, 77 tokens): {ref['wall'] * 1000:9.1f} ms  "
        f"(CPU time {ref['cpu'] * 1000:9.1f} ms)"
    )
    print(
        f"coop (batched, packed after each image's prefix): {ours['wall'] * 1000:5.1f} ms  "
        f"(CPU time {ours['cpu'] * 1000:9.1f} ms)"
    )
    print(
        f"speed-up: {wall:.2f}x wall = {wall / bound['bound']:.0%} of the bound, {cpu:.2f}x CPU time = "
        f"{cpu / bound['bound']:.0%} (forward+backward; best of {args.repeats} after {args.warmup} warm-up "
        "step(s) each, the sides alternating)"
    )
    print(
        f"loss {float(loss_ref):.6f} vs {float(loss_ours):.6f}; max |diff| logits "
        f"{float((out_ours - out_ref).abs().max()):.2e} (scale {float(out_ref.abs().max()):.2f})"
    )
    diffs = ", ".join(f"{k} {max_rel_diff(ours['grads'][k], g):.1e}" for k, g in ref["grads"].items())
    print(f"gradients, max |diff| / max |reference|: {diffs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

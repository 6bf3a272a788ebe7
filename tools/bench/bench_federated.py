"""Benchmark one FedOTP client step: ours vs the original's way of computing it.

    python tools/bench/bench_federated.py [--model ViT-B-16] [--classes 10 100] [--batch 16] [--device cpu]

Both sides compute the same training step (forward + cross-entropy + backward into `global.ctx`
and `local.ctx`) of `fl.method=fedotp` on the same cached patch tokens (random weights, the first
N ImageNet class names, the recipe's n_ctx 16, gamma 0.8, eps 0.1, up to 100 iterations):

- ours: `coop.federated.fedotp.FedOTP.loss` (each prompt's text tower cut after [EOS], the shared
  [SOS][ctx] prefix computed once, `unbalanced_ot` on a (B*C, M, N) batch);
- the reference, as the original's `GLP_OT` computes it: the 2 x C prompts through open_clip's own
  text modules at their full 77 tokens (`coop.reference.coop.coop_text_features`), and its
  `entropic_COT_fast` transcribed with its `diag_embed` products ((B*C, M, M) and (B*C, N, N)
  diagonal matrices) and a `.item()` stop check each iteration.

Each side gets `--warmup` untimed steps, then the best of `--repeats` timed steps counts, the two
sides alternating (`tools/bench/_bench.alternate`); wall and CPU seconds, the speed-up and the largest
relative differences of loss and gradients are printed, one JSON line per class count with --json.
Small sizes run in seconds: `--model configs/models/coop-tiny.json --classes 5 --batch 2`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import alternate, build_models, max_rel_diff  # noqa: E402
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: E402

from coop.config.load import load_config  # noqa: E402
from coop.federated.fedotp import FedOTP  # noqa: E402
from coop.reference.coop import coop_text_features, reference_inputs  # noqa: E402


def reference_cot(a, b, K, max_iter: int, thresh: float) -> torch.Tensor:
    """The original's entropic_COT_fast, written as it is (diag_embed products, .item() checks)."""
    dx, dy = torch.ones_like(a), torch.ones_like(b)
    kp = torch.matmul(torch.diag_embed(1 / a, dim1=1), K)
    kq = torch.matmul(torch.diag_embed(1 / b, dim1=1), K.permute(0, 2, 1))
    u, v, cpt = dx, dy, 0
    while cpt < max_iter:
        v0 = v
        u = torch.minimum(torch.div(dx, torch.matmul(kp, v.unsqueeze(-1)).squeeze(-1)), dx)
        v = torch.div(dy, torch.matmul(kq, u.unsqueeze(-1)).squeeze(-1))
        cpt += 1
        if (v - v0).abs().mean().item() < thresh:
            break
    return torch.matmul(torch.matmul(torch.diag_embed(u, dim1=1), K), torch.diag_embed(v, dim1=1))


def reference_loss(oc, method: FedOTP, inputs, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GLP_OT's forward on cached tokens (LND -> the same (B, 1+P, E) here) and its cross-entropy."""
    learners = [method.global_prompt.prompt_learner, method.local_prompt.prompt_learner]
    text = torch.stack([coop_text_features(oc, pl, inputs) for pl in learners])  # (N, C, E), 77 tokens each
    n, c = text.shape[:2]
    image = F.normalize(tokens[:, 1:].permute(1, 0, 2), dim=2)  # (M, B, E)
    text = F.normalize(text, dim=2)
    m, b = image.shape[:2]
    sim = (
        torch.einsum("mbd,ncd->mnbc", image, text).contiguous().view(m, n, b * c).permute(2, 0, 1)
    )  # (B*C, M, N)
    xx = torch.full((b * c, m), 1.0 / m, dtype=sim.dtype)
    yy = torch.full((b * c, n), method.gamma / n, dtype=sim.dtype)
    with torch.no_grad():
        plan = reference_cot(xx, yy, torch.exp(-(1.0 - sim) / method.eps), method.max_iter, method.thresh)
    logits = oc.logit_scale.exp() * torch.sum(plan * sim, dim=(1, 2)).view(b, c)
    return F.cross_entropy(logits, labels)


def bench(model: str, n_classes: int, batch: int, device: torch.device, repeats: int, warmup: int) -> dict:
    oc, clip = build_models(model, device)
    cfg = load_config(None, ["fl.method=fedotp", "prompt.n_ctx=16"])
    torch.manual_seed(0)
    method = FedOTP(clip, list(IMAGENET_CLASSNAMES[:n_classes]), cfg).to(device)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, clip.image_size, clip.image_size, generator=gen).to(device)
    with torch.no_grad():
        tokens = clip.encode_image(images, tokens=True)  # (B, 1+P, E): what the cache holds
    labels = torch.randint(n_classes, (batch,), generator=gen).to(device)
    inputs = reference_inputs(oc, method.global_prompt.prompt_learner)

    def ours():
        loss, _ = method.loss(tokens, labels)
        loss.backward()
        return loss.detach()

    def reference():
        loss = reference_loss(oc, method, inputs, tokens, labels)
        loss.backward()
        return loss.detach()

    sides = alternate(
        {"reference": reference, "coop": ours}, method.learnable, device, "fp32", repeats, warmup
    )
    ref, us = sides["reference"], sides["coop"]
    return {
        "model": model,
        "classes": n_classes,
        "batch": batch,
        "patches": tokens.shape[1] - 1,
        "reference_s": ref["wall"],
        "coop_s": us["wall"],
        "reference_cpu_s": ref["cpu"],
        "coop_cpu_s": us["cpu"],
        "speedup": ref["wall"] / us["wall"],
        "loss_rel_diff": max_rel_diff(us["result"], ref["result"]),
        "grad_rel_diff": max(max_rel_diff(us["grads"][k], ref["grads"][k]) for k in us["grads"]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ViT-B-16", help="open_clip name or model-config JSON (ViT-B-16)")
    ap.add_argument("--classes", type=int, nargs="+", default=[10, 100], help="class counts (10 100)")
    ap.add_argument("--batch", type=int, default=16, help="images per step (16: FedOTP's batch = shots)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="one JSON line per class count")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    _cli.setup_logging(args.verbose)
    for n in args.classes:
        r = bench(args.model, n, args.batch, torch.device(args.device), args.repeats, args.warmup)
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"{r['classes']:>5} classes, batch {r['batch']}, {r['patches']} patches: reference {r['reference_s']:.3f} s, "
            f"ours {r['coop_s']:.3f} s ({r['speedup']:.1f}x; cpu {r['reference_cpu_s']:.3f} / {r['coop_cpu_s']:.3f} s); "
            f"loss diff {r['loss_rel_diff']:.1e}, grad diff {r['grad_rel_diff']:.1e}"
        )
    return 0


if __name__ == "__main__":
    _cli.run_cli(main)

"""Benchmark 2SFS's training steps: ours (`method=2sfs`) vs the original's way (`coop.reference.twosfs`).

    python tools/bench/bench_twosfs.py [--model configs/models/coop-tiny.json] [--classes 100 1000]
                                       [--batch 32] [--repeats 3] [--device cpu]

Stage one is where the two differ: every step runs the text tower on every class's prompt with
gradients into its LayerNorms, and the image tower on the batch. The original runs each prompt's
77 tokens through `encode_text`; ours cuts each prompt after its [EOS] and computes the prefix that
every prompt shares ([SOS] a photo of a) once. The image side is the same work on both sides.
Per class count it times (best of --repeats after a warm-up call, the sides alternating):

    stage one  loss + backward of one step, ours and the reference; and the text side alone
               (forward + backward of sum(text^2) into the text tower's LayerNorms);
    stage two  loss + backward of the head (the image tower without gradient on both sides).

The bound is the text side's speed-up if time were proportional to tokens: 77 / own, own = mean
(eos + 1) - P tokens per prompt, P the shared prefix. The whole step's ratio lies below it: the
image tower is the same work on both sides.

It checks that both sides give the same loss and LayerNorm gradients, and reports the peak memory
of one stage-one step at the largest class count (CUDA: torch.cuda.max_memory_allocated per side;
CPU: the process's peak resident size after ours, then after the reference, which runs second).
The default (the tiny config, 100 and 1,000 ImageNet classes) runs in a few minutes on a CPU;
`--model ViT-B-16 --device cuda` measures the real sizes.
"""

from __future__ import annotations

import argparse
import copy
import logging
import resource
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _bench import build_models, imagenet_method, max_rel_diff, peak_fields, reset_peak, sync  # noqa: E402

from coop.methods.clip_lora import CLIP_LORA_TEMPLATE  # noqa: E402
from coop.reference import twosfs as ref  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "configs" / "models" / "coop-tiny.json"


def best(step, repeats: int, warmup: int, device) -> tuple[float, object]:
    """(best wall seconds, last result) of `step` over `repeats` calls after `warmup` ones."""
    wall, result = float("inf"), None
    for i in range(warmup + repeats):
        sync(device)
        t = time.perf_counter()
        result = step()
        sync(device)
        if i >= warmup:
            wall = min(wall, time.perf_counter() - t)
    return wall, result


def sides(oc, method, images, labels):
    """The steps of both sides: {name: call}, each returning (loss, {tensor name: gradient})."""
    norms = {k: v for k, v in method.learnable().items() if k not in ("head", "stage")}
    model = copy.deepcopy(oc)
    ref.trainable_norms(model)  # the original's selection on its own copy
    params = dict(model.named_parameters())
    theirs = {k: params[k.removeprefix("text.") if not hasattr(model, "text") else k] for k in norms}
    ids = method.clip.tokenize([CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in method.classnames])
    ids = ids.to(images.device)
    method.train()

    def grads(loss, tensors):
        return float(loss.detach()), dict(
            zip(tensors, torch.autograd.grad(loss, list(tensors.values())), strict=True)
        )

    def ours_one():
        return grads(method.loss(images, labels)[0], norms)

    def ref_one():
        return grads(F.cross_entropy(ref.stage_one_logits(model, images, ids), labels), theirs)

    def ours_text():
        text = {k: v for k, v in norms.items() if k.startswith("text.")}
        return grads(method.encode().square().sum(), text)

    def ref_text():
        text = {k: v for k, v in theirs.items() if k.startswith("text.")}
        return grads(model.encode_text(ids).square().sum(), text)

    head = ref.initial_head(model, ids).requires_grad_(True)

    def ours_two():
        return grads(method.loss(images, labels)[0], {"head": method.head})

    def ref_two():
        return grads(F.cross_entropy(ref.stage_two_logits(model, head, images), labels), {"head": head})

    return ours_one, ref_one, ours_text, ref_text, ours_two, ref_two


def measure(oc, clip, classes: int, args, device, memory: bool) -> dict:
    torch.manual_seed(0)
    method = imagenet_method(clip, "2sfs", classes)
    size = clip.image_size
    images = torch.randn(args.batch, 3, size, size, device=device)
    labels = torch.randint(classes, (args.batch,), device=device)
    ours_one, ref_one, ours_text, ref_text, ours_two, ref_two = sides(oc, method, images, labels)
    row = {"classes": classes}
    if memory:  # before the timing: one step each, ours first (CPU: the peak resident size only grows)
        start = reset_peak(device)
        ours_one()
        row["ours_peak"] = peak_fields(device, start)["peak_mib"] or rss_mib()
        start = reset_peak(device)
        ref_one()
        row["ref_peak"] = peak_fields(device, start)["peak_mib"] or rss_mib()
    row["ours_s"], (ours_loss, ours_grads) = best(ours_one, args.repeats, args.warmup, device)
    row["ref_s"], (ref_loss, ref_grads) = best(ref_one, args.repeats, args.warmup, device)
    row["ours_text_s"], (_, ours_text_grads) = best(ours_text, args.repeats, args.warmup, device)
    row["ref_text_s"], (_, ref_text_grads) = best(ref_text, args.repeats, args.warmup, device)
    row["loss_diff"] = abs(ours_loss - ref_loss)
    row["grad_diff"] = max(max_rel_diff(ours_grads[k], ref_grads[k]) for k in ours_grads)
    row["text_grad_diff"] = max(max_rel_diff(ours_text_grads[k], ref_text_grads[k]) for k in ours_text_grads)
    row["own"] = float((method.eos + 1).float().mean()) - method.prefix
    row["bound"] = method.clip.context_length / row["own"]
    method.start_stage_two()
    row["ours2_s"], _ = best(ours_two, args.repeats, args.warmup, device)
    row["ref2_s"], _ = best(ref_two, args.repeats, args.warmup, device)
    return row


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(TINY), help="open_clip model name or model-config JSON")
    ap.add_argument("--classes", type=int, nargs="+", default=[100, 1000], help="first N ImageNet classes")
    ap.add_argument("--batch", type=int, default=32, help="images per step (the recipe's 32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per side (the best counts)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per side first")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    device = torch.device(args.device)
    oc, clip = build_models(args.model, device)
    print(
        f"model {args.model}, batch {args.batch}, fp32, torch {torch.__version__}, {device}, "
        f"{torch.get_num_threads()} threads"
    )
    for classes in args.classes:
        r = measure(oc, clip, classes, args, device, memory=classes == max(args.classes))
        text = r["ref_text_s"] / r["ours_text_s"]
        print(
            f"{classes} classes: stage-one step: reference {r['ref_s'] * 1000:.1f} ms, 2sfs {r['ours_s'] * 1000:.1f} ms, "
            f"{r['ref_s'] / r['ours_s']:.2f}x; its text side: reference {r['ref_text_s'] * 1000:.1f} ms, 2sfs "
            f"{r['ours_text_s'] * 1000:.1f} ms, {text:.2f}x = {text / r['bound']:.0%} of the bound 77 / "
            f"{r['own']:.2f} = {r['bound']:.2f}x; stage-two step: reference {r['ref2_s'] * 1000:.1f} ms, "
            f"2sfs {r['ours2_s'] * 1000:.1f} ms"
        )
        print(
            f"  max |diff| loss: {r['loss_diff']:.2e}; LayerNorm gradients, max |diff| / max |ref|: step "
            f"{r['grad_diff']:.1e}, text side {r['text_grad_diff']:.1e}"
        )
        if "ours_peak" in r:
            what = "peak CUDA memory" if device.type == "cuda" else "peak resident size of the process"
            print(
                f"  {what} of one stage-one step: 2sfs {r['ours_peak']:.0f} MiB, reference {r['ref_peak']:.0f} MiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

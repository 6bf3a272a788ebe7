"""GPU check: parity with the reference, text speed-up, peak memory and epoch time on one GPU.

    python tools/bench/gpu_check.py [--out DIR] [--quick] [--device cuda:0]      # or: make gpu-check

One script, about 5 minutes on one H100/H200-class GPU, everything on the same device and with
random weights (offline). It checks, against the reference CoOp computation (`coop.reference.coop`):

  parity     ViT-B/16, 100 ImageNet classes, M = 16, class at the end and in the middle (shared
             context): text features and ctx gradients in fp32 (tolerance: max |diff| / max |ref|
             <= 1e-4 for features, <= 1e-3 for gradients; TF32 is switched off) and under bf16
             autocast (ours and the reference both in bf16, each against the fp32 reference;
             ours must stay within 3x the reference's own bf16 error, floor 2e-2);
  text speed forward + backward of the text side, ours vs reference, at 100 and 1,000 classes,
             M = 4 and 16, class at the end, shared context, fp32 and bf16 (best of 3 after a
             warm-up call);
  text bound the same text side per layout (end, middle, front; M = 4 and 16; 100 and 1,000
             classes; fp32, the sides alternating, as tools/bench/bench_text.py): shared prefix P, the
             bound 77 / (mean tokens per prompt - P) and the speed-up as a share of it;
  memory     peak GPU memory (torch.cuda.max_memory_allocated) of one 1,000-class training step,
             M = 16, batch 32: ours, ours with grad checkpointing, and the reference;
  epoch      one 16-shot ImageNet-sized epoch: 16,000 synthetic 224x224 images (tensors already
             on the GPU), batch 32, 1,000 classes, bf16 autocast; the aug_views=0 path (image tower
             forward every step + prompt step) and the cached-features path (prompt step on
             precomputed features), plus the one-off cost of the cache. Image decoding,
             augmentation and host-to-device copies are NOT included: the images are synthetic;
  maple      one MaPLe training step (recipe: n_ctx 2, depth 9) on ViT-B/16 and ViT-L/14, 1,000
             classes, batch 4, bf16 autocast: ours with and without grad checkpointing, and the
             reference computed the official way (`coop.reference.vision_prompts.maple_logits`: 77 tokens per
             class through open_clip's modules); time (best of 3 after a warm-up step) and peak
             torch.cuda.max_memory_allocated of the step;
  clip_lora  the same for one CLIP-LoRA step (rank-2 q|k|v adapters in every block of both towers),
             1,000 classes, batch 32 (its recipe): ours against `coop.reference.clip_lora`
             (77 tokens per class, LoRA added to the weights, as its original computes it).
  mmrl       the same for one MMRL training step (recipe: K 5, d_r 512, blocks 6..12 of the text
             tower and L/2..L of the image tower, its loss with the frozen image pass): ours with
             and without grad checkpointing, and the reference the official way
             (`coop.reference.mmrl.mmrl_step`: 77+K tokens per class, two full image passes).
  twosfs     the same for one 2SFS stage-one step (the LayerNorms of both towers' blocks train),
             ViT-B/16 and ViT-L/14, 1,000 classes, batch 32 (its recipe): ours against
             `coop.reference.twosfs` (77 tokens per class through open_clip's encode_text).
  coprompt   the same for one CoPrompt training step (ImageNet's recipe: n_ctx 4, depth 12, W 8; its
             whole loss on batches of two views, the frozen tower on the second): ours with and
             without grad checkpointing, and `coop.reference.coprompt.coprompt_loss` (77 tokens per
             class); the descriptions (5 made-up sentences per class) encoded once, untimed, on both.
  hicropl    the same for one HiCroPL training step (its recipe: n_ctx 16, depth 12, crossing at
             layer 6, W 12; its whole loss with the frozen image tower on the same images), batch 4:
             ours with and without grad checkpointing, and `coop.reference.hicropl.hicropl_forward`
             (77 tokens per class, its mapping's attention spelled out); the descriptions (5 made-up
             sentences per class) encoded once, untimed, on both.
  timm_maple, timm_clip_lora
             the MaPLe and CLIP-LoRA steps above on the timm towers of EVA02-B-16 (RoPE),
             ViT-B-16-SigLIP2 (no class token, MAP pool, 64-token text without the causal mask)
             and PE-Core-B-16 (RoPE, MAP pool, 32-token text), 1,000 classes, built as
             tools/bench/bench_vl.py builds them (CLIP's tokenizer; the reference's image side is timm's
             own forward, `coop.reference.timm_vit`); a model the method cannot be built on is one
             row saying why ("not supported: ...").
  tpt        TPT per image (tools/bench/bench_tta.py): a zero-shot host on ViT-B/16, 64 views of
             random image features, 200 and 1,000 classes: the original-style reference (77 tokens x
             all classes, forward, backward, forward per image) against ours (the starting prompt's
             forward and graph shared by all images, then per image a backward and a forward of the
             fast text pass); time per image (best of 3 after a warm-up image), the bound
             R / (B + F) and its share reached; peak memory of one image at 1,000 classes: ours,
             ours with tpt.grad_checkpointing, the reference;
  ddp        where several GPUs are visible: one run on 1 GPU vs on all of them (tools/bench/bench_ddp.py:
             torchrun, NCCL, ViT-B/16, CoOp on cached features and MaPLe on pixels, epoch times).

Writes `gpu_check.json` into --out (default: the current folder) and prints a table. Without
CUDA it prints one line and exits 0. `--quick` uses 3,200 images for the epoch.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import _cli  # noqa: E402, F401 - first: OpenMP's settings (tools/_cli.py) before torch loads
import torch  # noqa: E402
from _bench import build_models, free  # noqa: E402
from _gpu_coop import (  # noqa: E402
    TOL,
    check_epoch,
    check_memory,
    check_parity,
    check_speed,
    check_text_bound,
    print_epoch,
    print_memory,
    print_parity,
    print_speed,
    print_text_bound,
)
from _gpu_steps import (  # noqa: E402
    TINY_MODEL,
    check_clip_lora,
    check_coprompt,
    check_hicropl,
    check_maple,
    check_mmrl,
    check_timm,
    check_twosfs,
    print_clip_lora,
    print_coprompt,
    print_hicropl,
    print_maple,
    print_mmrl,
    print_timm,
    print_twosfs,
)
from _tta import check_tpt, print_tpt  # noqa: E402

SIZES = {  # --tiny: the test suite's model, so that the whole script runs on a CPU in seconds
    "full": {"model": "ViT-B-16", "parity": 100, "speed": (100, 1000), "n_ctx": (4, 16), "memory": 1000,
             "images": 16000, "repeats": 3, "tpt": (200, 1000), "tpt_images": 3, "tpt_views": 64},
    "tiny": {"model": TINY_MODEL, "parity": 10, "speed": (10,),
             "n_ctx": (4,), "memory": 20, "images": 64, "repeats": 1, "tpt": (10,), "tpt_images": 1,
             "tpt_views": 8},
}  # fmt: skip


def check_ddp(device) -> list[dict]:
    """1 vs all visible GPUs for one run (tools/bench/bench_ddp.py under torchrun, NCCL), when there
    are several; one row saying why not otherwise."""
    n = torch.cuda.device_count() if device.type == "cuda" else 0
    if n < 2:
        return [{"skipped": f"needs 2 or more GPUs, {n} visible"}]
    rows = Path(tempfile.mkdtemp()) / "bench_ddp.json"
    args = [
        "--device",
        "cuda",
        "--ranks",
        str(n),
        "--model",
        "ViT-B-16",
        "--shots",
        "128",
        "--batch-size",
        "32",
    ]
    subprocess.run(
        [sys.executable, str(Path(__file__).with_name("bench_ddp.py")), *args, "--json", str(rows)],
        check=True,
    )
    return json.loads(rows.read_text())


def print_ddp(rows: list[dict]) -> None:
    print("one run across GPUs (tools/bench/bench_ddp.py)")
    for r in rows:
        if "skipped" in r:
            print(f"  skipped: {r['skipped']}")
        else:
            print(f"  {r['workload']:<24} {r['ranks']} ranks  epoch {r['epoch_s']:.3f} s")


PRINTERS = {
    "parity": print_parity,
    "text_speed": print_speed,
    "memory": print_memory,
    "text_bound": print_text_bound,
    "epoch": print_epoch,
    "maple": print_maple,
    "clip_lora": print_clip_lora,
    "mmrl": print_mmrl,
    "twosfs": print_twosfs,
    "coprompt": print_coprompt,
    "hicropl": print_hicropl,
    "timm_maple": print_timm("maple"),
    "timm_clip_lora": print_timm("clip_lora"),
    "tpt": print_tpt,
    "ddp": print_ddp,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="folder for gpu_check.json (default: current folder)")
    ap.add_argument("--quick", action="store_true", help="3,200 images for the epoch instead of 16,000")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: tiny model, any device
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device available; nothing checked")
        return 0
    sizes = dict(SIZES["tiny" if args.tiny else "full"])
    if args.quick:
        sizes["images"] = min(sizes["images"], 3200)
    # Exact fp32 for the fp32 parity and timings: no TF32 matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    oc, clip = build_models(sizes["model"], device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    report = {
        "device": str(device), "device_name": name, "torch": torch.__version__,
        "model": Path(sizes["model"]).stem if args.tiny else sizes["model"], "weights": "random (seed 0)",
        "tolerances": TOL,
        "notes": "epoch images are synthetic tensors on the device: no decoding, augmentation or copies",
        "section_s": {}, "errors": {},
    }  # fmt: skip
    print(f"{name} | torch {torch.__version__} | {report['model']} (random weights)\n", flush=True)
    sections = {
        "parity": lambda: check_parity(oc, clip, sizes["parity"], device),
        "text_speed": lambda: check_speed(oc, clip, sizes["speed"], sizes["n_ctx"], device, sizes["repeats"]),
        "text_bound": lambda: check_text_bound(
            oc, clip, sizes["speed"], sizes["n_ctx"], device, sizes["repeats"]
        ),
        "memory": lambda: check_memory(oc, clip, sizes["memory"], device),
        "epoch": lambda: check_epoch(clip, sizes["memory"], sizes["images"], device),
        "maple": lambda: check_maple(device, args.tiny),
        "clip_lora": lambda: check_clip_lora(device, args.tiny),
        "mmrl": lambda: check_mmrl(device, args.tiny),
        "twosfs": lambda: check_twosfs(device, args.tiny),
        "coprompt": lambda: check_coprompt(device, args.tiny),
        "hicropl": lambda: check_hicropl(device, args.tiny),
        "timm_maple": lambda: check_timm("maple", device, args.tiny),
        "timm_clip_lora": lambda: check_timm("clip_lora", device, args.tiny),
        "tpt": lambda: check_tpt(oc, clip, sizes["tpt"], sizes["tpt_images"], sizes["tpt_views"], device),
        "ddp": lambda: check_ddp(device),
    }
    for section, run in sections.items():
        t0 = time.perf_counter()
        try:  # a failing section (e.g. out of memory) must not cost the others' results
            report[section] = run()
        except Exception as e:
            report["errors"][section] = f"{type(e).__name__}: {(str(e).strip() or '-').splitlines()[0]}"
            print(f"{section}: ERROR {report['errors'][section]}\n", flush=True)
            free(device)
        else:
            PRINTERS[section](report[section])
            print(f"  ({time.perf_counter() - t0:.1f} s)\n", flush=True)
        report["section_s"][section] = time.perf_counter() - t0
        report["total_s"] = time.perf_counter() - start
        report["ok"] = not report["errors"] and all(r["ok"] for r in report["parity"])
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")  # after every section
    print(f"all checks {'passed' if report['ok'] else 'FAILED'}; total {report['total_s']:.0f} s")
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""Shared pieces of the benchmarks (bench_text.py, bench_cocoop.py, bench_train.py, bench_vl.py,
gpu_check.py).

Models are built with random weights (offline, seeded), prompts use the first N ImageNet class
names, and every timing waits for the device (CUDA kernels run asynchronously) and follows
warm-up calls, so both sides of a comparison are measured the same way in the same process;
`alternate` interleaves the sides' calls, so that both see the same machine load.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import nullcontext

import open_clip
import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

import coop
from coop.config.load import load_config
from coop.methods import build_method
from coop.model.weights import resolve_model_name
from coop.reference.coop import coop_text_features, reference_inputs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> int:
    """Reset CUDA's peak-memory counter; the bytes allocated now (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_fields(device, start: int) -> dict:
    """Peak CUDA memory since the last reset, and its growth over `start` bytes, in MiB (None off CUDA)."""
    if device.type != "cuda":
        return {"peak_mib": None, "step_mib": None}
    peak = torch.cuda.max_memory_allocated(device)
    return {"peak_mib": peak / 2**20, "step_mib": (peak - start) / 2**20}


def free(device) -> None:
    """Hand CUDA's cached, unused blocks back between measurements (nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def precision_context(device: torch.device, precision: str):
    """bf16 autocast for "bf16" (on CPU too, for smoke runs); nothing for "fp32"."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision != "fp32":
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    return nullcontext()


def build_models(model: str, device: torch.device, seed: int = 0):
    """(open_clip model, coop.CLIP) with the same random weights on `device`, frozen.

    Args:
        model: an open_clip model name (e.g. "ViT-B-16") or a model-config JSON path.
    """
    torch.manual_seed(seed)
    oc = open_clip.create_model(resolve_model_name(model), pretrained=None).eval().to(device)
    oc.requires_grad_(False)
    # a timm trunk is taken over: ours is a copy
    return oc, coop.CLIP.from_openclip(copy.deepcopy(oc), name=resolve_model_name(model))


def imagenet_prompts(
    clip: coop.CLIP,
    n_classes: int,
    n_ctx: int,
    position: str = "end",
    seed: int = 0,
    csc: bool = False,
    depth: int = 1,
):
    """(PromptLearner, PromptClassifier) for the first `n_classes` ImageNet class names."""
    if not 1 <= n_classes <= len(IMAGENET_CLASSNAMES):
        raise ValueError(f"classes must be in 1..{len(IMAGENET_CLASSNAMES)}, got {n_classes}")
    torch.manual_seed(seed)
    names = list(IMAGENET_CLASSNAMES[:n_classes])
    device = clip.logit_scale.device
    learner = coop.PromptLearner(clip, names, n_ctx=n_ctx, position=position, csc=csc, depth=depth)
    learner = learner.to(device)
    return learner, coop.PromptClassifier(clip, learner)


def imagenet_method(clip: coop.CLIP, method: str, n_classes: int, overrides=(), seed: int = 0):
    """`method` with its recipe (`METHOD_DEFAULTS`) plus `key=value` overrides, built for the first
    `n_classes` ImageNet class names, on the CLIP's device."""
    if not 1 <= n_classes <= len(IMAGENET_CLASSNAMES):
        raise ValueError(f"classes must be in 1..{len(IMAGENET_CLASSNAMES)}, got {n_classes}")
    cfg = load_config(overrides=[f"method={method}", "data.name=imagenet", *overrides])
    torch.manual_seed(seed)
    return build_method(clip, list(IMAGENET_CLASSNAMES[:n_classes]), cfg).to(clip.logit_scale.device)


def text_sides(oc, classifier: coop.PromptClassifier) -> dict[str, Callable[[], torch.Tensor]]:
    """{"coop": ours, "reference": CoOp's full-77 computation}; the reference's tokenisation is
    done here, once, outside anything that is timed."""
    learner = classifier.prompt_learner
    inputs = reference_inputs(oc, learner)
    return {"coop": classifier.text_features, "reference": lambda: coop_text_features(oc, learner, inputs)}


def time_text(
    compute: Callable[[], torch.Tensor],
    learner: coop.PromptLearner,
    device: torch.device,
    precision: str = "fp32",
    repeats: int = 3,
    warmup: int = 1,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Best wall time (s) of forward + backward after `warmup` untimed calls.

    Returns:
        (seconds, text features of the last call (float32), ctx gradient of the last call).
    """
    best = float("inf")
    for i in range(warmup + repeats):
        learner.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        with precision_context(device, precision):
            out = compute()
        out.float().square().sum().backward()
        sync(device)
        if i >= warmup:
            best = min(best, time.perf_counter() - start)
    return best, out.detach().float(), learner.ctx.grad.detach().clone()


def text_steps(
    oc, classifier: coop.PromptClassifier, reference_chunk: int | None = None
) -> dict[str, Callable[[], torch.Tensor]]:
    """{"reference": CoOp's full-77 computation, "coop": ours}, each one forward + backward.

    Each step backpropagates sum(features^2) into the prompt tensors and returns the features
    (float32, detached). The reference runs `reference_chunk` classes at a time (default: all),
    each slice's backward before the next slice's forward: the same work and gradients (every
    class is computed on its own and the loss is a sum over classes), the memory of one slice.
    Its tokenisation is done here, once, outside anything that is timed.
    """
    learner = classifier.prompt_learner
    inputs = reference_inputs(oc, learner)
    return prompt_steps(
        classifier, lambda rows: coop_text_features(oc, learner, inputs, classes=rows), reference_chunk
    )


def prompt_steps(
    classifier: coop.PromptClassifier,
    reference_rows: Callable[[slice], torch.Tensor],
    chunk: int | None = None,
) -> dict[str, Callable[[], torch.Tensor]]:
    """{"reference": `reference_rows` over slices of `chunk` classes (default: all), "coop": ours},
    each one forward + backward of sum(features^2) into the prompt tensors, returning the
    features (float32, detached); each slice's backward runs before the next slice's forward."""
    n_cls = classifier.prompt_learner.n_cls
    step = chunk or n_cls

    def reference() -> torch.Tensor:
        outs = []
        for c in range(0, n_cls, step):
            out = reference_rows(slice(c, c + step))
            out.float().square().sum().backward()
            outs.append(out.detach().float())
        return torch.cat(outs)

    def ours() -> torch.Tensor:
        out = classifier.text_features()
        out.float().square().sum().backward()
        return out.detach().float()

    return {"reference": reference, "coop": ours}


def alternate(
    steps: dict[str, Callable[[], object]],
    learnable: Callable[[], dict[str, torch.Tensor]],
    device: torch.device,
    precision: str = "fp32",
    repeats: int = 3,
    warmup: int = 1,
) -> dict[str, dict]:
    """Time forward + backward steps side by side: each round runs every side once, in turn.

    Args:
        steps: side name -> a call that runs one forward + backward and returns its outputs.
        learnable: the trained tensors by name (`PromptLearner.prompt_tensors`, `Method.learnable`);
            their gradients are cleared before each call and read after it.
        repeats: timed rounds after `warmup` untimed ones; the best time of each side counts.
    Returns:
        Per side: best "wall" and process "cpu" seconds, and the last call's "result" and
        "grads" ({name: gradient}).
    """
    out = {name: {"wall": float("inf"), "cpu": float("inf")} for name in steps}
    for i in range(warmup + repeats):
        for name, step in steps.items():
            for p in learnable().values():
                p.grad = None
            sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            with precision_context(device, precision):
                result = step()
            sync(device)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            side = out[name]
            if i >= warmup:
                side["wall"], side["cpu"] = min(side["wall"], wall), min(side["cpu"], cpu)
            side["result"] = result
            side["grads"] = {k: p.grad.detach().clone() for k, p in learnable().items()}
    return out


def text_bound(learner: coop.PromptLearner, context_length: int = 77) -> dict:
    """The token bound of a prompt layout: what the reference computes per prompt (77 tokens)
    over what ours still computes on its own after the shared prefix.

    Returns:
        {"prefix": P, "tokens": mean eos + 1, "own": mean eos + 1 - P, "bound": 77 / own}.
    """
    tokens = float((learner.eos + 1).float().mean())
    own = tokens - learner.shared_prefix
    return {"prefix": learner.shared_prefix, "tokens": tokens, "own": own, "bound": context_length / own}


def max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())

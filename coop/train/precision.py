"""The precision policy: what `train.precision` runs on a device, and the autocast it runs under.

Training, evaluation, the feature cache, the federated clients and the exported classifier all run
at the precision `resolve_precision` gives, so that a run and its cached features agree on it.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision that really runs for `train.precision` on `device`.

    "amp" (bf16 autocast, fp32 prompts) needs a GPU with bf16 and "fp16" (CoOp's half-precision
    model and prompts) a GPU; everything else runs "fp32". GPUs without bf16 run fp32 rather than
    autocast fp16, which would need loss scaling to keep the small prompt gradients from underflowing.
    """
    if device.type != "cuda":
        return "fp32"
    if precision == "amp" and not torch.cuda.is_bf16_supported():
        return "fp32"
    return precision


def autocast(device: torch.device, precision: str):
    """bf16 autocast where `precision` resolves to amp; no autocast otherwise (fp32 and fp16)."""
    if resolve_precision(precision, device) != "amp":
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)

"""Gaussian prompt aggregation (GPA): a Gaussian-weighted average of learned tensors over epochs.

PromptSRC (Khattak et al., ICCV 2023) keeps, besides the prompts it trains, a running sum of the
prompts after every epoch, each epoch weighted by a Gaussian in the epoch number:

    w_e = N(e; mu, sigma) / sum_{k=1..E} N(k; mu, sigma)        e = 1..E (1-based epochs)
    aggregate = sum_e w_e * tensors_after_epoch_e

After the last epoch the aggregate replaces the learned tensors.

    gpa = GaussianAggregate(gpa_weights(epochs=20, mean=15, std=1))
    gpa.add(epoch, method.learnable())        # after each epoch, 1-based
    gpa.state_dict() / gpa.load_state_dict()  # the running sum, for checkpoints

The sum is kept in each tensor's own dtype, as the official code does (it multiplies each tensor by
its epoch's float weight and adds). The running sum is plain tensors, so it goes into a checkpoint
and a resumed run continues it exactly.
"""

from __future__ import annotations

import math

import torch


def gpa_weights(epochs: int, mean: float, std: float) -> list[float]:
    """The normalised Gaussian weights w_1..w_E of epochs 1..E (float64, summing to 1).

    The density's constant 1/(std sqrt(2 pi)) cancels in the normalisation, and the exponents are
    shifted by their largest value before `exp`, so a mean far outside 1..E still gives finite
    weights (the official code's plain densities would underflow to 0/0 there).

    Args:
        epochs: E, the number of training epochs.
        mean: mu, the epoch (1-based, real-valued) with the largest weight.
        std: sigma > 0, the width in epochs.
    """
    if not std > 0:
        raise ValueError(f"the GPA standard deviation must be > 0, got {std!r}")
    exponents = [-0.5 * ((e - mean) / std) ** 2 for e in range(1, epochs + 1)]
    top = max(exponents, default=0.0)
    densities = [math.exp(x - top) for x in exponents]
    total = sum(densities)
    return [d / total for d in densities]


class GaussianAggregate:
    """The running sum `sum_{k<=e} w_k * tensors_k` of named tensors over epochs.

    Args:
        weights: w_1..w_E, e.g. from `gpa_weights`.
    """

    def __init__(self, weights: list[float]):
        self.weights = list(weights)
        self.sum: dict[str, torch.Tensor] = {}
        self.epoch = 0  # the last epoch added

    @property
    def epochs(self) -> int:
        return len(self.weights)

    def add(self, epoch: int, tensors: dict[str, torch.Tensor]) -> None:
        """Add `w_epoch * tensors` (the tensors after 1-based `epoch`) to the running sum."""
        if epoch != self.epoch + 1 or epoch > self.epochs:
            raise ValueError(f"GPA expects epoch {self.epoch + 1} of {self.epochs} next, got {epoch}")
        w = self.weights[epoch - 1]
        with torch.no_grad():
            for name, t in tensors.items():
                weighted = t.detach() * w
                self.sum[name] = weighted if name not in self.sum else self.sum[name] + weighted
        self.epoch = epoch

    @property
    def complete(self) -> bool:
        return self.epoch == self.epochs

    def state_dict(self) -> dict:
        """The running sum and the last epoch added (plain tensors and an int, `weights_only` safe)."""
        return {"epoch": self.epoch, "sum": {k: v.detach().cpu().clone() for k, v in self.sum.items()}}

    def load_state_dict(self, state: dict, device: torch.device | str = "cpu") -> None:
        self.epoch = int(state["epoch"])
        self.sum = {k: v.to(device) for k, v in state["sum"].items()}

"""ZERO (Farina et al., NeurIPS 2024, FarinaMatteo/zero): test-time augmentation at zero temperature.

No gradient, no state: for each test image, the host's logits of its V views; the `n_confident`
views of lowest entropy (`zero.gamma`, 0.3: 19 of 64) each vote for their argmax, and the class
with the most votes is the prediction:

    keep  = the int(V * gamma) views of lowest entropy H(softmax(logits_v))      (at least one)
    votes = sum_{v in keep} onehot(argmax logits_v)                              (n_cls,)

A tie between classes with the most votes is broken as ZERO's `greedy_break` does: the first of
the views left out (in order of entropy) whose argmax is one of the tied classes wins; if none
is, the tied class with the highest logit in the first view left out (the intent of its
`break_sample_tie`, module docs/test_time.md); with every view kept, in the most confident one.
The winner gets one vote more, as the original adds 1 to its count.

The output is log(votes / total votes): its softmax is the share of the voting views that chose
each class (ZERO returns the counts themselves, whose softmax would say nothing), its argmax the
original's prediction. A class without votes gets log of the smallest normal float instead of
-inf, so that entropy and cross-entropy of the outputs stay finite.
"""

from __future__ import annotations

import torch

from coop.tta.base import TestTimeMethod, check_fraction, confident_views, host_logits


class Zero(TestTimeMethod):
    name = "zero"
    kind = "episodic"
    augment = "crop_flip"  # ZERO's MultiViewCropAndFlip on every set

    def __init__(self, host, cfg):
        super().__init__(host, cfg)
        self.gamma = check_fraction("zero.gamma", cfg.zero.gamma)
        self._prepared = None  # the host's text features (and vision prompts): once for all images

    @torch.no_grad()
    def predict(self, views: torch.Tensor, index: int) -> torch.Tensor:
        if self._prepared is None:
            self._prepared = self.host.prepare()
        logits = host_logits(self.host, views, self._prepared).float()  # (V, n_cls)
        return vote(logits, self.gamma)

    def describe(self) -> dict:
        return {"zero_gamma": self.gamma}


def vote(logits: torch.Tensor, gamma: float) -> torch.Tensor:
    """ZERO's prediction from the views' logits (V, n_cls), as log vote shares (n_cls,)."""
    order = confident_views(logits, 1.0)  # every view, most confident first (stable)
    k = confident_views(logits, gamma).numel()
    votes = torch.bincount(logits[order[:k]].argmax(-1), minlength=logits.shape[-1]).float()
    tied = (votes == votes.max()).nonzero().flatten()
    if tied.numel() > 1:
        votes[break_tie(tied, logits[order[k:]] if k < len(order) else logits[order[:1]])] += 1
    return (votes / votes.sum()).clamp_min(torch.finfo(torch.float32).tiny).log()


def break_tie(tied: torch.Tensor, rest: torch.Tensor) -> int:
    """The first row of `rest` (V', n_cls) whose argmax is among `tied`, else the tied class with the
    highest logit in `rest`'s first row (the lower index on equal logits)."""
    for pred in rest.argmax(-1).tolist():
        if pred in tied.tolist():
            return pred
    return int(tied[rest[0, tied].argmax()])

"""Latent-domain prompts (after DiPrompT's outline): a global prompt G, K domain prompts, a query.

    method = LatentDomains(clip, classnames, cfg)      # K = cfg.fl.domains
    loss, logits = method.loss(image_features, labels)  # training (counts routing in .usage)
    logits = method.logits(image_features, method.prepare())

G and every D_k are CoOp prompts of the run's `prompt.*` settings (any position, csc, depth:
with depth > 1 each is a deep prompt). The query is one learnable vector q_k (E,) per domain.
With s = logit_scale.exp(), img = normalize(f) for an image feature f, and CE the cross-entropy:

    domain scores   a_k(f) = s * <img, normalize(q_k)>                               (K,)
    routing         k*(f)  = argmax_k a_k(f)          (no domain label is ever used)
    training loss   CE(logits_G, y) + CE(logits_{D_k*}, y) + CE(a(f), k^(f)),
                    k^(f)  = argmin_k CE(logits_{D_k}, y)   (no gradient through k^)
    inference       w * logits_G + (1 - w) * sum_k softmax(a(f))_k * logits_{D_k},  w = fl.ensemble_weight

So G learns from every sample, D_k only from the samples routed to it, and the query learns to
send each sample to the domain prompt that classifies it best. These rules are ours: DiPrompT's
exact formulas were not available. The server side (moving average of D_k with rate fl.beta over
the clients that used it) lives in `coop.federated.strategy`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.methods.base import Method, TransferError
from coop.methods.coop import build_learner
from coop.model.clip import CLIP, cosine_logits
from coop.model.prompt import PromptClassifier

_DOMAIN_KEY = re.compile(r"^domain(\d+)\.")


def domain_of_key(key: str) -> int | None:
    """The domain k of a learnable tensor named "domain<k>.<...>", None for shared tensors."""
    m = _DOMAIN_KEY.match(key)
    return int(m.group(1)) if m else None


class LatentDomains(Method):
    """G + D_1..D_K + per-domain queries; see the module docstring for the exact rules."""

    name = "latent_domains"
    config_key = "fl.method"
    trainer = "sgd"
    text_prompt = True  # `prompt.*`: prompt.depth within the text tower

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        k = int(cfg.fl.domains)
        if k < 1:
            raise ValueError(f"fl.domains must be >= 1, got {k}")
        self.ensemble_weight = float(cfg.fl.ensemble_weight)
        if not 0.0 <= self.ensemble_weight <= 1.0:
            raise ValueError(f"fl.ensemble_weight must be in [0, 1], got {self.ensemble_weight}")
        self.global_prompt = PromptClassifier(clip, build_learner(clip, cfg, classnames))
        self.domain_prompts = nn.ModuleList(
            PromptClassifier(clip, build_learner(clip, cfg, classnames)) for _ in range(k)
        )
        self.query = nn.Parameter(torch.empty(k, clip.embed_dim).normal_(std=0.02))  # (K, E)
        self.register_buffer("usage", torch.zeros(k, dtype=torch.long), persistent=False)

    @property
    def n_domains(self) -> int:
        return len(self.domain_prompts)

    def learnable(self) -> dict[str, torch.Tensor]:
        out = {f"global.{n}": p for n, p in self.global_prompt.prompt_learner.prompt_tensors().items()}
        for k, prompt in enumerate(self.domain_prompts):
            out.update({f"domain{k}.{n}": p for n, p in prompt.prompt_learner.prompt_tensors().items()})
        out["query"] = self.query
        return out

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        if self.global_prompt.prompt_learner.csc and list(classnames) != self.classnames:
            raise TransferError(
                "class-specific context (prompt.csc=true) cannot be transferred to other classes"
            )
        super().load_learnable(tensors, classnames)

    def reset_usage(self) -> None:
        self.usage.zero_()

    def domain_scores(self, image_features: torch.Tensor) -> torch.Tensor:
        """a_k(f): (B, K) scaled cosine similarities of the image features with the queries."""
        return cosine_logits(image_features, self.query, self.clip.logit_scale)

    def _all_logits(self, image_features, prepared=None):
        """logits_G (B, C), logits_D (B, K, C) and domain scores (B, K)."""
        if prepared is None:
            prepared = self.prepare()
        text_g, text_d = prepared
        logits_g = cosine_logits(image_features, text_g, self.clip.logit_scale)  # (B, C)
        logits_d = torch.stack(
            [cosine_logits(image_features, t, self.clip.logit_scale) for t in text_d], dim=1
        )  # (B, K, C)
        return logits_g, logits_d, self.domain_scores(image_features)

    def prepare(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Text features of G (C, E) and of each D_k (K x (C, E))."""
        return self.global_prompt.text_features(), [p.text_features() for p in self.domain_prompts]

    def _ensemble(self, logits_g, logits_d, scores) -> torch.Tensor:
        weights = scores.softmax(dim=-1).unsqueeze(-1)  # (B, K, 1)
        w = self.ensemble_weight
        return w * logits_g + (1 - w) * (weights * logits_d).sum(dim=1)  # (B, C)

    def logits(self, image_features: torch.Tensor, prepared=None) -> torch.Tensor:
        return self._ensemble(*self._all_logits(image_features, prepared))

    def loss(self, image_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_g, logits_d, scores = self._all_logits(image_features)
        rows = torch.arange(len(labels), device=labels.device)
        routed = scores.argmax(dim=-1).detach()  # k*(f), (B,)
        with torch.no_grad():
            per_domain = F.cross_entropy(
                logits_d.float().transpose(1, 2),
                labels.unsqueeze(1).expand(-1, self.n_domains),
                reduction="none",
            )  # (B, K)
            best = per_domain.argmin(dim=-1)  # k^(f)
        loss = (
            F.cross_entropy(logits_g.float(), labels)
            + F.cross_entropy(logits_d[rows, routed].float(), labels)
            + F.cross_entropy(scores.float(), best)
        )
        if self.training:
            self.usage += torch.bincount(routed, minlength=self.n_domains).to(self.usage.device)
        return loss, self._ensemble(logits_g, logits_d, scores).detach()

    def describe(self) -> dict:
        pl = self.global_prompt.prompt_learner
        return {
            "n_ctx": pl.n_ctx,
            "position": pl.position,
            "csc": pl.csc,
            "depth": pl.depth,
            "domains": self.n_domains,
            "ensemble_weight": self.ensemble_weight,
        }

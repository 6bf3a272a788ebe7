"""FedPGP (Cui et al., ICML'24): a global prompt plus a low-rank personal part, pulled towards the
hand-crafted prompt by a contrastive term (the `FedPGP` trainer of TianyuCuiOvO/FedPGP).

    method = FedPGP(clip, classnames, cfg)        # fl.method=fedpgp; cfg.fedpgp.{rank, mu, temp}
    loss, logits = method.loss(image_features, labels)

Learned: `sigma` (M, W), global (sent and averaged), and `U` (M, r), `V` (r, W), the client's own
(`personal_keys`), r = fedpgp.rank; all N(0, 0.02). The personal context is sigma + U V. With
s = logit_scale.exp(), img = normalize(f) for a pooled image feature f (cacheable), and t(c) the
normalised text features of the prompts with context c:

    t      = t(sigma + U V)                            the personal prompt         (C, E)
    t_sig  = t(sigma)                                  the global prompt alone     (C, E)
    t_0    = normalize(text("X X ... X {class}."))     frozen, computed once       (C, E)
    loss   = CE(s * img @ t.T, y)
             + mu * CE([cos(t_0, t_sig), cos(t_sig, t)] / temp, target 0)   (mean over the C classes)

mu = fedpgp.mu (0.5), temp = fedpgp.temp (0.5). At inference the logits are s * img @ t.T. The
original also encodes t(U V) every step and never uses it; we skip it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.methods.base import Method
from coop.methods.coop import build_learner
from coop.model.clip import CLIP, cosine_logits
from coop.model.prompt import PromptClassifier


class FedPGP(Method):
    """sigma + U V prompts with the contrastive pull of sigma towards the hand-crafted prompt.

    Args:
        clip, classnames: the model and the classes to score.
        cfg: `prompt.*` (n_ctx, position; shared context, depth 1) and `fedpgp.*` (rank, mu, temp).
    """

    name = "fedpgp"
    config_key = "fl.method"
    trainer = "sgd"
    text_prompt = True  # `prompt.*`: prompt.depth within the text tower
    personal_keys = ("U", "V")

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.classifier = PromptClassifier(clip, build_learner(clip, cfg, classnames))  # its ctx is sigma
        m, width = self.sigma.shape
        rank = int(cfg.fedpgp.rank)
        self.U = nn.Parameter(torch.empty(m, rank).normal_(std=0.02))  # (M, r)
        self.V = nn.Parameter(torch.empty(rank, width).normal_(std=0.02))  # (r, W)
        self.mu, self.temp = float(cfg.fedpgp.mu), float(cfg.fedpgp.temp)
        self.global_only = False  # True: sigma alone, FLiP's "global" model
        placeholder = " ".join(["X"] * m)
        with torch.no_grad():
            ids = clip.tokenize([f"{placeholder} {name.replace('_', ' ')}." for name in classnames])
            self.register_buffer("t0", F.normalize(clip.encode_text(ids).float(), dim=-1))  # (C, E)

    @property
    def sigma(self) -> torch.Tensor:
        return self.classifier.prompt_learner.ctx

    def learnable(self) -> dict[str, torch.Tensor]:
        return {"sigma": self.sigma, "U": self.U, "V": self.V}

    def context(self) -> torch.Tensor:
        """sigma + U V (M, W), or sigma alone with `global_only`."""
        return self.sigma if self.global_only else self.sigma + self.U @ self.V

    def prepare(self) -> torch.Tensor:
        return self.classifier.text_features(self.context())  # (C, E)

    def logits(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> torch.Tensor:
        return cosine_logits(
            image_features, self.prepare() if prepared is None else prepared, self.clip.logit_scale
        )

    def contrastive(self, text: torch.Tensor, text_sigma: torch.Tensor) -> torch.Tensor:
        """CE([cos(t_0, t_sig), cos(t_sig, t)] / temp, 0), averaged over the classes."""
        t, ts = F.normalize(text.float(), dim=-1), F.normalize(text_sigma.float(), dim=-1)
        pair = torch.stack([(self.t0 * ts).sum(-1), (ts * t).sum(-1)], dim=1) / self.temp  # (C, 2)
        return F.cross_entropy(pair, torch.zeros(len(pair), dtype=torch.long, device=pair.device))

    def loss(self, image_features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.classifier.text_features(self.context())  # (C, E)
        logits = self.logits(image_features, text)
        ce = F.cross_entropy(logits.float(), labels)
        return ce + self.mu * self.contrastive(text, self.classifier.text_features()), logits

    def describe(self) -> dict:
        pl = self.classifier.prompt_learner
        return {
            "n_ctx": pl.n_ctx,
            "position": pl.position,
            "csc": False,
            "depth": 1,
            "fedpgp_rank": self.U.shape[1],
        }

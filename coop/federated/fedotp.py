"""FedOTP (Li et al., CVPR'24): a global and a local prompt per client, matched to patch features
by unbalanced optimal transport (the `GLP_OT` trainer of HongxiaLee/FedOTP).

    method = FedOTP(clip, classnames, cfg)         # fl.method=fedotp; cfg.fedotp.* below
    logits = method.logits(tokens, method.prepare())   # tokens (B, N+P, E): CLIP.encode_image(tokens=True)

Learned: `global.ctx` and `local.ctx`, each (M, W), N(0, 0.02) and the same start on every client
(the original's `ctx` (N = 2, M, W), row 0 global, row 1 local). `global.ctx` is sent and averaged
by the server; `local.ctx` stays the client's (`personal_keys`). With s = logit_scale.exp():

    patches  f_bm = normalize(tokens[:, N:])          (B, M, E)   the N prefix tokens ([CLS],
                                                                  registers; none on SigLIP)
                                                                  dropped, M = P patches
    prompts  t_nc = normalize(text(ctx_n, class c))   (N, C, E)   N = 2 prompts per class
    sim      S_bc[m, n] = <f_bm, t_nc>;  cost 1 - S;  kernel K = exp(-(1 - S) / eps)  (no gradient)
    plan     T_bc = ot(K_bc, a = 1/M (patches), b = gamma/N (prompts))           (no gradient)
    logits   s * sum_{m,n} T_bc[m, n] S_bc[m, n];  loss CE over all C classes

`ot` is the original's `entropic_COT_fast` (fedotp.ot=cot, unbalanced: the patch marginal is
relaxed to <= 1/M, the prompt marginal gamma/N is exact) or its `Sinkhorn` (fedotp.ot=sinkhorn,
both marginals exact, b = 1/N). Both run at most fedotp.max_iter iterations and stop when the
mean |change| of the scaling vector over the **whole batch** (every image and class) falls below
fedotp.thresh, as the original does. The OT always runs in fp32: under fp16, eps = 0.01 makes K
underflow to 0 (exp(-100)) and the original's few-shot script gives NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from coop.methods.base import Method
from coop.methods.coop import build_learner
from coop.model.clip import CLIP
from coop.model.prompt import PromptClassifier


def unbalanced_ot(
    K: torch.Tensor, a: torch.Tensor, b: torch.Tensor, max_iter: int = 100, thresh: float = 1e-3
) -> tuple[torch.Tensor, int]:
    """The original's `entropic_COT_fast`: (plan T (P, M, N), iterations run).

    With Kp = diag(1/a) K and Kq = diag(1/b) K^T, from u = 1, v = 1 it repeats
    u = min(1 / (Kp v), 1),  v = 1 / (Kq u)  until mean |v - v_prev| < thresh (over every
    problem of the batch) or max_iter iterations; T = diag(u) K diag(v). Its column sums equal b
    (v is updated last); at a fixed point its row sums are min(a, a (K v)) <= a, the relaxed side.

    Args:
        K: (P, M, N) kernels of P problems.
        a: (P, M) patch marginals (1/M), relaxed.
        b: (P, N) prompt marginals (gamma/N), exact.
    """
    kp = K / a.unsqueeze(-1)  # diag(1/a) K  (P, M, N)
    kq = K.transpose(1, 2) / b.unsqueeze(-1)  # diag(1/b) K^T  (P, N, M)
    ones = torch.ones_like(a)
    u, v = ones, torch.ones_like(b)
    it = 0
    while it < max_iter:
        v_prev = v
        u = torch.minimum(1.0 / (kp @ v.unsqueeze(-1)).squeeze(-1), ones)  # (P, M)
        v = 1.0 / (kq @ u.unsqueeze(-1)).squeeze(-1)  # (P, N)
        it += 1
        if (v - v_prev).abs().mean().item() < thresh:
            break
    return u.unsqueeze(-1) * K * v.unsqueeze(-2), it


def sinkhorn(
    K: torch.Tensor, a: torch.Tensor, b: torch.Tensor, max_iter: int = 100, thresh: float = 1e-3
) -> tuple[torch.Tensor, int]:
    """The original's balanced `Sinkhorn`: r = a / (K c), c = b / (K^T r) from r = c = 1, until
    mean |r - r_prev| < thresh (whole batch) or max_iter; T = diag(r) K diag(c). Returns (T, iterations)."""
    r, c = torch.ones_like(a), torch.ones_like(b)
    it = 0
    while it < max_iter:
        r_prev = r
        r = a / (K @ c.unsqueeze(-1)).squeeze(-1)  # (P, M)
        c = b / (K.transpose(1, 2) @ r.unsqueeze(-1)).squeeze(-1)  # (P, N)
        it += 1
        if (r - r_prev).abs().mean().item() < thresh:
            break
    return r.unsqueeze(-1) * K * c.unsqueeze(-2), it


SOLVERS = {"cot": unbalanced_ot, "sinkhorn": sinkhorn}


class FedOTP(Method):
    """Global + local prompt per class, OT-matched to patch tokens (module docstring).

    Args:
        clip, classnames: the model (a ViT image tower: patch tokens) and the classes to score.
        cfg: `prompt.*` (n_ctx, position; shared context, depth 1) and `fedotp.*` (eps, gamma,
            ot, max_iter, thresh).
    """

    name = "fedotp"
    config_key = "fl.method"
    trainer = "sgd"
    text_prompt = True  # `prompt.*`: prompt.depth within the text tower
    image_tokens = True  # the features are every projected token (CLIP.encode_image(tokens=True))
    token_features = True  # ... after the final norm: our tower's, and not an attention pool's (CoCa)
    personal_keys = ("local.ctx",)

    @classmethod
    def image_tower_use(cls, cfg: DictConfig) -> str | None:
        return "matches prompts to the image tower's patch tokens"

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)  # ModelError: a tower without tokens or their features
        self.n_prefix = int(clip.visual.n_prefix)  # tokens before the patches
        self.global_prompt = PromptClassifier(clip, build_learner(clip, cfg, classnames))
        self.local_prompt = PromptClassifier(clip, build_learner(clip, cfg, classnames))
        o = cfg.fedotp
        self.eps, self.gamma = float(o.eps), float(o.gamma)
        self.ot, self.max_iter, self.thresh = str(o.ot), int(o.max_iter), float(o.thresh)
        self.global_only = False  # True: the global prompt alone (N = 1), FLiP's "global" model
        self.last_iterations = 0

    def learnable(self) -> dict[str, torch.Tensor]:
        return {
            "global.ctx": self.global_prompt.prompt_learner.ctx,
            "local.ctx": self.local_prompt.prompt_learner.ctx,
        }

    def prepare(self) -> torch.Tensor:
        """Text features (N, C, E) of the N prompts of every class (N = 1 with `global_only`)."""
        prompts = [self.global_prompt] if self.global_only else [self.global_prompt, self.local_prompt]
        return torch.stack([p.text_features() for p in prompts])  # (N, C, E)

    def logits(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, C) from token features (B, N+P, E), N = the tower's prefix tokens."""
        text = self.prepare() if prepared is None else prepared
        with torch.autocast(image_features.device.type, enabled=False):
            patches = F.normalize(image_features[:, self.n_prefix :].float(), dim=-1)  # (B, M, E)
            txt = F.normalize(text.float(), dim=-1)  # (N, C, E)
            sim = torch.einsum("bme,nce->bcmn", patches, txt)  # (B, C, M, N)
            b, c, m, n = sim.shape
            with torch.no_grad():
                kernel = torch.exp(-(1.0 - sim) / self.eps).reshape(b * c, m, n)  # (B*C, M, N)
                a = kernel.new_full((b * c, m), 1.0 / m)
                mass = self.gamma if self.ot == "cot" else 1.0
                q = kernel.new_full((b * c, n), mass / n)
                plan, self.last_iterations = SOLVERS[self.ot](kernel, a, q, self.max_iter, self.thresh)
            score = (plan.reshape(b, c, m, n) * sim).sum(dim=(-2, -1))  # (B, C)
            return self.clip.logit_scale.float().exp() * score

    def describe(self) -> dict:
        pl = self.global_prompt.prompt_learner
        return {"n_ctx": pl.n_ctx, "position": pl.position, "csc": False, "depth": 1, "fedotp_ot": self.ot}

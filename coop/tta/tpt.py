"""TPT and C-TPT: a host's prompt tuned on each test image by one AdamW step, then reset.

As TPT's code computes it (azshue/TPT, `tpt_classification.py`), for test image i with views
x_0..x_{V-1} (x_0 the image itself) and prompt tensors theta:

    logits_v = s * norm(f(x_v)) @ norm(t(theta))^T          (V, C); s = logit_scale.exp()
    keep     = the int(V * tpt.selection) views of lowest entropy (at least one: `n_confident`)
    log p    = logsumexp_{v in keep} log_softmax(logits_v) - log |keep|   (the averaged probability)
    loss     = -sum_c p_c log p_c                            (TPT's `avg_entropy`)
             - lambda * mean_c || n_c - mean_c' n_c' ||       (C-TPT's ATFD, n = norm(t(theta)))
    theta_1  = theta_0 after `tpt.steps` AdamW steps (lr 5e-3, weight decay 0.01), the optimizer's
               state reset first: each image gets a first Adam step, ~ lr * sign(gradient)
    output   = s * norm(f(x_0)) @ norm(t(theta_1))^T         theta_0 again for the next image

The selection is made once, on the first step's logits, as TPT's `selected_idx`.

Hosts (`check_host`) and what is tuned:

    zeroshot        TPT's own prompt: the learnable context `tpt.ctx_init` ("a photo of a") then
                    "{class}." (TPT's `--ctx_init a_photo_of_a`); the host's templates do not apply
    coop, kgcoop    the host's prompt tensors: `ctx` (shared or class-specific, any class
                    position) and `deep_ctx`
    cocoop          the generated context ctx + meta_net(norm(f(x_0))), as TPT's `--cocoop`
                    (`gen_ctx` from the image itself); deep prompts stay as trained
    maple           every tensor MaPLe learns (`ctx`, `deep_ctx` and the couplings to the image
                    tower), as PromptAlign's TPT-on-MaPLe baseline: the image tower is re-run

The fast path. Every image's first step starts from the same theta_0 (all hosts but CoCoOp), so
the text forward at theta_0, with the graph it saves, is computed once (`start`): per image only
the backward of the image's own gradient dloss/dt through that graph
(`torch.autograd.grad(..., grad_outputs, retain_graph=True)`) and the forward at theta_1 remain,
both through the exact fast text pass (cut after [EOS], shared prefix, packed). The reference,
as TPT's code, runs forward, backward and forward over 77 tokens x all classes per image
(`coop.reference.tpt`). docs/test_time.md states the bound and the measured ratio.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.func import functional_call

from coop.methods.base import Method
from coop.model.clip import cosine_logits
from coop.model.prompt import PromptClassifier, PromptLearner
from coop.tta.base import TestTimeError, TestTimeMethod, check_fraction, confident_views, host_features

HOSTS = ("zeroshot", "coop", "kgcoop", "cocoop", "maple")
# C-TPT's scripts: lambda 20 for the natural distribution shifts (test_tpt_ctpt_ds.sh), 50 for
# ImageNet and the fine-grained sets (test_tpt_ctpt_fg.sh)
CTPT_SHIFT_LAMBDA, CTPT_LAMBDA = 20.0, 50.0
SHIFT_SETS = ("imagenet_a", "imagenet_r", "imagenetv2", "imagenet_sketch")


def average_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the averaged probability of the rows of `logits` (K, C), as TPT's `avg_entropy`:
    log-probabilities averaged in probability space by logsumexp, clamped at the dtype's minimum."""
    logp = logits - logits.logsumexp(dim=-1, keepdim=True)  # (K, C)
    avg = logp.logsumexp(dim=0) - math.log(logp.shape[0])  # (C,) log of the mean probability
    avg = avg.clamp(min=torch.finfo(avg.dtype).min)
    return -(avg * avg.exp()).sum(dim=-1)


def text_dispersion(text: torch.Tensor) -> torch.Tensor:
    """C-TPT's average text feature dispersion: mean_c ||n_c - mean(n)|| of the normalised (C, E)."""
    n = F.normalize(text.float(), dim=-1)
    return (n - n.mean(0)).norm(dim=-1).mean()


def ctpt_lambda(cfg: DictConfig) -> float:
    """`ctpt.lambda_term`, or C-TPT's scripts' value for `data.name` when it is null."""
    value = OmegaConf.select(cfg, "ctpt.lambda_term", default=None)
    if value is not None:
        return float(value)
    return CTPT_SHIFT_LAMBDA if OmegaConf.select(cfg, "data.name") in SHIFT_SETS else CTPT_LAMBDA


class _Calls(nn.Module):
    """The host's pieces as one module, so that `functional_call` can run them with the tuned
    tensors in place of the host's own: "text" -> unnormalised text features (n_cls, E),
    "image" -> unnormalised image features (V, E) of views (a pixel host's prompted tower)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, what: str, views: torch.Tensor | None = None) -> torch.Tensor:
        if what == "text":
            return self.inner.text_features()
        return self.inner.image_features(views)


class TPT(TestTimeMethod):
    """Test-time prompt tuning (Shu et al., NeurIPS 2022): episodic, one host prompt per image.

    Args:
        host: a zeroshot, coop, kgcoop, cocoop or maple `Method` (`check_host`).
        cfg: reads `tpt.lr`, `tpt.steps`, `tpt.selection`, `tpt.weight_decay`, `tpt.ctx_init`,
            `tpt.grad_checkpointing` (and C-TPT's `ctpt.lambda_term`).
    """

    name = "tpt"
    kind = "episodic"

    @classmethod
    def check_host(cls, host: Method) -> None:
        if getattr(host, "name", None) not in HOSTS:
            raise TestTimeError(
                f"tta.method={cls.name} tunes a host's text prompt; method={getattr(host, 'name', host)} has "
                f"none it can tune (hosts: {', '.join(HOSTS)})"
            )

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__(host, cfg)
        t = cfg.tpt
        self.lr, self.steps = float(t.lr), int(t.steps)
        self.weight_decay = float(t.weight_decay)
        self.selection = check_fraction("tpt.selection", t.selection)
        if self.steps < 1 or not self.lr > 0 or self.weight_decay < 0:
            raise TestTimeError(
                f"tpt.steps={self.steps} must be >= 1, tpt.lr={self.lr} > 0, tpt.weight_decay >= 0"
            )
        self.grad_checkpointing = bool(t.grad_checkpointing)
        self.weight = 0.0  # C-TPT's lambda
        clip = host.clip
        if host.name == "zeroshot":  # TPT's own prompt: "a photo of a" learnable, then "{class}."
            learner = PromptLearner(clip, host.classnames, ctx_init=str(t.ctx_init)).to(
                clip.logit_scale.device
            )
            inner = PromptClassifier(clip, learner)
        elif host.name == "cocoop":
            inner = PromptClassifier(clip, host.prompt_learner)  # the generated context goes in `ctx`
        elif host.name == "maple":
            inner = host
        else:
            inner = host.classifier
        self.calls = _Calls(inner)
        if host.name in ("zeroshot", "cocoop"):
            own = {id(inner.prompt_learner.ctx)}
        else:  # every tensor the host learned
            own = {id(p) for p in host.learnable().values()}
        # the tuned tensors by their names in `calls`, and their starting values
        self._tensors = {n: p for n, p in self.calls.named_parameters() if id(p) in own}
        self.tuned = list(self._tensors)
        self.pixels = host.input == "pixels"  # the image tower takes the prompt (MaPLe): re-run
        self.shared = host.name != "cocoop"  # every image starts from the same prompt
        self._start = None  # (leaves, text features with their graph) at theta_0, built once

    def describe(self) -> dict:
        return {"lr": self.lr, "steps": self.steps, "selection": self.selection, "tuned": list(self.tuned)}

    # -- one image ------------------------------------------------------------------------------

    def predict(self, views: torch.Tensor, index: int) -> torch.Tensor:
        # the step needs autograd: also under a caller's no_grad or inference_mode
        with torch.inference_mode(False):
            views = views.clone() if views.is_inference() else views
            logits, _ = self.adapt(views)
        return logits

    def adapt(self, views: torch.Tensor, features: torch.Tensor | None = None):
        """(logits (n_cls,) of views[0] at the tuned prompt, the tuned tensors by name) for one
        image's views (V, 3, H, W); `features` (V, E) instead of the views' image features for a
        host that reads features (the benchmark's way to leave the frozen image tower out)."""
        if features is None and not self.pixels:
            with torch.no_grad():
                features = host_features(self.host, views)
        theta = {k: v.detach().clone().requires_grad_(True) for k, v in self.starting(features).items()}
        optimizer = torch.optim.AdamW(list(theta.values()), lr=self.lr, weight_decay=self.weight_decay)
        keep = None
        for step in range(self.steps):
            grads, keep = self._gradient(theta, views, features, keep, first=step == 0)
            for p, g in zip(theta.values(), grads, strict=True):
                p.grad = g
            optimizer.step()
        theta = {k: v.detach() for k, v in theta.items()}
        with torch.no_grad():
            text = self.run(theta, "text")
            image = self.run(theta, "image", views[:1]) if self.pixels else features[:1]
            return cosine_logits(image, text, self.host.clip.logit_scale)[0], theta

    def run(
        self, theta: dict[str, torch.Tensor], what: str, views: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The host's unnormalised text features ("text") or image features of `views` ("image")
        with the tensors `theta` in place of the host's own (none of them tied to another)."""
        return functional_call(self.calls, theta, (what, views), tie_weights=False)

    def starting(self, features: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """theta_0 by name: the host's prompt, or for CoCoOp ctx + meta_net(norm(f(x_0)))."""
        theta = self._tensors
        if not self.shared:
            meta = self.host.meta_net
            with torch.no_grad():
                shift = meta(F.normalize(features[:1], dim=-1).to(meta.linear1.weight.dtype))[0]  # (W,)
                theta = {k: v + shift for k, v in theta.items()}
        return theta

    def _gradient(self, theta, views, features, keep, first: bool):
        """The loss's gradient for every tensor of `theta` (and the selection, made on the first
        step). The first step of a shared start backpropagates through the saved graph at theta_0."""
        if first and self.shared:
            leaves, text = self._shared_start()
        else:
            leaves = list(theta.values())
            with torch.enable_grad(), self._checkpointing():
                text = self.run(theta, "text")
        with torch.enable_grad():
            t = text.detach().requires_grad_(True)  # dloss/dt first, then one backward through the text
            image = self.run(theta, "image", views) if self.pixels else features
            logits = cosine_logits(image, t, self.host.clip.logit_scale)  # (V, n_cls) fp32
            if keep is None:
                keep = confident_views(logits.detach(), self.selection)
            loss = average_entropy(logits[keep])
            if self.weight:
                loss = loss - self.weight * text_dispersion(t)
            direct = list(theta.values()) if self.pixels else []  # the prompted image tower's share
            g_text, *g_direct = torch.autograd.grad(loss, [t, *direct], allow_unused=True)
            grads = torch.autograd.grad(
                text, leaves, grad_outputs=g_text.to(text.dtype), retain_graph=first and self.shared,
                allow_unused=True,
            )  # fmt: skip
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(theta.values(), grads, strict=True)]
        for i, g in enumerate(g_direct):
            if g is not None:
                grads[i] = grads[i] + g
        return grads, keep

    def _shared_start(self):
        """(leaves, text features) at theta_0 with the forward's graph kept for every image's
        backward; built at the first image, under its precision."""
        if self._start is None:
            leaves = [v.detach().clone().requires_grad_(True) for v in self.starting(None).values()]
            with torch.enable_grad(), self._checkpointing():
                text = self.run(dict(zip(self.tuned, leaves, strict=True)), "text")
            self._start = (leaves, text)
        return self._start

    @contextmanager
    def _checkpointing(self):
        """`tpt.grad_checkpointing`: the text tower's blocks recomputed in each backward."""
        text = self.host.clip.text
        before = text.grad_checkpointing
        text.grad_checkpointing = before or self.grad_checkpointing
        try:
            yield
        finally:
            text.grad_checkpointing = before


class CTPT(TPT):
    """C-TPT (Yoon et al., ICLR 2024): TPT's loss minus lambda times the text features' dispersion
    (`text_dispersion`), lambda from `ctpt.lambda_term` or C-TPT's scripts (`ctpt_lambda`)."""

    name = "ctpt"

    def __init__(self, host: Method, cfg: DictConfig):
        super().__init__(host, cfg)
        self.weight = ctpt_lambda(cfg)
        if not self.weight >= 0:
            raise TestTimeError(f"ctpt.lambda_term={self.weight} must be >= 0")

    def describe(self) -> dict:
        return {**super().describe(), "lambda": self.weight}

"""CoOp: learnable context vectors in the prompt, cosine-similarity classifier (the default method)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from coop.methods.base import Method, Towers, TransferError
from coop.model.clip import CLIP
from coop.model.prompt import N_CTX_DEFAULT, PromptClassifier, PromptLearner


def build_learner(
    clip: CLIP, cfg: DictConfig, classnames: list[str], phrase_max_ctx: int | None = None
) -> PromptLearner:
    """The PromptLearner described by the `prompt.*` keys of a run config.

    Args:
        clip, cfg, classnames: the model, the run config and the classes to prompt.
        phrase_max_ctx: `PromptLearner`'s rule for `ctx_init` (4 for IVLP and MaPLe; None: always).
    """
    p = cfg.prompt
    return PromptLearner(
        clip,
        classnames,
        n_ctx=N_CTX_DEFAULT if p.n_ctx is None else int(p.n_ctx),
        ctx_init=p.ctx_init,
        position=p.position,
        csc=bool(p.csc),
        depth=int(p.depth),
        phrase_max_ctx=phrase_max_ctx,
    )


def require_transferable(csc: bool, trained: list[str], target: list[str]) -> None:
    """TransferError unless prompts learned for `trained` can score `target`: only shared context
    transfers to other classes; class-specific context (csc) belongs to its own classes."""
    if csc and list(trained) != list(target):
        raise TransferError(
            "class-specific context (prompt.csc=true) cannot be transferred to other classes; "
            "only shared context transfers"
        )


class CoOp(Method):
    """`logit_scale.exp() * norm(img) @ norm(text_features(prompts)).T`; only the prompts train."""

    name = "coop"
    trainer = "sgd"
    text_prompt = True

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.classifier = PromptClassifier(clip, build_learner(clip, cfg, classnames))

    @property
    def prompt_learner(self) -> PromptLearner:
        return self.classifier.prompt_learner

    def learnable(self) -> dict[str, torch.Tensor]:
        return self.prompt_learner.prompt_tensors()

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        require_transferable(self.prompt_learner.csc, classnames, self.classnames)
        super().load_learnable(tensors, classnames)

    def prepare(self) -> torch.Tensor:
        return self.classifier.text_features()  # (n_cls, E)

    def logits(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> torch.Tensor:
        return self.classifier.logits(image_features, prepared)

    def towers(self, image_features: torch.Tensor, prepared: torch.Tensor | None = None) -> Towers:
        text = self.classifier.text_features() if prepared is None else prepared  # (n_cls, E)
        return Towers(self.classifier.logits(image_features, text), text, image_features)

    def describe(self) -> dict:
        pl = self.prompt_learner
        return {"n_ctx": pl.n_ctx, "position": pl.position, "csc": pl.csc, "depth": pl.depth}

"""MMRL: shared representation tokens in the upper blocks of both towers (Guo & Gu, CVPR 2025).

As in yunncheng/MMRL (`trainers/mmrl.py`, `clip/model_mmrl.py`), with d_r = `mmrl.rep_dim` and
K = `mmrl.n_tokens`:

    R                  (K, d_r) representation tokens, N(0, 0.02)
    r_t^l = T_l(R)     (K, W_t) for each text block l in `mmrl.layers`       (Linear d_r -> W_t)
    r_v^l = V_l(R)     (K, W_v) for each image block l in `mmrl.vision_layers` (Linear d_r -> W_v)
    text  = the dataset's hand-crafted prompt (CoOp's template), r_t inserted after [SOS] (at
            position 0, before the first text token, for a tokenizer without [SOS]: SigLIP's,
            MetaCLIP 2's) at the first listed block and replaced at the later ones
            (`coop.model.inserted`); the pooled token stays the same token           (n_cls, E)
    image = r_v inserted after the prefix tokens ([CLS]; first on a tower without one, SigLIP's)
            the same way; f_cls = the tower's own pooled feature of its own tokens (CLIP's ViT:
            ln_post(x[:, 0]) @ proj, frozen), f_rep = mean_k of the K tokens after the final
            norm(s) @ proj_rep (docs/image_tower.md, "Towers other than CLIP's ViT")   (B, E) each
    logits = s * norm(f_cls) @ norm(text).T,  logits_rep = s * norm(f_rep) @ norm(text).T
    fusion = alpha * logits + (1 - alpha) * logits_rep

    loss = alpha * CE(logits) + (1 - alpha) * CE(logits_rep)
         + lambda * (1 - mean_b cos(f_cls, f_cls^zs)) + lambda * (1 - mean_c cos(text, t_zs))

f_cls^zs is the frozen tower on the same augmented batch (its blocks before the insertion are the
student's, computed once); t_zs the frozen text features of the same template, once per run, in
the tower's precision (fp32 under fp32 and amp, half under `train.precision=fp16`: the original's
zero-shot CLIP is cast to fp32 for PREC fp32/amp and stays half under fp16).
s = exp(logit_scale) (the original writes 100, its value on OpenAI's weights). At evaluation the
method scores with `fusion` on the classes it was trained on (`on_training_classes`: the base
classes, the training dataset, a subset of its classes) and with `logits` on others (new classes,
another dataset). Layers are 1-based block numbers, as in the original's REP_LAYERS; each list
null means blocks L/2..L of its own tower (6..12 of 12). T_l start as copies of one initialised
Linear, and so do V_l (the original's clones); proj_rep (W_v, E) is W_v^-0.5 * randn.

Learned tensors (checkpoint names -> the original's `state_dict` names): `rep_tokens` ->
`representation_learner.compound_rep_tokens`, `rep_to_text.{j}.*` ->
`representation_learner.compound_rep_tokens_r2tproj.{j}.*`, `rep_to_vision.{j}.*` ->
`representation_learner.compound_rep_tokens_r2vproj.{j}.*`, `proj_rep` -> `image_encoder.proj_rep`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from coop.config.checks import ConfigError
from coop.methods.base import TowerLayers
from coop.methods.promptsrc import frozen_text_features
from coop.methods.vpt import VisionPromptMethod
from coop.methods.zeroshot import resolve_templates
from coop.model.clip import CLIP
from coop.model.inserted import InsertedTokens
from coop.model.tokenizer import prompt_tokenizer


def block_indices(layers, n_blocks: int, key: str) -> list[int]:
    """0-based block indices of a 1-based `layers` list; null: blocks L/2..L (the original's 6..12
    of 12). A ConfigError names `key` if a block is beyond the tower's `n_blocks`."""
    if layers is None:
        return list(range(max(n_blocks // 2 - 1, 0), n_blocks))
    layers = [int(x) for x in layers]
    if layers[-1] > n_blocks:
        raise ConfigError(f"{key}={layers} names block {layers[-1]}, and the tower has {n_blocks} blocks")
    return [x - 1 for x in layers]


class RepresentationLearner(nn.Module):
    """R (K, d_r) and one Linear per listed block of each tower, each tower's Linears copies of one.

    Args:
        n_tokens, rep_dim: K and d_r.
        text_width, vision_width: W_t and W_v.
        text_blocks, vision_blocks: how many blocks of each tower take the tokens.
    """

    def __init__(
        self,
        n_tokens: int,
        rep_dim: int,
        text_width: int,
        vision_width: int,
        text_blocks: int,
        vision_blocks: int,
    ):
        super().__init__()
        self.tokens = nn.Parameter(torch.empty(n_tokens, rep_dim).normal_(std=0.02))
        to_vision, to_text = nn.Linear(rep_dim, vision_width), nn.Linear(rep_dim, text_width)
        self.to_text = nn.ModuleList(copy.deepcopy(to_text) for _ in range(text_blocks))
        self.to_vision = nn.ModuleList(copy.deepcopy(to_vision) for _ in range(vision_blocks))

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tokens of every listed text block (K, W_t) and image block (K, W_v)."""
        return [f(self.tokens) for f in self.to_text], [f(self.tokens) for f in self.to_vision]


def mmrl_loss(
    logits: torch.Tensor,
    logits_rep: torch.Tensor,
    labels: torch.Tensor,
    image: torch.Tensor,
    image_zs: torch.Tensor,
    text: torch.Tensor,
    text_zs: torch.Tensor,
    alpha: float,
    reg_weight: float,
) -> torch.Tensor:
    """MMRL's loss in fp32 (the original's MMRL_Loss).

    Args:
        logits, logits_rep: (B, n_cls) class-token and representation-token logits.
        labels: (B,).
        image, image_zs: (B, E) f_cls and the frozen tower's features of the same images.
        text, text_zs: (n_cls, E) the text features with tokens and the frozen ones.
        alpha, reg_weight: the CE weights alpha / 1 - alpha and lambda.
    """
    with torch.autocast(logits.device.type, enabled=False):
        ce = alpha * F.cross_entropy(logits.float(), labels) + (1 - alpha) * F.cross_entropy(
            logits_rep.float(), labels
        )
        image_reg = 1 - F.cosine_similarity(image.float(), image_zs.float(), dim=1).mean()
        text_reg = 1 - F.cosine_similarity(text.float(), text_zs.float(), dim=1).mean()
        return ce + reg_weight * image_reg + reg_weight * text_reg


class MMRL(VisionPromptMethod):
    """Representation tokens in both towers, two image readouts, fused logits.

    Args:
        clip, classnames: as for every method.
        cfg: reads `mmrl.*`, `data.name` (the template) and `train.grad_checkpointing`.
    """

    name = "mmrl"
    token_features = True  # f_rep: the K tokens after the final norm
    inserts_text_tokens = True  # its text tokens, from mmrl.layers on

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        block_indices(cfg.mmrl.layers, towers.text, "mmrl.layers")
        super().check_config(cfg, towers)

    @classmethod
    def check_vision(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """`mmrl.vision_layers` within the image tower (MMRL reads no `vision.*` key)."""
        if towers.image is not None:
            block_indices(cfg.mmrl.vision_layers, towers.image, "mmrl.vision_layers")

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)  # ModelError: a tower without tokens or their features
        self.n_sos = int(prompt_tokenizer(clip.tokenizer).sos_id is not None)  # the text tokens go after it
        m = cfg.mmrl
        self.n_tokens, self.rep_dim = int(m.n_tokens), int(m.rep_dim)
        self.alpha, self.reg_weight = float(m.alpha), float(m.reg_weight)
        self.text_blocks = block_indices(m.layers, len(clip.text.blocks), "mmrl.layers")
        self.vision_blocks = block_indices(m.vision_layers, self.tower_layers, "mmrl.vision_layers")
        self.rep = RepresentationLearner(
            self.n_tokens,
            self.rep_dim,
            clip.width,
            self.tower_width,
            len(self.text_blocks),
            len(self.vision_blocks),
        ).to(self.device)
        proj = self.tower_width**-0.5 * torch.randn(self.tower_width, clip.visual.output_dim)
        self.proj_rep = nn.Parameter(proj.to(self.device))  # (W_v, E)
        self.template = resolve_templates("coop", cfg.data.name)[0]
        ids = clip.tokenize([self.template.format(c.replace("_", " ")) for c in self.classnames])
        eos = clip.text.pool_positions(ids)  # (n_cls,) each prompt's pooled token
        length = clip.text.cut_length(eos, ids.shape[1])
        self.register_buffer("ids", ids[:, :length].to(self.device), persistent=False)
        self.register_buffer("eos", eos.to(self.device), persistent=False)
        self._t_zs: torch.Tensor | None = None  # (n_cls, E), once per run, never checkpointed

    def learnable(self) -> dict[str, torch.Tensor]:
        rep = {f"rep_{k}": p for k, p in self.rep.named_parameters()}
        return {**rep, "proj_rep": self.proj_rep}

    def text_features(self, tokens: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Unnormalised (n_cls, E) features of the template with the text tokens (packed; [SOS] and
        the tokens, or the tokens alone without [SOS], are the prefix every class shares)."""
        tokens = self.rep()[0] if tokens is None else tokens
        x = self.clip.text.token_embedding(self.ids)  # (n_cls, L, W_t)
        n = self.n_sos
        inserted = InsertedTokens(tokens, self.text_blocks, after=n)
        return self.clip.text.encode_with_shared_prefix(x[:1, :n], x[:, n:], self.eos, inserted=inserted)

    def image_features(self, images: torch.Tensor, tokens: list[torch.Tensor], frozen: bool = False):
        """(f_cls, f_rep, f_cls^zs or None), each unnormalised (B, E)."""
        inserted = InsertedTokens(tokens, self.vision_blocks)
        cls, rep, plain = self.clip.visual.encode_with_inserted(
            images, inserted, frozen, self.grad_checkpointing
        )
        return cls, rep.mean(dim=1) @ self.proj_rep.to(rep.dtype), plain  # (B, K, W) -> (B, W) -> (B, E)

    def frozen_text(self) -> torch.Tensor:
        """t_zs (n_cls, E): the frozen tower's features of the template, encoded and normalised in
        the tower's precision, as fp32 values."""
        if self._t_zs is None:
            self._t_zs = frozen_text_features(self.clip, self.classnames, [self.template], own_precision=True)
        return self._t_zs

    def all_logits(self, images: torch.Tensor, prepared=None, frozen: bool = False):
        """(logits, logits_rep, f_cls, f_cls^zs, text) of a batch; `prepared` from `prepare`."""
        text, vision_tokens = self.prepare() if prepared is None else prepared
        cls, rep, plain = self.image_features(images, vision_tokens, frozen)
        return self.cosine(cls, text), self.cosine(rep, text), cls, plain, text

    def fuse(self, logits: torch.Tensor, logits_rep: torch.Tensor) -> torch.Tensor:
        return self.alpha * logits + (1 - self.alpha) * logits_rep

    def prepare(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(text features, vision tokens): neither depends on the image, so once per evaluation."""
        text_tokens, vision_tokens = self.rep()
        return self.text_features(text_tokens), vision_tokens

    def logits(self, images: torch.Tensor, prepared=None) -> torch.Tensor:
        """`fusion` on the classes the tokens were trained on, the class-token `logits` elsewhere."""
        logits, logits_rep, *_ = self.all_logits(images, prepared)
        return self.fuse(logits, logits_rep) if self.on_training_classes else logits

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, logits_rep, cls, plain, text = self.all_logits(images, frozen=True)
        loss = mmrl_loss(
            logits, logits_rep, labels, cls, plain, text, self.frozen_text(), self.alpha, self.reg_weight
        )
        return loss, self.fuse(logits, logits_rep)  # the original reports accuracy on the fusion

    def to_half(self) -> None:
        """The original's PREC=fp16: CLIP and the representation learner in half; `proj_rep` stays
        fp32 (its CLIP conversion halves `proj` only) and is cast in the forward pass."""
        super().to_half()
        self.rep.half()

    def describe(self) -> dict:
        return {
            "mmrl_n_tokens": self.n_tokens,
            "mmrl_rep_dim": self.rep_dim,
            "mmrl_layers": ",".join(str(i + 1) for i in self.text_blocks),  # 1-based, as the keys
            "mmrl_vision_layers": ",".join(str(i + 1) for i in self.vision_blocks),
            "mmrl_alpha": self.alpha,
            "mmrl_reg_weight": self.reg_weight,
            "template": self.template,
        }

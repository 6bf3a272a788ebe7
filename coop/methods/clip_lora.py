"""CLIP-LoRA: low-rank adapters on q, k and v of both towers (Zanella & Ben Ayed, CVPRW 2024).

As MaxZanella/CLIP-LoRA computes it (`lora.py`, `loralib/`), one training step on a batch of
augmented images with labels y:

    text   = adapted text tower on "a photo of a {class}." for every class, with gradients  (n_cls, E)
    image  = adapted image tower on the batch                                             (B, E)
    logits = logit_scale.exp() * norm(image) @ norm(text).T;   loss = CE(logits, y)

Adapters (`coop.model.lora`): for every block in `lora.layers` of every tower in `lora.towers`, each
of its q, k, v projections in `lora.targets` (our packed q|k|v, timm's fused `qkv` or its separate
`q_proj`/`k_proj`/`v_proj`) gets s * B A, A (r, W) kaiming_uniform(a=sqrt(5)),
B (W, r) zeros, s = alpha / sqrt(r) (r = 2, alpha = 1), dropout 0.25 on the branch's input.
Nothing of CLIP trains or changes: the updates are added to the projection's output, never
written into the weights, so evaluation (dropout off) equals merged weights without any merge.

The text side runs every prompt cut after its [EOS], packed into one sequence. The prefix that
every prompt shares ([SOS] a photo of a) is computed once where that is exact, i.e. when the text
adapters draw no dropout masks (evaluation, `lora.dropout=0`): the adapted weights are the same
for every class. In training with dropout each class runs its own prefix, so that every token of
every class gets its own masks, as in the original (docs/clip_lora.md).

Recipe (`METHOD_DEFAULTS`): AdamW lr 2e-4, weight decay 1e-2, betas (0.9, 0.999), batch 32,
torch's cosine stepped every iteration to 1e-6 over 500 x shots iterations, no warm-up, the last
model evaluated. Checkpoint names -> the original's: see docs/clip_lora.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from coop.config.checks import ConfigError
from coop.methods.base import Method, TowerLayers
from coop.model.clip import CLIP, cosine_logits
from coop.model.lora import LoRAAdapters, LoRAError, resolve_layers

# The original's template for every dataset: each dataset file's own template sits in a string
# literal, and the live assignment that follows is this one.
CLIP_LORA_TEMPLATE = "a photo of a {}."


def layers_tag(layers) -> str:
    """`lora.layers` as a name part: "all", "half-up", "half-bottom" or "0-1-5"."""
    return layers if isinstance(layers, str) else "-".join(str(int(i)) for i in layers)


def shared_prefix_length(ids: torch.Tensor, eos: torch.Tensor) -> int:
    """Leading positions whose token is the same in every row, at most min(eos): (N, L) ids."""
    same = (ids == ids[:1]).all(dim=0)  # (L,)
    differs = (~same).nonzero()
    common = int(differs[0]) if len(differs) else ids.shape[1]
    return min(common, int(eos.min()))


def template_ids(clip: CLIP, classnames: list[str]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The template's prompt for every class, tokenised and cut after the last pooled token:
    (ids (n_cls, L), each row's pooled position (n_cls,), the length of the prefix all rows share)."""
    texts = [CLIP_LORA_TEMPLATE.format(c.replace("_", " ")) for c in classnames]
    ids = clip.tokenize(texts).to(clip.logit_scale.device)  # (n_cls, 77)
    eos = clip.text.pool_positions(ids)  # each prompt's pooled token: [EOS] in CLIP's tower
    ids = ids[:, : clip.text.cut_length(eos, ids.shape[1])]
    return ids, eos, shared_prefix_length(ids, eos)


def encode_template(text, ids: torch.Tensor, eos: torch.Tensor, prefix: int) -> torch.Tensor:
    """(n, E) unnormalised features of the prompts `ids` (n, L) pooled at `eos` (n,) through the text
    tower `text`, their first `prefix` tokens computed once for all rows (0: every row its own)."""
    x = text.token_embedding(ids)  # (n, L, W)
    if not prefix:
        return text.encode_embeddings(x, eos)
    return text.encode_with_shared_prefix(x[:1, :prefix], x[:, prefix:], eos)


def layer_spec(cfg: DictConfig) -> str | list[int]:
    """`lora.layers` as `coop.model.lora.resolve_layers` takes it: a name or a plain list."""
    layers = cfg.lora.layers
    return OmegaConf.to_object(layers) if OmegaConf.is_list(layers) else layers


def lora_adapters(clip: CLIP, towers: list[str], cfg: DictConfig) -> LoRAAdapters:
    """The `lora.*` adapters (targets, layers, rank, alpha, dropout) on `towers` of `clip`, attached,
    on CLIP's device (CLIP-LoRA's; 2SFS's stage one with `twosfs.peft=lora`)."""
    lora = cfg.lora
    adapters = LoRAAdapters(
        clip,
        towers,
        list(lora.targets),
        layer_spec(cfg),
        rank=int(lora.rank),
        alpha=float(lora.alpha),
        dropout=float(lora.dropout),
    ).to(clip.logit_scale.device)
    adapters.attach()
    return adapters


class CLIPLoRA(Method):
    """CLIP with low-rank q|k|v adapters in both towers, trained on cross-entropy.

    Args:
        clip: a `coop.CLIP` whose image tower is an `ImageTower` (open_clip's ViT, or a timm ViT or
            EVA trunk) for `lora.towers` with "vision"; its attention modules get the adapters
            (`LoRAAdapters.attach`).
        classnames: as for every method.
        cfg: reads `lora.*` and `train.grad_checkpointing`.
    """

    name = "clip_lora"
    trainer = "sgd"
    input = "pixels"

    @classmethod
    def image_tower_use(cls, cfg: DictConfig) -> str | None:
        return "adapts the image tower (lora.towers)" if "vision" in cfg.lora.towers else None

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """`lora.layers` within each adapted tower (`coop.model.lora.resolve_layers`)."""
        super().check_config(cfg, towers)  # an image tower that takes no adapters: refused
        for tower in cfg.lora.towers:
            try:
                resolve_layers(layer_spec(cfg), towers.text if tower == "text" else towers.image, tower)
            except LoRAError as e:
                raise ConfigError(str(e)) from None

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        lora = cfg.lora
        towers = list(lora.towers)
        self.settings = {  # for metrics.json
            "lora_rank": int(lora.rank),
            "lora_alpha": float(lora.alpha),
            "lora_dropout": float(lora.dropout),
            "lora_towers": "+".join(towers),
            "lora_targets": "".join(lora.targets),
            "lora_layers": layers_tag(lora.layers),
        }
        self.adapters = lora_adapters(clip, towers, cfg)
        self.grad_checkpointing = bool(OmegaConf.select(cfg, "train.grad_checkpointing", default=False))
        ids, eos, self.prefix = template_ids(clip, self.classnames)
        self.register_buffer("token_ids", ids, persistent=False)  # (n_cls, L)
        self.register_buffer("eos", eos, persistent=False)
        self._frozen_text: torch.Tensor | None = None  # lora.towers without text: computed once

    @property
    def device(self) -> torch.device:
        return self.clip.logit_scale.device

    def learnable(self) -> dict[str, torch.Tensor]:
        return self.adapters.tensors()

    def text_features(self) -> torch.Tensor:
        """Unnormalised class features (n_cls, E) of the adapted text tower, packed after [EOS];
        with the text tower not adapted, its frozen features, computed once (as the original's
        `clip_classifier` for `--encoder vision`)."""
        if "text" in self.adapters.towers:
            return self.encode_classes()
        if self._frozen_text is None:
            with torch.no_grad():
                self._frozen_text = self.encode_classes()
        return self._frozen_text

    def encode_classes(self) -> torch.Tensor:
        """(n_cls, E): the template's prompts through the text tower, the shared prefix once unless
        the text adapters draw dropout masks (then every class computes its own prefix)."""
        shared = 0 if self.adapters.draws_masks("text") else self.prefix  # else a mask per token
        return encode_template(self.clip.text, self.token_ids, self.eos, shared)

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """Unnormalised features (B, E) of the adapted image tower."""
        return self.clip.encode_image(images, grad_checkpointing=self.grad_checkpointing)

    def prepare(self) -> torch.Tensor:
        """The class text features, once per evaluation (no dropout in eval mode)."""
        return self.text_features()

    def logits(self, images: torch.Tensor, prepared=None) -> torch.Tensor:
        text = self.text_features() if prepared is None else prepared
        return cosine_logits(self.image_features(images), text, self.clip.logit_scale)

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(images)
        return F.cross_entropy(logits.float(), labels), logits

    def to_half(self) -> None:
        """fp16: CLIP in half; A and B stay fp32 (as the original's) and are cast in the forward."""
        self.clip.half()

    def describe(self) -> dict:
        return dict(self.settings)

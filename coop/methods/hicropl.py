"""HiCroPL: hierarchical cross-modal prompts (Zheng et al., ICCV 2025; zzeoZheng/HiCroPL, `trainers/hicropl.py`).

J layers of M prompt tokens in each tower (J = `prompt.depth`, M = `prompt.n_ctx`): text t_0..t_{J-1}
(t_0 = the input context `ctx`, t_i = `deep_ctx[i-1]` replacing the context slots before text block
i) and vision v_0..v_{J-1} (`cross_prompts_visual`: v_0 appended to the image tokens, v_i
replacing them before image block i), as IVLP places them. Below the crossing layer L
(`hicropl.cross_layer`) knowledge flows from text to image, above it from image to text:

    p_i  = LKP_t[i](q_t[i], t_i)                  i < L     one proxy token per text layer
    v_{0..L-1}  <- M_t2v(v_{0..L-1}, [p_0..p_{L-1}])        every visual token attends to all L proxies
    r_i  = LKP_v[i](q_v[i], v_i)                  i >= L    one proxy token per image layer
    t_{L..J-1}  <- M_v2t(t_{L..J-1}, [r_L..r_{J-1}])

    LKP(q, x)   = LN_2(q + MHA(LN_1 q, LN_1 x, LN_1 x))                 (`AttentionPooling`)
    M(x, s)     = y + FFN(LN_2 y),  y = Q x + MHA(LN_1 Q x, LN_1 K s, LN_1 V s)   (`KnowledgeMapper`)

The arrows are the original's: at EVERY forward pass it computes the mapped prompts and writes
them into the prompt tensors in place (`.data.copy_`), outside autograd. So the mappers, the
poolings and the proxy tokens q never receive a gradient and keep their random initialisation
(they are stored, not trained), and v_{0..L-1}, t_{L..J-1} are overwritten by the mapping before
each step and then moved by the optimizer like the other prompts. Here `loss` maps in place
before each step; an evaluation maps once, into copies (`prepare`), as the original's first test
batch does (the original maps again at every later batch; docs/hicropl.md).

Features, logits and loss, with d_c the class's description feature (the mean of its normalised
sentence features under the frozen text tower, normalised; `data.descriptions`, once per run) and
v0 the frozen image tower's features of the same images:

    v = norm(norm(image) + norm(v0))      t = norm(norm(text) + half(d))
    logits = logit_scale.exp() * v @ t.T                                   (training and evaluation)
    loss = CE(logits, y) + lambda * [(1 - mean_c cos(t_c, d_c)) + (1 - mean_b cos(v_b, norm(v0_b)))]

with lambda = `hicropl.weight` (the original's LAMBD, 12), `half(d)` d rounded to fp16 as the
original adds it, and cos with eps 1e-7. Learned tensors (checkpoint names = the official ones after
`prompt_learner.`, the per-layer lists stacked): `ctx`, `deep_ctx` (`cross_prompts_text.1..`),
`cross_prompts_visual`, `text_proxy_token`, `visual_proxy_token`, `text2visual_net.*`,
`visual2text_net.*`, `attn_pooling_text_nets.*`, `attn_pooling_visual_nets.*`.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from open_clip.transformer import QuickGELU
from torch import nn

from coop.config.checks import ConfigError
from coop.data.descriptions import load_descriptions, read_description_file
from coop.methods.base import TowerLayers, Towers
from coop.methods.descriptions import description_features
from coop.methods.ivlp import IVLP, check_shared_depth
from coop.model.clip import CLIP
from coop.model.errors import ModelError

log = logging.getLogger(__name__)

HEADS = 8  # the original's num_attention_heads of every mapper and pooling
COS_EPS = 1e-7  # the original's nn.CosineSimilarity(dim=1, eps=1e-07)


class AttentionPooling(nn.Module):
    """The layer-specific knowledge proxy (LKP): a query token pools one layer's prompts."""

    def __init__(self, width: int, heads: int = HEADS):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_1 = nn.LayerNorm(width)
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, query: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(1, W) query, (M, W) prompts -> (1, W)."""
        x = self.ln_1(tokens)
        return self.ln_2(query + self.attn(self.ln_1(query), x, x, need_weights=False)[0])


class KnowledgeMapper(nn.Module):
    """The multi-scale knowledge mapper (the original's `CrossPromptAttention`): one tower's prompts
    (queries, projected by `linear_q`) attend to the other tower's proxy tokens, then an MLP."""

    def __init__(self, width: int, source_width: int, heads: int = HEADS):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads)
        self.linear_q = nn.Linear(width, width)
        self.linear_k = nn.Linear(source_width, width)
        self.linear_v = nn.Linear(source_width, width)
        self.ln_1 = nn.LayerNorm(width)
        self.ffn = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, 4 * width)),
                    ("gelu", QuickGELU()),
                    ("c_proj", nn.Linear(4 * width, width)),
                ]
            )
        )
        self.ln_2 = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """(N, W) prompts, (S, W_s) proxy tokens -> (N, W)."""
        q = self.linear_q(tokens)
        k, v = self.linear_k(source), self.linear_v(source)
        q = q + self.attn(self.ln_1(q), self.ln_1(k), self.ln_1(v), need_weights=False)[0]
        return q + self.ffn(self.ln_2(q))


class HiCroPL(IVLP):
    """IVLP-placed prompts in both towers, crossed by knowledge mappers, fused with frozen features.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.*` (M, J, phrase; csc refused), `hicropl.cross_layer`, `hicropl.weight`,
            `data.descriptions` (sentences for every class scored) and `train.grad_checkpointing`.
    """

    name = "hicropl"
    scores_with_descriptions = True  # its text features are fused with the class's sentences

    @classmethod
    def check_config(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        super().check_config(cfg, towers)
        if cfg.prompt.csc:
            raise ConfigError(
                "prompt.csc=true is not defined for hicropl: its text prompts are shared by all classes"
            )
        depth, cross = int(cfg.prompt.depth), int(cfg.hicropl.cross_layer)
        if not 1 <= cross < depth:
            raise ConfigError(
                f"hicropl.cross_layer={cross} must be in 1..prompt.depth-1={depth - 1}: text flows to the "
                "image below it and the image to the text from it on"
            )
        path = OmegaConf.select(cfg, "data.descriptions")
        if path is None:
            raise ConfigError(
                "method=hicropl needs data.descriptions=FILE (a JSON of class name -> sentences; "
                "tools/describe.py writes one)"
            )
        read_description_file(path)  # a one-line DataError for a missing or malformed file

    @classmethod
    def check_vision(cls, cfg: DictConfig, towers: TowerLayers) -> None:
        """Both towers take prompt.n_ctx tokens to prompt.depth; vision.* must not say otherwise."""
        check_shared_depth(cls.name, cfg, towers)
        for key in ("n_ctx", "depth"):
            value = OmegaConf.select(cfg, f"vision.{key}")
            if value is not None and value != cfg.prompt[key]:
                raise ConfigError(
                    f"vision.{key}={value} conflicts with prompt.{key}={cfg.prompt[key]}: hicropl takes "
                    f"both towers' prompt {key} from prompt.{key}"
                )

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        self.cross_layer = int(cfg.hicropl.cross_layer)
        super().__init__(clip, classnames, cfg)
        self.weight = float(cfg.hicropl.weight)
        sentences = load_descriptions(cfg.data.descriptions, self.classnames)
        # fp32, never halved (the original's `fixed_embeddings` is an attribute, not a buffer)
        self.descriptions = description_features(clip, sentences).mean  # HiCroPL's gpt_clip_classifier
        log.info("HiCroPL: description features of %d classes from %s", self.n_cls, cfg.data.descriptions)

    def build_vision(self, cfg: DictConfig) -> None:
        pl = self.prompt_learner
        depth, n_ctx, width = pl.depth, pl.n_ctx, pl.ctx.shape[-1]
        vwidth, cross = self.tower_width, self.cross_layer
        for what, w in (("text", width), ("image", vwidth)):
            if w % HEADS:
                raise ModelError(
                    f"method=hicropl: the {what} tower's width {w} of model {self.clip.name} is not a "
                    f"multiple of the mappers' {HEADS} attention heads"
                )
        dev = self.device
        # the original wraps ONE draw in every layer's Parameter (then copied apart by .to(device))
        first = torch.empty(n_ctx, vwidth, device=dev).normal_(std=0.02)
        self.cross_prompts_visual = nn.Parameter(first.expand(depth, -1, -1).clone())  # (J, M, W_v)
        self.text2visual_net = KnowledgeMapper(vwidth, width).to(dev)
        self.visual2text_net = KnowledgeMapper(width, vwidth).to(dev)
        pool_text, pool_visual = AttentionPooling(width).to(dev), AttentionPooling(vwidth).to(dev)
        self.attn_pooling_text_nets = nn.ModuleList(copy.deepcopy(pool_text) for _ in range(cross))
        self.attn_pooling_visual_nets = nn.ModuleList(
            copy.deepcopy(pool_visual) for _ in range(depth - cross)
        )
        text_q, visual_q = torch.randn(1, width, device=dev), torch.randn(1, vwidth, device=dev)
        self.text_proxy_token = nn.Parameter(text_q.expand(cross, -1, -1).clone())  # (L, 1, W)
        self.visual_proxy_token = nn.Parameter(
            visual_q.expand(depth - cross, -1, -1).clone()
        )  # (J-L, 1, W_v)
        for p in self.mapping_tensors().values():
            p.requires_grad_(False)  # no gradient ever reaches them in the original

    def mapping_tensors(self) -> dict[str, torch.Tensor]:
        """The mappers, poolings and proxy tokens: stored in the checkpoint, never trained."""
        out = {"text_proxy_token": self.text_proxy_token, "visual_proxy_token": self.visual_proxy_token}
        for name in (
            "text2visual_net",
            "visual2text_net",
            "attn_pooling_text_nets",
            "attn_pooling_visual_nets",
        ):
            out |= {f"{name}.{k}": p for k, p in getattr(self, name).named_parameters()}
        return out

    def learnable(self) -> dict[str, torch.Tensor]:
        return {
            **self.prompt_learner.prompt_tensors(),
            "cross_prompts_visual": self.cross_prompts_visual,
            **self.mapping_tensors(),
        }

    def text_prompts(self) -> list[torch.Tensor]:
        """t_0..t_{J-1}, each (M, W)."""
        pl = self.prompt_learner
        return [pl.ctx, *pl.deep_ctx.unbind(0)]

    def crossed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mapped prompts from the current ones: v_{0..L-1} (L, M, W_v) from the text below the
        crossing, t_{L..J-1} (J-L, M, W) from the image above it."""
        text, vision, cross = self.text_prompts(), self.cross_prompts_visual, self.cross_layer
        n_ctx, width, vwidth = vision.shape[1], text[0].shape[-1], vision.shape[-1]
        proxies = torch.cat(
            [pool(self.text_proxy_token[i], text[i]) for i, pool in enumerate(self.attn_pooling_text_nets)]
        )
        low = self.text2visual_net(vision[:cross].reshape(-1, vwidth), proxies).view(cross, n_ctx, vwidth)
        pools = self.attn_pooling_visual_nets
        proxies = torch.cat(
            [pool(self.visual_proxy_token[i], vision[cross + i]) for i, pool in enumerate(pools)]
        )
        high = self.visual2text_net(torch.stack(text[cross:]).reshape(-1, width), proxies)
        return low, high.view(-1, n_ctx, width)

    @torch.no_grad()
    def cross_(self) -> None:
        """Write the mapped prompts into the prompt tensors, as the original's forward does."""
        low, high = self.crossed()
        self.cross_prompts_visual[: self.cross_layer].copy_(low)
        self.prompt_learner.deep_ctx[self.cross_layer - 1 :].copy_(high)

    def vision_prompts(self) -> list[torch.Tensor]:
        return list(self.cross_prompts_visual.unbind(0))

    def fuse(
        self, text: torch.Tensor, image: torch.Tensor, frozen_image: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, t, v, v0) in fp32: the prompted features fused with the frozen ones (module doc)."""
        with torch.autocast(image.device.type, enabled=False):
            v0 = F.normalize(frozen_image.float(), dim=-1)
            v = F.normalize(F.normalize(image.float(), dim=-1) + v0, dim=-1)
            described = self.descriptions.half().float()  # the original adds fixed_embeddings.half()
            t = F.normalize(F.normalize(text.float(), dim=-1) + described, dim=-1)
            return self.clip.logit_scale.float().exp() * v @ t.t(), t, v, v0

    def prepare(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(text features, vision prompts) after one mapping, into copies: the learned tensors stay."""
        pl = self.prompt_learner
        kept = self.cross_prompts_visual.detach().clone(), pl.deep_ctx.detach().clone()
        try:
            self.cross_()
            return self.text_features(), [p.detach().clone() for p in self.vision_prompts()]
        finally:
            with torch.no_grad():
                self.cross_prompts_visual.copy_(kept[0])
                pl.deep_ctx.copy_(kept[1])

    def towers(self, images: torch.Tensor, prepared=None) -> Towers:
        text, prompts = self.prepare() if prepared is None else prepared
        logits, t, v, _ = self.fuse(
            text, self.image_features(images, prompts), self.frozen_image_features(images)
        )
        return Towers(logits, t, v)

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cross_()
        text = self.text_features()
        image = self.image_features(images)
        logits, t, v, v0 = self.fuse(text, image, self.frozen_image_features(images))
        with torch.autocast(images.device.type, enabled=False):
            text_term = 1.0 - F.cosine_similarity(t, self.descriptions, dim=1, eps=COS_EPS).mean()
            image_term = 1.0 - F.cosine_similarity(v, v0, dim=1, eps=COS_EPS).mean()
            return F.cross_entropy(logits, labels) + self.weight * (text_term + image_term), logits

    def to_half(self) -> None:
        """The original's PREC=fp16: every prompt, mapper, pooling and proxy tensor in half (built
        in CLIP's dtype); the description features stay fp32, as its `.float()` CLIP makes them."""
        super().to_half()
        self.half()

    def describe(self) -> dict:
        pl = self.prompt_learner
        return {
            "n_ctx": pl.n_ctx,
            "position": pl.position,
            "depth": pl.depth,
            "hicropl_cross_layer": self.cross_layer,
            "hicropl_weight": self.weight,
        }

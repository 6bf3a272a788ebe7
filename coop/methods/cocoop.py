"""CoCoOp: context vectors shifted per image by a meta-net, batched through the shared-prefix path.

As in CoCoOp (Zhou et al., CVPR 2022):

    meta_net = Linear(E, E//16) -> ReLU -> Linear(E//16, W)     # input: the L2-normalised image feature
    ctx_b    = ctx + meta_net(norm(img_b))                       # (M, W), the same shift in every slot
    logits_b = logit_scale.exp() * norm(img_b) @ norm(text_features(ctx_b)).T     # over all classes

Only `ctx` and the meta-net train. The original runs one image at a time, all classes' full
77-token prompts per image. Here a batch of B images runs as B x n_cls prompts at once, exactly:

- with shared context and the class at the end or in the middle, image b's `[SOS][ctx_b..]` is a
  prefix of all its classes' prompts: the B prefixes are computed once each and n_cls suffixes
  attend to each (`TextTransformer.prefix_keys_values` / `encode_after_prefixes`), cut after
  [EOS] and packed into one sequence (`coop.model.packing`), the same packing after every prefix;
- with class-specific context or the class at the front, only [SOS] is shared: the B x n_cls
  prompts run after it as one packed sequence (still cut after [EOS]);
- on a text tower without the cut (not causal: SigLIP, CLIPA, MobileCLIP-S; `TextTransformer.cuts`)
  nothing is shared: the B x n_cls prompts run whole, [SOS] and the full context included.

Memory: with `train.grad_checkpointing`, training runs the prompts in blocks of at most
`cocoop.chunk_prompts` (images x classes), each recomputed in the backward pass
(`torch.utils.checkpoint`): only the blocks' logits stay in memory, plus one block's activations
at a time, so 1,000 classes x batch 32 needs about what 1,000 classes x batch 1 needs. Evaluation
keeps no graph and always runs in blocks of `EVAL_BLOCKS` x `cocoop.chunk_prompts` prompts.

Deep prompts (`prompt.depth > 1`) replace the hidden states at the context slots as in CoOp; they
are not shifted by the meta-net.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.checkpoint import checkpoint

from coop.methods.base import Method, Towers
from coop.methods.coop import build_learner, require_transferable
from coop.model.clip import CLIP

CHUNK_PROMPTS = 1024  # default prompts per block (`cocoop.chunk_prompts`)
EVAL_BLOCKS = 8  # without a graph, blocks may be this many times larger


class MetaNet(nn.Sequential):
    """CoCoOp's meta-net: Linear(E, E//16) -> ReLU -> Linear(E//16, W), as in its code."""

    def __init__(self, embed_dim: int, width: int):
        hidden = embed_dim // 16
        if hidden < 1:
            raise ValueError(f"CoCoOp's meta-net needs an image-feature dimension >= 16, got {embed_dim}")
        super().__init__(
            OrderedDict(
                [
                    ("linear1", nn.Linear(embed_dim, hidden)),
                    ("relu", nn.ReLU()),
                    ("linear2", nn.Linear(hidden, width)),
                ]
            )
        )


class CoCoOp(Method):
    """Instance-conditioned prompts; `learnable()` = the prompt tensors plus `meta_net.*`.

    Args:
        clip, classnames: as for every method.
        cfg: reads `prompt.*` (as CoOp) and `cocoop.chunk_prompts`.
    """

    name = "cocoop"
    trainer = "sgd"
    text_prompt = True

    def __init__(self, clip: CLIP, classnames: list[str], cfg: DictConfig):
        super().__init__(clip, classnames, cfg)
        self.prompt_learner = build_learner(clip, cfg, classnames)
        device = self.prompt_learner.ctx.device
        self.meta_net = MetaNet(clip.embed_dim, clip.width).to(device)
        self.chunk_prompts = int(OmegaConf.select(cfg, "cocoop.chunk_prompts", default=CHUNK_PROMPTS))

    def learnable(self) -> dict[str, torch.Tensor]:
        meta = {f"meta_net.{k}": p for k, p in self.meta_net.named_parameters()}
        return {**self.prompt_learner.prompt_tensors(), **meta}

    def load_learnable(self, tensors: dict[str, torch.Tensor], classnames: list[str]) -> None:
        require_transferable(self.prompt_learner.csc, classnames, self.classnames)
        super().load_learnable(tensors, classnames)

    def logits(self, image_features: torch.Tensor, prepared=None) -> torch.Tensor:
        """(B, n_cls) logits, in fp32; image b is scored against the prompts shifted by image b."""
        return self._run(image_features, self._cosine)

    def _cosine(self, text: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        """(b, c, E) text and (b, E) image features -> (b, c) fp32 logits."""
        with torch.autocast(img.device.type, enabled=False):
            img, text = F.normalize(img.float(), dim=-1), F.normalize(text.float(), dim=-1)
            return self.clip.logit_scale.float().exp() * torch.einsum("be,bce->bc", img, text)

    def towers(self, image_features: torch.Tensor, prepared=None) -> Towers:
        text = self.text_features(image_features)  # (B, n_cls, E): every image has its own prompts
        return Towers(self._cosine(text, image_features), text, image_features)

    def text_features(self, image_features: torch.Tensor) -> torch.Tensor:
        """Unnormalised class text features (B, n_cls, E) of each image's prompts."""
        return self._run(image_features, lambda text, img: text)

    def describe(self) -> dict:
        pl = self.prompt_learner
        return {"n_ctx": pl.n_ctx, "position": pl.position, "csc": pl.csc, "depth": pl.depth}

    # -- the batched computation ---------------------------------------------------------------

    def _run(self, image_features: torch.Tensor, head) -> torch.Tensor:
        """Encode every (image, class) prompt block by block; `head(text (b, c, E), img (b, E))`
        turns a block's text features into its output, which is all a block keeps."""
        pl, text = self.prompt_learner, self.clip.text
        img = F.normalize(image_features, dim=-1)
        shift = self.meta_net(img.to(self.meta_net.linear1.weight.dtype))  # (B, W)
        view = (len(shift),) + (1,) * (pl.ctx.dim() - 1) + (shift.shape[-1],)
        ctx = (pl.ctx.unsqueeze(0) + shift.view(view)).to(pl.token_embeds.dtype)  # (B, [n_cls,] M, W)
        start, n_sos = pl.shared_prefix, pl.n_sos
        if not text.cuts:  # a tower without the cut (not causal): every row runs whole
            kv = None
        elif start > n_sos:  # image b's [SOS][ctx_b..] is shared by all its classes
            sos = pl.token_embeds[:1, :n_sos].expand(len(ctx), -1, -1)  # (B, 1 or 0, W)
            prefix = torch.cat([sos, ctx[:, : start - n_sos]], dim=1)  # (B, P, W)
            kv = text.prefix_keys_values(prefix, self._deep(), pl.slots)
        elif n_sos:  # only [SOS] is shared, by every prompt
            kv = text.prefix_keys_values(pl.token_embeds[:1, :1], self._deep(), pl.slots)
        else:  # a tokenizer without [SOS]: nothing is shared
            kv = None
        n_img, n_cls = len(ctx), pl.n_cls
        chunked = not torch.is_grad_enabled() or text.grad_checkpointing
        per_img, per_cls = n_img, n_cls
        if chunked:
            limit = self.chunk_prompts * (1 if torch.is_grad_enabled() else EVAL_BLOCKS)
            per_img = max(1, min(n_img, limit // n_cls))
            per_cls = min(n_cls, limit)
        rows = []
        for i in range(0, n_img, per_img):
            images = slice(i, i + per_img)
            block_kv = [(k[images], v[images]) for k, v in kv] if kv and start > n_sos else kv
            cols = []
            for c in range(0, n_cls, per_cls):
                args = (head, block_kv, ctx[images], image_features[images], c, min(c + per_cls, n_cls))
                if chunked and torch.is_grad_enabled():  # keep only the block's output
                    cols.append(checkpoint(self._block, *args, use_reentrant=False))
                else:
                    cols.append(self._block(*args))
            rows.append(torch.cat(cols, dim=1))
        return torch.cat(rows, dim=0)

    def _deep(self) -> torch.Tensor | None:
        """Deep prompts (J-1, 1 or n_cls, M, W), the same for every image, or None."""
        pl = self.prompt_learner
        if pl.deep_ctx is None:
            return None
        return pl.deep_ctx if pl.csc else pl.deep_ctx.unsqueeze(1)

    def _block(self, head, kv, ctx: torch.Tensor, img: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
        """`head` of the text features of images `ctx` (b, [n_cls,] M, W) x classes c0..c1-1."""
        pl, text = self.prompt_learner, self.clip.text
        b, n, width = len(ctx), c1 - c0, ctx.shape[-1]
        start, n_sos = pl.shared_prefix, pl.n_sos
        embeds, slots, eos = pl.token_embeds[c0:c1], pl.slots[c0:c1], pl.eos[c0:c1]
        deep = self._deep()
        if kv is not None and start > n_sos:
            x = embeds[:, start:].unsqueeze(0)  # (1, c, L-P, W): the same for every image at the end
            in_suffix = slots[:, start - n_sos :] - start  # (c, M-h) slots after the prefix (middle)
            if in_suffix.shape[1]:
                index = in_suffix.unsqueeze(0).unsqueeze(-1).expand(b, -1, -1, width)  # (b, c, M-h, W)
                src = ctx[:, None, start - n_sos :].expand(-1, n, -1, -1)  # (b, c, M-h, W)
                x = x.expand(b, -1, -1, -1).scatter(2, index, src)  # (b, c, L-P, W)
            feats = text.encode_after_prefixes(kv, x, eos, deep, slots if deep is not None else None)
        else:
            ctx = ctx[:, c0:c1] if pl.csc else ctx.unsqueeze(1).expand(-1, n, -1, -1)  # (b, c, M, W)
            index = slots.unsqueeze(0).unsqueeze(-1).expand(b, -1, -1, width)  # (b, c, M, W)
            prompts = embeds.unsqueeze(0).expand(b, -1, -1, -1).scatter(2, index, ctx)  # (b, c, L, W)
            if deep is not None and pl.csc:
                deep = deep[:, c0:c1].repeat(1, b, 1, 1)  # (J-1, b c, M, W), image-major like the rows
            skip = n_sos if kv is not None else 0  # [SOS] is in the prefix unless nothing is shared
            x = prompts[:, :, skip:].reshape(1, b * n, -1, width)  # (1, b c, L-skip, W)
            rows_slots = slots.repeat(b, 1) if deep is not None else None
            if kv is None:
                feats = text.encode_embeddings(x[0], eos.repeat(b), deep, rows_slots).view(b, n, -1)
            else:
                feats = text.encode_after_prefixes(kv, x, eos.repeat(b), deep, rows_slots).view(b, n, -1)
        return head(feats, img)  # feats: (b, c, E)

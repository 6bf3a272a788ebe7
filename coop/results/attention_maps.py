"""Attention maps of prompts under the causal mask, through the model's own attention modules.

    from coop.train.checkpoint import load_trained
    from coop.results import attention_maps
    clip, learner, ckpt = load_trained("runs/.../checkpoint.pt")
    feats, maps, pooled = attention_maps.attention_maps(clip.text, learner)  # maps: (layers, n_cls, L, L)

Entry point: `tools/attention.py` (heatmaps, end vs middle). The maps come from
`TextTransformer.encode_with_attention`: the encoder's own blocks, whose attention modules are
asked for their weights (softmax(q k^T / sqrt(Dh) + causal mask), formed explicitly only on that
call); the features it returns equal `PromptClassifier.text_features()` (tested). Each feature is
read at its pooled token's row, which the tower names (`TextTransformer.pooled_index`): the [EOS]
in CLIP's tower, CoCa's class token appended after the text (the last row), the last or first
position in towers without the causal mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from coop.model.clip import CLIP
from coop.model.prompt import PromptLearner
from coop.model.text_encoder import TextTransformer
from coop.model.text_full import coca_mask
from coop.results.nearest_words import readable_token


@torch.no_grad()
def attention_maps(
    text: TextTransformer, learner: PromptLearner
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Text features, head-averaged attention of every layer, and the row each feature is read at.

    Args:
        text: the CLIP text encoder (`clip.text`).
        learner: the PromptLearner whose prompts (and deep prompts) are encoded.
    Returns:
        features (n_cls, E), equal to `PromptClassifier.text_features()`; attention
        (layers, n_cls, L, L): row t holds the head-averaged probabilities query t -> key s (0
        where the mask hides s: `visible`); and pooled (n_cls,): the row whose query gives each
        feature (`TextTransformer.pooled_index`; CoCa's class token is row L - 1).
    """
    prompts, deep = learner()
    slots = learner.slots if deep is not None else None
    feats, weights = text.encode_with_attention(prompts, learner.eos, deep, slots)
    pooled = text.pooled_index(learner.eos, weights.shape[-1] - text.cfg.embed_cls)
    return feats, weights.mean(dim=2), pooled  # (layers, N, H, L, L) -> (layers, N, L, L)


def visible(text: TextTransformer, eos: torch.Tensor, size: int) -> torch.Tensor:
    """(N, L, L) bool with L = `size`: True where a query sees a key in `attention_maps`: the causal
    mask, CoCa's (`coop.model.text_full.coca_mask`: its class token sees the text through the
    token after [EOS]) or, in a tower without the causal mask, every key."""
    if text.cls_emb is not None:
        return coca_mask(eos.cpu(), None, size - 1)[:, 0]
    seen = torch.ones(size, size, dtype=torch.bool)
    return (seen.tril() if text.cfg.causal else seen).expand(len(eos), -1, -1)


def _norm_name(name: str) -> str:
    return name.replace("_", " ")


def layout_learners(
    clip: CLIP, learner: PromptLearner, classes: list[str], positions: list[str]
) -> dict[str, PromptLearner]:
    """The learned context of `learner` placed in several layouts, for the given classes.

    Only the class-token position changes; `ctx`/`deep_ctx` are copied as they are, so layouts
    other than the trained one show the same vectors in an arrangement they were not trained in.

    Args:
        clip: the CLIP the learner belongs to.
        learner: the trained PromptLearner.
        classes: class names to build prompts for; with class-specific context (csc) they must
            be classes of the learner; with shared context any names work.
        positions: layouts, e.g. ["end", "middle"].
    """
    names = [_norm_name(c) for c in classes]
    if not names:
        raise ValueError("no classes given")
    rows = None
    if learner.csc:
        missing = [c for c in names if c not in learner.classnames]
        if missing:
            raise ValueError(
                f"class {missing[0]!r} is not in the checkpoint's classes (class-specific context); "
                f"classes: {', '.join(learner.classnames[:10])}{' ...' if learner.n_cls > 10 else ''}"
            )
        rows = torch.tensor([learner.classnames.index(c) for c in names])
    out = {}
    for pos in positions:
        new = PromptLearner(
            clip, names, n_ctx=learner.n_ctx, position=pos, csc=learner.csc, depth=learner.depth
        )
        with torch.no_grad():
            new.ctx.copy_(learner.ctx[rows] if learner.csc else learner.ctx)
            if learner.deep_ctx is not None:
                new.deep_ctx.copy_(learner.deep_ctx[:, rows] if learner.csc else learner.deep_ctx)
        out[new.position] = new
    return out


def token_roles(learner: PromptLearner, tokenizer, pooled: torch.Tensor) -> list[dict]:
    """Per class: the tokens drawn, their labels (context slots as v1..vM), and each role's positions.

    Args:
        learner: the PromptLearner of the maps.
        tokenizer: its CLIP's tokenizer (labels from its vocabulary where it has one).
        pooled: (n_cls,) the pooled rows from `attention_maps`.
    Returns:
        One dict per class: keys (positions drawn: the prompt through [EOS], then the pooled token
        where it comes after the text, CoCa's class token), labels (list[str], one per key), ctx
        (positions), cls (class-name token positions), eos (position), pooled (position).
    """
    words = getattr(tokenizer, "decoder", None) or {}
    out = []
    for c in range(learner.n_cls):
        eos = int(learner.eos[c])
        ids = learner.token_ids[c, : eos + 1].tolist()
        ctx = learner.slots[c].tolist()
        n_name = learner.name_lens[c]
        frozen = range(
            ctx[-1] + 1, ctx[-1] + 1 + learner.n_phrase - learner.n_ctx
        )  # "of a" of "[V1][V2] of a"
        first = [p for p in range(learner.n_sos, eos) if p not in ctx and p not in frozen]  # class, "."
        labels = [readable_token(tokenizer, words[t]) if t in words else str(t) for t in ids]
        if learner.n_sos:
            labels[0] = "[SOS]"
        labels[eos] = "[EOS]"
        for m, p in enumerate(ctx):
            labels[p] = f"v{m + 1}"
        keys, at = list(range(eos + 1)), int(pooled[c])
        if at > eos:  # CoCa's class token, appended after the text
            keys.append(at)
            labels.append("[cls_emb]")
        row = {"keys": keys, "labels": labels, "ctx": ctx, "cls": first[:n_name], "eos": eos, "pooled": at}
        out.append(row)
    return out


def attention_to_roles(attn: torch.Tensor, roles: list[dict]) -> dict[str, torch.Tensor]:
    """Attention mass between token roles, per layer, averaged over the classes.

    Args:
        attn: (layers, n_cls, L, L) from `attention_maps`.
        roles: `token_roles` of the same learner.
    Returns:
        {"pooled->ctx", "cls->ctx", "ctx->cls"}: each (layers,), the summed probability that a
        query of the first role puts on keys of the second (averaged over the role's query
        tokens); "pooled" is the token the feature is read at ([EOS] in CLIP's tower).
    """
    out = {k: [] for k in ("pooled->ctx", "cls->ctx", "ctx->cls")}
    for c, r in enumerate(roles):
        a = attn[:, c]  # (layers, L, L)
        ctx, cls = torch.tensor(r["ctx"]), torch.tensor(r["cls"])
        out["pooled->ctx"].append(a[:, r["pooled"], ctx].sum(-1))
        out["cls->ctx"].append(a[:, cls][:, :, ctx].sum(-1).mean(-1))
        out["ctx->cls"].append(a[:, ctx][:, :, cls].sum(-1).mean(-1))
    return {k: torch.stack(v).mean(0) for k, v in out.items()}


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in name).strip("_") or "class"


def attention_figures(
    clip: CLIP, learner: PromptLearner, classes: list[str], positions: list[str], out_dir
) -> tuple[list, dict]:
    """Heatmaps of the pooled token's and the class tokens' attention to every prompt token, per
    layer and layout.

    Writes into `out_dir`: `attention_<class>.png` (rows: layers; columns: layouts; each cell
    the attention of the class tokens and the pooled token (queries: [EOS] in CLIP's tower,
    CoCa's class token) to the tokens of `token_roles` (keys)), `attention_roles.png` (per layer:
    pooled -> context, class -> context, context -> class, one line per layout) and
    `attention.json` (all matrices and the role summary).

    Args:
        clip: the CLIP of the checkpoint.
        learner: the trained PromptLearner.
        classes: classes to draw (see `layout_learners`).
        positions: layouts to compare, e.g. ["end", "middle"].
        out_dir: output folder (created).
    Returns:
        (paths written, the JSON-able data).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import PowerNorm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    learners = layout_learners(clip, learner, classes, positions)
    data = {"trained_position": learner.position, "positions": {}}
    traces = {}
    for pos, lrn in learners.items():
        _, attn, pooled = attention_maps(clip.text, lrn)
        roles = token_roles(lrn, clip.tokenizer, pooled)
        summary = attention_to_roles(attn, roles)
        traces[pos] = (attn, roles, visible(clip.text, lrn.eos, attn.shape[-1]))
        data["positions"][pos] = {
            "classes": {
                name: {
                    "tokens": r["labels"],
                    "attention": attn[:, c][:, r["keys"]][:, :, r["keys"]].tolist(),
                }
                for c, (name, r) in enumerate(zip(lrn.classnames, roles, strict=True))
            },
            "summary": {k: v.tolist() for k, v in summary.items()},
        }
    written = []
    n_layers = len(clip.text.blocks)
    norm = PowerNorm(0.5, vmin=0, vmax=1)  # sqrt scale: [SOS] soaks up much attention
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")  # grey: keys hidden by the mask
    for c, name in enumerate(next(iter(learners.values())).classnames):
        fig, axes = plt.subplots(
            n_layers,
            len(learners),
            figsize=(4.2 * len(learners) + 1, 0.9 * n_layers + 1.6),
            sharex="col",
            squeeze=False,
            layout="constrained",
        )
        for col, (pos, (attn, roles, seen)) in enumerate(traces.items()):
            r = roles[c]
            queries, keys = r["cls"] + [r["pooled"]], r["keys"]
            label = dict(zip(keys, r["labels"], strict=True))
            hidden = ~seen[c][queries][:, keys].numpy()  # (queries, keys)
            for layer in range(n_layers):
                ax = axes[layer, col]
                m = attn[layer, c][queries][:, keys].numpy()  # (queries, keys)
                image = ax.imshow(np.ma.masked_array(m, hidden), cmap=cmap, norm=norm, aspect="auto")
                ax.set_yticks(range(len(queries)), [label[q] for q in queries], fontsize=6)
                ax.set_xticks(range(len(keys)), r["labels"], fontsize=6, rotation=90)
                ax.tick_params(axis="x", labelbottom=layer == n_layers - 1)  # keys: under each column
                if layer == 0:
                    trained = " (trained)" if pos == learner.position else ""
                    ax.set_title(f"{pos}{trained}", fontsize=9)
                if col == 0:
                    ax.set_ylabel(f"layer {layer}", fontsize=8)
        fig.suptitle(
            f"attention of class tokens and the pooled token to prompt tokens: {name} (grey: masked)",
            fontsize=10,
        )
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention (head mean)")
        path = out_dir / f"attention_{_safe(name)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=True, layout="constrained")
    titles = {"pooled->ctx": "pooled → context", "cls->ctx": "class → context", "ctx->cls": "context → class"}
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        for pos, d in data["positions"].items():
            ax.plot(range(n_layers), d["summary"][key], marker="o", label=pos)
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.set_xticks(range(n_layers))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("attention mass (0 to 1)")
    fig.legend(*axes[0].get_legend_handles_labels(), title="layout", loc="outside right upper", fontsize=8)
    fig.suptitle(
        f"attention mass between prompt roles per layer (head mean; mean over {len(classes)} classes; "
        f"trained layout: {learner.position})",
        fontsize=10,
    )
    path = out_dir / "attention_roles.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    path = out_dir / "attention.json"
    path.write_text(json.dumps(data) + "\n")
    written.append(path)
    return written, data

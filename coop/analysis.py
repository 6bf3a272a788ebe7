"""Looking inside learned prompts: nearest vocabulary words and attention under the causal mask.

    from coop.checkpoint import load_trained
    from coop import analysis
    clip, learner, ckpt = load_trained("runs/.../checkpoint.pt")
    rows = analysis.nearest_words(learner, clip.text.token_embedding.weight, clip.tokenizer, topk=5)
    feats, attn = analysis.encode_with_attention(clip.text, *learner(), learner.eos, learner.slots)

Entry points: `tools/interpret_prompt.py` (nearest words, as in CoOp's paper) and
`tools/attention.py` (attention heatmaps, end vs middle).

Nearest words: every learned context vector -- shared or per class, the input layer and every
deep layer -- is compared with the whole token-embedding table by Euclidean distance and by
cosine similarity. Deep-layer vectors replace hidden states, not input embeddings, so their
nearest words are only a rough reading.

Attention: our text encoder calls `F.scaled_dot_product_attention`, which returns no weights.
`encode_with_attention` runs the same blocks by hand (ln_1 -> packed q|k|v -> softmax(q k^T /
sqrt(Dh) + causal mask) -> out_proj, then the MLP) and returns the head-averaged attention
probabilities of every layer; its features equal `PromptClassifier.text_features()` (tested).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from coop.model import CLIP
from coop.prompt import PromptLearner
from coop.text_encoder import TextTransformer

METRICS = ("euclidean", "cosine")


# ---------------------------------------------------------------- nearest words


def _readable(tokenizer, token: str) -> str:
    """A BPE string as text: drop the word-end mark, undo the byte-to-unicode mapping."""
    token = token.replace("</w>", "")
    byte_decoder = getattr(tokenizer, "byte_decoder", None)
    if byte_decoder and all(ch in byte_decoder for ch in token):
        return bytearray(byte_decoder[ch] for ch in token).decode("utf-8", errors="replace")
    return token


def vocab_words(tokenizer, vocab_size: int) -> list[str]:
    """A readable string for every token id.

    Args:
        tokenizer: OpenCLIP's `SimpleTokenizer` (its `.decoder` maps id -> BPE string), or an HF
            tokenizer wrapper with `.tokenizer.convert_ids_to_tokens`; otherwise ids are shown.
        vocab_size: rows of the token-embedding table.
    """
    decoder = getattr(tokenizer, "decoder", None)
    if isinstance(decoder, dict):
        words = [decoder.get(i) for i in range(vocab_size)]
    elif hasattr(getattr(tokenizer, "tokenizer", None), "convert_ids_to_tokens"):
        words = tokenizer.tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    else:
        words = [None] * vocab_size
    return [_readable(tokenizer, w) if isinstance(w, str) else f"<{i}>" for i, w in enumerate(words)]


def context_vectors(learner: PromptLearner) -> tuple[torch.Tensor, list[dict]]:
    """All learned context vectors as rows, with where each one sits.

    Returns:
        vectors (N, W) and one dict per row: layer (0 = input, i = deep prompt before block i),
        class (None when shared) and slot (1-based context index v1..vM).
    """
    layers = [learner.ctx.detach()]  # each (M, W) or (n_cls, M, W)
    if learner.deep_ctx is not None:
        layers += list(learner.deep_ctx.detach().unbind(0))
    vectors, where = [], []
    for layer, ctx in enumerate(layers):
        per_class = ctx if learner.csc else ctx.unsqueeze(0)  # (n_cls or 1, M, W)
        for c, rows in enumerate(per_class):
            cls = learner.classnames[c] if learner.csc else None
            for m, vec in enumerate(rows):
                vectors.append(vec)
                where.append({"layer": layer, "class": cls, "slot": m + 1})
    return torch.stack(vectors).float(), where  # (N, W)


@torch.no_grad()
def nearest_tokens(
    vectors: torch.Tensor, table: torch.Tensor, topk: int = 5, chunk: int = 256
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Top-k nearest rows of `table` for each vector, by Euclidean distance and by cosine.

    Args:
        vectors: (N, W) query vectors.
        table: (V, W) token-embedding table.
        topk: neighbours per vector.
        chunk: vectors per distance computation (bounds memory at chunk x V).
    Returns:
        {"euclidean": (ids (N, k), distances (N, k)), "cosine": (ids (N, k), similarities (N, k))}
    """
    if not 1 <= topk <= table.shape[0]:
        raise ValueError(f"topk must be in 1..{table.shape[0]}, got {topk}")
    table = table.float()
    table_unit = F.normalize(table, dim=-1)  # (V, W)
    out = {m: ([], []) for m in METRICS}
    starts = range(0, vectors.shape[0], chunk)
    for start in tqdm(starts, desc="nearest words", unit="chunk", disable=None if len(starts) > 8 else True):
        v = vectors[start : start + chunk].to(table)  # (n, W)
        dist = torch.cdist(v, table)  # (n, V)
        d, i = dist.topk(topk, dim=-1, largest=False)
        out["euclidean"][0].append(i)
        out["euclidean"][1].append(d)
        sim = F.normalize(v, dim=-1) @ table_unit.t()  # (n, V)
        s, j = sim.topk(topk, dim=-1)
        out["cosine"][0].append(j)
        out["cosine"][1].append(s)
    return {m: (torch.cat(ids).cpu(), torch.cat(vals).cpu()) for m, (ids, vals) in out.items()}


def nearest_words(learner: PromptLearner, table: torch.Tensor, tokenizer, topk: int = 5) -> list[dict]:
    """CoOp's prompt interpretation: the vocabulary words nearest to each learned vector.

    Args:
        learner: a trained PromptLearner (shared or class-specific, any depth).
        table: the token-embedding table (V, W), `clip.text.token_embedding.weight`.
        tokenizer: the model's tokenizer, to name the token ids.
        topk: words per vector and metric.
    Returns:
        Long-format records: layer, class, slot, metric ("euclidean" distance or "cosine"
        similarity), rank (1 = nearest), token_id, word, score.
    """
    vectors, where = context_vectors(learner)
    words = vocab_words(tokenizer, table.shape[0])
    found = nearest_tokens(vectors, table, topk)
    rows = []
    for n, loc in enumerate(where):
        for metric in METRICS:
            ids, scores = found[metric]
            for r in range(topk):
                tid = int(ids[n, r])
                rows.append(
                    {**loc, "metric": metric, "rank": r + 1, "token_id": tid, "word": words[tid],
                     "score": round(float(scores[n, r]), 4)}
                )  # fmt: skip
    return rows


def format_words_table(rows: list[dict]) -> str:
    """One line per context vector: `layer class vK | euclidean: w (d) ... | cosine: w (s) ...`."""
    lines, groups = [], {}
    for r in rows:
        groups.setdefault((r["layer"], r["class"], r["slot"]), {}).setdefault(r["metric"], []).append(r)
    width = max([len(str(k[1] or "(shared)")) for k in groups] + [8])
    lines.append(f"{'layer':>5}  {'class':<{width}}  {'ctx':<4} | " + " | ".join(METRICS))
    for (layer, cls, slot), by_metric in groups.items():
        cells = [", ".join(f"{r['word']} ({r['score']:.3g})" for r in by_metric.get(m, [])) for m in METRICS]
        lines.append(f"{layer:>5}  {str(cls or '(shared)'):<{width}}  v{slot:<3} | " + " | ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------- attention


def _project(text: TextTransformer, pooled: torch.Tensor) -> torch.Tensor:
    if isinstance(text.text_projection, nn.Linear):
        return text.text_projection(pooled)
    return pooled @ text.text_projection  # (N, E)


@torch.no_grad()
def encode_with_attention(
    text: TextTransformer,
    prompts: torch.Tensor,
    deep: torch.Tensor | None,
    eos: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text Transformer run block by block, keeping each layer's attention probabilities.

    Args:
        text: the CLIP text encoder (`clip.text`).
        prompts: prompt token embeddings (N, L, W), without positions (`learner()[0]`).
        deep: deep prompts (J-1, N or 1, M, W) or None (`learner()[1]`).
        eos: (N,) index of each row's [EOS].
        slots: (N, M) context positions; required with `deep`.
    Returns:
        features (N, E), equal to `PromptClassifier.text_features()`, and attention
        (layers, N, L, L): row t holds the head-averaged probabilities query t -> key s (s <= t).
    """
    n, length, width = prompts.shape
    # All rows run at the longest length: under the causal mask tokens after a row's [EOS] never
    # reach its [EOS], so this equals the encoder's length buckets.
    x = prompts + text.positional_embedding[:length]  # (N, L, W)
    mask = torch.full((length, length), float("-inf"), device=x.device).triu(1)  # (L, L)
    n_deep = 0 if deep is None else deep.shape[0]
    if n_deep:
        index = slots.unsqueeze(-1).expand(-1, -1, width)  # (N, M, W)
    maps = []
    for i, block in enumerate(text.blocks):
        if 1 <= i <= n_deep:
            x = x.scatter(1, index, deep[i - 1].to(x.dtype).expand(n, -1, -1))
        attn = block.attn
        heads = attn.heads
        dh = width // heads
        qkv = F.linear(block.ln_1(x), attn.in_proj_weight, attn.in_proj_bias)  # (N, L, 3W)
        q, k, v = qkv.view(n, length, 3, heads, dh).permute(2, 0, 3, 1, 4).unbind(0)  # each (N, H, L, Dh)
        probs = (q @ k.transpose(-2, -1) / math.sqrt(dh) + mask).softmax(dim=-1)  # (N, H, L, L)
        y = (probs @ v).transpose(1, 2).reshape(n, length, width)  # (N, L, W)
        x = x + attn.out_proj(y)
        x = x + block.mlp(block.ln_2(x))
        maps.append(probs.mean(dim=1))  # (N, L, L)
    x = text.ln_final(x)
    pooled = x[torch.arange(n, device=x.device), eos]  # (N, W)
    return _project(text, pooled), torch.stack(maps)  # (N, E), (layers, N, L, L)


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


def token_roles(learner: PromptLearner, tokenizer) -> list[dict]:
    """Per class: token labels (context slots as v1..vM) and the positions of each role.

    Returns:
        One dict per class: labels (list[str], up to [EOS]), ctx (positions), cls (class-name
        token positions), eos (position).
    """
    words = getattr(tokenizer, "decoder", None) or {}
    out = []
    for c, name in enumerate(learner.classnames):
        eos = int(learner.eos[c])
        ids = learner.token_ids[c, : eos + 1].tolist()
        ctx = learner.slots[c].tolist()
        n_name = len(tokenizer.encode(name))
        first = [p for p in range(1, eos) if p not in ctx]  # class tokens, then "."
        labels = [_readable(tokenizer, words[t]) if t in words else str(t) for t in ids]
        labels[0], labels[eos] = "[SOS]", "[EOS]"
        for m, p in enumerate(ctx):
            labels[p] = f"v{m + 1}"
        out.append({"labels": labels, "ctx": ctx, "cls": first[:n_name], "eos": eos})
    return out


def attention_to_roles(attn: torch.Tensor, roles: list[dict]) -> dict[str, torch.Tensor]:
    """Attention mass between token roles, per layer, averaged over the classes.

    Args:
        attn: (layers, n_cls, L, L) from `encode_with_attention`.
        roles: `token_roles` of the same learner.
    Returns:
        {"eos->ctx", "cls->ctx", "ctx->cls"}: each (layers,), the summed probability that a query
        of the first role puts on keys of the second (averaged over the role's query tokens).
    """
    out = {k: [] for k in ("eos->ctx", "cls->ctx", "ctx->cls")}
    for c, r in enumerate(roles):
        a = attn[:, c]  # (layers, L, L)
        ctx, cls = torch.tensor(r["ctx"]), torch.tensor(r["cls"])
        out["eos->ctx"].append(a[:, r["eos"], ctx].sum(-1))
        out["cls->ctx"].append(a[:, cls][:, :, ctx].sum(-1).mean(-1))
        out["ctx->cls"].append(a[:, ctx][:, :, cls].sum(-1).mean(-1))
    return {k: torch.stack(v).mean(0) for k, v in out.items()}


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in name).strip("_") or "class"


def attention_figures(
    clip: CLIP, learner: PromptLearner, classes: list[str], positions: list[str], out_dir
) -> tuple[list, dict]:
    """Heatmaps of [EOS] and class-token attention to every prompt token, per layer and layout.

    Writes into `out_dir`: `attention_<class>.png` (rows: layers; columns: layouts; each cell
    the attention of the class tokens and [EOS] (queries) to all tokens up to [EOS] (keys)),
    `attention_roles.png` (per layer: [EOS] -> context, class -> context, context -> class, one
    line per layout) and `attention.json` (all matrices and the role summary).

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
        prompts, deep = lrn()
        _, attn = encode_with_attention(clip.text, prompts, deep, lrn.eos, lrn.slots)
        roles = token_roles(lrn, clip.tokenizer)
        summary = attention_to_roles(attn, roles)
        traces[pos] = (attn, roles)
        data["positions"][pos] = {
            "classes": {
                name: {
                    "tokens": r["labels"],
                    "attention": attn[:, c, : r["eos"] + 1, : r["eos"] + 1].tolist(),
                }
                for c, (name, r) in enumerate(zip(lrn.classnames, roles, strict=True))
            },
            "summary": {k: v.tolist() for k, v in summary.items()},
        }
    written = []
    n_layers = len(clip.text.blocks)
    norm = PowerNorm(0.5, vmin=0, vmax=1)  # sqrt scale: [SOS] soaks up much attention
    cmap = plt.get_cmap("viridis").with_extremes(bad="0.85")  # grey: keys hidden by the causal mask
    for c, name in enumerate(next(iter(learners.values())).classnames):
        fig, axes = plt.subplots(
            n_layers,
            len(learners),
            figsize=(4.2 * len(learners) + 1, 1.6 * n_layers + 0.8),
            squeeze=False,
            layout="constrained",
        )
        for col, (pos, (attn, roles)) in enumerate(traces.items()):
            r = roles[c]
            queries = r["cls"] + [r["eos"]]
            for layer in range(n_layers):
                ax = axes[layer, col]
                m = attn[layer, c][queries][:, : r["eos"] + 1].numpy()  # (queries, keys)
                hidden = np.arange(m.shape[1])[None, :] > np.array(queries)[:, None]  # causal mask
                image = ax.imshow(np.ma.masked_array(m, hidden), cmap=cmap, norm=norm, aspect="auto")
                ax.set_yticks(range(len(queries)), [r["labels"][q] for q in queries], fontsize=6)
                ax.set_xticks(range(r["eos"] + 1), r["labels"], fontsize=6, rotation=90)
                if layer == 0:
                    trained = " (trained)" if pos == learner.position else ""
                    ax.set_title(f"{pos}{trained}", fontsize=9)
                if col == 0:
                    ax.set_ylabel(f"layer {layer}", fontsize=8)
        fig.suptitle(
            f"attention of class tokens and [EOS] to prompt tokens: {name} (grey: masked)", fontsize=10
        )
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention (head mean)")
        path = out_dir / f"attention_{_safe(name)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
    titles = {"eos->ctx": "[EOS] → context", "cls->ctx": "class → context", "ctx->cls": "context → class"}
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        for pos, d in data["positions"].items():
            ax.plot(range(n_layers), d["summary"][key], marker="o", label=pos)
        ax.set_title(title)
        ax.set_xlabel("layer")
        ax.set_xticks(range(n_layers))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("attention mass")
    axes[-1].legend(title="layout")
    fig.suptitle(f"mean over {len(classes)} classes; trained layout: {learner.position}", fontsize=10)
    fig.tight_layout()
    path = out_dir / "attention_roles.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    path = out_dir / "attention.json"
    path.write_text(json.dumps(data) + "\n")
    written.append(path)
    return written, data

"""Looking inside learned prompts: the vocabulary words nearest to each learned vector.

    from coop.train.checkpoint import load_trained
    from coop.results import nearest_words
    clip, learner, ckpt = load_trained("runs/.../checkpoint.pt")
    table = nearest_words.embedding_table(clip.text.token_embedding)
    rows = nearest_words.nearest_words(learner, table, clip.tokenizer, topk=5)

Entry point: `tools/interpret_prompt.py` (as in CoOp's paper). Every learned context vector --
shared or per class, the input layer and every deep layer -- is compared with the whole
token-embedding table by Euclidean distance and by cosine similarity. Deep-layer vectors replace
hidden states, not input embeddings, so their nearest words are only a rough reading.
Attention maps live in `coop.results.attention_maps`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from coop.model.prompt import PromptLearner

METRICS = ("euclidean", "cosine")


def embedding_table(embedding: torch.nn.Module) -> torch.Tensor:
    """(V, W) the vector the text tower's embedding gives each token id, what the learned context
    vectors stand in for: its weight, times the scale an embedding applies in its forward (NLLB's
    `M2M100ScaledWordEmbedding`: sqrt(width)); the weight itself for every other tower."""
    return embedding.weight * getattr(embedding, "embed_scale", 1.0)


def readable_token(tokenizer, token: str) -> str:
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
    return [readable_token(tokenizer, w) if isinstance(w, str) else f"<{i}>" for i, w in enumerate(words)]


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
        table: the token-embedding table (V, W), `embedding_table(clip.text.token_embedding)`.
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

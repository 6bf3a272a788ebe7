"""Class descriptions (`data.descriptions`) as text features, encoded once per run by the frozen CLIP.

    feats = description_features(clip, load_descriptions(path, classnames))
    feats.mean          # (C, E): per class, its sentences' normalised features averaged, renormalised
    feats.sentences     # (C, S_max, E): every sentence's normalised features, zero rows past counts[c]
    feats.counts        # (C,): sentences per class
    feats.pick(i)       # (C, E): sentence i of every class (i modulo each class's count)

Both originals encode a class's sentences with the frozen CLIP's `encode_text` and L2-normalise
each sentence's features (`gpt_clip_classifier` in their trainers). HiCroPL then averages them
and renormalises: its fixed text embeddings are `mean`. CoPrompt keeps every sentence, stacked as
(S, C, E) (its `ori_embedding`), and at each step distils toward one index drawn for all classes:
`pick(i)` (its files hold the same number of sentences per class; with unequal counts we take
sentence i modulo each class's count). The originals tokenize with CLIP's `tokenize`, which raises
on a sentence over 77 tokens; we tokenize with the model's tokenizer, which truncates it and ends it
with [EOS] (`tools/check_data.py --descriptions` lists such sentences). All classes' sentences go
through the text tower in batches of `batch_size` (whose forward cuts each batch after its last
[EOS] and packs the rows: a sentence costs its own tokens), without gradients, in float32 whatever the
run's precision: autocast off, and a half text tower (train.precision=fp16) encodes through a
float32 copy, as the originals encode on a `.float()` CLIP.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coop.model.clip import CLIP

BATCH_SIZE = 256  # sentences per text-tower pass


@dataclass
class DescriptionFeatures:
    """Normalised features of every class's sentences (see the module docstring)."""

    sentences: torch.Tensor  # (C, S_max, E)
    counts: torch.Tensor  # (C,) long
    mean: torch.Tensor  # (C, E)

    def pick(self, index: int | torch.Tensor) -> torch.Tensor:
        """(C, E): sentence `index` (an int for every class, or a (C,) tensor) of each class, taken
        modulo the class's count."""
        index = torch.as_tensor(index, device=self.counts.device).expand(self.counts.shape)
        rows = torch.arange(len(self.counts), device=self.counts.device)
        return self.sentences[rows, index % self.counts]


@torch.no_grad()
def description_features(
    clip: CLIP, sentences_per_class: list[list[str]], batch_size: int = BATCH_SIZE
) -> DescriptionFeatures:
    """Encode every class's sentences once with the frozen `clip` (in float32, on its device).

    Args:
        clip: the frozen model.
        sentences_per_class: one non-empty list per class (`coop.data.descriptions.load_descriptions`).
        batch_size: sentences per text-tower pass.
    """
    counts = [len(s) for s in sentences_per_class]
    if not counts or min(counts) == 0:
        raise ValueError("description_features needs at least one sentence for every class")
    flat = [s for sentences in sentences_per_class for s in sentences]
    device = clip.logit_scale.device
    text = clip.text
    if any(p.dtype != torch.float32 for p in text.parameters()):
        text = copy.deepcopy(
            text
        ).float()  # a half tower (train.precision=fp16): the originals' .float() CLIP
    with torch.autocast(device.type, enabled=False):  # the same features inside a training step's autocast
        parts = [
            F.normalize(text(clip.tokenize(flat[i : i + batch_size]).to(device)).float(), dim=-1)
            for i in range(0, len(flat), batch_size)
        ]
    per_class = torch.cat(parts).split(counts)
    sentences = torch.nn.utils.rnn.pad_sequence(list(per_class), batch_first=True)
    mean = F.normalize(torch.stack([f.mean(0) for f in per_class]), dim=-1)
    return DescriptionFeatures(sentences, torch.tensor(counts, device=device), mean)

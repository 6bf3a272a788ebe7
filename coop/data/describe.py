"""Class descriptions written by a local language model (CuPL's recipe), for `data.descriptions`.

    model = load_language_model("/models/Qwen2.5-7B-Instruct", device="cuda")
    sentences = describe_class(model, "golden retriever", n=50, max_words=50, seed=0)
    describe_classes(model, classnames, "descriptions.json", n=50, max_words=50, seed=0)

The model is any Hugging Face causal language model saved in a directory (`save_pretrained`: Llama,
Qwen, Gemma, GPT-2, ...), read offline with transformers' `AutoModelForCausalLM` and
`AutoTokenizer` (`local_files_only`); nothing is downloaded. Each class is asked `QUESTIONS` in
turn (CuPL's idea: several questions about what the class looks like, sampled at a high
temperature), in the tokenizer's chat template when it has one and as "Q: ... A:" otherwise. An
answer keeps its first non-blank line and, of it, its first sentence (up to a ".", "!" or "?"
followed by a capital), cut to `max_words` words; empty answers are dropped and asked again, up to
`ROUNDS` rounds of the questions. The defaults are HiCroPL's
recipe: 50 sentences per class of at most 50 words.

Sampling is seeded per class (from `seed` and the class name), so a class's sentences do not
depend on which classes came before it, and a resumed run writes what an uninterrupted one would.
`describe_classes` writes the file `{class: [sentences]}` atomically after every class and keeps
the classes the file already holds (resuming). We ship no third-party sentences.
"""

from __future__ import annotations

import logging
import math
import re
import zlib
from pathlib import Path

import torch
from tqdm import tqdm

from coop.data.base import DataError
from coop.data.descriptions import read_description_file
from coop.io import write_json

logger = logging.getLogger(__name__)

# Our own wording of CuPL's kind of question: what the class looks like, how to tell it apart.
QUESTIONS = (
    "Describe what a {} looks like.",
    "How can you recognise a {} in a photo?",
    "What are the visual features of a {}?",
    "Describe a photo of a {}.",
    "What shape, colour and texture does a {} have?",
)
SENTENCES = 50  # per class: HiCroPL's recipe
MAX_WORDS = 50  # per sentence: HiCroPL's recipe
TEMPERATURE = 0.99  # CuPL's
ROUNDS = 4  # times the questions are asked before a class is written with fewer sentences
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")  # ". It": a new sentence; "e.g. a": not


def load_language_model(directory: str | Path, device: str = "cpu"):
    """(model, tokenizer) of the causal language model saved in `directory`, offline, in eval mode.

    Raises:
        DataError: in one line naming the directory: not a folder, or no model or tokenizer there.
    """
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise DataError(f"--model {directory}: not a folder (a language model saved with save_pretrained)")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except ImportError as e:
        raise DataError(f"--model {directory} needs transformers: pip install 'coop[hf]' ({e})") from None
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"--model {directory}: no causal language model readable there ({first})") from None
    model.to(device).eval()
    return model, tokenizer


def prompt_for(tokenizer, question: str, max_words: int) -> str:
    """The text the model continues: `question` in the tokenizer's chat template, or "Q: ... A:"."""
    ask = f"{question} Answer in one sentence of at most {max_words} words."
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": ask}]
        # enable_thinking: Qwen3's templates answer without a <think> block; other templates ignore it
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    return f"Q: {ask}\nA:"


def clean(answer: str, max_words: int) -> str:
    """An answer's first line and first sentence, at most `max_words` words ("" if none)."""
    lines = answer.strip().splitlines()
    first = SENTENCE_END.split(" ".join(lines[0].split()) if lines else "", maxsplit=1)[0]
    return " ".join(first.split()[:max_words])


def class_seed(seed: int, name: str) -> int:
    """The sampling seed of one class: from `seed` and the class name, not the class's position."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def describe_class(
    lm,
    name: str,
    n: int = SENTENCES,
    max_words: int = MAX_WORDS,
    seed: int = 0,
    questions: tuple[str, ...] | list[str] = QUESTIONS,
    temperature: float = TEMPERATURE,
) -> list[str]:
    """Up to `n` sentences about class `name` from `lm` = (model, tokenizer), seeded (`class_seed`).

    Each round asks every question for its share of the sentences still missing.
    """
    model, tokenizer = lm
    shown = name.replace("_", " ")
    torch.manual_seed(class_seed(seed, name))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chat = bool(getattr(tokenizer, "chat_template", None))
    out: list[str] = []
    for _ in range(ROUNDS):
        per_question = math.ceil((n - len(out)) / len(questions))
        for question in questions:
            if len(out) >= n:
                break
            prompt = prompt_for(tokenizer, question.format(shown), max_words)
            # a chat template writes the start token itself: not a second one
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=not chat)
            ids = ids.to(model.device)
            generated = model.generate(
                **ids,
                do_sample=True,
                temperature=temperature,
                max_new_tokens=2 * max_words + 8,
                num_return_sequences=per_question,
                pad_token_id=pad,
            )
            answers = tokenizer.batch_decode(
                generated[:, ids["input_ids"].shape[1] :], skip_special_tokens=True
            )
            out += [s for s in (clean(a, max_words) for a in answers) if s][: n - len(out)]
        if len(out) >= n:
            break
    return out


def describe_classes(
    lm,
    classnames: list[str],
    out: str | Path,
    n: int = SENTENCES,
    max_words: int = MAX_WORDS,
    seed: int = 0,
    **kw,
) -> dict[str, list[str]]:
    """Describe every class of `classnames` that `out` does not hold yet, writing `out` after each.

    Classes already in `out` are kept as they are (a resumed run); a class for which the model
    gave no sentence is left out with a warning (a rerun asks again), one with fewer than `n` is
    written with a warning. Returns what `out` holds.
    """
    out = Path(out)
    done = read_description_file(out) if out.exists() else {}
    wanted = list(dict.fromkeys(classnames))
    todo = [c for c in wanted if c not in done]
    bar = tqdm(
        total=len(wanted),
        initial=len(wanted) - len(todo),
        desc="describing",
        unit="class",
        dynamic_ncols=True,
    )
    with bar:
        for name in todo:
            sentences = describe_class(lm, name, n, max_words, seed, **kw)
            bar.update()
            if not sentences:
                logger.warning("class %r: the model gave no sentence; left out (run again to retry)", name)
                continue
            if len(sentences) < n:
                logger.warning(
                    "class %r: %d of %d sentences after %d rounds", name, len(sentences), n, ROUNDS
                )
            done[name] = sentences
            write_json(out, done)
    return done

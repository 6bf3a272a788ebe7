"""Class descriptions as data: sentences about each class, written by a language model (CuPL's
idea), that methods such as HiCroPL and CoPrompt learn from (`data.descriptions=FILE`).

Two JSON layouts are read:

    {"class name": ["sentence", ...], ...}                       CoPrompt's and HiCroPL's gpt_file/*.json
    {"class name": {"attribute": ["sentence", ...], ...}, ...}   TAP's attribute bags

An attribute bag is flattened into one list: the attributes in the file's order, each one's
sentences in their order. A class is found by its name as the dataset writes it or, failing that,
with `_` read as a space and case ignored ("Yorkshire_terrier" finds "yorkshire terrier"); a file
may describe more classes than the run scores. We ship no third-party sentences: write them with
`tools/describe.py` from a local language model, or bring a file.
"""

from __future__ import annotations

import json
from pathlib import Path

from coop.data.base import DataError


def _key(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


def read_description_file(path: str | Path) -> dict[str, list[str]]:
    """Every class's sentences in the file, by the file's own class names, attribute bags flattened.

    A DataError in one line naming the file (and the class) for a missing or unreadable file, JSON
    that is not an object, or a class whose value is not a list of strings or an attribute bag.
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"data.descriptions: {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data.descriptions: {path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"data.descriptions: {path} must hold a JSON object mapping class names to sentences")
    out = {}
    for name, value in raw.items():
        if isinstance(value, dict):  # TAP: attribute -> sentences
            sentences = [s for bag in value.values() for s in (bag if isinstance(bag, list) else [bag])]
        else:
            sentences = value
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise DataError(
                f"data.descriptions: {path}: class '{name}' must map to a list of sentences "
                "or to attributes that each map to a list of sentences"
            )
        out[str(name)] = list(sentences)
    return out


def match_descriptions(described: dict[str, list[str]], classnames: list[str]) -> dict[str, list[str] | None]:
    """For each of `classnames`, its sentences in `described` (by name, else by `_key`), or None."""
    exact = described
    loose = {}
    for name, sentences in described.items():
        loose.setdefault(_key(name), sentences)
    return {c: exact[c] if c in exact else loose.get(_key(c)) for c in classnames}


def load_descriptions(path: str | Path, classnames: list[str]) -> list[list[str]]:
    """The sentences of each class of `classnames`, in that order (one non-empty list per class).

    A DataError in one line naming the file and the first class that has no entry or an empty list.
    """
    matched = match_descriptions(read_description_file(path), classnames)
    for name, sentences in matched.items():
        if sentences is None:
            raise DataError(f"data.descriptions: {path} has no sentences for class '{name}'")
        if not sentences:
            raise DataError(f"data.descriptions: {path} has an empty list for class '{name}'")
    return [matched[c] for c in classnames]


def check_descriptions(
    path: str | Path, classnames: list[str], count_tokens, context_length: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) of a description file for a dataset's classes, as (problem, fix) pairs, one
    per class: errors for a class without an entry or with an empty list (a run refuses them),
    warnings for a class with sentences longer than the tokenizer's context (a run truncates them).

    Args:
        path: the description file.
        classnames: the dataset's classes.
        count_tokens: a sentence -> its tokens, start and end tokens included.
        context_length: the tokenizer's context length.
    Raises:
        DataError: the file is missing or not a description file (`read_description_file`).
    """
    matched = match_descriptions(read_description_file(path), classnames)
    write = f"add its sentences to {path} (tools/describe.py writes them)"
    errors, warnings = [], []
    for name, sentences in matched.items():
        if sentences is None:
            errors.append((f"{path} has no sentences for class '{name}'", write))
        elif not sentences:
            errors.append((f"{path} has an empty list for class '{name}'", write))
        else:
            long = [n for n in map(count_tokens, sentences) if n > context_length]
            if long:
                warnings.append(
                    (
                        f"{path}: {len(long)} of {len(sentences)} sentences of class '{name}' are longer "
                        f"than the tokenizer's context of {context_length} tokens (the longest: {max(long)})",
                        "shorten them: a run truncates them to the context (the originals refuse them)",
                    )
                )
    return errors, warnings

"""Held-out text records as whole passages, and the last-word cloze items cut from them: what ``kvcal tasks`` hands
lm-evaluation-harness instead of a stock task's downloaded data.

A passage is one paragraph of a plain-text record of ``--data`` (a record split at its blank lines: a verse, a
paragraph, a document's paragraphs each), each file's records through the token stream's seeded shuffle (sources and
files in the order given); a record calibration used (its digest, ``stream.text_digest``, among the checkpoint's
records) gives none. A cloze item is a passage of at least ``MIN_WORDS`` words whose last word is letters only once
its trailing punctuation is dropped: the context is the passage up to that word, the target is a space and the word
(LAMBADA's form, so a tokenizer sees the word as it would in running text).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sources import pick_column, read_rows, resolve_sources
from .stream import text_digest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MIN_WORDS = 8  # a shorter passage leaves too little context to predict its last word from
_PARAGRAPH = re.compile(r"\n\s*\n")  # a blank line: where a record's paragraphs part
# The passage's last whitespace-separated token, with the space before it: the context ends where it starts.
_LAST_TOKEN = re.compile(r"\s(\S+)\s*$")
_TRAILING = string.punctuation + "\u2019\u201d"  # ASCII punctuation and the closing curly quotes


@dataclass
class Passages:
    """Held-out passages, and how many records calibration used were passed over."""

    texts: list[str] = field(default_factory=list)
    excluded: int = 0


@dataclass(frozen=True)
class ClozeItem:
    """One last-word item: the passage up to its last word, and that word with a leading space."""

    context: str
    target: str


def held_out_passages(sources: list[str], tokenizer: PreTrainedTokenizerBase, exclude: frozenset[str], *,
                      limit: int, text_field: str | None = None, seed: int = 0) -> Passages:
    """Up to ``limit`` passages: the paragraphs of the non-empty plain-text records of ``sources`` whose digest is not
    in ``exclude``, each stripped of surrounding whitespace: sources and their files in the order given, each file's
    records through the stream's seeded shuffle (``read_rows``).

    The digest is the token stream's for a text record (``stream.text_digest``), whatever its length. Chat
    (``messages``) and pre-tokenized (``input_ids``) records have no passage to cut a word from and are refused."""
    found = Passages()
    for source in resolve_sources(sources):
        for part in source.parts:
            first = next(read_rows(part), None)
            if first is None:
                raise ValueError(f"{part.path} holds no records; remove it from --data")
            part.column = pick_column(part, list(first), text_field)
            if part.column in ("messages", "input_ids"):
                raise ValueError(f"{part.path} holds {part.column!r} records; task accuracy needs plain text passages "
                                 "(a 'text' column, or --text-field naming one)")
            for row in read_rows(part, shuffle_seed=seed):
                if len(found.texts) >= limit:
                    return found
                text = row[part.column]
                if not isinstance(text, str) or not text.strip():
                    continue
                text = text.strip()
                if exclude and text_digest(tokenizer, text) in exclude:
                    found.excluded += 1
                    continue
                for paragraph in _PARAGRAPH.split(text):
                    if paragraph.strip() and len(found.texts) < limit:
                        found.texts.append(paragraph.strip())
    return found


def cloze_item(text: str) -> ClozeItem | None:
    """The last-word item of a passage, or None when it has under ``MIN_WORDS`` words or its last word, trailing
    punctuation dropped, is not letters only (a number, a hyphenated or quoted word: not one word to predict)."""
    if len(text.split()) < MIN_WORDS:
        return None
    last = _LAST_TOKEN.search(text)
    word = last.group(1).rstrip(_TRAILING) if last else ""
    if not word.isalpha():
        return None
    return ClozeItem(context=text[: last.start()], target=" " + word)


def cloze_items(texts: list[str], count: int) -> list[ClozeItem]:
    """The first ``count`` passages of ``texts`` that make a cloze item, as items (fewer when too few do)."""
    items = []
    for text in texts:
        item = cloze_item(text)
        if item is not None:
            items.append(item)
            if len(items) == count:
                break
    return items

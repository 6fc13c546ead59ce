"""Calibration data: the user's files or hub datasets → token sequences, with a manifest of what was read.

Sources (``DataConfig.sources``, ``--data`` given several times), each one of:

* a local file: ``.txt`` (documents separated by blank lines, i.e. one record per paragraph),
  ``.jsonl`` / ``.json`` (one object per line, or an array of objects), ``.parquet``, ``.csv``;
* a glob (``data/*.jsonl``, ``data/**/*.txt``) or a directory: every supported file it matches or
  holds directly (not recursive; use a ``**`` glob for that), in sorted order, other files ignored
  (a file or directory whose own name holds ``*?[``, such as ``x[1].jsonl``, is read as itself);
* a directory written by ``datasets``' ``save_to_disk``, optionally ``dir@split`` for a DatasetDict;
* a Hugging Face Hub dataset ``name[:config][@split]`` (split ``train`` by default), streamed at the
  revision current when the run starts.

A source may end in ``::WEIGHT`` (``code.jsonl::0.3``). Weighted sources share the token budget in
proportion to their weights (normalised; every source or none must have one): the next sequence
always comes from the source furthest below its share, so each share is met to within one
sequence. Without weights the sources take turns, one sequence each (round-robin). A source that
runs out drops out and the others fill the budget (with a warning when it had a weight).

Records are read in streaming mode (bounded memory), every file and hub dataset through
``datasets``. The record kind comes from its columns: ``text_field`` if given (``.txt`` files
always give text), else the first of ``input_ids`` (token ids used exactly as given: no BOS, EOS or
packing, only cut at ``seq_len``), ``messages`` (a chat, rendered with the tokenizer's chat template)
and ``text``. All files of one source must hold the same kind (their other columns may differ).
Text is stripped; empty records are skipped. Text files must be UTF-8: anything else is refused
with the byte offset of the first bad byte (decoding with replacement characters would calibrate
on garbage without anyone noticing).

Sequences: text and chats are packed — documents joined with EOS, every sequence starting with BOS
when the tokenizer adds one by default — into sequences of exactly ``seq_len`` tokens, except the
last one of a source that runs out and the last one of the run, which is cut to the token budget.
With ``pack=False`` each record is its own sequence. A record that does not fit in one sequence
is split into several (``long_records="split"``) or refused (``"error"``).

Records are identified by ``record_digest``: sha256 of their token ids, so one rule covers text, chats and
``input_ids``, whichever file or mixture they came from. A stream lists the digests of the records it used
(``consumed()``; a record split over sequences or packed across two counts once, whole) and skips records whose
digest is in its ``exclude`` set: that is how verify keeps clear of what calibration saw.

A stream made with ``layouts=True`` (verify's) also keeps, for each sequence it yields, a ``Layout``: which record each
token came from and what kind of token it is (``kinds``), so verify can tell a token deep in its own record from one
deep in a packed sequence of unrelated records, and report KL by chat role or by JSON, code and prose.
"""

import hashlib
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import file_sha256
from .config import DataConfig
from .kinds import chat_labels, text_labels, token_codes
from .sources import Part, Source, files_of, hub_revision, part_label, pick_column, read_rows, resolve_sources

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


# Hex digits kept of a record's sha256: 64 bits, no collision expected below billions of records.
DIGEST_HEX = 16
# Text longer than this many characters is tokenized a piece at a time, each piece cut before a space or newline:
# a fast tokenizer holds offsets and token strings for all it encodes (a 32 MiB record took 7 GB whole), and only
# the first max_tokens ids of a record can ever be used.
TOKENIZE_CHARS = 1 << 18


def record_digest(ids: list[int]) -> str:
    """A record's identity: sha256 of its token ids as 8-byte little-endian integers, first DIGEST_HEX hex digits.

    Token ids rather than text: chats, text and pre-tokenized records all end as ids, and an id list is what
    the model saw (the same text under another tokenizer is other data to it).
    """
    return _digest_update(hashlib.sha256(), ids).hexdigest()[:DIGEST_HEX]


def text_digest(tokenizer, text: str) -> str:
    """``record_digest`` of a plain-text record (``text`` stripped), as the stream computes it: tokenized a piece of
    ``TOKENIZE_CHARS`` at a time without special tokens, so a record of any length has the digest calibration wrote."""
    hasher = hashlib.sha256()
    for start, end in _pieces(text, TOKENIZE_CHARS):
        _digest_update(hasher, tokenizer(text[start:end], add_special_tokens=False).input_ids)
    return hasher.hexdigest()[:DIGEST_HEX]


def _digest_update(hasher: "hashlib._Hash", ids: list[int]) -> "hashlib._Hash":
    """``hasher`` fed ``ids`` as record_digest encodes them, so a record hashed piece by piece gets the same digest."""
    hasher.update(b"".join(t.to_bytes(8, "little") for t in ids))
    return hasher


def read_digests(path: Path) -> frozenset[str]:
    """Record digests one a line, as OUT keeps the calibration's; an empty set when the file is missing (an
    output older than it, or not kvcal's)."""
    if not path.is_file():
        return frozenset()
    digests = frozenset(path.read_text().split())
    bad = next((d for d in digests if len(d) != DIGEST_HEX or d.strip("0123456789abcdef")), None)
    if bad is not None:
        raise ValueError(f"{path} holds {bad[:40]!r}, not a record digest; it was damaged: pass --include-calibration-data to verify without it")
    return digests


@dataclass
class Layout:
    """Where each token of one yielded sequence came from.

    ``record``: [S] int64, the record each token belongs to, numbered in the order its source read them (-1: the BOS
    a sequence starts with); a record's EOS is its own, and a record split over sequences keeps its number.
    ``kind``: [S] uint8, each token's ``kinds`` code (0: none).
    """

    record: "torch.Tensor"
    kind: "torch.Tensor"


def iter_sequences(
    config: DataConfig, tokenizer: "PreTrainedTokenizerBase", *, max_context: int | None = None,
    exclude: frozenset[str] = frozenset(), layouts: bool = False,
) -> "SequenceStream":
    """Prepare the token sequences of a calibration run.

    Opens every source once (first record only) so that a wrong column, a schema mix or an
    unreachable hub fails here rather than halfway through calibration.

    Args:
        config: the data configuration; validated here.
        tokenizer: the model's Hugging Face tokenizer.
        max_context: the model's context length in tokens, when known.
        exclude: ``record_digest``s of records to skip (counted per source as ``records_excluded``).
        layouts: keep a ``Layout`` of every sequence yielded (``layouts()``).

    Returns:
        A re-iterable stream of 1-D int64 token sequences, with a ``manifest()``.
    """
    config.validate(max_context=max_context)
    sources = resolve_sources(config.sources)
    for source in sources:
        kinds = {}
        for part in source.parts:
            if part.builder == "hub":
                part.revision = hub_revision(part)
            first = next(read_rows(part), None)
            if first is None:
                raise ValueError(f"{part_label(part)} holds no records; remove it from --data")
            part.column = pick_column(part, list(first), config.text_field)
            kinds["text" if part.column not in ("input_ids", "messages") else part.column] = part_label(part)
        if len(kinds) > 1:
            raise ValueError(
                f"source {source.spec} mixes record kinds: "
                + ", ".join(f"{kind} in {label}" for kind, label in kinds.items())
                + "; give each kind its own --data"
            )
        source.kind = next(iter(kinds))
        if source.kind == "messages" and not tokenizer.chat_template:
            raise ValueError(
                f"{source.spec} holds chat 'messages' but the tokenizer has no chat template; "
                "use the chat model's tokenizer or give the data as plain text"
            )
        if source.kind != "input_ids" and config.pack and tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token to separate packed documents; pass pack=False")
    return SequenceStream(config, sources, tokenizer, exclude, layouts)


class SequenceStream:
    """Token sequences of a calibration run: iterate for 1-D int64 tensors; ``manifest()`` says what was read.

    Iterating again starts over and yields the same sequences (the shuffle is seeded).
    """

    def __init__(self, config: DataConfig, sources: list[Source], tokenizer: "PreTrainedTokenizerBase",
                 exclude: frozenset[str] = frozenset(), layouts: bool = False):
        self.config = config
        self.track = layouts
        self._layouts: list[Layout] = []  # of the current (or last) iteration's sequences, when tracked
        self.exclude = exclude
        self._consumed: set[str] = set()  # digests of the records the current (or last) iteration used
        self.tokenizer = tokenizer
        self.tokens_yielded = 0
        self._sources = sources
        self._vocab_size = len(tokenizer)
        self._sha256: dict[Path, str] = {}  # file → hash, computed on the first manifest()
        bos = tokenizer.bos_token_id
        # BOS only for tokenizers that add it themselves: that is how the model saw text in training.
        self._prefix = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []

    def __iter__(self) -> Iterator["torch.Tensor"]:
        """Sequences until the token budget is spent or every source has run out."""
        import torch  # here: `kvcal --help` and recipe checks read DataConfig without paying for torch

        self.tokens_yielded = 0
        self._consumed = set()
        self._layouts = []
        for source in self._sources:
            source.records_read = source.records_empty = source.records_excluded = source.sequences = source.tokens = 0
        streams = {i: self._sequences(source) for i, source in enumerate(self._sources)}
        weighted = self._sources[0].weight is not None
        while streams and self.tokens_yielded < self.config.max_tokens:
            # Weighted: the source furthest below its token share; else the one with fewest sequences.
            i = min(
                streams,
                key=lambda i: (
                    self._sources[i].tokens / self._sources[i].weight if weighted else self._sources[i].sequences,
                    i,
                ),
            )
            source = self._sources[i]
            sequence, layout = next(streams[i], (None, None))
            if sequence is None:
                del streams[i]
                if source.records_read == source.records_empty:
                    raise ValueError(
                        f"{source.spec}: all {source.records_read} records are empty; "
                        "check text_field or remove this source"
                    )
                if weighted and streams:
                    warnings.warn(
                        f"{source.spec} ran out after {source.tokens} tokens, short of its share "
                        f"{source.weight:.0%} of {self.config.max_tokens}; the other sources fill the rest",
                        stacklevel=2,
                    )
                continue
            sequence = sequence[: self.config.max_tokens - self.tokens_yielded]
            if layout is not None:
                self._layouts.append(Layout(layout.record[: len(sequence)], layout.kind[: len(sequence)]))
            source.sequences += 1
            source.tokens += len(sequence)
            self.tokens_yielded += len(sequence)
            yield torch.tensor(sequence, dtype=torch.long)

    def shard(self, rank: int, world: int, *, skip: int = 0, skip_tokens: int | None = None) -> Iterator["torch.Tensor"]:
        """This rank's share of the sequences: sequence i goes to rank ``i % world``.

        Every rank reads and tokenizes the whole stream and keeps its share, so the shares together are
        exactly the sequences of one process, however many ranks and however unevenly they split (a rank
        may get none), and ``manifest()`` still describes the whole set once the shard is exhausted.

        Args:
            skip: the first ``skip`` sequences of the share are read but not yielded: a resumed run has their
                statistics already, and reading them keeps the packing, the mixture and the manifest as they were.
            skip_tokens: how many tokens those sequences held when they were captured; other data or another
                tokenizer would cut them differently, which is refused.
        """
        share = skipped = 0
        for i, sequence in enumerate(self):
            if i % world != rank:
                continue
            share += 1
            if share > skip:
                yield sequence
                continue
            skipped += sequence.numel()
            if share == skip and skip_tokens is not None and skipped != skip_tokens:
                raise ValueError(
                    f"the first {skip} sequences of rank {rank}'s share hold {skipped} tokens now but {skip_tokens} "
                    "when they were captured: the data or the tokenizer changed; start over without resuming"
                )
        if share < skip:
            raise ValueError(f"rank {rank}'s share holds {share} sequences now but {skip} were captured before: "
                             "the data changed; start over without resuming")

    def layouts(self) -> list[Layout]:
        """The ``Layout`` of each sequence the current (or last) iteration yielded, in order (a stream made with
        ``layouts=True``)."""
        if not self.track:
            raise ValueError("this stream keeps no layouts: make it with iter_sequences(..., layouts=True)")
        return list(self._layouts)

    def consumed(self) -> list[str]:
        """Sorted ``record_digest``s of the records the current (or last) iteration used.

        A record counts once any of its tokens went into a yielded sequence; the last sequence's cut at the token
        budget may leave part of the final record unused, which still counts (erring toward excluding more).
        """
        return sorted(self._consumed)

    def manifest(self) -> list[dict]:
        """Per source: what it is, its weight, how much of it was used, and hashes to reproduce the run.

        Local files are identified by size and sha256 of their bytes (a save_to_disk directory by
        all its files; hashed on the first call), hub datasets by the commit they were read at.
        Counts are those of the current (or last) iteration.
        """
        return [
            {
                "source": source.spec,
                "kind": source.kind,
                "weight": source.weight,
                "records_read": source.records_read,
                "records_empty": source.records_empty,
                "records_excluded": source.records_excluded,
                "sequences": source.sequences,
                "tokens": source.tokens,
                "files": [
                    {"path": str(f), "bytes": f.stat().st_size, "sha256": self._hash(f)}
                    for part in source.parts
                    if part.builder != "hub"
                    for f in files_of(part)
                ],
                "revision": next((part.revision for part in source.parts if part.builder == "hub"), None),
            }
            for source in self._sources
        ]

    def _hash(self, path: Path) -> str:
        """sha256 of a file's bytes, read in 1 MiB chunks, once per stream."""
        if path not in self._sha256:
            self._sha256[path] = file_sha256(path)
        return self._sha256[path]

    def _sequences(self, source: Source) -> Iterator[tuple[list[int], Layout | None]]:
        """A source's sequences: packed, one per record, or ids cut at seq_len; each with its layout when tracked."""
        seq_len = self.config.seq_len
        if source.kind == "input_ids":
            for n, (ids, codes) in enumerate(self._documents(source)):
                yield from ((ids[i : i + seq_len], self._layout([], [n] * len(ids[i : i + seq_len]), codes[i : i + seq_len]))
                            for i in range(0, len(ids), seq_len))
        elif not self.config.pack:
            body = seq_len - len(self._prefix)
            for n, (ids, codes) in enumerate(self._documents(source)):
                yield from ((self._prefix + ids[i : i + body], self._layout(self._prefix, [n] * len(ids[i : i + body]), codes[i : i + body]))
                            for i in range(0, len(ids), body))
        else:
            body = seq_len - len(self._prefix)
            buffer: list[int] = []
            records: list[int] = []  # parallel to buffer when tracked: each token's record number
            kinds: list[int] = []  # and its kinds code
            for n, (ids, codes) in enumerate(self._documents(source)):
                buffer += ids + [self.tokenizer.eos_token_id]
                if self.track:
                    records += [n] * (len(ids) + 1)
                    kinds += codes + [0]
                full = len(buffer) - len(buffer) % body
                yield from ((self._prefix + buffer[i : i + body], self._layout(self._prefix, records[i : i + body], kinds[i : i + body]))
                            for i in range(0, full, body))
                del buffer[:full], records[:full], kinds[:full]  # once per document: a book-long record stays linear
            if buffer:
                yield self._prefix + buffer, self._layout(self._prefix, records, kinds)

    def _layout(self, prefix: list[int], records: list[int], codes: list[int]) -> Layout | None:
        """The layout of ``prefix`` + the tokens of ``records`` with kinds ``codes``; None when not tracked."""
        if not self.track:
            return None
        import torch

        return Layout(torch.tensor([-1] * len(prefix) + records, dtype=torch.long),
                      torch.tensor([0] * len(prefix) + codes, dtype=torch.uint8))

    def _documents(self, source: Source) -> Iterator[tuple[list[int], list[int]]]:
        """A source's non-empty records as token ids with each token's kinds code (an empty list when not tracked),
        files in seeded order, records through a seeded shuffle."""
        seed = self.config.seed
        for part in random.Random(seed).sample(source.parts, len(source.parts)):
            for row in read_rows(part, shuffle_seed=seed):
                source.records_read += 1
                ids, length, digest, codes = self._encode(row[part.column], source.kind, part)
                if not length:
                    source.records_empty += 1
                    continue
                if digest in self.exclude:
                    source.records_excluded += 1
                    continue
                extra = 0 if source.kind == "input_ids" else len(self._prefix)
                if self.config.long_records == "error" and length + extra > self.config.seq_len:
                    raise ValueError(
                        f"{part_label(part)}: a record of {length + extra} tokens does not fit in "
                        f"seq_len={self.config.seq_len}; raise seq_len or pass long_records='split'"
                    )
                # Read only when the next sequence needs it: every record read lands (at least in part) in one.
                self._consumed.add(digest)
                yield ids, (codes or [0] * len(ids)) if self.track else []

    def _encode(self, value: object, kind: str, part: Part) -> tuple[list[int], int, str, list[int]]:
        """One record → (its first ``max_tokens`` token ids, its length in tokens, its ``record_digest``, the kinds code
        of each token kept: empty when not tracked or not known).

        No special tokens except those the data itself holds. Long text is tokenized in pieces of TOKENIZE_CHARS
        (the digest still covers the whole record), so memory stays bounded by the budget, not the record.
        """
        if kind == "input_ids":
            if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
                raise ValueError(f"{part_label(part)}: 'input_ids' must be lists of integers, got {_short(value)}")
            if value and (min(value) < 0 or max(value) >= self._vocab_size):
                raise ValueError(
                    f"{part_label(part)}: token ids outside [0, {self._vocab_size}) of this "
                    "tokenizer; were they made with another model's tokenizer?"
                )
            return value, len(value), record_digest(value), []
        chars: bytearray | None = None  # each character's kinds code, when tracked
        if kind == "messages":
            if not value:
                return [], 0, "", []
            try:
                if self.track:
                    text, chars = chat_labels(value, lambda m: self.tokenizer.apply_chat_template(m, tokenize=False))
                else:
                    text = self.tokenizer.apply_chat_template(value, tokenize=False)
            except Exception as e:  # jinja errors, malformed messages: name the file, keep the template's words
                raise ValueError(f"{part_label(part)}: chat template failed on {_short(value)}: {e}") from e
        elif value is None:
            return [], 0, "", []
        elif not isinstance(value, str):
            raise ValueError(
                f"{part_label(part)}: column '{part.column}' should hold text, got {_short(value)}; "
                "pass text_field naming a text column"
            )
        else:
            text = value.strip()
            chars = text_labels(text) if self.track else None
        offsets = chars is not None and self.tokenizer.is_fast  # a slow tokenizer gives no offsets: no labels
        kept: list[int] = []
        codes: list[int] = []
        length, hasher = 0, hashlib.sha256()
        for start, end in _pieces(text, TOKENIZE_CHARS):
            encoded = self.tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=offsets)
            ids, spans = encoded.input_ids, encoded.get("offset_mapping", [])
            if start == 0 and kind == "messages" and self._prefix and ids[:1] == self._prefix:
                ids, spans = ids[1:], spans[1:]  # the template's own BOS: every sequence gets one at its start instead
            _digest_update(hasher, ids)
            length += len(ids)
            room = self.config.max_tokens - len(kept)
            kept += ids[:room]
            if offsets:
                codes += token_codes(chars, spans[:room], base=start)
        return kept, length, hasher.hexdigest()[:DIGEST_HEX], codes


def _pieces(text: str, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of ``text`` in pieces of at most ``size`` characters, each cut before a space or newline when one
    is in reach (so no word is split); the whole text as one piece when it fits."""
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = cut if cut > start else end
        yield start, end
        start = end


def _short(value: object) -> str:
    """A value's repr, cut for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def portable_manifest(manifest: list[dict]) -> list[dict]:
    """A ``SequenceStream.manifest`` with no local path: files by name (size and sha256 identify them), a source
    given as a path or glob by its last part; Hub datasets keep their id and revision. For what leaves the machine."""
    return [{**d, "source": Path(d["source"]).name if d["files"] else d["source"],
             "files": [{**f, "path": Path(f["path"]).name} for f in d["files"]]} for d in manifest]

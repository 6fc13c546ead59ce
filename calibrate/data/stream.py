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
"""

import codecs
import glob
import json
import os
import random
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import file_sha256
from ..choices import LONG_RECORDS
from ..hub import HUB_TIMEOUT_S

if TYPE_CHECKING:
    import torch
    import datasets
    from transformers import PreTrainedTokenizerBase

# File suffix → the `datasets` builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
TEXT_BUILDERS = ("text", "json", "csv")  # builders that decode bytes as UTF-8
KIND_COLUMNS = ("input_ids", "messages", "text")  # auto-detected columns, in order of preference
SHUFFLE_BUFFER = 1000  # records held by the streaming shuffle: bounds memory, limits how far records move
_HUB_NAME = re.compile(r"^(?P<name>[\w.-]+(?:/[\w.-]+)?)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?$")
_TRUE = ("1", "ON", "YES", "TRUE")


def as_sources(data: str | Path | list | None) -> list[str]:
    """``--data`` as given (one source, a list of them, or none) → a list of source strings."""
    return [str(data)] if isinstance(data, (str, Path)) else [str(s) for s in data or []]


def check_int(name: str, value: object, low: int) -> None:
    """The one rule for a count setting: a whole number ≥ ``low``; the error names the setting and its flag."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        rule = "a positive integer" if low == 1 else f"an integer ≥ {low}"
        raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value!r}")


@dataclass
class DataConfig:
    """What to read and how to cut it into sequences (a recipe's ``data:`` section).

    Attributes:
        sources: files, globs, directories or hub names, each optionally ``::WEIGHT`` (module docstring).
        seq_len: tokens per sequence (the last one of a source, and of the run, may be shorter).
        max_tokens: token budget of the whole run, BOS and EOS included.
        chunk_len: a sequence longer than this runs through the model as chunked prefill through a KV cache.
        text_field: column holding plain text; None = auto-detect ``input_ids``, ``messages``, ``text``.
        pack: join documents into full ``seq_len`` sequences; False = one record per sequence.
        seed: seed of the record shuffle (and of the order in which a source's files are read).
        long_records: ``"split"`` a record longer than one sequence, or refuse it with ``"error"``.
    """

    sources: list[str]
    seq_len: int = 2048
    max_tokens: int = 500_000
    chunk_len: int = 2048
    text_field: str | None = None
    pack: bool = True
    seed: int = 0
    long_records: str = "split"

    def check_values(self) -> "DataConfig":
        """Every setting but the sources (a recipe's ``data:`` section is checked this way); returns self."""
        check_int("seq_len", self.seq_len, 2)
        check_int("max_tokens", self.max_tokens, 1)
        check_int("chunk_len", self.chunk_len, 1)
        if self.long_records not in LONG_RECORDS:
            raise ValueError(f"long_records must be one of {', '.join(LONG_RECORDS)}, got {self.long_records!r}")
        if self.text_field is not None and (not isinstance(self.text_field, str) or not self.text_field):
            raise ValueError(f"text_field must be a column name or None, got {self.text_field!r}")
        if not isinstance(self.pack, bool):
            raise ValueError(f"pack must be True or False, got {self.pack!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        return self

    def check_budget(self) -> None:
        """A run's budget holds at least one packed sequence (the data layer itself cuts the last one to it)."""
        if self.pack and self.max_tokens < self.seq_len:
            raise ValueError(f"--max-tokens {self.max_tokens} is less than one sequence (--seq-len {self.seq_len}); raise it")

    def validate(self, *, max_context: int | None = None) -> "DataConfig":
        """Cheap checks (values, sources exist and are non-empty), to run before any model is loaded; returns self.

        Args:
            max_context: the model's context length in tokens, when known; ``seq_len`` must fit in it.

        Raises:
            ValueError: saying what is wrong and how to fix it.
        """
        self.check_values()
        self.check_context(max_context)
        _resolve_sources(self.sources)
        return self

    def check_context(self, max_context: int | None) -> None:
        """``seq_len`` fits in the model's context (in tokens; None: unknown, anything fits)."""
        if max_context is not None and self.seq_len > max_context:
            raise ValueError(
                f"--seq-len {self.seq_len} is longer than the model's context of {max_context} tokens; "
                f"lower it to at most {max_context}"
            )


@dataclass
class _Part:
    """One stream of records: a data file, a save_to_disk directory or a hub dataset."""

    builder: str  # a BUILDERS value, "disk" or "hub"
    path: str  # file or directory path, or hub dataset name
    config: str | None = None  # hub config
    split: str | None = None  # DatasetDict / hub split
    revision: str | None = None  # hub commit, looked up when the stream is prepared
    column: str | None = None  # the column records are read from, found when the stream is prepared


@dataclass
class _Source:
    """One ``--data`` entry and what has been read from it so far."""

    spec: str  # as given, without the weight
    weight: float | None  # normalised; None when sources take turns
    parts: list[_Part]
    kind: str = ""  # one of KIND_COLUMNS
    records_read: int = 0
    records_empty: int = 0
    sequences: int = 0
    tokens: int = 0


def iter_sequences(
    config: DataConfig, tokenizer: "PreTrainedTokenizerBase", *, max_context: int | None = None
) -> "SequenceStream":
    """Prepare the token sequences of a calibration run.

    Opens every source once (first record only) so that a wrong column, a schema mix or an
    unreachable hub fails here rather than halfway through calibration.

    Args:
        config: the data configuration; validated here.
        tokenizer: the model's Hugging Face tokenizer.
        max_context: the model's context length in tokens, when known.

    Returns:
        A re-iterable stream of 1-D int64 token sequences, with a ``manifest()``.
    """
    config.validate(max_context=max_context)
    sources = _resolve_sources(config.sources)
    for source in sources:
        kinds = {}
        for part in source.parts:
            if part.builder == "hub":
                part.revision = _hub_revision(part)
            first = next(_rows(part), None)
            if first is None:
                raise ValueError(f"{_label(part)} holds no records; remove it from --data")
            part.column = _pick_column(part, list(first), config.text_field)
            kinds["text" if part.column not in ("input_ids", "messages") else part.column] = _label(part)
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
    return SequenceStream(config, sources, tokenizer)


class SequenceStream:
    """Token sequences of a calibration run: iterate for 1-D int64 tensors; ``manifest()`` says what was read.

    Iterating again starts over and yields the same sequences (the shuffle is seeded).
    """

    def __init__(self, config: DataConfig, sources: list[_Source], tokenizer: "PreTrainedTokenizerBase"):
        self.config = config
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
        for source in self._sources:
            source.records_read = source.records_empty = source.sequences = source.tokens = 0
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
            sequence = next(streams[i], None)
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
                "sequences": source.sequences,
                "tokens": source.tokens,
                "files": [
                    {"path": str(f), "bytes": f.stat().st_size, "sha256": self._hash(f)}
                    for part in source.parts
                    if part.builder != "hub"
                    for f in _files_of(part)
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

    def _sequences(self, source: _Source) -> Iterator[list[int]]:
        """A source's sequences: packed, one per record, or ids cut at seq_len."""
        seq_len = self.config.seq_len
        if source.kind == "input_ids":
            for ids in self._documents(source):
                yield from _chunks(ids, seq_len)
        elif not self.config.pack:
            for ids in self._documents(source):
                yield from (self._prefix + chunk for chunk in _chunks(ids, seq_len - len(self._prefix)))
        else:
            body = seq_len - len(self._prefix)
            buffer: list[int] = []
            for ids in self._documents(source):
                buffer += ids + [self.tokenizer.eos_token_id]
                full = len(buffer) - len(buffer) % body
                yield from (self._prefix + buffer[i : i + body] for i in range(0, full, body))
                del buffer[:full]  # once per document: a book-long record stays linear in its length
            if buffer:
                yield self._prefix + buffer

    def _documents(self, source: _Source) -> Iterator[list[int]]:
        """A source's non-empty records as token ids, files in seeded order, records through a seeded shuffle."""
        seed = self.config.seed
        for part in random.Random(seed).sample(source.parts, len(source.parts)):
            for row in _rows(part, shuffle_seed=seed):
                source.records_read += 1
                ids = self._encode(row[part.column], source.kind, part)
                if not ids:
                    source.records_empty += 1
                    continue
                extra = 0 if source.kind == "input_ids" else len(self._prefix)
                if self.config.long_records == "error" and len(ids) + extra > self.config.seq_len:
                    raise ValueError(
                        f"{_label(part)}: a record of {len(ids) + extra} tokens does not fit in "
                        f"seq_len={self.config.seq_len}; raise seq_len or pass long_records='split'"
                    )
                yield ids

    def _encode(self, value: object, kind: str, part: _Part) -> list[int]:
        """One record → token ids, without special tokens except those the data itself holds."""
        if kind == "input_ids":
            if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
                raise ValueError(f"{_label(part)}: 'input_ids' must be lists of integers, got {_short(value)}")
            if value and (min(value) < 0 or max(value) >= self._vocab_size):
                raise ValueError(
                    f"{_label(part)}: token ids outside [0, {self._vocab_size}) of this "
                    "tokenizer; were they made with another model's tokenizer?"
                )
            return value
        if kind == "messages":
            if not value:
                return []
            try:
                text = self.tokenizer.apply_chat_template(value, tokenize=False)
            except Exception as e:  # jinja errors, malformed messages: name the file, keep the template's words
                raise ValueError(f"{_label(part)}: chat template failed on {_short(value)}: {e}") from e
        elif value is None:
            return []
        elif not isinstance(value, str):
            raise ValueError(
                f"{_label(part)}: column '{part.column}' should hold text, got {_short(value)}; "
                "pass text_field naming a text column"
            )
        else:
            text = value.strip()
        ids = self.tokenizer(text, add_special_tokens=False).input_ids if text else []
        if kind == "messages" and self._prefix and ids[:1] == self._prefix:
            ids = ids[1:]  # the template's own BOS: every sequence gets one at its start instead
        return ids


def local_paths(specs: list[str]) -> list[Path]:
    """The local files and directories ``--data`` reads (a hub dataset has none): inputs an output must not hold."""
    return [Path(part.path) for source in _resolve_sources(specs) for part in source.parts if part.builder != "hub"]


def _resolve_sources(specs: list[str]) -> list[_Source]:
    """``--data`` entries → sources with their parts, checking only what needs no reading of data."""
    if isinstance(specs, str) or not specs:
        raise ValueError("no calibration data: pass at least one --data FILE, DIR, GLOB or hub dataset name")
    sources = []
    for text in specs:
        spec, sep, weight_text = text.rpartition("::")
        if not sep:
            spec, weight = text, None
        else:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = -1.0
            if not 0 < weight < float("inf"):
                raise ValueError(f"weight in {text!r} must be a positive number, as in data.jsonl::0.3")
        sources.append(_Source(spec=spec, weight=weight, parts=_parts(spec)))
    weights = [s.weight for s in sources]
    if None in weights and any(w is not None for w in weights):
        raise ValueError("give every --data source a ::WEIGHT, or none (then they take turns): " + ", ".join(specs))
    if weights[0] is not None:
        for source in sources:
            source.weight /= sum(weights)
    return sources


def _parts(spec: str) -> list[_Part]:
    """The files, save_to_disk directory or hub dataset a source spec names."""
    path = Path(spec).expanduser()
    head, _, split = spec.rpartition("@")
    hub = _HUB_NAME.match(spec)
    if any(c in spec for c in "*?[") and not path.exists():  # a file named x[1].jsonl is that file, not a glob
        files = [Path(f) for f in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
        files = [f for f in files if f.is_file() and f.suffix.lower() in BUILDERS]
        if not files:
            raise ValueError(f"no {'/'.join(BUILDERS)} files match {spec}")
    elif _is_saved_dataset(path):
        return [_Part(builder="disk", path=str(path), split=_saved_split(path, None))]
    elif head and _is_saved_dataset(Path(head).expanduser()):
        path = Path(head).expanduser()
        return [_Part(builder="disk", path=str(path), split=_saved_split(path, split))]
    elif path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in BUILDERS)
        if not files:
            raise ValueError(
                f"directory {spec} holds no {'/'.join(BUILDERS)} files; "
                "point --data at the files or a ** glob for subdirectories"
            )
    elif path.is_file():
        if path.suffix.lower() not in BUILDERS:
            raise ValueError(f"{spec}: unsupported file type; convert it to one of {', '.join(BUILDERS)}")
        files = [path]
    elif path.suffix.lower() in BUILDERS or spec.startswith((".", "/", "~")) or not hub:
        raise ValueError(f"{spec}: no such file or directory (and not a hub dataset name:config@split)")
    elif _hub_offline():
        raise ValueError(
            f"{spec} is no local file or directory, and the Hugging Face Hub is off "
            "(HF_HUB_OFFLINE is set): pass local files instead"
        )
    else:
        return [_Part(builder="hub", path=hub["name"], config=hub["config"], split=hub["split"] or "train")]
    for f in files:
        try:
            with f.open("rb") as handle:
                empty = not handle.read(1)
        except OSError as e:
            raise ValueError(f"cannot read {f}: {e.strerror}; fix its permissions or remove it from --data") from e
        if empty:
            raise ValueError(f"{f} is empty; remove it from --data")
    return [_Part(builder=BUILDERS[f.suffix.lower()], path=str(f)) for f in files]


def _pick_column(part: _Part, columns: list[str], text_field: str | None) -> str:
    """The column records of ``part`` are read from: text_field, else the first of KIND_COLUMNS present."""
    if part.builder == "text":
        return "text"
    wanted = [text_field] if text_field else KIND_COLUMNS
    for name in wanted:
        if name in columns:
            return name
    raise ValueError(
        f"{_label(part)} has no {' / '.join(repr(w) for w in wanted)} column; its columns are "
        f"{', '.join(columns)}: pass text_field naming the text column"
    )


def _open(part: _Part) -> "datasets.IterableDataset":
    """A streaming ``datasets.IterableDataset`` over the records of one part."""
    import datasets  # here, not at the top: importing datasets takes seconds that `kvcal --help` should not

    if part.builder == "hub":
        return datasets.load_dataset(part.path, part.config, split=part.split, revision=part.revision, streaming=True)
    if part.builder == "disk":
        dataset = datasets.load_from_disk(part.path)
        return (dataset[part.split] if part.split else dataset).to_iterable_dataset()
    options = {"sample_by": "paragraph"} if part.builder == "text" else {}
    # load_dataset pings the hub to count downloads even of local files; without a network the DNS lookup
    # alone can stall for seconds, once per file.
    counting = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        # data_files are patterns to datasets: escaped, x[1].jsonl is that file, not x1.jsonl.
        return datasets.load_dataset(part.builder, data_files=[glob.escape(part.path)], split="train", streaming=True, **options)
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counting


def _rows(part: _Part, *, shuffle_seed: int | None = None) -> Iterator[dict]:
    """The records of one part, shuffled in a bounded buffer when seeded; read errors name the file."""
    try:
        dataset = _open(part)
        if shuffle_seed is not None:
            # One input shard at a time: more would start reader threads, and datasets (5.x) then sleeps 5 s
            # after a Parquet stream to let them end. The shard order is shuffled all the same.
            dataset = dataset.shuffle(seed=shuffle_seed, buffer_size=SHUFFLE_BUFFER, max_buffer_input_shards=1)
        yield from dataset
    except Exception as e:  # any reader's error (pyarrow, pandas, json, network): say which file and why
        offset = _first_invalid_utf8(Path(part.path)) if part.builder in TEXT_BUILDERS else None
        if offset is not None:
            raise ValueError(
                f"{part.path} is not UTF-8 text (first invalid byte at offset {offset}); "
                f"convert it, e.g. iconv -f latin1 -t utf-8"
            ) from e
        raise ValueError(f"cannot read {_label(part)}: {type(e).__name__}: {e}") from e


def _hub_offline() -> bool:
    """Whether the hub is switched off, read at call time (datasets reads the variable once, at import)."""
    return any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _hub_revision(part: _Part) -> str | None:
    """The commit of a hub dataset, one short request that also fails fast without a network."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        return HfApi().dataset_info(part.path, timeout=HUB_TIMEOUT_S).sha
    except RepositoryNotFoundError as e:
        raise ValueError(f"{part.path}: no such local file or directory, and no such dataset on the hub") from e
    except Exception as e:  # DNS, proxy, timeout, offline mode: all mean the same to the user
        raise ValueError(
            f"cannot reach the Hugging Face Hub for {part.path} ({type(e).__name__}): "
            "no network? pass local files instead"
        ) from e


def _is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` was written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _saved_split(path: Path, split: str | None) -> str | None:
    """The split to read from a save_to_disk directory: checked against the splits a DatasetDict lists."""
    if not (path / "dataset_dict.json").is_file():
        if split is not None:
            raise ValueError(f"{path} holds a single dataset, not splits; drop @{split}")
        return None
    splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    if split is None and len(splits) == 1:
        return splits[0]
    if split not in splits:
        raise ValueError(f"{path} holds splits {', '.join(splits)}; pick one as {path}@SPLIT")
    return split


def _files_of(part: _Part) -> list[Path]:
    """The files whose bytes identify a local part."""
    path = Path(part.path)
    return sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]


def _first_invalid_utf8(path: Path) -> int | None:
    """Byte offset of the first byte that is not valid UTF-8, or None when the file decodes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with path.open("rb") as f:
        while True:
            chunk = f.read(1 << 20)
            pending = len(decoder.getstate()[0])  # bytes of an unfinished character from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return offset - pending + e.start
            if not chunk:
                return None
            offset += len(chunk)


def _chunks(ids: list[int], size: int) -> Iterator[list[int]]:
    """``ids`` cut into pieces of ``size`` tokens (the last may be shorter)."""
    return (ids[i : i + size] for i in range(0, len(ids), size))


def _label(part: _Part) -> str:
    """How errors and the manifest name a part."""
    if part.builder == "hub":
        return f"hub dataset {part.path}" + (f":{part.config}" if part.config else "") + f"@{part.split}"
    return part.path + (f"@{part.split}" if part.split else "")


def _short(value: object) -> str:
    """A value's repr, cut for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

"""Data sources: a --data entry (file, glob, directory, save_to_disk directory or Hub dataset, with an optional
::WEIGHT) → its parts, and the records each part holds, read in streaming mode through datasets."""

import codecs
import glob
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..hub import HUB_TIMEOUT_S

if TYPE_CHECKING:
    import datasets

# File suffix → the `datasets` builder that reads it.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
TEXT_BUILDERS = ("text", "json", "csv")  # builders that decode bytes as UTF-8
# A text file gzipped (data.jsonl.gz): datasets' streaming reader decompresses it by this suffix; Parquet compresses
# inside the file, and is never gzipped whole.
GZIP_SUFFIX = ".gz"
SUPPORTED = "/".join([*BUILDERS, *(f"{s}{GZIP_SUFFIX}" for s, b in BUILDERS.items() if b in TEXT_BUILDERS)])
KIND_COLUMNS = ("input_ids", "messages", "text")  # auto-detected columns, in order of preference
SHUFFLE_BUFFER = 1000  # records held by the streaming shuffle: bounds memory, limits how far records move
_HUB_NAME = re.compile(r"^(?P<name>[\w.-]+(?:/[\w.-]+)?)(?::(?P<config>[\w.-]+))?(?:@(?P<split>[\w.-]+))?$")
_TRUE = ("1", "ON", "YES", "TRUE")


@dataclass
class Part:
    """One stream of records: a data file, a save_to_disk directory or a hub dataset."""

    builder: str  # a BUILDERS value, "disk" or "hub"
    path: str  # file or directory path, or hub dataset name
    config: str | None = None  # hub config
    split: str | None = None  # DatasetDict / hub split
    revision: str | None = None  # hub commit, looked up when the stream is prepared
    column: str | None = None  # the column records are read from, found when the stream is prepared


@dataclass
class Source:
    """One ``--data`` entry and what has been read from it so far."""

    spec: str  # as given, without the weight
    weight: float | None  # normalised; None when sources take turns
    parts: list[Part]
    kind: str = ""  # one of KIND_COLUMNS
    records_read: int = 0
    records_empty: int = 0
    records_excluded: int = 0  # held by the stream's ``exclude`` set: read but not used
    sequences: int = 0
    tokens: int = 0


def local_paths(specs: list[str]) -> list[Path]:
    """The local files and directories ``--data`` reads (a hub dataset has none): inputs an output must not hold."""
    return [Path(part.path) for source in resolve_sources(specs) for part in source.parts if part.builder != "hub"]


def resolve_sources(specs: list[str]) -> list[Source]:
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
        sources.append(Source(spec=spec, weight=weight, parts=spec_parts(spec)))
    weights = [s.weight for s in sources]
    if None in weights and any(w is not None for w in weights):
        raise ValueError("give every --data source a ::WEIGHT, or none (then they take turns): " + ", ".join(specs))
    if weights[0] is not None:
        for source in sources:
            source.weight /= sum(weights)
    return sources


def spec_parts(spec: str) -> list[Part]:
    """The files, save_to_disk directory or hub dataset a source spec names."""
    path = Path(spec).expanduser()
    head, _, split = spec.rpartition("@")
    hub = _HUB_NAME.match(spec)
    if any(c in spec for c in "*?[") and not path.exists():  # a file named x[1].jsonl is that file, not a glob
        files = [Path(f) for f in sorted(glob.glob(os.path.expanduser(spec), recursive=True))]
        files = [f for f in files if f.is_file() and builder_of(f)]
        if not files:
            raise ValueError(f"no {SUPPORTED} files match {spec}")
    elif _is_saved_dataset(path):
        return [Part(builder="disk", path=str(path), split=_saved_split(path, None))]
    elif head and _is_saved_dataset(Path(head).expanduser()):
        path = Path(head).expanduser()
        return [Part(builder="disk", path=str(path), split=_saved_split(path, split))]
    elif path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and builder_of(f))
        if not files:
            raise ValueError(
                f"directory {spec} holds no {SUPPORTED} files; "
                "point --data at the files or a ** glob for subdirectories"
            )
    elif path.is_file():
        if not builder_of(path):
            raise ValueError(f"{spec}: unsupported file type; convert it to one of {SUPPORTED.replace('/', ', ')}")
        files = [path]
    elif builder_of(path) or spec.startswith((".", "/", "~")) or not hub:
        raise ValueError(f"{spec}: no such file or directory (and not a hub dataset name:config@split)")
    elif _hub_offline():
        raise ValueError(
            f"{spec} is no local file or directory, and the Hugging Face Hub is off "
            "(HF_HUB_OFFLINE is set): pass local files instead"
        )
    else:
        return [Part(builder="hub", path=hub["name"], config=hub["config"], split=hub["split"] or "train")]
    for f in files:
        try:
            with f.open("rb") as handle:
                empty = not handle.read(1)
        except OSError as e:
            raise ValueError(f"cannot read {f}: {e.strerror}; fix its permissions or remove it from --data") from e
        if empty:
            raise ValueError(f"{f} is empty; remove it from --data")
    return [Part(builder=builder_of(f), path=str(f)) for f in files]


def builder_of(path: Path) -> str | None:
    """The `datasets` builder that reads the file at ``path``, by its suffix (a text file's may end in .gz), or None."""
    name = path.name.lower()
    if name.endswith(GZIP_SUFFIX):
        builder = BUILDERS.get(Path(name.removesuffix(GZIP_SUFFIX)).suffix)
        return builder if builder in TEXT_BUILDERS else None
    return BUILDERS.get(Path(name).suffix)


def pick_column(part: Part, columns: list[str], text_field: str | None) -> str:
    """The column records of ``part`` are read from: text_field, else the first of KIND_COLUMNS present."""
    if part.builder == "text":
        return "text"
    wanted = [text_field] if text_field else KIND_COLUMNS
    for name in wanted:
        if name in columns:
            return name
    raise ValueError(
        f"{part_label(part)} has no {' / '.join(repr(w) for w in wanted)} column; its columns are "
        f"{', '.join(columns)}: pass text_field naming the text column"
    )


def open_part(part: Part) -> "datasets.IterableDataset":
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


def read_rows(part: Part, *, shuffle_seed: int | None = None) -> Iterator[dict]:
    """The records of one part, shuffled in a bounded buffer when seeded; read errors name the file."""
    try:
        dataset = open_part(part)
        if shuffle_seed is not None:
            # One input shard at a time: more would start reader threads, and datasets (5.x) then sleeps 5 s
            # after a Parquet stream to let them end. The shard order is shuffled all the same.
            dataset = dataset.shuffle(seed=shuffle_seed, buffer_size=SHUFFLE_BUFFER, max_buffer_input_shards=1)
        yield from dataset
    except Exception as e:  # any reader's error (pyarrow, pandas, json, network): say which file and why
        offset = _first_invalid_utf8(Path(part.path)) if part.builder in TEXT_BUILDERS else None
        if offset is not None:
            raise ValueError(
                f"{part.path} is not UTF-8 text (first invalid byte at offset {offset}"
                f"{' of its decompressed text' if part.path.lower().endswith(GZIP_SUFFIX) else ''}); "
                f"convert it, e.g. iconv -f latin1 -t utf-8"
            ) from e
        raise ValueError(f"cannot read {part_label(part)}: {type(e).__name__}: {e}") from e


def _hub_offline() -> bool:
    """Whether the hub is switched off, read at call time (datasets reads the variable once, at import)."""
    return any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_revision(part: Part) -> str | None:
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


def files_of(part: Part) -> list[Path]:
    """The files whose bytes identify a local part."""
    path = Path(part.path)
    return sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]


def _first_invalid_utf8(path: Path) -> int | None:
    """Byte offset of the first byte that is not valid UTF-8 (in the decompressed text of a .gz), or None when the file
    decodes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with (gzip.open(path) if path.name.lower().endswith(GZIP_SUFFIX) else path.open("rb")) as f:
        while True:
            try:
                chunk = f.read(1 << 20)
            except (OSError, EOFError):  # a damaged .gz: the reader's own error, which read_rows gives, says so
                return None
            pending = len(decoder.getstate()[0])  # bytes of an unfinished character from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return offset - pending + e.start
            if not chunk:
                return None
            offset += len(chunk)


def part_label(part: Part) -> str:
    """How errors and the manifest name a part."""
    if part.builder == "hub":
        return f"hub dataset {part.path}" + (f":{part.config}" if part.config else "") + f"@{part.split}"
    return part.path + (f"@{part.split}" if part.split else "")

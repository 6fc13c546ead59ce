"""Tests for calibrate/data/stream.py: every format, record kind, mixture, budget and bad input, on the SmolLM2 tokenizer.

Expected sequences are computed here independently: the test tokenizes the texts itself and packs them by hand.
"""

import copy
import gzip
import hashlib
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import datasets
import pandas as pd
import pytest

from calibrate.data import stream
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In the beginning God created the heaven and the earth.",
    "A paragraph that spans\ntwo lines of one record.",
    "Short.",
    "Calibration data should look like the traffic the model will serve in production.",
    "FP8 keeps four exponent bits and three mantissa bits.",
    "Numbers: 3.14159, 2.71828 and 1.41421 are famous constants.",
    "Another record, with a comma, and more words to make it longer than one short sequence of tokens.",
    "def f(x):\n    return x * 2",
    "Last one.",
]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test whose code looks up a host name: reading local data must not touch the network."""
    lookups = []

    def getaddrinfo(host, *args, **kwargs):
        lookups.append(host)
        raise OSError(f"network access to {host} in a test")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert not lookups, f"the code under test tried to reach {lookups}"


@pytest.fixture(scope="module")
def bos_tokenizer(smol_tokenizer):
    """The SmolLM2 tokenizer made to add BOS (id 1) by default, like Llama's."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_bos_token = True
    assert tokenizer("a").input_ids[0] == tokenizer.bos_token_id
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def read_all(tokenizer, sources, **options) -> list[list[int]]:
    return [s.tolist() for s in iter_sequences(DataConfig(sources=sources, **options), tokenizer)]


def check_packed(sequences, tokenizer, texts, seq_len, prefix):
    """Sequences are ``texts`` (in some order) joined with EOS, cut every seq_len - len(prefix), each prefixed."""
    eos = tokenizer.eos_token_id
    assert all(s[: len(prefix)] == prefix for s in sequences)
    flat = [t for s in sequences for t in s[len(prefix) :]]
    assert flat[-1] == eos
    documents, current = [], []
    for t in flat:
        if t == eos:
            documents.append(current)
            current = []
        else:
            current.append(t)
    assert sorted(documents) == sorted(encode(tokenizer, t) for t in texts)
    # Pack the recovered order by hand: the stream must be exactly that.
    stream = [t for d in documents for t in d + [eos]]
    body = seq_len - len(prefix)
    assert sequences == [prefix + stream[i : i + body] for i in range(0, len(stream), body)]


# ---- writers: each puts TEXTS into one format under tmp_path and returns the --data spec ----


def write_txt(tmp_path):
    # Blank lines separate records; extra blank lines and a whitespace-only paragraph are not records.
    (tmp_path / "a.txt").write_text("\n\n\n".join(TEXTS[:4]) + "\n\n  \n\n" + "\n\n".join(TEXTS[4:]) + "\n")
    return str(tmp_path / "a.txt")


def write_jsonl(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    return str(tmp_path / "a.jsonl")


def write_json(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    return str(tmp_path / "a.json")


def write_parquet(tmp_path):
    pd.DataFrame({"text": TEXTS, "n": range(len(TEXTS))}).to_parquet(tmp_path / "a.parquet")
    return str(tmp_path / "a.parquet")


def write_csv(tmp_path):
    pd.DataFrame({"n": range(len(TEXTS)), "text": TEXTS}).to_csv(tmp_path / "a.csv", index=False)
    return str(tmp_path / "a.csv")


def gzipped(path: str) -> str:
    """``path`` gzipped beside itself as PATH.gz, the plain file removed."""
    packed = Path(path + ".gz")
    packed.write_bytes(gzip.compress(Path(path).read_bytes()))
    Path(path).unlink()
    return str(packed)


def write_jsonl_gz(tmp_path):
    return gzipped(write_jsonl(tmp_path))


def write_txt_gz(tmp_path):
    return gzipped(write_txt(tmp_path))


def write_csv_gz(tmp_path):
    return gzipped(write_csv(tmp_path))


def write_gz_directory(tmp_path):
    """A folder of gzipped files of every text kind, read as one source."""
    folder = tmp_path / "gz"
    folder.mkdir()
    for i, t in enumerate(TEXTS):
        (folder / f"part{i}.jsonl.gz").write_bytes(gzip.compress((json.dumps({"text": t}) + "\n").encode()))
    return str(folder)


def write_save_to_disk(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "saved")
    return str(tmp_path / "saved")


def write_glob(tmp_path):
    for i, t in enumerate(TEXTS):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"text": t}) + "\n")
    (tmp_path / "notes.md").write_text("not data")
    return str(tmp_path / "part*.jsonl")


def write_directory(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("\n\n".join(TEXTS[:3]))
    pd.DataFrame({"text": TEXTS[3:6]}).to_parquet(folder / "b.parquet")
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[6:]))
    (folder / "README.md").write_text("ignored: not a data file")
    return str(folder)


WRITERS = [
    write_txt,
    write_jsonl,
    write_json,
    write_parquet,
    write_csv,
    write_save_to_disk,
    write_glob,
    write_directory,
    write_jsonl_gz,
    write_txt_gz,
    write_csv_gz,
    write_gz_directory,
]


@pytest.mark.parametrize("write", WRITERS, ids=[w.__name__.removeprefix("write_") for w in WRITERS])
def test_format_packs_its_records(tmp_path, smol_tokenizer, write):
    sequences = read_all(smol_tokenizer, [write(tmp_path)], seq_len=16)
    check_packed(sequences, smol_tokenizer, TEXTS, seq_len=16, prefix=[])
    assert all(len(s) == 16 for s in sequences[:-1])


def test_packed_sequences_start_with_bos_when_the_tokenizer_adds_it(tmp_path, bos_tokenizer):
    sequences = read_all(bos_tokenizer, [write_jsonl(tmp_path)], seq_len=12)
    check_packed(sequences, bos_tokenizer, TEXTS, seq_len=12, prefix=[bos_tokenizer.bos_token_id])


@pytest.mark.smoke
def test_unpacked_gives_one_record_per_sequence(tmp_path, bos_tokenizer):
    sequences = read_all(bos_tokenizer, [write_jsonl(tmp_path)], seq_len=64, pack=False)
    assert sorted(sequences) == sorted([bos_tokenizer.bos_token_id] + encode(bos_tokenizer, t) for t in TEXTS)


def test_unpacked_long_record_is_split_with_bos_on_each_piece(tmp_path, bos_tokenizer):
    text = " ".join(TEXTS)
    (tmp_path / "long.txt").write_text(text)
    sequences = read_all(bos_tokenizer, [str(tmp_path / "long.txt")], seq_len=16, pack=False)
    ids, bos = encode(bos_tokenizer, text), bos_tokenizer.bos_token_id
    assert sequences == [[bos] + ids[i : i + 15] for i in range(0, len(ids), 15)]


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_long_record_refused_when_asked(tmp_path, smol_tokenizer, pack):
    with pytest.raises(ValueError, match=r"a record of \d+ tokens does not fit in seq_len=8.*long_records='split'"):
        read_all(smol_tokenizer, [write_jsonl(tmp_path)], seq_len=8, pack=pack, long_records="error")


def test_a_huge_record_is_tokenized_in_pieces_and_kept_to_the_budget(tmp_path, smol_tokenizer, monkeypatch):
    """A record far longer than the budget: the tokenizer never sees more than TOKENIZE_CHARS at once, the stream keeps
    only the ids the budget can use, and yet the sequences and the digest are those of tokenizing the record whole."""
    words = [f"w{i % 977}x" for i in range(3 * stream.TOKENIZE_CHARS // 5)]  # ~3 pieces of text, no word twice in a row
    text = " ".join(words)
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    whole = encode(smol_tokenizer, text)
    seen: list[int] = []
    original = type(smol_tokenizer).__call__
    monkeypatch.setattr(type(smol_tokenizer), "__call__", lambda self, t, **kw: seen.append(len(t)) or original(self, t, **kw))
    kept: list[int] = []
    monkeypatch.setattr(stream, "_digest_update", lambda h, ids: kept.append(len(ids)) or h.update(b"".join(t.to_bytes(8, "little") for t in ids)) or h)
    returned: list[int] = []
    encode_record = stream.SequenceStream._encode
    monkeypatch.setattr(stream.SequenceStream, "_encode", lambda *a: (r := encode_record(*a)) and returned.append(len(r[0])) or r)
    config = DataConfig(sources=[str(path)], seq_len=64, max_tokens=256)
    s = iter_sequences(config, smol_tokenizer)
    sequences = [t.tolist() for t in s]
    assert len(seen) >= 3 and max(seen) <= stream.TOKENIZE_CHARS  # in pieces (one more call is the BOS probe)
    assert returned == [256]  # of ~10^5 tokens, the budget's worth is kept
    assert sum(kept) == len(whole)  # every token of the record went into its digest
    assert [t for q in sequences for t in q] == whole[:256]  # cut before a space: the same ids as whole
    assert s.consumed() == [stream.record_digest(whole)]


def test_input_ids_used_exactly(tmp_path, bos_tokenizer):
    records = [[5, 6, 7], [49151, 0, 42, 42], list(range(100, 125))]  # the last is longer than seq_len
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": r, "text": "unused"}) + "\n" for r in records))
    sequences = read_all(bos_tokenizer, [str(tmp_path / "ids.jsonl")], seq_len=10)  # pack=True: ignored for ids
    assert sorted(sequences) == sorted([records[0], records[1], records[2][:10], records[2][10:20], records[2][20:]])


def test_input_ids_outside_the_vocabulary_are_refused(tmp_path, smol_tokenizer):
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": [1, 2, 49152]}) + "\n")
    with pytest.raises(ValueError, match=r"ids.jsonl: token ids outside \[0, 49152\).*another model's tokenizer"):
        read_all(smol_tokenizer, [str(tmp_path / "ids.jsonl")])


CHATS = [
    [{"role": "user", "content": "What is FP8?"}, {"role": "assistant", "content": "An 8-bit float."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]


@pytest.mark.parametrize("adds_bos", [False, True], ids=["no-bos", "bos"])
def test_chat_rendered_with_the_template_without_a_second_bos(tmp_path, smol_tokenizer, bos_tokenizer, adds_bos):
    tokenizer = bos_tokenizer if adds_bos else smol_tokenizer
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    sequences = read_all(tokenizer, [str(tmp_path / "chat.jsonl")], seq_len=512, pack=False)
    # SmolLM2's template starts every conversation with <|im_start|>, which is its BOS token.
    expected = [encode(smol_tokenizer, smol_tokenizer.apply_chat_template(m, tokenize=False)) for m in CHATS]
    assert all(e[0] == tokenizer.bos_token_id for e in expected)
    assert sorted(sequences) == sorted(expected)


def test_chat_without_template_is_refused(tmp_path, smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = None
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(ValueError, match="chat.jsonl holds chat 'messages' but the tokenizer has no chat template"):
        read_all(tokenizer, [str(tmp_path / "chat.jsonl")])


def test_packing_without_eos_is_refused(tmp_path, smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.eos_token = None
    with pytest.raises(
        ValueError, match="the tokenizer has no EOS token to separate packed documents; pass pack=False"
    ):
        read_all(tokenizer, [write_jsonl(tmp_path)])
    assert read_all(tokenizer, [write_jsonl(tmp_path)], pack=False)


def write_ids(path: Path, low: int, records: int, length: int = 16) -> str:
    """``records`` token-id records of ``length`` ids in [low, low + 100): each sequence betrays its source."""
    path.write_text(
        "".join(json.dumps({"input_ids": [low + (i + j) % 100 for j in range(length)]}) + "\n" for i in range(records))
    )
    return str(path)


def origin(sequence: list[int]) -> str:
    return "a" if sequence[0] < 1000 else "b"


def test_weights_give_token_shares(tmp_path, smol_tokenizer):
    a = write_ids(tmp_path / "a.jsonl", 100, records=200)
    b = write_ids(tmp_path / "b.jsonl", 1000, records=200)
    stream = iter_sequences(DataConfig(sources=[a + "::1", b + "::3"], seq_len=16, max_tokens=16 * 40), smol_tokenizer)
    tokens = {"a": 0, "b": 0}
    for s in stream:
        tokens[origin(s.tolist())] += len(s)
    assert sum(tokens.values()) == 16 * 40
    assert abs(tokens["a"] - 16 * 10) <= 16
    assert [m["tokens"] for m in stream.manifest()] == [tokens["a"], tokens["b"]]
    assert [m["weight"] for m in stream.manifest()] == [0.25, 0.75]


def test_without_weights_sources_take_turns_until_one_runs_out(tmp_path, smol_tokenizer):
    a = write_ids(tmp_path / "a.jsonl", 100, records=2)
    b = write_ids(tmp_path / "b.jsonl", 1000, records=5)
    sequences = read_all(smol_tokenizer, [a, b], seq_len=16)
    assert "".join(origin(s) for s in sequences) == "ababbbb"


def test_weighted_source_running_out_warns(tmp_path, smol_tokenizer):
    a = write_ids(tmp_path / "a.jsonl", 100, records=2)
    b = write_ids(tmp_path / "b.jsonl", 1000, records=50)
    with pytest.warns(UserWarning, match="a.jsonl ran out after 32 tokens, short of its share 50%"):
        sequences = read_all(smol_tokenizer, [a + "::1", b + "::1"], seq_len=16, max_tokens=320)
    assert sum(map(len, sequences)) == 320


@pytest.mark.parametrize("max_tokens, lengths", [(50, [16, 16, 16, 2]), (48, [16, 16, 16]), (1, [1])])
def test_budget_cuts_the_last_sequence_never_to_nothing(tmp_path, smol_tokenizer, max_tokens, lengths):
    stream = iter_sequences(
        DataConfig(sources=[write_jsonl(tmp_path)], seq_len=16, max_tokens=max_tokens), smol_tokenizer
    )
    assert [len(s) for s in stream] == lengths
    assert stream.tokens_yielded == max_tokens


def test_seed_gives_the_same_order_and_another_seed_another(tmp_path, smol_tokenizer):
    source = write_ids(tmp_path / "a.jsonl", 100, records=30)
    first = read_all(smol_tokenizer, [source], seq_len=16, seed=1)
    assert read_all(smol_tokenizer, [source], seq_len=16, seed=1) == first
    other = read_all(smol_tokenizer, [source], seq_len=16, seed=2)
    assert other != first and sorted(other) == sorted(first)


def test_stream_iterates_again_identically(tmp_path, smol_tokenizer):
    stream = iter_sequences(DataConfig(sources=[write_jsonl(tmp_path)], seq_len=16), smol_tokenizer)
    assert [s.tolist() for s in stream] == [s.tolist() for s in stream]


def test_text_field_names_the_column_and_txt_files_still_read(tmp_path, smol_tokenizer):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "text": "decoy"}) + "\n" for t in TEXTS[:5]))
    (tmp_path / "b.txt").write_text("\n\n".join(TEXTS[5:]))
    sequences = read_all(smol_tokenizer, [str(tmp_path)], seq_len=16, text_field="body")
    check_packed(sequences, smol_tokenizer, TEXTS, seq_len=16, prefix=[])


def test_manifest_names_hashes_and_counts(tmp_path, smol_tokenizer):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS + ["", "   "]))
    stream = iter_sequences(DataConfig(sources=[str(path)], seq_len=16), smol_tokenizer)
    tokens = sum(len(s) for s in stream)
    assert stream.manifest() == [
        {
            "source": str(path),
            "kind": "text",
            "weight": None,
            "records_read": len(TEXTS) + 2,
            "records_empty": 2,
            "records_excluded": 0,
            "sequences": -(-tokens // 16),
            "tokens": tokens,
            "files": [
                {
                    "path": str(path),
                    "bytes": path.stat().st_size,
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                }
            ],
            "revision": None,
        }
    ]


# ---- bad input: every one a ValueError that says what to do ----


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sources": []}, "no calibration data: pass at least one --data"),
        ({"seq_len": 1}, "--seq-len must be an integer ≥ 2"),
        ({"max_tokens": 0}, "--max-tokens must be a positive integer"),
        ({"long_records": "drop"}, "long_records must be one of split, error"),
        ({"text_field": ""}, "text_field must be a column name or None"),
        ({"sources": ["{tmp}/a.jsonl::-1"]}, r"weight in .* must be a positive number, as in data.jsonl::0.3"),
        ({"sources": ["{tmp}/a.jsonl::x"]}, "must be a positive number"),
        ({"sources": ["{tmp}/a.jsonl::2", "{tmp}/a.jsonl"]}, "give every --data source a ::WEIGHT, or none"),
        ({"sources": ["{tmp}/missing.jsonl"]}, "missing.jsonl: no such file or directory"),
        ({"sources": ["{tmp}/empty.jsonl"]}, "empty.jsonl is empty; remove it from --data"),
        ({"sources": ["{tmp}/data.xml"]}, r"data.xml: unsupported file type; convert it to one of .txt, .jsonl"),
        ({"sources": ["{tmp}/a.parquet.gz"]}, r"a.parquet.gz: unsupported file type; .* .jsonl.gz, .json.gz, .csv.gz$"),
        ({"sources": ["{tmp}/nothing"]}, "directory .*nothing holds no .txt/.jsonl/.json/.parquet/.csv/.txt.gz/.jsonl.gz/.json.gz/.csv.gz files"),
        ({"sources": ["{tmp}/*.parquet"]}, r"no .txt/.jsonl/.json/.parquet/.csv/.txt.gz/.jsonl.gz/.json.gz/.csv.gz files match .*\*.parquet"),
    ],
    ids=[
        "no-sources",
        "seq-len",
        "max-tokens",
        "long-records",
        "text-field",
        "negative-weight",
        "weight-not-number",
        "partial-weights",
        "missing",
        "empty",
        "unsupported",
        "parquet-gzipped-whole",
        "dir-without-data",
        "glob-without-match",
    ],
)
def test_validate_refuses_bad_config(tmp_path, options, message):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "data.xml").write_text("<a/>")
    (tmp_path / "a.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "notes.md").write_text("no data here")
    options = {"sources": ["{tmp}/a.jsonl"], **options}
    options["sources"] = [s.format(tmp=tmp_path) for s in options["sources"]]
    with pytest.raises(ValueError, match=message):
        DataConfig(**options).validate()


def test_seq_len_must_fit_the_model_context(tmp_path, smol_tokenizer):
    config = DataConfig(sources=[write_jsonl(tmp_path)], seq_len=4096)
    with pytest.raises(ValueError, match="--seq-len 4096 is longer than the model's context of 2048 tokens"):
        iter_sequences(config, smol_tokenizer, max_context=2048)


def test_unreadable_file_is_refused(tmp_path, monkeypatch):
    path = Path(write_jsonl(tmp_path))
    real_open = Path.open

    def open_as_another_user(self, *args, **kwargs):  # mode 000 stops no one when tests run as root
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_as_another_user)
    with pytest.raises(ValueError, match="cannot read .*a.jsonl: Permission denied; fix its permissions"):
        DataConfig(sources=[str(path)]).validate()


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "a.jsonl",
            '{"body": "x", "n": 1}\n',
            r"a.jsonl has no 'input_ids' / 'messages' / 'text' column; "
            r"its columns are body, n: pass text_field",
        ),
        ("a.jsonl", '{"text": "ok"}\n{"text": oops\n', r"cannot read .*a.jsonl: ArrowInvalid"),
        ("a.csv", "text\n1\n2\n", r"a.csv: column 'text' should hold text, got 1"),
        ("a.jsonl", '{"text": ""}\n{"text": "  "}\n{"text": null}\n', "all 3 records are empty"),
        ("a.jsonl", '{"input_ids": "1 2 3"}\n', "'input_ids' must be lists of integers"),
    ],
    ids=["no-usable-column", "malformed-json", "numbers-not-text", "all-empty", "ids-not-a-list"],
)
def test_unusable_records_are_refused(tmp_path, smol_tokenizer, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        read_all(smol_tokenizer, [str(tmp_path / name)])


def test_missing_text_field_lists_the_columns(tmp_path, smol_tokenizer):
    with pytest.raises(ValueError, match="a.jsonl has no 'content' column; its columns are text, id"):
        read_all(smol_tokenizer, [write_jsonl(tmp_path)], text_field="content")


def test_mixed_record_kinds_in_one_source_are_refused(tmp_path, smol_tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    with pytest.raises(
        ValueError,
        match=r"mixes record kinds: text in .*a.jsonl, input_ids in .*b.jsonl; "
        "give each kind its own --data",
    ):
        read_all(smol_tokenizer, [str(tmp_path / "*.jsonl")])


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.csv"])
def test_non_utf8_file_is_refused_at_the_first_bad_byte(tmp_path, smol_tokenizer, name):
    good = {"a.txt": "ok\n\n", "a.jsonl": '{"text": "ok"}\n', "a.csv": "text\nok\n"}[name]
    (tmp_path / name).write_bytes(good.encode() + "caf\xe9 au lait\n".encode("latin-1"))
    offset = len(good.encode()) + 3
    with pytest.raises(ValueError, match=rf"{name} is not UTF-8 text \(first invalid byte at offset {offset}\)"):
        read_all(smol_tokenizer, [str(tmp_path / name)])


def test_non_utf8_gzipped_file_is_refused_at_the_first_bad_byte_of_its_text(tmp_path, smol_tokenizer):
    good = '{"text": "ok"}\n'
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(good.encode() + "caf\xe9 au lait\n".encode("latin-1")))
    offset = len(good.encode()) + 3  # in the decompressed text, not the file's bytes
    with pytest.raises(ValueError, match=rf"a.jsonl.gz is not UTF-8 text \(first invalid byte at offset {offset} of its "
                                         r"decompressed text\)"):
        read_all(smol_tokenizer, [str(tmp_path / "a.jsonl.gz")])


def test_a_file_named_gz_that_is_not_gzip_is_refused_in_one_line(tmp_path, smol_tokenizer):
    (tmp_path / "a.jsonl.gz").write_text('{"text": "plain, not gzipped"}\n')
    with pytest.raises(ValueError, match=r"cannot read .*a.jsonl.gz: BadGzipFile: Not a gzipped file"):
        read_all(smol_tokenizer, [str(tmp_path / "a.jsonl.gz")])


def test_non_utf8_offset_counts_a_character_cut_by_the_read_chunks(tmp_path, smol_tokenizer):
    # "é" is c3 a9: here its first byte ends the first 1 MiB read and a "(" follows instead of a9.
    (tmp_path / "a.txt").write_bytes(b"x" * ((1 << 20) - 1) + b"\xc3(")
    with pytest.raises(ValueError, match=rf"a.txt is not UTF-8 text \(first invalid byte at offset {(1 << 20) - 1}\)"):
        read_all(smol_tokenizer, [str(tmp_path / "a.txt")])


def test_save_to_disk_splits(tmp_path, smol_tokenizer):
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["train text"]}),
            "test": datasets.Dataset.from_dict({"text": ["test text"]}),
        }
    )
    splits.save_to_disk(tmp_path / "dd")
    assert read_all(smol_tokenizer, [f"{tmp_path}/dd@test"], pack=False) == [encode(smol_tokenizer, "test text")]
    with pytest.raises(ValueError, match="dd holds splits train, test; pick one as .*dd@SPLIT"):
        DataConfig(sources=[str(tmp_path / "dd")]).validate()


def test_hub_offline_fails_before_any_request(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError,
        match="org/corpus:en@validation is no local file or directory, and the Hugging "
        "Face Hub is off .*pass local files instead",
    ):
        DataConfig(sources=["org/corpus:en@validation"]).validate()


def test_hub_unreachable_is_one_clear_error(monkeypatch, smol_tokenizer):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", no_network)
    with pytest.raises(ValueError, match="cannot reach the Hugging Face Hub for org/corpus .*no network"):
        iter_sequences(DataConfig(sources=["org/corpus"]), smol_tokenizer)


def test_hub_dataset_streams_at_the_current_revision(monkeypatch, smol_tokenizer):
    """The hub path end to end, with the hub replaced by an in-memory dataset."""
    import huggingface_hub

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"text": TEXTS}).to_iterable_dataset()

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name, **kw: SimpleNamespace(sha="abc123"))
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    stream = iter_sequences(DataConfig(sources=["org/corpus:en@validation"], seq_len=16), smol_tokenizer)
    check_packed([s.tolist() for s in stream], smol_tokenizer, TEXTS, seq_len=16, prefix=[])
    assert calls[0] == (("org/corpus", "en"), {"split": "validation", "revision": "abc123", "streaming": True})
    assert stream.manifest()[0]["revision"] == "abc123" and stream.manifest()[0]["files"] == []

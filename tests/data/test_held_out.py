"""A stream's record digests: what calibration consumed, and a second stream that keeps clear of it.

The test computes every record's digest itself (sha256 of its token ids as 8-byte little-endian integers) and finds
which records a stream used by looking for each record's first tokens in the stream's tokens, so neither side
trusts ``consumed()`` to tell the truth about itself.
"""

import hashlib
import json
from dataclasses import replace

import pytest

from calibrate.data.config import DataConfig
from calibrate.data.stream import DIGEST_HEX, iter_sequences, record_digest

# Tokens of a record's start looked for in a stream: every record starts with its own number.
WINDOW = 8


def digest(ids: list[int]) -> str:
    return hashlib.sha256(b"".join(t.to_bytes(8, "little") for t in ids)).hexdigest()[:DIGEST_HEX]


def text(i: int) -> str:
    return f"Record {i} says: the {i % 7}th verse of chapter {i % 13} names {i * 31 % 97} things, then rests."


def chat(i: int) -> list[dict]:
    return [{"role": "system", "content": f"Record {i} is a chat."},
            {"role": "user", "content": f"What holds {i * 7 % 11} apples?"}, {"role": "assistant", "content": text(i)}]


def write_text(path, numbers) -> tuple[str, dict]:
    path.write_text("".join(json.dumps({"text": text(i)}) + "\n" for i in numbers))
    return str(path), {}


def used(records: dict[str, list[int]], sequences: list[list[int]]) -> set[str]:
    """Digests of the records whose first WINDOW tokens occur, contiguous, in the stream's tokens."""
    flat = "," + ",".join(str(t) for s in sequences for t in s) + ","
    return {d for d, ids in records.items() if "," + ",".join(map(str, ids[:WINDOW])) + "," in flat}


def text_records(tokenizer, numbers) -> dict[str, list[int]]:
    ids = [tokenizer(text(i), add_special_tokens=False).input_ids for i in numbers]
    return {digest(x): x for x in ids}


def chat_records(tokenizer, numbers) -> dict[str, list[int]]:
    ids = [tokenizer(tokenizer.apply_chat_template(chat(i), tokenize=False), add_special_tokens=False).input_ids for i in numbers]
    return {digest(x): x for x in ids}


def ids_records(numbers) -> dict[str, list[int]]:
    ids = [[1000 + i, 2000 + i, *range(3000 + 40 * i, 3000 + 40 * i + 38)] for i in numbers]  # 40 ids, split at 16
    return {digest(x): x for x in ids}


def case(name: str, tmp_path, tokenizer) -> tuple[list[str], dict[str, list[int]], dict]:
    """Sources, every record by the test's own digest, and DataConfig options for the case ``name``."""
    if name == "file":
        return [write_text(tmp_path / "a.jsonl", range(60))[0]], text_records(tokenizer, range(60)), {}
    if name == "mixture":
        a, _ = write_text(tmp_path / "a.jsonl", range(40))
        b, _ = write_text(tmp_path / "b.jsonl", range(100, 140))
        return [a + "::1", b + "::2"], text_records(tokenizer, [*range(40), *range(100, 140)]), {}
    if name == "chat":
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": chat(i)}) + "\n" for i in range(40)))
        return [str(tmp_path / "chat.jsonl")], chat_records(tokenizer, range(40)), {}
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"input_ids": x}) + "\n" for x in ids_records(range(60)).values()))
    return [str(tmp_path / "ids.jsonl")], ids_records(range(60)), {}


@pytest.mark.parametrize("name", ["file", "mixture", "chat", "input_ids"])
def test_a_stream_excluding_what_calibration_consumed_never_reads_it(tmp_path, smol_tokenizer, name):
    sources, records, options = case(name, tmp_path, smol_tokenizer)
    # seq_len 16: every record is packed across two or more sequences (ids records are split at 16).
    calibration = DataConfig(sources=sources, seq_len=16, max_tokens=16 * 30, **options)
    stream = iter_sequences(calibration, smol_tokenizer)
    cal_sequences = [s.tolist() for s in stream]
    consumed = set(stream.consumed())
    cal_used = used(records, cal_sequences)
    assert cal_used and cal_used <= consumed <= set(records)  # every record calibration used is listed, no other kind

    held = iter_sequences(replace(calibration, seed=calibration.seed + 1), smol_tokenizer, exclude=frozenset(consumed))
    held_sequences = [s.tolist() for s in held]
    held_used = used(records, held_sequences)
    assert held_used and not held_used & consumed and not set(held.consumed()) & consumed
    assert 0 < sum(source["records_excluded"] for source in held.manifest()) <= len(consumed)  # those it came upon
    # Without the exclusion the same seed+1 draw reuses calibration records: the exclusion is what keeps them apart.
    overlap = iter_sequences(replace(calibration, seed=calibration.seed + 1), smol_tokenizer)
    assert used(records, [s.tolist() for s in overlap]) & consumed


def test_the_digest_is_sha256_of_the_ids():
    assert record_digest([1, 2, 300]) == digest([1, 2, 300]) == hashlib.sha256(
        bytes([1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 44, 1, 0, 0, 0, 0, 0, 0])).hexdigest()[:16]


def test_excluding_every_record_leaves_nothing(tmp_path, smol_tokenizer):
    source, _ = write_text(tmp_path / "a.jsonl", range(5))
    config = DataConfig(sources=[source], seq_len=16)
    stream = iter_sequences(config, smol_tokenizer)
    list(stream)
    rest = iter_sequences(config, smol_tokenizer, exclude=frozenset(stream.consumed()))
    assert list(rest) == [] and rest.manifest()[0]["records_excluded"] == 5

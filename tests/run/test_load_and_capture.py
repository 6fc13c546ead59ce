"""calibrate/run/load_and_capture.py: the sequences the output observer searches on are made of records the
statistics never saw."""

import json

import pytest

from calibrate.config import CalibrationConfig
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences, record_digest
from calibrate.run import load_and_capture


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-record-per-sequence"])
def test_the_output_observer_searches_on_records_the_statistics_never_saw(smol_tokenizer, data_file, pack):
    """The budget ends inside a record: not even its rest may reach the search. Records are told apart here by
    tokenizing the file's lines directly, not through the stream."""
    records = {}
    for line in data_file.read_text().splitlines():
        ids = smol_tokenizer(json.loads(line)["text"].strip(), add_special_tokens=False).input_ids
        records[record_digest(ids)] = ids
    data = DataConfig(sources=[str(data_file)], seq_len=64, max_tokens=300, pack=pack)
    stream = iter_sequences(data, smol_tokenizer)
    assert sum(s.numel() for s in stream) == 300
    consumed = stream.consumed()
    held = load_and_capture.held_back(CalibrationConfig(model=".", out="o", data=data), smol_tokenizer, None, consumed)
    assert held and sum(s.numel() for s in held) == load_and_capture.HELD_BACK_SEQUENCES * 64
    eos = smol_tokenizer.eos_token_id
    seen = [records[d] for d in consumed]
    for n, sequence in enumerate(held):
        pieces = [piece for piece in _split(sequence.tolist(), eos) if piece]
        for i, piece in enumerate(pieces):
            # A packed sequence's first and last pieces may be parts of records, and so may the very last piece of all
            # (the budget cuts it).
            last = n == len(held) - 1 and i == len(pieces) - 1
            whole = (0 < i < len(pieces) - 1 or not pack) and not last
            if whole:
                assert record_digest(piece) in records and record_digest(piece) not in consumed
            else:  # part of a record: of none the statistics saw
                assert not any(_contains(ids, piece) for ids in seen)


def _split(ids: list[int], sep: int) -> list[list[int]]:
    pieces = [[]]
    for t in ids:
        pieces.append([]) if t == sep else pieces[-1].append(t)
    return pieces


def _contains(ids: list[int], piece: list[int]) -> bool:
    return any(ids[i : i + len(piece)] == piece for i in range(len(ids) - len(piece) + 1))

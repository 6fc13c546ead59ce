"""data/passages.py: held-out passages and the last-word cloze items cut from them.

The cloze target is checked against the passage's last word found another way (``str.split`` and the punctuation
stripped by hand), and the held-out passages against the records a calibration stream really read: their digests
computed here from the tokenizer's ids (sha256 of 8-byte little-endian ids), not taken from the stream.
"""

import hashlib
import json

import pytest
from builders import kjv_jsonl

from calibrate.data.config import DataConfig
from calibrate.data.passages import MIN_WORDS, cloze_item, cloze_items, held_out_passages
from calibrate.data.stream import DIGEST_HEX, TOKENIZE_CHARS, iter_sequences


def digest(tokenizer, text: str) -> str:
    ids = tokenizer(text.strip(), add_special_tokens=False).input_ids
    return hashlib.sha256(b"".join(t.to_bytes(8, "little") for t in ids)).hexdigest()[:DIGEST_HEX]


@pytest.mark.parametrize("text,word", [
    ("In the beginning God created the heaven and the earth.", "earth"),
    ("And God said, Let there be light: and there was light.", "light"),
    ("Then he said unto them, Go ye into all the world, saith the LORD;", "LORD"),
    ("and the people answered him not a word, neither did they ask why\u201d", "why"),
], ids=["period", "colon-inside", "semicolon", "curly-quote"])
def test_the_target_is_the_passages_last_word(text, word):
    item = cloze_item(text)
    assert item is not None
    assert item.target == " " + word
    assert text.split()[-1].startswith(word)  # the word, found another way
    assert item.context == text[: text.rindex(" " + text.split()[-1])]
    assert (item.context + item.target + text[len(item.context + item.target):]) == text  # nothing lost or moved


@pytest.mark.parametrize("text", [
    "Jesus wept.",  # under MIN_WORDS words
    "And the number of them was four hundred and 12.",  # not letters
    "and these are the generations of the sons of Noah-Shem",  # hyphenated
    "",
], ids=["short", "number", "hyphenated", "empty"])
def test_passages_without_one_word_to_predict_make_no_item(text):
    assert cloze_item(text) is None


def test_items_stop_at_the_count_and_skip_what_makes_none():
    texts = ["Jesus wept."] + [f"word {'and ' * MIN_WORDS}number{i}" for i in range(3)] + \
            [f"these are the words of passage number {'x' * (i + 1)} end" for i in range(5)]
    items = cloze_items(texts, 3)
    assert [i.target for i in items] == [" end"] * 3
    assert len(cloze_items(texts, 100)) == 5  # fewer than asked when fewer passages fit


def test_held_out_passages_leave_out_every_record_calibration_read(tmp_path, smol_tokenizer):
    path = kjv_jsonl(tmp_path / "kjv.jsonl", 120)
    stream = iter_sequences(DataConfig([str(path)], seq_len=128, max_tokens=640), smol_tokenizer)
    list(stream)
    consumed = frozenset(stream.consumed())
    assert 5 < len(consumed) < 120  # calibration read some records, not all
    found = held_out_passages([str(path)], smol_tokenizer, consumed, limit=1000)
    records = [json.loads(line)["text"].strip() for line in path.read_text().splitlines()]
    used = {t for t in records if digest(smol_tokenizer, t) in consumed}  # what calibration read, found here
    assert used and not used & set(found.texts)
    assert found.excluded == len(used) and sorted(found.texts) == sorted(set(records) - used)


def test_held_out_passages_stop_at_the_limit_and_refuse_chats(tmp_path, smol_tokenizer):
    path = kjv_jsonl(tmp_path / "kjv.jsonl", 50)
    assert len(held_out_passages([str(path)], smol_tokenizer, frozenset(), limit=7).texts) == 7
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="plain text passages"):
        held_out_passages([str(chats)], smol_tokenizer, frozenset(), limit=7)


def test_a_long_document_gives_its_paragraphs_and_none_when_calibration_read_it(tmp_path, smol_tokenizer):
    """A record longer than the stream tokenizes at once (a whole document, as one big text file often is) is cut at
    its blank lines into passages; when calibration read it (its digest, the stream's own, among the records), none
    of it is held out. The calibration here is a real stream over the same file."""
    verses = [json.loads(line)["text"].strip() for line in kjv_jsonl(tmp_path / "kjv.jsonl", 2000).read_text().splitlines()]
    paragraphs = [" ".join(verses[i:i + 5]) for i in range(0, len(verses), 5)]
    document = "\n\n".join(paragraphs)
    assert len(document) > TOKENIZE_CHARS  # the stream digests it piece by piece
    (tmp_path / "book.jsonl").write_text(json.dumps({"text": document}) + "\n")
    (tmp_path / "other.jsonl").write_text(json.dumps({"text": "\n\n".join(paragraphs[:3])}) + "\n")
    both = [str(tmp_path / "book.jsonl"), str(tmp_path / "other.jsonl")]
    found = held_out_passages(both, smol_tokenizer, frozenset(), limit=10_000)
    assert found.texts == paragraphs + paragraphs[:3] and found.excluded == 0
    stream = iter_sequences(DataConfig([str(tmp_path / "book.jsonl")], seq_len=128, max_tokens=256), smol_tokenizer)
    list(stream)
    read = frozenset(stream.consumed())
    assert len(read) == 1
    found = held_out_passages(both, smol_tokenizer, read, limit=10_000)
    assert found.texts == paragraphs[:3] and found.excluded == 1

"""calibrate/data/kinds.py and the layouts ``stream`` keeps: each token's record, chat role and form survive templating
and packing. Checked by decoding the tokens of each label back to text and comparing with the record's own strings."""

import copy
import json
from collections import defaultdict

import pytest

from calibrate.data import kinds
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences

# A tiny chat fixture: every role, a reasoning span, and an answer holding JSON.
CHATS = [
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": f"What is {i} plus {i}?"},
     {"role": "assistant", "content": f"<think>add {i} to itself</think>It is {2 * i}."},
     {"role": "user", "content": "As JSON?"},
     {"role": "assistant", "content": json.dumps({"sum": 2 * i})}]
    for i in range(12)
]
# A tiny JSON fixture: records that are JSON, prose with a code fence, plain prose.
TEXTS = [json.dumps({"name": f"item {i}", "tags": ["a", "b"], "n": i}) for i in range(6)] + [
    f"Call it like this:\n```python\nf({i})\n```\nand read the result." for i in range(6)
] + ["Plain words and nothing else, one record of prose."]


def stream_of(tmp_path, tokenizer, records: list[dict], **options):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stream = iter_sequences(DataConfig(sources=[str(path)], **options), tokenizer, layouts=True)
    sequences = [s.tolist() for s in stream]
    return sequences, stream.layouts()


def text_by_label(tokenizer, sequences, layouts, label) -> dict[int, str]:
    """Record number → the decoded text of its tokens for which ``label(code)`` holds, across every sequence."""
    ids = defaultdict(list)
    for seq, layout in zip(sequences, layouts):
        for token, record, code in zip(seq, layout.record.tolist(), layout.kind.tolist()):
            if record >= 0 and label(code):
                ids[record].append(token)
    return {record: tokenizer.decode(t) for record, t in ids.items()}


@pytest.mark.parametrize("seq_len", [48, 4096], ids=["split-over-sequences", "one-sequence"])
def test_roles_survive_templating_and_packing(tmp_path, smol_tokenizer, seq_len):
    sequences, layouts = stream_of(tmp_path, smol_tokenizer, [{"messages": m} for m in CHATS], seq_len=seq_len, max_tokens=100_000)
    assert len(layouts) == len(sequences) and all(len(s) == layout.record.numel() for s, layout in zip(sequences, layouts))
    # Sequences hold the same tokens as without layouts: labels never change what the model reads.
    plain = [s.tolist() for s in iter_sequences(DataConfig(sources=[str(tmp_path / "data.jsonl")], seq_len=seq_len,
                                                           max_tokens=100_000), smol_tokenizer)]
    assert plain == sequences
    order = {}  # record number → which chat it is (the shuffle picks the order): found by its user question
    for record, text in text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.role_of(c) == "user").items():
        order[record] = next(i for i in range(len(CHATS)) if text == f"What is {i} plus {i}?As JSON?")
    assert sorted(order.values()) == list(range(len(CHATS)))
    for role, expected in {
        "system": lambda m: m[0]["content"],
        "reasoning": lambda m: m[2]["content"].split("It is")[0],
        "assistant": lambda m: m[2]["content"].split("</think>")[1] + m[4]["content"],
    }.items():
        got = text_by_label(smol_tokenizer, sequences, layouts, lambda c, role=role: kinds.role_of(c) == role)
        assert got == {record: expected(CHATS[i]) for record, i in order.items()}, role
    json_text = text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.form_of(c) == "json")
    assert json_text == {record: CHATS[i][4]["content"] for record, i in order.items()}
    # The template's own tokens (headers, end marks) are template, and the packing EOS has no label.
    template = text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.role_of(c) == "template")
    assert all(t.count("<|im_start|>") == 5 for t in template.values())
    eos = [code for s, layout in zip(sequences, layouts) for t, code, r in zip(s, layout.kind.tolist(), layout.record.tolist())
           if r >= 0 and t == smol_tokenizer.eos_token_id]
    assert 0 in eos


def test_json_and_code_against_prose(tmp_path, smol_tokenizer):
    sequences, layouts = stream_of(tmp_path, smol_tokenizer, [{"text": t} for t in TEXTS], seq_len=64, max_tokens=100_000)
    texts = text_by_label(smol_tokenizer, sequences, layouts, lambda c: True)
    by_record = {r: TEXTS.index(t.removesuffix("<|im_end|>")) for r, t in texts.items()}
    json_text = text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.form_of(c) == "json")
    code_text = text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.form_of(c) == "code")
    prose = text_by_label(smol_tokenizer, sequences, layouts, lambda c: kinds.form_of(c) == "prose")
    assert json_text == {r: TEXTS[i] for r, i in by_record.items() if i < 6}
    # The fence's own lines are code; the token after the closing fence starts with its newline, which is prose.
    assert code_text == {r: TEXTS[i][TEXTS[i].index("```"):TEXTS[i].rindex("```") + 3] for r, i in by_record.items() if 6 <= i < 12}
    assert prose[max(by_record, key=by_record.get)] == TEXTS[-1]
    assert all(kinds.role_of(c) is None for layout in layouts for c in layout.kind.tolist())


def test_bos_prefix_and_unpacked_records(tmp_path, smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_bos_token = True
    sequences, layouts = stream_of(tmp_path, tokenizer, [{"text": t} for t in TEXTS], seq_len=16, max_tokens=100_000, pack=False)
    for seq, layout in zip(sequences, layouts):
        assert seq[0] == tokenizer.bos_token_id and layout.record[0] == -1 and layout.kind[0] == 0
        assert len(set(layout.record[1:].tolist())) == 1  # one record per sequence, split ones keep their number
    assert len({layout.record[1].item() for layout in layouts}) == len(TEXTS)


def test_a_template_that_rewrites_earlier_turns_gives_no_roles():
    def render(messages):  # drops the reasoning of every assistant turn but the last, as some reasoning templates do
        last = len(messages) - 1
        return "".join(f"<{m['role']}>{m['content'] if i == last else m['content'].split('</think>')[-1]}\n"
                       for i, m in enumerate(messages))

    text, codes = kinds.chat_labels(CHATS[0][:3] + [{"role": "user", "content": "more"}], render)
    assert codes is None and text.startswith("<system>Be brief.")
    text, codes = kinds.chat_labels(CHATS[0][:3], render)  # the last turn keeps it: prefixes hold
    assert codes is not None and {kinds.role_of(c) for c in codes} == {"template", "system", "user", "assistant", "reasoning"}


def test_a_stream_without_layouts_says_how_to_get_them(tmp_path, smol_tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x y z"}) + "\n")
    stream = iter_sequences(DataConfig(sources=[str(tmp_path / "a.jsonl")], seq_len=8, max_tokens=64), smol_tokenizer)
    list(stream)
    with pytest.raises(ValueError, match="layouts=True"):
        stream.layouts()

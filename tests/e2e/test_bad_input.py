"""Bad input, in-process, where the proof needs the process itself: what runs before a refusal (no weights
fetched, no model loaded) and the success path of a lowered bar. Every refusal's wording, exit code and untouched
inputs are tested through the real console script in test_bad_input_cli.py.
"""

import json

import pytest
from builders import save_tiny_checkpoint
from runners import assert_refused, kvcal

from calibrate.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    """A tiny model and the data files the cases read."""
    root = tmp_path_factory.mktemp("bad")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    with open(kjv_path) as src, open(root / "data.jsonl", "w") as dst:
        for _, line in zip(range(200), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    (root / "hi.jsonl").write_text('{"text": "hi"}\n')
    (root / "wrong-column.jsonl").write_text('{"body": "In the beginning"}\n')
    return root


def _after_model_load(err: str) -> str:
    """stderr without transformers' weight-loading progress bar, which model.load_model prints even with --quiet."""
    return "\n".join(line for line in err.splitlines() if "Loading weights" not in line)


def test_min_tokens_lowers_the_bar_on_purpose_and_the_run_says_it_rests_on_little_data(root, capsys):
    out = root / "tiny-sample"
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / "hi.jsonl"), "--out", str(out),
                      "--seq-len", "64", "--max-tokens", "128", "--min-tokens", "3", "--quiet", "--no-verify")
    assert_refused(code, _after_model_load(err), "fewer than the 3 needed (--min-tokens 3)")
    assert not out.exists()
    code = main(["calibrate", str(root / "llama"), "--data", str(root / "hi.jsonl"), "--out", str(out), "--seq-len", "64",
                 "--max-tokens", "128", "--min-tokens", "2", "--quiet", "--no-verify"])
    assert code == 0
    assert "scales rest on little data: 2 tokens per layer (< 100,000)" in capsys.readouterr().out
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance["little_data"] is True and provenance["tokens"] == 2 and provenance["settings"]["min_tokens"] == 2


@pytest.mark.parametrize("data, text_field, fragment", [
    ("wrong-column.jsonl", None, "has no 'input_ids' / 'messages' / 'text' column; its columns are body"),
    ("data.jsonl", "content", "has no 'content' column; its columns are text"),
], ids=["no-known-column", "text-field-missing"])
def test_bad_data_fails_before_the_weights_download_or_the_model_load(root, capsys, monkeypatch, data, text_field, fragment):
    """A 70B model takes minutes to download and load: data that cannot be read must fail before either."""
    fetched = []
    monkeypatch.setattr("calibrate.hub.fetch", lambda model, *, trust_remote_code=False, weights=True: fetched.append(weights))

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was opened")

    monkeypatch.setattr("calibrate.model.load.load_model", no_load)
    out = root / "new"
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / data), "--out", str(out), "--quiet",
                      "--no-verify", *(["--text-field", text_field] if text_field else []))
    assert_refused(code, err, fragment)
    assert fetched == [False]  # the configs and tokenizer only
    assert not out.exists()

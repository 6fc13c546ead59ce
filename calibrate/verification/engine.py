"""``kvcal verify --engine vllm``: the same held-out sequences through the installed vLLM, once per cache dtype, set
beside the emulation.

Per scheme the engine serves: vLLM's full-vocabulary prompt log-probabilities (``engine/jobs/logprobs.py``) with that
cache against its own unquantized (``auto``) cache, the same statistics the emulation reports (KL per sequence, its
standard error, top-1 agreement), and what the engine stored (the cache tensor, the scales it used) against what the
dtype's name promises. ``auto`` runs twice: the second run's KL to the first is the engine's run-to-run noise. The
engine's *floor* is its ``auto`` cache against the reference model kvcal loaded (the Hugging Face model in verify's
dtype).

The tolerance, per scheme: the emulation and the engine agree when |engine KL − emulated KL| ≤ engine floor +
run-to-run noise + ``significance.margin`` of the per-sequence difference (its paired standard error × Student's t at
n − 1 degrees of freedom, two-sided 5%: ``tolerance``), judged only from ``AGREEMENT_SEQUENCES`` sequences on (fewer:
"too few sequences to tell"). Two schemes are ranked differently only when both orders are clear: each gap beyond its
own margin plus the noise.
"""

import json
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..choices import CACHE_DTYPES, SCHEMES, SchemeSpec, size_text
from ..engine.launch import EngineError, Job, find_vllm_python, run_job
from ..model.directory import KV_SCALE_PATTERN, tensor_names, vllm_files
from ..vllm_facts.platforms import PLATFORMS
from ..vllm_facts.serving import PROMISES
from .drift import engine_drift
from .passes import token_kl
from .significance import margin, mean_stderr


def _not_run(spec: SchemeSpec) -> str | None:
    """Why no single engine run stands for a scheme, read off what ``choices.SCHEMES`` says of it (None: one does).
    The engine serves the checkpoint's files as they are, so scales that exist only in kvcal's statistics are not in
    them."""
    if spec.scales == "observer":
        return "scales from statistics: export them to run"
    if spec.granularity == "head":
        return "per-head scales: not in a per-tensor checkpoint"
    return None


# Schemes no single engine run stands for, and why (a few words, for the engine cells).
NOT_RUN = {name: why for name, spec in SCHEMES.items() if (why := _not_run(spec))}
# kvcal scheme → (the --kv-cache-dtype the engine serves it with, where its scales come from), both as choices.SCHEMES
# holds them (``kv_dtype``, ``scales``), for every quantized scheme an engine run stands for. Scales "ones" run with
# every k, v and q scale set to 1.0 in the engine (as vLLM serves a checkpoint without scales), "checkpoint" as loaded,
# "computed" (the cache writer's own, per token and head) from the checkpoint as it is.
RUNS = {name: (spec.kv_dtype, spec.scales) for name, spec in SCHEMES.items() if spec.scales != "none" and name not in NOT_RUN}
NOT_AS_NAMED = "not what the name says"
# The start of the reason of a scheme whose engine run failed (its verdict: ``verdict.RUN_FAILED``), vLLM's or the
# OS's line after it.
RUN_FAILED_TEXT = "the engine's run failed"
POLL_S = 0.2  # how often run_schemes looks for a start the running job has finished
ROOM_MARGIN = 64 << 20  # a job's own files (its request, the array's header) and the file system's slack
# The fewest sequences the agreement test is judged at: its margin is t₀.₉₇₅ paired standard errors at n − 1 degrees
# of freedom, 12.7 at 2 sequences (the test could pass almost any gap) and 2.36 at 8, within a fifth of the
# large-sample 1.96. Below it the engine and the emulation are "too few sequences to tell" apart, never "agree".
AGREEMENT_SEQUENCES = 8
TOO_FEW = "too few sequences to tell"


@dataclass
class EngineHost:
    """The vLLM verify will run: its interpreter, version, platform, the ISA the job saw, and its own list of cache
    dtypes."""

    python: Path
    version: str
    platform: str
    isa: dict = field(default_factory=dict)
    cache_dtypes: tuple[str, ...] = ()


def probe(vllm_python: str | None) -> EngineHost:
    """Find vLLM (``launch.find_vllm_python``) and ask it its version, platform and cache dtypes, in one import;
    ValueError in one line if it cannot be found or started."""
    try:
        python = find_vllm_python(vllm_python)
        answer = run_job(python, "version", {}, timeout_s=300)
    except EngineError as e:
        raise ValueError(str(e)) from None
    if answer["error"]:
        raise ValueError(f"vLLM could not start: {answer['error']}")
    info = answer["result"]
    return EngineHost(python, info["vllm_version"], info["platform"], {k: info[k] for k in ("avx512", "amx")},
                      tuple(info["cache_dtypes"]))


def model_len(tokens: int, block_size: int) -> int:
    """The ``max_model_len`` that holds ``tokens`` tokens: rounded up to whole blocks."""
    return -(-tokens // block_size) * block_size


def kv_cache_bytes(num_layers: int, kv_heads: int, head_dim: int, max_model_len: int, block_size: int) -> int:
    """vLLM's KV space sized to one sequence of ``max_model_len`` (the engine runs one at a time): K and V of every
    layer at 4 bytes an element (above any dtype's, its scales included), doubled, at least 64 MiB."""
    tokens = max_model_len + 2 * block_size
    return max(64 << 20, 2 * 2 * num_layers * kv_heads * head_dim * 4 * tokens)


def room_needed(sequences: int, positions: int, vocab: int, names: Sequence[str]) -> tuple[int, str]:
    """Bytes ``run_schemes`` writes at most, and what they are, in words: float32 [sequences, positions, vocab]
    arrays, the reference model's and the engine's unquantized run's (every run is compared with it) beside the runs of
    one start (``job_groups``), each reduced to its figures once its start ends."""
    array = sequences * positions * vocab * 4
    count = 2 + max((len(g) for g in job_groups(names) if g[0] not in ("auto", "auto2")), default=1)
    return count * array + ROOM_MARGIN, f"{count} log-probability arrays of {size_text(array)}"


def check_room(sequences: int, positions: int, vocab: int, names: Sequence[str], where: Path) -> None:
    """Refuse, in one line, a ``where`` (the temporary directory, TMPDIR) without room for the engine's files
    (``room_needed``): before the reference model loads, not when the first run fills the disk."""
    need, parts = room_needed(sequences, positions, vocab, names)
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(f"--engine vllm writes up to {size_text(need)} in {where} ({parts}), and it has "
                         f"{size_text(free)} free: set TMPDIR to a directory on a disk with room, or verify fewer or "
                         "shorter sequences (--max-tokens, --seq-len)")


def has_kv_scales(checkpoint: Path) -> bool:
    """Whether a file vLLM loads from ``checkpoint`` holds a KV scale (else vLLM serves its fp8 cache at 1.0)."""
    return any(KV_SCALE_PATTERN.search(name) for path in vllm_files(checkpoint)[0] for name in tensor_names(path))


def check_stored(dtype: str, stored: dict, scheme_scales: dict | None) -> dict:
    """What the engine stored against what ``dtype``'s name promises: ``agrees`` False with the reasons when not."""
    layers = stored["layers"]
    reasons = []
    backend, offered = stored["attention_backend"], stored["backend_kv_cache_dtypes"]
    if offered and dtype not in offered:
        reasons.append(f"{backend} does not implement {dtype} (it implements {', '.join(offered)})")
    size, scales = PROMISES.get(dtype, (None, "unknown"))
    elem = {torch.finfo(getattr(torch, d)).bits // 8 if getattr(torch, d).is_floating_point else torch.iinfo(getattr(torch, d)).bits // 8
            for d in {layer["cache_dtype"] for layer in layers}}
    if size is not None and size >= 1 and elem != {size}:
        reasons.append(f"cache holds {sorted(elem)} byte(s) an element, the name promises {size}")
    if scheme_scales is not None and dtype in ("fp8", "fp8_e4m3"):
        for kind in ("k", "v"):
            want = [float(row.max()) for row in scheme_scales[kind]]
            got = [layer[f"{kind}_scale_float"] for layer in layers]
            off = [i for i, (w, g) in enumerate(zip(want, got)) if not math.isclose(w, g, rel_tol=1e-2)]
            if off:
                reasons.append(f"{kind}_scale differs from the scheme's in layers {', '.join(map(str, off[:8]))}")
    return {"agrees": not reasons, "reasons": reasons, "cache_dtype": layers[0]["cache_dtype"] if layers else None,
            "cache_shape": layers[0]["cache_shape"] if layers else None, "scales": scales,
            "k_scale": [layer["k_scale_float"] for layer in layers], "v_scale": [layer["v_scale_float"] for layer in layers]}


def _row(logprobs: np.ndarray, i: int) -> torch.Tensor:
    """Sequence ``i`` of a (memory-mapped) [sequences, positions, vocab] array, copied into memory."""
    return torch.from_numpy(np.array(logprobs[i]))


def _sequence_figures(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref ‖ other) and top-1 agreement over one sequence's positions, [positions, vocab] each."""
    return (token_kl(ref, ref.exp(), other).double().mean().item(),
            (ref.argmax(-1) == other.argmax(-1)).double().mean().item())


def mean_nll(logprobs: np.ndarray, targets: np.ndarray) -> float:
    """Mean negative log-likelihood of the sample's next tokens ``targets`` [sequences, positions] under
    [sequences, positions, vocab] log-probabilities: what perplexity is made of."""
    rows = np.arange(targets.shape[1])
    return -float(np.mean([np.asarray(logprobs[i])[rows, targets[i]].astype(np.float64).mean() for i in range(targets.shape[0])]))


def run_schemes(host: EngineHost, checkpoint: Path, names: Sequence[str], sequences: list[list[int]], *, dtype: str,
                chunk_len: int, max_model_len: int, block_size: int, kv_bytes: int, vocab_size: int, workdir: Path,
                unquantized: str = "auto", offered: Sequence[str] = CACHE_DTYPES, prompts: Sequence[list[int]] = (),
                steps: int = 0, attention_backend: str | None = None, tokenizer: bool = True,
                deny_isa: tuple[str, ...] = (), reference: np.ndarray | None = None,
                targets: np.ndarray | None = None, skip_layers: Sequence[str] = (),
                tensor_parallel_size: int = 1) -> dict[str, dict]:
    """One engine run per name (``auto`` first, then ``auto2`` and schemes), each the job's answer plus its figures
    (``figures``: the run's array is reduced to them when it ends and removed, all but ``auto``'s, which stays as
    ``npy`` for the others), or ``why`` (a few words: why it did not run; with ``failed`` where the run crashed, was
    killed, timed out or ran out of memory or disk). ``reference``: the reference model's log-probabilities, and
    ``targets``: the sample's next tokens [sequences, positions], for the figures. ``unquantized``: the cache dtype
    ``auto`` runs with (``serving.unquantized_dtype``: a checkpoint declaring a kv_cache_scheme makes vLLM's auto
    fp8). ``offered``: the cache dtypes the installed vLLM has (a scheme whose dtype is not among them is not run; the
    seam for the installed vLLM's own list). ``prompts`` and ``steps``: each run also decodes ``steps`` greedy tokens
    after every prompt (its answer's ``greedy``), for the engine's decode drift; ``max_model_len`` must hold the
    longest prompt plus ``steps``. ``attention_backend``: vLLM's ``--attention-backend`` (None: vLLM chooses);
    ``tokenizer`` False for a checkpoint without one (token ids in, token ids out); ``skip_layers``:
    ``--kv-cache-dtype-skip-layers`` entries every quantized run keeps unquantized (a serve line run as printed; ``auto``
    has nothing to skip); ``tensor_parallel_size``: vLLM's, the GPUs each run spreads the model over."""
    checkpoint = checkpoint.resolve()  # the job runs elsewhere: a relative path would read as a Hub id there
    runs: dict[str, dict] = {}
    base = {"dtype": dtype, "max_model_len": max_model_len, "block_size": block_size, "chunk_len": chunk_len,
            "kv_cache_bytes": kv_bytes, "sequences": sequences, "vocab_size": vocab_size, "prompts": list(prompts),
            "steps": steps, "attention_backend": attention_backend, "tokenizer": tokenizer,
            "tensor_parallel_size": tensor_parallel_size, "checkpoint": str(checkpoint)}
    starts = []  # each start's request: its cache dtype, its runs, its skip layers
    for group in job_groups(names):
        ready = []
        for name in group:
            kv_dtype = RUNS.get(name, (unquantized,))[0]  # auto and auto2: the unquantized cache
            if name in NOT_RUN or name not in (*RUNS, "auto", "auto2"):
                runs[name] = {"why": NOT_RUN.get(name, "a scales file: not run in the engine")}
            elif kv_dtype not in (*offered, unquantized):
                runs[name] = {"why": f"vLLM {host.version} has no {kv_dtype}"}
            else:
                ready.append(name)
        if ready:
            kv_dtype, scales = RUNS.get(ready[0], (unquantized, "none"))
            starts.append({"kv_cache_dtype": kv_dtype, "skip_layers": list(skip_layers) if scales != "none" else [],
                           "runs": [{"name": name, "out": str(workdir / f"{name}.npy"),
                                     "scales": "ones" if RUNS.get(name, (None, "none"))[1] == "ones" else "loaded"}
                                    for name in ready]})
    array = len(sequences) * (len(sequences[0]) - 1) * vocab_size * 4 if sequences else 0
    asked_auto = any(run["name"] == "auto" for start in starts for run in start["runs"])
    auto = None  # the unquantized run's array, once it ran
    for batch in _processes(starts, array, workdir):
        if asked_auto and auto is None and batch[0]["runs"][0]["name"] != "auto":
            answered = [(start, None) for start in batch]  # its process came after the unquantized run's failed
        else:
            answered = _answers(host, base, batch, deny_isa)
        for start, answer in answered:
            ready = [run["name"] for run in start["runs"]]
            kv_dtype = start["kv_cache_dtype"]
            if ready[0] != "auto" and asked_auto and auto is None:  # nothing to compare with
                for name in ready:
                    runs[name] = {"why": "not run: the engine's unquantized run, which every run is compared with, did "
                                         "not run"}
                continue
            seconds = answer["seconds"] / len(ready)  # the start is shared
            if answer.get("crashed"):
                for name in ready:
                    runs[name] = failed_run(answer["crashed"].detail or str(answer["crashed"]), str(answer["crashed"]),
                                            kv_dtype, seconds)
                continue
            if answer["fault"]:
                for name in ready:
                    runs[name] = failed_run(answer["fault"], f"vLLM's logprobs job failed: {answer['fault']}", kv_dtype,
                                            seconds)
                continue
            if answer["error"]:
                for name in ready:
                    runs[name] = {"why": short_reason(answer["error"]), "error": answer["error"], "kv_cache_dtype": kv_dtype,
                                  "seconds": seconds}
                continue
            shared = {key: value for key, value in answer["result"].items() if key != "runs"}
            for name in ready:
                npy = workdir / f"{name}.npy"
                logprobs = np.load(npy, mmap_mode="r")
                runs[name] = {**shared, **answer["result"]["runs"][name], **figures(logprobs, auto, reference, targets),
                              "seconds": seconds}
                if name == "auto":
                    auto, runs[name]["npy"] = logprobs, npy
                else:
                    del logprobs
                    npy.unlink()
    return runs


def _processes(starts: list[dict], array: int, workdir: Path) -> list[list[dict]]:
    """The starts grouped into job processes, in order: every start but the second unquantized run's in one process
    (vLLM imported once, not once per start), that run alone in another (it measures the noise between two engines
    started apart), where ``workdir`` has room for all of the first process's arrays of ``array`` bytes at once (its
    runs are reduced to figures as each start ends, but the job may write the next start's while they are read);
    else each start in a process of its own, as the room allows."""
    first = [s for s in starts if s["runs"][0]["name"] != "auto2"]
    apart = [s for s in starts if s["runs"][0]["name"] == "auto2"]
    arrays = sum(len(s["runs"]) for s in first)
    if len(first) > 1 and shutil.disk_usage(workdir).free >= arrays * array + ROOM_MARGIN:
        return [first, *([apart] if apart else [])]
    return [[s] for s in starts]


def _answers(host: EngineHost, base: dict, batch: list[dict], deny_isa: tuple[str, ...]) -> Iterator[tuple[dict, dict | None]]:
    """Each start of ``batch`` with its answer from one logprobs job (``jobs/logprobs.py``), as each start ends, while
    the job goes on with the next (its runs are reduced to their figures meanwhile): the job's answer with its
    ``seconds``; ``crashed`` (the EngineError) where its process crashed, was killed or timed out; None where the job
    did not start it because the first start, the unquantized run the others need, failed (a batch that begins with
    another start runs every start whatever the first's answer). A process of several starts that crashed
    is run again a start at a time, so one dtype that crashes vLLM costs only its own runs; a start that ran out of
    memory or disk after others in the same process, and those after it, run again each in a process of its own."""
    needed = batch[0]["runs"][0]["name"] == "auto"  # the first start is the unquantized run the others need
    began, answered, first, whole, crashed = time.perf_counter(), 0, None, None, None
    try:
        with Job(host.python, "logprobs", {**base, "starts": batch, "stop_if_first_fails": needed}, deny_isa=deny_isa) as job:
            while answered < len(batch):
                path = job.folder / f"start-{answered}.json"
                if path.is_file():
                    mine = json.loads(path.read_text())
                    if mine["fault"] and answered > 0:  # after other starts in this process: run again alone, below
                        break
                    first = first or mine
                    yield batch[answered], mine
                    answered += 1
                    if mine["fault"] or (needed and mine["error"] and answered == 1):  # the job starts nothing more
                        break
                elif job.running():
                    time.sleep(POLL_S)
                else:
                    break
            whole = job.answer()
    except EngineError as e:
        crashed = e
    rest = batch[answered:]
    if not rest:
        return
    if needed and first is not None and (first["error"] or first["fault"]):
        yield from ((start, None) for start in rest)
    elif whole is not None and (whole["error"] or whole["fault"]) and answered == 0:  # the job itself, before any start
        yield from ((start, {"error": whole["error"], "fault": whole["fault"], "seconds": 0.0}) for start in rest)
    elif len(batch) == 1:
        crashed = crashed or EngineError("vLLM's logprobs job ended without an answer", "no answer")
        yield batch[0], {"crashed": crashed, "error": None, "fault": None, "seconds": time.perf_counter() - began}
    else:
        for j, start in enumerate(rest):
            alone = next(_answers(host, base, [start], deny_isa))
            yield alone
            if needed and answered == 0 and j == 0 and any(alone[1].get(key) for key in ("crashed", "error", "fault")):
                yield from ((later, None) for later in rest[1:])  # the others need the first
                return


def job_groups(names: Sequence[str]) -> list[list[str]]:
    """``names`` as vLLM starts, in order: the runs of one cache dtype whose scales are the checkpoint's or 1.0 (scale
    1.0 and calibrated per tensor are both ``fp8``) share a start, the job setting the scales between them; each other
    run has its own (the second unquantized run measures the noise between starts; a dtype that computes its own
    scales has no other run of its dtype)."""
    groups: list[list[str]] = []
    shared: dict[str, list[str]] = {}
    for name in names:
        kv_dtype, scales = RUNS.get(name, (None, None))
        if scales not in ("ones", "checkpoint"):
            groups.append([name])
        elif kv_dtype in shared:
            shared[kv_dtype].append(name)
        else:
            shared[kv_dtype] = [name]
            groups.append(shared[kv_dtype])
    return groups


def failed_run(detail: str, error: str, kv_dtype: str, seconds: float) -> dict:
    """A run that crashed, was killed, timed out or ran out of room: ``why`` carries vLLM's or the OS's one line."""
    return {"why": f"{RUN_FAILED_TEXT}: {detail}", "failed": True, "error": error, "kv_cache_dtype": kv_dtype,
            "seconds": seconds}


def figures(logprobs: np.ndarray, auto: np.ndarray | None, reference: np.ndarray | None,
            targets: np.ndarray | None) -> dict:
    """A run reduced to what ``compare`` needs, so its [sequences, positions, vocab] array can go: KL and top-1 per
    sequence against the engine's unquantized run (``auto``; None: this is that run), against the reference model
    (None: no reference), and the mean NLL of ``targets`` (None: none). One read of the run's array, a sequence at a
    time."""
    against = {"auto": auto, "reference": reference}
    per: dict[str, list[tuple[float, float]]] = {side: [] for side, base in against.items() if base is not None}
    for i in range(logprobs.shape[0]):
        run = _row(logprobs, i)
        for side in per:
            per[side].append(_sequence_figures(_row(against[side], i), run))
    out: dict = {f"{fig}_vs_{side}": None for side in against for fig in ("kl", "top1")}
    for side, rows in per.items():
        out[f"kl_vs_{side}"], out[f"top1_vs_{side}"] = [kl for kl, _ in rows], [top1 for _, top1 in rows]
    out["nll"] = mean_nll(logprobs, targets) if targets is not None else None
    return out


def short_reason(error: str) -> str:
    """vLLM's refusal in a few words for a table cell (the whole message stays in report.json)."""
    text = error.split(": ", 1)[-1]
    return text.split(". ")[0][:90]


def tolerance(floor_kl: float, noise_kl: float, diff_se: float | None, sequences: int) -> float:
    """How far the engine's KL may lie from the emulation's and still agree (nats/token): see the module's docstring."""
    return floor_kl + noise_kl + margin(diff_se, sequences)


def compare(results: dict[str, dict], runs: dict[str, dict], scheme_scales: dict[str, dict], host: EngineHost,
            settings: dict) -> dict:
    """The engine's figures per scheme (``run_schemes``' runs, each reduced by ``figures``) beside the emulation's,
    with the floor, the noise, the tolerance and the flags (the flags only on a platform whose like-for-like emulation
    was measured, ``platforms.Platform.measured``). ``failed``: each run that crashed, was killed, timed out or ran out
    of room, with vLLM's or the OS's line (the second ``auto`` run's too: the noise is then unmeasured)."""
    auto = runs["auto"]
    if "kl_vs_reference" not in auto:
        raise ValueError(f"vLLM {host.version} could not run the unquantized cache, so nothing was measured in the engine: "
                         f"{auto.get('error', auto['why'])}")
    twin = PLATFORMS[host.platform].measured
    auto_nll = auto["nll"]
    noise_kl, noise_drift = 0.0, None
    if runs.get("auto2", {}).get("kl_vs_auto") is not None:
        noise_kl = mean_stderr(runs["auto2"]["kl_vs_auto"])[0]
        noise_drift = _drift(auto, runs["auto2"])
    floor = None
    if auto["kl_vs_reference"] is not None:
        kls, top1 = auto["kl_vs_reference"], auto["top1_vs_reference"]
        floor = {"kl": mean_stderr(kls)[0], "kl_stderr": mean_stderr(kls)[1], "top1": sum(top1) / len(top1)}
    schemes = {}
    for name, r in results.items():
        if r["mode"] == "reference":
            continue
        run = runs.get(name, {"why": "not run"})
        row = {"kv_cache_dtype": run.get("kv_cache_dtype") or RUNS.get(name, (None,))[0], "emulated_kl": r["kl"]}
        if run.get("kl_vs_auto") is None:
            schemes[name] = {**row, "why": run["why"], "error": run.get("error"), "failed": run.get("failed", False)}
            continue
        kls, top1 = run["kl_vs_auto"], run["top1_vs_auto"]
        kl, se = mean_stderr(kls)
        vs_ref = mean_stderr(run["kl_vs_reference"])[0] if run["kl_vs_reference"] is not None else None
        ppl = math.exp(run["nll"] - auto_nll) - 1 if auto_nll is not None else None
        diff_se = mean_stderr([a - b for a, b in zip(kls, r["kl_per_sequence"])])[1]
        tol = tolerance(floor["kl"] if floor else 0.0, noise_kl, diff_se, len(kls))
        judged = twin and len(kls) >= AGREEMENT_SEQUENCES
        stored = check_stored(run["kv_cache_dtype"], run["stored"], scheme_scales.get(name))
        schemes[name] = {**row, "kl": kl, "kl_stderr": se, "kl_per_sequence": kls, "top1": sum(top1) / len(top1),
                         "kl_vs_reference": vs_ref, "ppl_change": ppl,
                         "ratio": kl / r["kl"] if r["kl"] > 0 else None, "tolerance_kl": tol if judged else None,
                         "within_tolerance": abs(kl - r["kl"]) <= tol if judged else None,
                         "agreement": _agreement(twin, len(kls), judged and abs(kl - r["kl"]) <= tol),
                         "diff_stderr": diff_se, "stored": stored,
                         "as_named": stored["agrees"],
                         "stored_text": "as named" if stored["agrees"] else NOT_AS_NAMED, "seconds": run["seconds"],
                         "rss_peak_delta_mib": run["rss_peak_delta_mib"], "drift": _drift(auto, run)}
    ranking = ranking_flips(schemes, results, noise_kl) if twin else []
    stored_auto = auto["stored"]
    return {"engine": "vllm", "vllm_version": host.version, "platform": host.platform, "target": PLATFORMS[host.platform].target,
            "isa": auto["isa"], "like_for_like": twin,
            "attention_backend": stored_auto["attention_backend"], "settings": settings, "noise_kl": noise_kl,
            "floor": floor, "schemes": schemes, "ranking_flips": ranking, "noise_drift": noise_drift,
            "rss_peak_delta_mib": auto["rss_peak_delta_mib"],
            "failed": {name: run["why"] for name, run in runs.items() if run.get("failed")},
            "seconds": sum(r.get("seconds", 0.0) for r in runs.values())}


def _agreement(twin: bool, sequences: int, within: bool) -> str:
    """Whether the engine and the emulation agree on a scheme, in words: not judged off a measured like-for-like pair,
    too few sequences to tell (under ``AGREEMENT_SEQUENCES``), or the tolerance's answer."""
    if not twin:
        return "not judged (no like-for-like emulation measured)"
    if sequences < AGREEMENT_SEQUENCES:
        return f"{TOO_FEW} ({sequences} < {AGREEMENT_SEQUENCES})"
    return "agree" if within else "disagree"


def _drift(auto: dict, run: dict) -> dict | None:
    """A run's greedy decode against the engine's unquantized cache's, after the same prompts (None: no decode)."""
    if not auto.get("greedy") or not run.get("greedy"):
        return None
    return engine_drift(auto["greedy"], run["greedy"], len(auto["greedy"][0]["tokens"]))


def ranking_flips(schemes: dict[str, dict], results: dict[str, dict], noise_kl: float) -> list[tuple[str, str]]:
    """Pairs (a, b) the emulation clearly ranks a < b and the engine clearly b < a (each gap beyond the
    ``significance.margin`` of the per-sequence difference, plus the noise)."""
    measured = [n for n, row in schemes.items() if "kl" in row]
    flips = []
    for i, a in enumerate(measured):
        for b in measured[i + 1:]:
            emu = [x - y for x, y in zip(results[a]["kl_per_sequence"], results[b]["kl_per_sequence"])]
            eng = [x - y for x, y in zip(schemes[a]["kl_per_sequence"], schemes[b]["kl_per_sequence"])]
            (me, se_e), (mg, se_g) = mean_stderr(emu), mean_stderr(eng)
            clear_e = abs(me) > margin(se_e, len(emu)) + noise_kl
            clear_g = abs(mg) > margin(se_g, len(eng)) + noise_kl
            if clear_e and clear_g and (me > 0) != (mg > 0):
                flips.append((a, b))
    return flips


# A scheme's figures that the engine's replace where it ran the scheme; the emulation's stay beside them, labelled.
# Not drift: the engine's (its greedy decode against its own unquantized cache's, no decode KL) has its own column in
# the engine table, and the emulation's, against the reference with the reference's near-ties followed, stays.
ENGINE_FIGURES = ("kl", "kl_stderr", "kl_per_sequence", "top1", "ppl_change")


def as_printed(choice: str | None, skip: Sequence[str], engine: dict, checkpoint: Path) -> tuple[bool, str | None]:
    """Whether the engine's run of scheme ``choice`` (``engine["schemes"]``) already is the serve line as printed, with
    ``skip`` its skip-layer entries: (True, None) when it is, (False, None) when a run with the skip layers is needed,
    (False, why) when no engine run can stand for the line (never run; 1.0 set in place over the checkpoint's scales)."""
    row = engine["schemes"].get(choice, {})
    if "kl" not in row:
        return False, f"not run in the engine: {row.get('why', 'no engine run')}"
    if RUNS[choice][1] == "ones" and has_kv_scales(checkpoint):
        return False, ("the engine ran scale 1.0 by setting the checkpoint's KV scales to 1.0; the line serves the "
                       "checkpoint, whose scales vLLM would use instead")
    return not skip, None


def worse_than_promised(run: dict, promised: dict, noise_kl: float) -> dict:
    """The serve line's run against the scheme's own engine run (every layer quantized), paired by sequence: worse when
    its KL is higher by more than the paired test's margin plus the engine's run-to-run noise."""
    diff = [a - b for a, b in zip(run["kl_per_sequence"], promised["kl_per_sequence"])]
    mean, se = mean_stderr(diff)
    limit = margin(se, len(diff)) + noise_kl
    return {"kl_change": mean, "limit": limit, "worse": mean > limit}

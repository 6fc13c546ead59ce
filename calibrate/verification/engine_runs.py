"""verify's steps in the engine (``--engine vllm``): the start, the schemes' runs, and the serve line run as printed.

The start comes first (its platform sets the emulation and the target, and the load audit ends a run that cannot
load in its first minute); the runs come after the emulation, on the same held-out sequences, with the reference
model off the GPU; the serve line's run after the advice. Measuring is ``engine.py``'s, judging ``judgment.py``'s.
"""

import contextlib
import copy
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..engine.audit import FAILED, AuditResult
from ..engine.delivery import DeliveryResult, audit_and_check
from ..engine.dtypes import EngineDtypes
from ..engine.launch import EngineError
from ..engine.started import check_hooks, emulation_for, shown
from ..files import no_room, reserved_array
from ..vllm_facts import serving
from ..vllm_facts.caveats import AMX_MLA_AUTO_ONLY
from ..vllm_facts.platforms import platform
from . import engine
from .advice import Advice
from .config import VerifyConfig
from .emulation import Emulated
from .judgment import Judged, engine_limits, thresholds_json
from .reference import Reference, off_gpu
from .sample import Sample
from .schemes import Mode
from .subject import Subject
from .verdict import emulated_figures
from .verdict_table import AUDIT_FAILED, ENGINE_FAILED, NOT_DELIVERED

REFERENCE_LOGPROBS = "reference.npy"  # the reference model's log-probabilities, in the engine's temporary folder


@dataclass(frozen=True)
class EngineStart:
    """The engine as verify found it before the emulation: where it runs, the load audit, the cache dtypes it offers,
    and verify's settings matched to it (``config``) with the line saying what kvcal set, and why."""

    host: engine.EngineHost
    audit: AuditResult
    delivery: DeliveryResult | None  # None: the audit did not pass, so delivery was not asked
    config: VerifyConfig  # the run's settings with the emulation and the target set like for like with the engine
    settings: str  # the line saying what kvcal set, and why
    dtypes: EngineDtypes
    facts: dict | None  # what the engine showed of itself at its starts (``engine.started.shown``; None: no start)


def start_engine(config: VerifyConfig, subject: Subject) -> EngineStart:
    """Find vLLM and its cache dtypes (one import), run the load audit and, where it passed, the delivery check
    (``engine.delivery``: the kernel uses the scales); refuse a release whose engine lacks a hook the jobs need; match
    the emulation and the target to the platform and the attention backend the engine started with
    (``VerifyConfig.match_engine``, on a copy of ``config``; said on stderr with the progress). A flag that contradicts
    the platform, or a vLLM that cannot load the checkpoint, ends the run here, in one line, before the emulation."""
    host = engine.probe(config.vllm_python)
    chosen = platform(host.platform)
    copy.copy(config).match_engine(host.platform, chosen)  # a flag contradicting the platform: refused before any start
    if (chosen.target == "cpu" and host.isa.get("amx") and subject.described.mla
            and serving.unquantized_dtype(subject.described.config) != "auto"):
        raise ValueError(f"{AMX_MLA_AUTO_ONLY}: nothing can be measured in the engine on this host; verify the source "
                         f"model with --engine vllm, or {config.checkpoint} without it")
    checkpoint = subject.absolute
    try:
        held, delivered = audit_and_check(checkpoint, host.python)  # one start serves both
    except EngineError as e:
        raise ValueError(f"the check could not run: vLLM {host.version} on {checkpoint.name} ({e}), so nothing can be "
                         "measured in the engine") from None
    if held.status == FAILED and not held.layers:  # vLLM refused the load itself
        raise ValueError(f"{held.failures[0]}: nothing can be measured in the engine; fix the checkpoint (kvcal inspect "
                         f"{config.checkpoint}), or verify without --engine")
    facts = shown([delivered.engine if delivered else None, held.engine])
    check_hooks(facts, host.version)
    matched = copy.copy(config)
    settings = matched.match_engine(host.platform, chosen, emulation_for(chosen, facts))
    if config.progress:
        print(f"kvcal: {settings}", file=sys.stderr, flush=True)
    return EngineStart(host, held, delivered, matched, settings, EngineDtypes(host.version, host.cache_dtypes), facts)


class Scratch:
    """The engine's temporary folder, and the reference pass's log-probabilities kept in it for the engine's runs:
    [sequences, positions, vocab] float32, written by the emulation's reference pass (``keep``) and read by the
    schemes' runs and the serve line's, so the model computes them once. Its bytes are reserved at the first chunk
    (the vocabulary is known then): a full disk is one line in the answer (``error``), and the emulation goes on."""

    def __init__(self, folder: Path, sequences: int) -> None:
        self.folder, self.path, self.sequences = folder, folder / REFERENCE_LOGPROBS, sequences
        self.layout: tuple[int, int, int] | None = None  # the data's offset in the file, positions, vocabulary
        self.error: str | None = None

    def keep(self, sequence: int, start: int, positions: int, logprobs: torch.Tensor) -> None:
        """``passes.measure``'s ``keep``: one chunk's log-probabilities [n, V] from ``start`` of ``sequence``, written
        at their place in the file (not through a memory map, whose pages would count as this process's memory for
        the rest of the emulation)."""
        if self.error is not None:
            return
        if self.layout is None:
            try:
                offset = reserved_array(self.path, (self.sequences, positions, logprobs.shape[-1]))
            except OSError as e:
                if (why := no_room(e)) is None:
                    raise
                self.path.unlink(missing_ok=True)
                self.error = (f"writing the reference log-probabilities in {tempfile.gettempdir()} failed: {why}; "
                              "free space there")
                return
            self.layout = (offset, positions, logprobs.shape[-1])
        offset, positions, vocab = self.layout
        rows = logprobs.float().cpu().numpy()
        data, at = memoryview(rows).cast("B"), offset + (sequence * positions + start) * vocab * rows.itemsize
        with open(self.path, "r+b") as f:
            while data:  # one call writes at most about 2 GiB
                written = os.pwrite(f.fileno(), data, at)
                data, at = data[written:], at + written

    def reference(self) -> np.ndarray:
        """The reference's log-probabilities, memory-mapped read-only; ValueError (``error``) where they could not be
        kept."""
        if self.error is not None or self.layout is None:
            raise ValueError(self.error or "the reference pass kept no log-probabilities")
        return np.load(self.path, mmap_mode="r")


@contextlib.contextmanager
def scratch(started: EngineStart | None, sequences: int):
    """The engine's ``Scratch`` for ``sequences`` sequences, removed at the end (None without an engine)."""
    if started is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="kvcal-engine-") as folder:
        yield Scratch(Path(folder), sequences)


def run_engine(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference, sample: Sample,
               emulated: Emulated, judged: Judged, work: Scratch) -> tuple[dict | None, str | None]:
    """The same sequences in the engine, once per scheme it can serve; with decode drift's prompts, the engine's own
    greedy decode after each too, compared with the reference's log-probabilities the emulation's reference pass kept
    in ``work``; the model leaves the GPU first (``reference.off_gpu``). (result, None), or (None, the failure in one
    line) when the engine failed after the emulation ran, which then stands alone. The result's limits are the
    engine's own (``judgment.engine_limits``), which ``judgment.judge_engine`` judges it by."""
    host, sequences = started.host, sample.sequences
    request, settings = engine_request(config, subject, started, ref, sample)
    schemes = emulated.schemes
    names = ["auto", "auto2", *(s.name for s in schemes if s.mode != Mode.REFERENCE)]
    targets = torch.stack([s[1:] for s in sequences]).numpy()  # the next tokens, for the engine's perplexity
    try:
        logprobs = work.reference()
        off_gpu(ref, platform(host.platform).target != "cpu")
        runs = engine.run_schemes(host, subject.absolute, names, [s.tolist() for s in sequences], **request,
                                  vocab_size=logprobs.shape[-1], workdir=work.folder, reference=logprobs, targets=targets)
        del logprobs
        if "npy" in runs.get("auto", {}):  # the serve line's run makes its own unquantized run
            runs["auto"].pop("npy").unlink()
        result = engine.compare(judged.results, runs, {s.name: s.scales for s in schemes if s.scales}, host, settings)
    except (ValueError, EngineError) as e:
        return None, str(e)
    except OSError as e:  # the temporary directory filled after check_room
        if (why := no_room(e)) is None:
            raise
        return None, f"writing in {tempfile.gettempdir()} failed: {why}; free space there"
    held = started.audit
    return {**result, "thresholds": thresholds_json(config.thresholds, engine_limits(config, result, len(sequences)),
                                                    result["floor"]),
            "audit": {"status": held.status, "failures": held.failures, "reason": held.reason,
                      "kv_cache_dtype": held.kv_cache_dtype},
            "set": started.settings, "not_emulated": started.dtypes.not_emulated(), "at_start": started.facts,
            "delivery": started.delivery.to_json() | {"text": started.delivery.text()} if started.delivery else None}, None


def engine_request(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference,
                   sample: Sample) -> tuple[dict, dict]:
    """What every engine run of this verify is given (``engine.run_schemes``' settings but the names, the sequences, the
    vocabulary and the folder), and the settings report.json shows."""
    sig, prompts = ref.sig, sample.prompts
    block = config.block_size or platform(started.host.platform).block_size
    longest = max(config.data.seq_len + 1, max((len(p) + config.generate for p in prompts), default=0))
    max_len = config.max_model_len or engine.model_len(longest, block)
    settings = {"max_model_len": max_len, "block_size": block, "dtype": config.dtype, "chunk_len": config.data.chunk_len,
                "prefix_caching": False, "enforce_eager": True}
    request = {"dtype": config.dtype or "auto", "chunk_len": config.data.chunk_len, "max_model_len": max_len,
               "block_size": block, "kv_bytes": engine.kv_cache_bytes(len(ref.layers), sig.num_kv_heads, sig.head_dim, max_len, block),
               "unquantized": serving.unquantized_dtype(subject.described.config), "offered": started.dtypes.names,
               "prompts": [p.tolist() for p in prompts], "steps": config.generate, "tensor_parallel_size": config.tp}
    return request, settings


def engine_lines(started: EngineStart, engine_result: dict | None, engine_error: str | None) -> list[str]:
    """The recommendation's first lines under --engine: a failed audit or delivery, the engine's failure, or which
    figures ranked and judged."""
    return [*(f"{AUDIT_FAILED}{line}" for line in started.audit.failures),
            *([f"{NOT_DELIVERED}{started.delivery.text()}"] if started.delivery and not started.delivery.ok() else []),
            *([f"{ENGINE_FAILED}, which alone is judged here: {engine_error}"] if engine_error else
              [*(f"{ENGINE_FAILED} in {name}: {why}; "
                 + ("the engine's run-to-run noise is unmeasured" if name == "auto2" else "that scheme has no verdict")
                 for name, why in engine_result["failed"].items()),
               f"Ranked and judged on the engine's figures (vLLM {engine_result['vllm_version']}, "
               f"{engine_result['attention_backend']}, target {engine_result['target']}) where it ran a "
               "scheme, the emulation's beside them; docs/engine.md."])]


def run_serve_line(config: VerifyConfig, subject: Subject, started: EngineStart, ref: Reference, sample: Sample,
                   judged: Judged, advice: Advice, engine_result: dict, work: Scratch) -> dict:
    """The serve line the answer prints, run as printed in the engine (its cache dtype, its skip layers, this
    checkpoint's scales) on the held-out sequences: the scheme's own run where that already is the line, else one run
    with the skip layers beside a fresh unquantized one, against the reference's log-probabilities kept in ``work``;
    against the scheme's all-quantized run, flagged when worse beyond the noise (``run_verify`` then serves that run's
    line instead)."""
    choice = advice.serve_lines[config.target]["scheme"]
    dtype, skip = serving.serve_args(advice.serve)
    out = {"line": advice.serve, "scheme": choice, "kv_cache_dtype": dtype, "skip_layers": skip,
           "vllm_version": engine_result["vllm_version"], "attention_backend": engine_result["attention_backend"]}
    if choice is None:
        return {**out, "ran": False, "why": "the line keeps the cache unquantized: the engine's floor is that run"}
    same, why = engine.as_printed(choice, skip, engine_result, subject.absolute)
    promised = engine_result["schemes"][choice]
    if why is not None:
        return {**out, "ran": False, "why": why}
    if same:
        return {**out, "ran": True, "same_run": True, "floor": engine_result["floor"],
                **{k: promised[k] for k in ("kl", "kl_stderr", "top1", "drift")}}
    request, settings = engine_request(config, subject, started, ref, sample)
    sequences = sample.sequences
    targets = torch.stack([s[1:] for s in sequences]).numpy()
    off_gpu(ref, platform(started.host.platform).target != "cpu")  # the skip-layer probe brought it back
    try:
        logprobs = work.reference()
        runs = engine.run_schemes(started.host, subject.absolute, ["auto", choice], [s.tolist() for s in sequences],
                                  **request, vocab_size=logprobs.shape[-1], workdir=work.folder, skip_layers=skip,
                                  reference=logprobs, targets=targets)
        del logprobs
        result = engine.compare({choice: emulated_figures(judged.results)[choice]}, runs, {}, started.host, settings)
    except (ValueError, EngineError) as e:
        return {**out, "ran": False, "why": f"the engine failed: {e}"}
    except OSError as e:  # the temporary directory filled after check_room
        if (why := no_room(e)) is None:
            raise
        return {**out, "ran": False, "why": f"the engine failed: writing in {tempfile.gettempdir()} failed: {why}"}
    row = result["schemes"][choice]
    if "kl" not in row:
        return {**out, "ran": False, "why": f"the engine failed: {row['why']}"}
    # No "as named" here: the skipped layers' unquantized cache is what the line asks for (the scheme's own run checked
    # the dtype's name on every layer).
    return {**out, "ran": True, "same_run": False, "floor": result["floor"],
            **{k: row[k] for k in ("kl", "kl_stderr", "kl_per_sequence", "top1", "drift")},
            "against_promised": engine.worse_than_promised(row, promised, engine_result["noise_kl"])}

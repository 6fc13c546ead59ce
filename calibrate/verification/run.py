"""``kvcal verify``: what a quantized KV cache costs a checkpoint, measured against the unquantized model.

A *scheme* is one way vLLM could store attention's inputs (``choices.VERIFY_SCHEMES``, or a scales file the user names).
Every scheme is emulated as vLLM's cache write does it: FP8 schemes as x / scale, saturated to the format's
finite max, rounded to nearest even, times scale — K and V always, Q too where the backend quantizes queries
(``vllm_facts.caveats.Q_QUANTIZERS``; ``kv_only`` models the Triton/FlashInfer backends); vLLM's other cache dtypes (int8 and int4 per
token-head, nvfp4) by ``kvdtypes``, K and V only.

Cost: one reference forward of the sample (which also runs each scheme's attention on every layer's own inputs,
for the per-layer errors), one forward per scheme with every layer quantized at once, one for the *floor* (the
unquantized model in another precision, what the verdicts are relative to), and for the recommended scheme one
per probed layer left unquantized (plus a reference): about 3 + S + P forwards. The FA3 accumulator model
(``fa3.probe``), the needle probe (``needle.py``) and decode drift (``drift.py``: prompts × generated tokens
decode steps, for the reference and each scheme) are extra; the tails (``tails.py``), KL by context depth (``depth.py``)
and by kind of token (``token_kinds.py``) reuse the passes' per-token KL. What the numbers mean, verdicts and the
recommendation, is ``verdict.py``'s; the memory arithmetic ``capacity.py``'s.

Each step lives in a module named for its job and returns a new value that the later steps read and none edits:
``subject`` (the checkpoint described), ``sample`` (the held-out sequences), ``reference`` (the model), ``emulation``,
``judgment``, ``engine_runs`` (--engine), ``advice`` and ``report_json``. This module holds the order.
"""

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..files import no_room
from ..model.load import resolve_device
from ..vllm_facts import serving
from . import engine, report
from .advice import advise
from .config import VerifyConfig
from .emulation import emulate
from .engine_runs import engine_lines, run_engine, run_serve_line, scratch, start_engine
from .judgment import engine_limits, judge_emulation, judge_engine
from .reference import load_reference
from .report_json import build_report, refresh_card
from .sample import held_out_sample
from .subject import describe_subject

# verify's exit status when the answer is incomplete: an engine run failed after the emulation ran (docs/usage.md).
INCOMPLETE = 3


@dataclass
class VerifyResult:
    """Every number of a verify run (``report``, as written to report.json) and where the report went."""

    report: dict
    report_dir: Path | None
    checkpoint: str | None = None  # as the user typed it: the terminal's serve line names it, the report does not
    report_error: str | None = None  # why --report's folder was not written (a full disk): the terminal has the answer

    @property
    def schemes(self) -> dict[str, dict]:
        return self.report["schemes"]

    def outcome(self) -> tuple[int, str | None]:
        """The command's exit status and its one-line error (docs/usage.md, "Exit status"): 2 when the report could
        not be written (the terminal's answer is all there is), INCOMPLETE when the engine failed after the emulation
        ran, wholly or in one scheme's run (the report keeps what ran), 1 when the load audit found the engine does not
        hold the checkpoint's scales or the delivery check found the kernel ignores them."""
        if self.report_error:  # first: the folder the user will look for is not there
            return 2, self.report_error
        if self.report.get("engine_error"):
            return INCOMPLETE, ("the engine failed after the emulation ran (its figures alone are reported): "
                                f"{self.report['engine_error']}")
        engine = self.report.get("engine")
        if engine and engine.get("failed"):
            name, why = next(iter(engine["failed"].items()))
            more = f" (and {len(engine['failed']) - 1} more)" if len(engine["failed"]) > 1 else ""
            return INCOMPLETE, f"the answer is incomplete: {name}: {why}{more}"
        if engine and engine["audit"]["failures"]:
            return 1, f"the load audit failed: {engine['audit']['failures'][0]}"
        if engine and engine["delivery"] and not engine["delivery"]["ok"]:
            return 1, f"the delivery check failed: {engine['delivery']['text'].splitlines()[0]}"
        return 0, None

    def summary(self, skip_layers: Sequence[str | int] = (), *, verbose: bool = False, risks: Sequence[str] = ()) -> str:
        """The verdict table and the answer, the serve command last (``report.verify_text``; ``verbose``: with every
        detail report.md holds), for a person; ``skip_layers`` (a recipe's) are added to every serve line, and each
        names the checkpoint as the user typed it; ``risks``: the caller's warnings, weighed for the answer."""

        def local(line: str) -> str:
            return serving.with_skip_layers(line if self.checkpoint is None else serving.with_model(line, self.checkpoint), skip_layers)

        rep = {**self.report, "serve_command": local(self.report["serve_command"]),
               "serve_lines": {t: {**s, "line": local(s["line"])} for t, s in self.report.get("serve_lines", {}).items()}}
        return report.verify_text(rep, report_md=self.report_dir / "report.md" if self.report_dir else None,
                                  verbose=verbose, risks=risks)


class Clock:
    """Seconds since the run started, marked at the end of each step, for the report's timings."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks = {"start": self.start}

    def mark(self, step: str) -> None:
        self.marks[step] = time.perf_counter()

    def between(self, first: str, last: str) -> float:
        return self.marks[last] - self.marks[first]


def verify(checkpoint: str | Path, data: str | Path | list[str], **options) -> VerifyResult:
    """Measure what an FP8 KV cache costs ``checkpoint`` on ``data``, per scheme, and recommend how to serve it.

    ``options`` are flat settings, each going to the part of ``VerifyConfig`` that owns it: ``seq_len``,
    ``max_tokens``, ``chunk_len``, ``text_field``, ``seed`` (the sample), ``max_kl``, ``fail_kl``, ``min_top1``,
    ``fail_top1`` (the thresholds) and VerifyConfig's own fields (schemes, fa3, accum_bits, needle, report_dir...).
    """
    return run_verify(VerifyConfig.from_options(checkpoint, data, **options))


def run_verify(config: VerifyConfig) -> VerifyResult:
    """Run a verify; see ``verify``."""
    clock = Clock()
    # 1. Describe the checkpoint once (config.json, vLLM's weight files, kvcal's records) and check every option and
    # data source, before anything is loaded.
    subject, device = describe_subject(config), resolve_device(config.device)
    # 2. The engine (--engine), started before anything long: its platform sets the emulation and the target (the
    # settings matched to it are the run's from here), and the load audit shows it loads this checkpoint, or ends the
    # run in its first minute.
    started = start_engine(config, subject) if config.engine else None
    config = started.config if started else config
    clock.mark("engine_start")
    # 3. The held-out sample, before the model is loaded: data too short for one sequence is refused cheaply.
    sample = held_out_sample(config, subject)
    clock.mark("sample")
    # 4. The reference model (float32 on CPU by default, K and V unquantized) and its attention layers.
    ref = load_reference(config, subject, device, sample.tokenizer, sample.sequences)
    if started is not None:  # the engine's arrays fit the temporary directory, known before the emulation's passes
        engine.check_room(len(sample.sequences), config.data.seq_len - 1, ref.model.config.get_text_config().vocab_size,
                          ["auto", "auto2", *config.schemes], Path(tempfile.gettempdir()))
    clock.mark("load")
    with scratch(started, len(sample.sequences)) as work:
        # 5. Emulate every scheme and the floor as vLLM's cache write does it (under --engine, the reference pass also
        # keeps its log-probabilities for the engine's runs); the optional probes.
        emulated = emulate(config, subject, ref, sample, clock.mark, work and work.keep)
        # 6. Judge the emulation: limits from the floor unless set, tails, depth, kinds of token, verdicts.
        judged = judge_emulation(config, sample, emulated)
        engine_result, engine_error, lead = None, None, []
        if started is not None:
            # 7. The engine runs the same sequences per scheme it serves, the reference model off the GPU while it
            # does; its figures, judged against its own floor, take the emulation's place where it ran.
            engine_result, engine_error = run_engine(config, subject, started, ref, sample, emulated, judged, work)
            if engine_result is not None:
                judged = judge_engine(judged, engine_result, engine_limits(config, engine_result, len(sample.sequences)))
            lead = engine_lines(started, engine_result, engine_error)
        # 8. Advise the target on the figures that decide: what its vLLM refuses, the choice, the layers to keep
        # unquantized, what the cache costs and frees, whether scale 1.0 is enough.
        advice = advise(config, subject, ref, sample, emulated, judged, engine_result, lead=lead)
        # 8b. The serve line it will print, run as printed in the engine: the answer shows that run's figures. Where
        # its skip layers made it worse than every layer quantized, the next candidate is that line, which the engine
        # already ran: the advice is made again without the skip-layer probe.
        if engine_result is not None:
            served = run_serve_line(config, subject, started, ref, sample, judged, advice, engine_result, work)
            if served.get("against_promised", {}).get("worse"):
                probed = advice.skip_probe
                advice = advise(config, subject, ref, sample, emulated, judged, engine_result, probe=False, lead=lead)
                served = {**served, "skip_probe": probed, "instead": advice.serve}
            engine_result = {**engine_result, "serve_run": served}
    # 9. The report; a kvcal output's model card gets its table.
    rep = build_report(config, subject, ref, sample, emulated, judged, advice, engine_result, engine_error,
                       _timings(clock, emulated.tallies, advice.skip_probe, emulated.ref_seconds))
    out, failed = None, None
    if config.report_dir is not None:
        try:  # both files or neither; a full disk here loses the folder, never the answer the terminal shows
            report.write_verify_report(Path(config.report_dir), rep)
            out = Path(config.report_dir)
        except OSError as e:
            if (why := no_room(e)) is None:
                raise
            failed = (f"the report was not written to {config.report_dir} ({why}; nothing of it is there): free space "
                      "there and run again")
        else:
            refresh_card(subject, rep)
    return VerifyResult(rep, out, config.checkpoint, failed)


def _timings(clock: Clock, tallies: dict, skip_probe: dict | None, reference_pass_s: float) -> dict:
    """The report's timings: each step's seconds from the clock's marks, and each pass's own."""
    return {
        "engine_start_s": clock.between("start", "engine_start"),  # describing the checkpoint, and the engine start
        "sample_s": clock.between("engine_start", "sample"), "load_s": clock.between("sample", "load"),
        "passes_s": clock.between("load", "passes"), "reference_pass_s": reference_pass_s,
        "scheme_pass_s": {n: t.seconds for n, t in tallies.items()},
        "skip_probe_s": skip_probe["seconds"] if skip_probe else 0.0, "fa3_s": clock.between("passes", "fa3"),
        "needle_s": clock.between("fa3", "needle"), "drift_s": clock.between("needle", "drift"),
        "total_s": time.perf_counter() - clock.start,
    }

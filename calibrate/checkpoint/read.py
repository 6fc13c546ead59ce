"""Reading the KV scales a checkpoint holds as vLLM's loaders would: per layer, under whichever name the
checkpoint's form uses, with vLLM's rules for a missing scale applied. ``load_scales`` is the one chain both
``kvcal inspect`` (which reports every problem) and ``kvcal verify`` (which runs the model with the result) use."""

from dataclasses import dataclass
from pathlib import Path

import torch

from ..capture.stats import KINDS
from ..model.directory import read_tensor, tensor_names
from ..model.layers import AttentionLayer, ModelSignature
from ..vllm_facts.loaders import LoadedScale, fill_missing
from .loaders import layer_sources


@dataclass
class CheckpointScales:
    """A checkpoint's k/v/q scales as vLLM maps them onto its attention layers."""

    sources: dict[tuple[int, str], list[str]]  # (layer, kind) → every tensor name mapped there (vLLM keeps the last)
    ignored: list[tuple[int, str]]  # (layer, message) for each name vLLM ignores under this quantization method
    tensors: dict[tuple[int, str], torch.Tensor]  # (layer, kind) → the tensor vLLM keeps, as stored
    loaded: dict[int, dict[str, LoadedScale]]  # layer → kind → what vLLM uses, gaps filled by its rules
    gaps: list[tuple[int, str, str]]  # (layer, severity, message) for each gap vLLM fills

    def has_kv(self) -> bool:
        """Whether any k or v scale is stored: without one, vLLM uses 1.0 everywhere."""
        return any(kind in ("k", "v") for _, kind in self.sources)


def load_scales(where: dict[str, Path], prefixes: dict[int, str], method: str | None, *,
                stored: torch.dtype | None = None) -> CheckpointScales:
    """Every layer's scales as vLLM loads them.

    Args:
        where: tensor name → file, over the files vLLM reads.
        prefixes: layer index → attention module prefix.
        method: the checkpoint's quantization method (vLLM maps some names only under some methods).
        stored: the dtype vLLM stores the scales in when that rounds them (``loaders.stored_dtype``), else None.
    """
    sources, ignored = layer_sources(where, prefixes, method)
    tensors = {key: read_tensor(where[names[-1]], names[-1]) for key, names in sources.items()}
    if stored is not None:
        tensors = {key: t.to(stored).float() for key, t in tensors.items()}  # what vLLM's base loader keeps and uses
    loaded, gaps = {}, []
    for index in prefixes:
        scales = {kind: LoadedScale(tensors[index, kind].flatten().tolist(), sources[index, kind][-1], where[sources[index, kind][-1]].name)
                  for kind in KINDS if (index, kind) in tensors}
        gaps += [(index, severity, message) for severity, message in fill_missing(scales, any_scales=bool(sources))]
        loaded[index] = {kind: scales[kind] for kind in KINDS}
    return CheckpointScales(sources, ignored, tensors, loaded, gaps)


def read_scales(
    files: list[Path], layers: list[AttentionLayer], sig: ModelSignature, method: str | None
) -> tuple[dict[str, torch.Tensor], str | None, list[str]]:
    """KV scales stored in safetensors ``files`` as vLLM would use them for each attention layer, for verify.

    Returns:
        (kind → [L, H] float32 scales as stored (before any loader multiplier), granularity
        "tensor"/"head"/None when no k/v scale exists, notes for the report). A zero or negative scale is
        treated as 1.0, as vLLM does.

    Raises:
        ValueError: a scale whose shape does not fit the model's heads, or that is NaN/Inf.
    """
    where = {name: path for path in files for name in tensor_names(path)}
    found = load_scales(where, {layer.layer_idx: layer.prefix for layer in layers}, method)
    notes = [message for _, message in found.ignored]
    if not found.has_kv():
        return {}, None, notes
    heads = sig.heads
    for (index, kind), t in found.tensors.items():
        name = found.sources[index, kind][-1]
        if t.numel() != 1 and t.shape not in ((heads[kind], 1, 1), (heads[kind],)):
            raise ValueError(
                f"{name} in {where[name].name} has shape {list(t.shape)}, but this model has {heads[kind]} "
                f"{'query' if kind == 'q' else 'KV'} heads: expected [1] or [{heads[kind]}, 1, 1]; were these "
                "scales written for another model?"
            )
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} is NaN or Inf; vLLM would produce garbage with it: recalibrate")
    per_head = any(t.numel() > 1 for t in found.tensors.values())
    notes += [f"layer {index}: {message}; so does this verify" for index, _, message in found.gaps]
    rows: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    for layer in layers:
        for kind, scale in found.loaded[layer.layer_idx].items():
            value = torch.tensor(scale.value).expand(heads[kind]).clone()  # [H]
            if (value <= 0).any():
                notes.append(f"{scale.tensor} is zero or negative: vLLM treats it as absent and uses 1.0, and so does this verify")
                value = torch.where(value > 0, value, torch.ones_like(value))
            rows[kind].append(value)
    return {kind: torch.stack(r) for kind, r in rows.items()}, ("head" if per_head else "tensor"), notes  # kind → [L, H]

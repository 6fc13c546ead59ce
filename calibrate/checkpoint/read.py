"""Reading the KV scales a checkpoint holds as vLLM's loaders would: per layer, under whichever name the
checkpoint's form uses, in the units vLLM then uses (verify and inspect read them here)."""

from pathlib import Path

import torch

from ..loaders import LoadedScale, fill_missing, layer_sources, read_tensor, tensor_names
from ..model.layers import AttentionLayer
from ..capture.stats import KINDS
from ..model.layers import ModelSignature


def read_scales(files: list[Path], layers: list[AttentionLayer], sig: ModelSignature, method: str | None) -> tuple[dict[str, torch.Tensor], str | None, list[str]]:
    """KV scales stored in safetensors ``files``, as vLLM would load them for each attention layer.

    Names, and what a missing scale becomes, follow ``checkpoint`` (the rules ``kvcal inspect`` reports by).

    Args:
        method: the checkpoint's quantization method (vLLM maps some names only under some methods).

    Returns:
        (kind → [L, H] float32 scales as stored (before any loader multiplier), granularity
        "tensor"/"head"/None when no k/v scale exists, notes for the report). A zero or negative scale is
        treated as 1.0, as vLLM does.

    Raises:
        ValueError: a scale whose shape does not fit the model's heads, or that is NaN/Inf.
    """
    where = {name: path for path in files for name in tensor_names(path)}
    sources, ignored = layer_sources(where, {layer.layer_idx: layer.prefix for layer in layers}, method)
    notes = [message for _, message in ignored]
    if not any(kind in ("k", "v") for _, kind in sources):
        return {}, None, notes
    heads = {"k": sig.num_kv_heads, "v": sig.num_kv_heads, "q": sig.num_heads}
    rows: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    per_head = False
    for layer in layers:
        loaded = {}
        for kind in KINDS:
            if (layer.layer_idx, kind) not in sources:
                continue
            name = sources[layer.layer_idx, kind][-1]
            t = read_tensor(where[name], name)
            if t.numel() != 1 and t.shape not in ((heads[kind], 1, 1), (heads[kind],)):
                raise ValueError(
                    f"{name} in {where[name].name} has shape {list(t.shape)}, but this model has {heads[kind]} "
                    f"{'query' if kind == 'q' else 'KV'} heads: expected [1] or [{heads[kind]}, 1, 1]; were these "
                    "scales written for another model?"
                )
            if not torch.isfinite(t).all():
                raise ValueError(f"{name} is NaN or Inf; vLLM would produce garbage with it: recalibrate")
            per_head |= t.numel() > 1
            loaded[kind] = LoadedScale(t.flatten().tolist(), name, where[name].name)
        notes += [f"layer {layer.layer_idx}: {message}; so does this verify" for _, message in fill_missing(loaded, any_scales=True)]
        for kind in KINDS:
            value = torch.tensor(loaded[kind].value).expand(heads[kind]).clone()  # [H]
            if (value <= 0).any():
                notes.append(f"{loaded[kind].tensor} is zero or negative: vLLM treats it as absent and uses 1.0, and so does this verify")
                value = torch.where(value > 0, value, torch.ones_like(value))
            rows[kind].append(value)
    return {kind: torch.stack(r) for kind, r in rows.items()}, ("head" if per_head else "tensor"), notes  # kind → [L, H]

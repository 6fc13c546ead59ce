"""What kvcal tells a person: the per-layer scale table and the serve command."""

import torch

from .export import SCALE_NAMES

# What each granularity needs from vLLM at serve time.
SERVE_NOTES = {
    "tensor": "per-tensor scales: read by every vLLM attention backend that supports an FP8 KV cache",
    "head": "per-head scales are used only by vLLM's FlashAttention-3 backend (Hopper); Triton and FlashInfer refuse them",
    "token": "per-token-head mode: vLLM computes scales as it writes the cache (Triton backend only) and ignores the "
    "checkpoint's scales; the per-tensor scales written are the fallback for any other --kv-cache-dtype",
}


def serve_command(out: str, granularity: str, skip_sliding: bool = False) -> str:
    """The exact ``vllm serve`` line for the written checkpoint."""
    dtype = "fp8_per_token_head" if granularity == "token" else "fp8"
    line = f"vllm serve {out} --kv-cache-dtype {dtype}"
    if granularity == "head":
        line += " --attention-backend FLASH_ATTN"
    if skip_sliding:
        line += " --kv-cache-dtype-skip-layers sliding_window"
    return line


def scale_table(
    layers: list[int], absmax: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], saturated: dict[str, torch.Tensor]
) -> str:
    """Per-layer table of absmax, scale and predicted saturation for k, v and q (max over heads when per head)."""
    kinds = [k for k in SCALE_NAMES if k in scales]
    header = f"{'layer':>5} " + " ".join(f"{k + ' absmax':>10} {k + '_scale':>10} {k + ' sat%':>7}" for k in kinds)
    rows = [header, "-" * len(header)]
    for row, layer in enumerate(layers):
        cells = []
        for k in kinds:
            scale = scales[k][row].max().item()
            cells.append(f"{absmax[k][row].max().item():>10.4g} {scale:>10.4g} {100 * saturated[k][row].max().item():>7.3f}")
        rows.append(f"{layer:>5} " + " ".join(cells))
    return "\n".join(rows)

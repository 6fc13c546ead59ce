"""Does a smaller KV cache pay at my context length? Memory and decode-bytes arithmetic: no model, no GPU.

For each ``--kv-cache-dtype`` the caller sizes (bytes per token per layer, ``docs/kv-dtypes.md``): how many
full-length sequences fit beside the weights, and how many bytes one decoded token reads from memory. Decode at
small batch is memory bound, so bytes read is the model of its cost here; it says bytes, never time. Every figure
is per GPU: over ``tp`` tensor-parallel GPUs each holds 1/tp of the weights and its KV heads (``per_gpu``) and
serves every sequence. Imports neither torch nor transformers.
"""

import math
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, replace

from ..choices import SIZE_UNITS, parse_size
from ..data.config import check_int
from ..vllm_facts.serving import GPU_MEMORY_UTILIZATION

# Memory of one GPU as nvidia-smi reports its total (SXM parts; docs/vllm-notes.md "GPU memory"), not the vendors' sales
# figure (an H100 sold as "80 GB" reports 79.6 GiB; counting 80 * 10**9 bytes was 6% low). vLLM takes its utilization of the total CUDA reports
# (torch.cuda.mem_get_info()[1]), a few hundred MiB less again: pass that size with --gpu for a tight estimate.
GPUS = {"H100": 81559 * SIZE_UNITS["MIB"], "H200": 143771 * SIZE_UNITS["MIB"], "B200": 183359 * SIZE_UNITS["MIB"]}
# Quoted beside kvcal's own arithmetic for comparison; nothing here derives them. They are the figures kvcal's planning
# started from, unmeasured here; docs/verify.md ("Does it pay") says so.
QUOTED_FIGURES = {"fp8_decode_cost_vs_bf16": 0.54, "break_even_context_tokens": 7000}
QUOTED_NOTE = "quoted figures, not measured by kvcal (docs/verify.md: Does it pay)"


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's cache shape, as the whole model has it (before tensor parallelism).

    Attributes:
        index: vLLM's layer index, the one ``--kv-cache-dtype-skip-layers`` names.
        heads: KV heads (1 for an MLA latent). head_dim, head_dim_v: K and V head sizes.
        sliding_window: tokens a sliding-window layer keeps of a sequence; None: a full layer keeps them all.
    """

    index: int
    heads: int
    head_dim: int
    head_dim_v: int
    sliding_window: int | None = None


BytesOf = Callable[[LayerKV], float]  # bytes per token of one layer in one cache dtype, K and V together


def bf16_bytes(layer: LayerKV) -> float:
    """Bytes per token of ``layer`` in a 16-bit cache (``auto`` of a bf16/fp16 model): K and V, 2 bytes each."""
    return 2 * layer.heads * (layer.head_dim + layer.head_dim_v)


def parse_memory(text: str | int) -> int:
    """Bytes of one GPU's memory: a name in ``GPUS`` (any case), a size (``80GB``, ``141GiB``, ``24000MiB``,
    ``1.5TB``; GB = 10**9, GiB = 2**30) or an int of bytes."""
    name = text.strip().upper() if isinstance(text, str) else ""
    size = GPUS.get(name) or parse_size(text)
    if not size:
        raise ValueError(f"memory {text!r} is neither a GPU ({', '.join(GPUS)}) nor a positive size; "
                         "write a GPU name or a number and unit, e.g. 80GB, 141GiB, 24000MiB, 1.5TB")
    return size


def per_gpu(layers: Iterable[LayerKV], tp: int = 1) -> list[LayerKV]:
    """The layers as one of ``tp`` GPUs holds them: max(1, heads // tp) KV heads, vLLM's rule
    (``ModelConfig.get_num_kv_heads``), which replicates the KV heads when there are fewer than ``tp``.

    A tp that does not divide the heads is not refused: vLLM refuses it when it loads the model (a check on the
    query heads, which a LayerKV does not carry), and this arithmetic is defined for any tp.
    """
    check_int("tp", tp, 1)
    return [replace(layer, heads=max(1, layer.heads // tp)) for layer in layers]


def kv_bytes(layers: Iterable[LayerKV], bytes_of: BytesOf, context: int, skip: Set[int] = frozenset(),
             bf16_bytes_of: BytesOf = bf16_bytes, tp: int = 1) -> float:
    """KV bytes one sequence of ``context`` tokens holds on one GPU: each layer min(context, window) tokens at
    ``bytes_of(layer)`` bytes each, a layer in ``skip`` (``--kv-cache-dtype-skip-layers``) at ``bf16_bytes_of``."""
    check_int("context", context, 1)
    # A lower bound of what vLLM allocates: it pads the pages of layers whose sizes differ (docs/kv-dtypes.md
    # "Sizing") and keeps somewhat more than the window of a sliding-window layer (whole blocks, one step's tokens).
    total = 0.0
    for layer in per_gpu(layers, tp):
        tokens = context if layer.sliding_window is None else min(context, layer.sliding_window)
        total += tokens * (bf16_bytes_of(layer) if layer.index in skip else bytes_of(layer))
    return total


def per_token(layers: Iterable[LayerKV], bytes_of: BytesOf, context: int, skip: Set[int] = frozenset(),
              bf16_bytes_of: BytesOf = bf16_bytes, tp: int = 1) -> float:
    """KV bytes per token of a ``context``-token sequence, averaged over it: the same at every context without
    sliding-window layers, falling with context past their window."""
    return kv_bytes(layers, bytes_of, context, skip, bf16_bytes_of, tp) / context


def fit(memory_bytes: int, weight_bytes: float, per_sequence_bytes: float,
        utilization: float = GPU_MEMORY_UTILIZATION, reserve_bytes: float = 0, tp: int = 1) -> int:
    """Most full-length sequences whose KV fits on one GPU beside its weights; 0 when the weights alone do not fit.

    Room = utilization · memory − weight_bytes / tp − reserve_bytes, the budget vLLM sizes its cache from.
    ``reserve_bytes`` stands for what else vLLM keeps (activations at its profiling peak, CUDA graphs); left at 0,
    the count is an upper bound. ``weight_bytes`` is the whole model's, ``per_sequence_bytes`` one sequence's KV
    on one GPU (``kv_bytes(..., tp=tp)``).
    """
    for name, value, positive in (("memory", memory_bytes, True), ("weights", weight_bytes, False),
                                  ("per-sequence KV", per_sequence_bytes, True), ("reserve", reserve_bytes, False)):
        if not _number(value) or not (value > 0 if positive else value >= 0) or value == math.inf:
            raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number of bytes, got {value!r}")
    if not _number(utilization) or not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1] (vLLM's default {GPU_MEMORY_UTILIZATION}), got {utilization!r}")
    check_int("tp", tp, 1)
    room = utilization * memory_bytes - weight_bytes / tp - reserve_bytes
    return max(0, math.floor(room / per_sequence_bytes))


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decode_bytes_per_token(weight_bytes: float, kv_bytes_per_sequence: float, batch: int = 1) -> float:
    """Bytes read from memory per decoded token, the memory-bound model of decode: a step reads the weights once
    for its ``batch`` tokens and each sequence's whole KV once, so weight_bytes / batch + the sequence's KV."""
    check_int("batch", batch, 1)
    return weight_bytes / batch + kv_bytes_per_sequence


def decode_ratio(weight_bytes: float, kv_bytes_per_sequence: float, reference_kv_bytes: float, batch: int = 1) -> float:
    """Bytes per decoded token with one cache over those with the reference cache (auto), same weights and batch."""
    return (decode_bytes_per_token(weight_bytes, kv_bytes_per_sequence, batch)
            / decode_bytes_per_token(weight_bytes, reference_kv_bytes, batch))


def break_even_context(layers: list[LayerKV], weight_bytes: float, tp: int = 1) -> int | None:
    """Shortest context at which one sequence's 16-bit KV is at least as many bytes as the weights, on one GPU.

    There a decoded token at batch 1 reads 2 W with a 16-bit cache and 1.5 W with one of half its size (fp8):
    halving the KV cuts decode bytes by a quarter, by more beyond (towards a half), by less before. None when
    the KV never gets there (only sliding-window layers, their windows too short).
    """
    weights = weight_bytes / tp
    full_rate = sum(bf16_bytes(layer) for layer in per_gpu(layers, tp) if layer.sliding_window is None)
    windows = [layer.sliding_window for layer in layers if layer.sliding_window is not None]
    high = max([1, *windows, math.ceil(weights / full_rate) if full_rate else 1])  # KV(high) ≥ weights, if ever

    def reaches(context: int) -> bool:
        return kv_bytes(layers, bf16_bytes, context, tp=tp) >= weights

    if not reaches(high):
        return None
    low = 1
    while low < high:  # bisection: KV grows with context
        middle = (low + high) // 2
        low, high = (low, middle) if reaches(middle) else (middle + 1, high)
    return low


def plan(layers: list[LayerKV], weight_bytes: float, context: int, memory: str | int, dtypes: dict[str, BytesOf],
         skip: Set[int] = frozenset(), tp: int = 1, utilization: float = GPU_MEMORY_UTILIZATION,
         reserve_bytes: float = 0) -> dict:
    """Per cache dtype, the sequences that fit and the bytes per decoded token at ``context``, against ``auto``.

    ``dtypes`` maps names to bytes per token of a layer and must hold ``auto``, which skipped layers use too
    (vLLM's ``sliding_window`` skip entry: pass the sliding-window layers' indices).
    Returns a JSON-able dict (bytes per GPU): the inputs; ``dtypes``: name → bytes_per_token,
    kv_bytes_per_sequence, max_sequences, capacity_ratio, decode_bytes_per_token,
    decode_bytes_per_token_at_max_batch, decode_ratio, verdict; ``kvcal_figures`` beside ``quoted_figures``.
    """
    memory_bytes = parse_memory(memory)
    if "auto" not in dtypes:
        raise ValueError(f"dtypes {sorted(dtypes)} lack 'auto', the reference of every ratio; add auto's bytes per token")
    indices = {layer.index for layer in layers}
    if not indices:
        raise ValueError("no attention layers given; pass one LayerKV per attention layer of the model")
    if not set(skip) <= indices:
        raise ValueError(f"skip names layers {sorted(set(skip) - indices)}, which are not among the layers given; "
                         f"name skipped layers by vLLM's layer index ({min(indices)} to {max(indices)})")
    kv = {name: kv_bytes(layers, b, context, skip, dtypes["auto"], tp) for name, b in dtypes.items()}
    fits = {name: fit(memory_bytes, weight_bytes, kv[name], utilization, reserve_bytes, tp) for name in dtypes}
    weights, auto_fit = weight_bytes / tp, fits["auto"]
    rows = {}
    for name in dtypes:
        n, ratio = fits[name], fits[name] / auto_fit if auto_fit else None
        read = decode_ratio(weights, kv[name], kv["auto"])
        if n == 0:
            verdict = f"at {context} tokens {name} fits no sequence beside the weights"
        elif name == "auto":
            verdict = (f"at {context} tokens auto holds {n} sequences and reads {weights + kv[name]:,.0f} bytes "
                       "per decoded token at batch 1")
        elif ratio is None:
            verdict = f"at {context} tokens {name} holds {n} sequences where auto holds none"
        else:
            verdict = (f"at {context} tokens {name} holds {ratio:.2f}× the sequences of auto ({n} vs {auto_fit}) "
                       f"and reads {read:.2f}× the bytes per decoded token at batch 1")
        rows[name] = {
            "bytes_per_token": kv[name] / context, "kv_bytes_per_sequence": kv[name], "max_sequences": n,
            "capacity_ratio": ratio, "decode_bytes_per_token": decode_bytes_per_token(weights, kv[name]),
            "decode_bytes_per_token_at_max_batch": decode_bytes_per_token(weights, kv[name], n) if n else None,
            "decode_ratio": read, "verdict": verdict,
        }
    return {
        "memory_bytes": memory_bytes, "weight_bytes": weight_bytes, "context": context, "tp": tp,
        "utilization": utilization, "reserve_bytes": reserve_bytes, "dtypes": rows,
        "kvcal_figures": {
            "fp8_decode_bytes_vs_bf16": rows["fp8"]["decode_ratio"] if "fp8" in rows else None,
            "break_even_context_tokens": break_even_context(layers, weight_bytes, tp),
            "note": "kvcal's arithmetic: bytes read per decoded token at batch 1, not time; KV sizes are lower bounds",
        },
        "quoted_figures": {**QUOTED_FIGURES, "note": QUOTED_NOTE},
    }


def plan_text(result: dict) -> str:
    """``plan``'s dict as a fixed-width table for the terminal (sizes in GiB = 2**30 bytes, per GPU)."""
    gb, tp = SIZE_UNITS["GIB"], result["tp"]
    lines = [f"{result['memory_bytes'] / gb:.1f} GiB per GPU × {result['utilization']}, weights "
             f"{result['weight_bytes'] / tp / gb:.2f} GiB per GPU (tp={tp}), context {result['context']} tokens",
             f"{'dtype':<22}{'B/token':>10}{'KV/seq GiB':>11}{'seqs':>7}{'×seqs':>7}{'B/decoded tok':>15}"
             f"{'×bytes':>7}{'at max batch':>14}"]
    for name, row in result["dtypes"].items():
        ratio = "-" if row["capacity_ratio"] is None else f"{row['capacity_ratio']:.2f}"
        batch = row["decode_bytes_per_token_at_max_batch"]
        lines.append(f"{name:<22}{row['bytes_per_token']:>10,.0f}{row['kv_bytes_per_sequence'] / gb:>11.3f}"
                     f"{row['max_sequences']:>7}{ratio:>7}{row['decode_bytes_per_token'] / gb:>11.2f} GiB"
                     f"{row['decode_ratio']:>7.2f}{'-' if batch is None else f'{batch / gb:.3f} GiB':>14}")
    even, quoted = result["kvcal_figures"]["break_even_context_tokens"], result["quoted_figures"]
    lines += [f"bf16 KV read = weight read at {'no context' if even is None else f'{even:,} tokens'} (kvcal's arithmetic)",
              f"{quoted['note']}: fp8 decode cost {quoted['fp8_decode_cost_vs_bf16']}× bf16, "
              f"break-even {quoted['break_even_context_tokens']:,} tokens"]
    return "\n".join(lines)

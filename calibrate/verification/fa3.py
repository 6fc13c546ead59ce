"""A numeric model of FlashAttention-3's FP8 forward pass on Hopper, for ``kvcal verify --fa3``.

This is a model of the hardware, not the hardware: nobody has checked it against an H100 yet. It
follows the facts in docs/fa3-numerics.md:

* Q, K, V and the softmax probabilities P are all e4m3; both matmuls are FP8 tensor-core MMAs.
* Every MMA k-step adds ``K_STEP`` products into the accumulator with the per-term aligned
  truncation model (MMA-Sim): align the running sum and all products to the largest exponent,
  truncate each term toward zero to ``accum_bits`` fractional bits, add exactly, truncate the
  result toward zero to ``accum_bits`` bits. Hopper keeps about 13 bits; 25 models B200.
  float64 holds this exactly (each term has at most accum_bits + 1 significant bits, a sum of
  33 of them at most accum_bits + 7).
* P = exp2(S·scale·log2e − (m·scale·log2e − 8)) in [0, 256], cast to e4m3 with round-to-nearest-even;
  the row sum is taken from the fp32 P, before the cast.
* Key blocks of ``kBlockN`` keys are processed last block first with an online softmax. Q·Kᵀ starts a
  fresh accumulator for every block. P·V either runs as one reduced-precision chain over the whole
  context (``single_chain``: upstream FA3) or each block in a fresh accumulator promoted to an fp32
  register (``two_level``: vLLM's fork since flash-attention PR #104).

The emulator is slow (a Python loop over k-steps): run it on a few sampled query rows. ``probe`` does that
for verify, on the rows its reference pass captured.
"""

import math

import torch

from ..choices import scheme_label
from ..fp8 import FORMATS, FP8Format, quantize
from .config import HOPPER_ACCUM_BITS

E4M3 = FORMATS["e4m3fn"]  # the format Hopper's FP8 attention computes in

LOG2E = math.log2(math.e)
K_STEP = 32  # products per WGMMA k-step (PTX; MMA-Sim)
P_MAX_OFFSET = 8.0  # FA3's FP8 path subtracts (m − 8): P = exp2(…) ≤ 2**8
B200_ACCUM_BITS = 25

# Keys per block (kBlockN) by head_dim, from FA3's tile_size.h: vLLM's fork (prefill, two-level on)
# and upstream FA3 (two-level off). Other head_dims use the next larger tabulated one.
KBLOCK_N = {
    "two_level": {64: 128, 128: 192, 256: 128},
    "single_chain": {64: 160, 128: 224, 256: 128},
}
MODES = tuple(KBLOCK_N)


def block_n(head_dim: int, mode: str) -> int:
    """kBlockN for ``head_dim`` in ``mode`` (``two_level`` or ``single_chain``)."""
    if mode not in KBLOCK_N:
        raise ValueError(f"unknown FA3 mode {mode!r}; choose one of: {', '.join(MODES)}")
    table = KBLOCK_N[mode]
    fits = [d for d in sorted(table) if d >= head_dim]
    return table[fits[0] if fits else max(table)]


@torch.no_grad()
def truncate(x: torch.Tensor, accum_bits: int) -> torch.Tensor:
    """Round float64 ``x`` toward zero to ``accum_bits`` bits after its leading bit (elementwise)."""
    _, exponent = torch.frexp(x)  # |x| = m · 2**e, m in [0.5, 1): the leading bit is 2**(e − 1)
    quantum = torch.ldexp(torch.ones_like(x), exponent - 1 - accum_bits)
    return torch.trunc(x / quantum) * quantum


@torch.no_grad()
def fused_sum(acc: torch.Tensor, products: torch.Tensor, accum_bits: int | None) -> torch.Tensor:
    """One MMA k-step: ``acc + products.sum(-1)`` as the tensor core adds it.

    Args:
        acc: [...] running sum (float64 holding an fp32 value).
        products: [..., K] exact products of this k-step (float64).
        accum_bits: fractional bits kept by the aligned adder; None adds exactly (float64).

    Returns:
        [...] float64, the new running sum.
    """
    terms = torch.cat([acc.unsqueeze(-1), products], dim=-1)  # [..., K + 1]
    if accum_bits is None:
        return terms.sum(-1)
    _, exponent = torch.frexp(terms.abs().amax(-1, keepdim=True))  # [..., 1] exponent of the largest term
    quantum = torch.ldexp(torch.ones_like(terms[..., :1]), exponent - 1 - accum_bits)  # [..., 1]
    aligned = torch.trunc(terms / quantum) * quantum  # each term truncated toward zero at the common quantum
    return truncate(aligned.sum(-1), accum_bits)  # exact sum, then normalized and truncated


@torch.no_grad()
def mma(a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor, accum_bits: int | None) -> torch.Tensor:
    """``acc + a · bᵀ`` over the last dimension, ``K_STEP`` products per k-step.

    Args:
        a: [..., M, K] and b: [..., N, K], exact FP8 values as float64 (K a multiple of K_STEP).
        acc: [..., M, N] starting accumulator.
        accum_bits: as in ``fused_sum``.

    Returns:
        [..., M, N] float64.
    """
    for k0 in range(0, a.shape[-1], K_STEP):
        products = a[..., :, None, k0 : k0 + K_STEP] * b[..., None, :, k0 : k0 + K_STEP]  # [..., M, N, K_STEP]
        acc = fused_sum(acc, products, accum_bits)
    return acc


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest fp32 value (what a register holds), kept as float64."""
    return x.float().double()


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3fn, nearest even, saturating at ±448; float64 result."""
    return x.float().clamp(-E4M3.max, E4M3.max).to(E4M3.dtype).double()


def _visible(q_pos: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[R, n] bool: key position ``keys[n]`` is attended by the row at ``q_pos[r]`` (causal, sliding window)."""
    seen = keys[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= keys[None, :] > q_pos[:, None] - window
    return seen


@torch.no_grad()
def fa3_attention(
    q8: torch.Tensor,
    k8: torch.Tensor,
    v8: torch.Tensor,
    *,
    descale: torch.Tensor,
    v_descale: torch.Tensor,
    softmax_scale: float,
    q_pos: torch.Tensor,
    window: int | None = None,
    mode: str = "two_level",
    accum_bits: int | None = HOPPER_ACCUM_BITS,
    quantize_p: bool = True,
) -> torch.Tensor:
    """Attention output of sampled query rows as the modelled FA3 FP8 kernel computes it.

    Args:
        q8: [H, R, D] e4m3 values (as float64) of R query rows per query head.
        k8, v8: [H, N, D] e4m3 values of keys and values, already expanded to query heads (GQA).
        descale: [H] q_scale × k_scale, folded into the softmax scale as FA3 does.
        v_descale: [H] v_scale, applied to the output at the end.
        softmax_scale: the model's attention scaling (usually head_dim ** −0.5).
        q_pos: [R] int64 absolute position of each row; key n is visible when n ≤ q_pos (and within ``window``).
            All tensors on one device: the model runs where they are (a GPU runs long contexts far faster).
        window: sliding-window length in keys, or None.
        mode: ``two_level`` or ``single_chain`` (see the module docstring).
        accum_bits: accumulator fractional bits; None accumulates exactly (float64).
        quantize_p: cast P to e4m3 before P·V (False isolates the accumulator).

    Returns:
        [H, R, D] float64 attention output in real units.
    """
    H, R, D = q8.shape
    bn = block_n(D, mode)
    if D % K_STEP:  # FA3 itself takes head_dim 64..256; pad small test models with zeros, which add nothing
        q8, k8 = (torch.nn.functional.pad(x, (0, K_STEP - D % K_STEP)) for x in (q8, k8))
    n_keys = int(q_pos.max()) + 1
    n_blocks = math.ceil(n_keys / bn)
    pad = n_blocks * bn - n_keys  # zero keys past the last row's position; they are masked anyway
    k8 = torch.nn.functional.pad(k8[:, :n_keys], (0, 0, 0, pad))  # [H, n_blocks·bn, D]
    vt = torch.nn.functional.pad(v8[:, :n_keys], (0, 0, 0, pad)).transpose(1, 2)  # [H, D, n_blocks·bn]
    scale_log2 = (softmax_scale * LOG2E * descale.double())[:, None, None]  # [H, 1, 1]

    f64 = dict(dtype=torch.float64, device=q8.device)
    m = torch.full((H, R), -math.inf, **f64)  # running row max, log2 units
    row_sum = torch.zeros(H, R, **f64)
    acc = torch.zeros(H, R, D, **f64)  # the fp32 output register (single chain: also the MMA's C)
    for j in reversed(range(n_blocks)):  # FA3 walks key blocks last first
        keys = slice(j * bn, (j + 1) * bn)
        s = mma(q8, k8[:, keys], torch.zeros(H, R, bn, **f64), accum_bits)  # [H, R, bn] fresh per block
        visible = _visible(q_pos, torch.arange(j * bn, (j + 1) * bn, device=q_pos.device), window)  # [R, bn]
        s = _fp32(s * scale_log2).masked_fill(~visible, -math.inf)  # [H, R, bn]
        m_new = torch.maximum(m, s.amax(-1))  # [H, R]
        seen = m_new > -math.inf  # rows with at least one visible key so far
        rescale = torch.where(seen, torch.exp2(m - m_new), torch.ones_like(m))  # [H, R]
        acc, row_sum = _fp32(acc * rescale[..., None]), _fp32(row_sum * rescale)
        offset = torch.where(seen, m_new - P_MAX_OFFSET, torch.zeros_like(m_new))[..., None]  # [H, R, 1]
        p = _fp32(torch.exp2(s - offset))  # [H, R, bn] in [0, 256]; masked keys give 0
        row_sum = _fp32(row_sum + p.sum(-1))
        p = _e4m3(p) if quantize_p else p
        if mode == "two_level":
            acc = _fp32(acc + mma(p, vt[:, :, keys], torch.zeros_like(acc), accum_bits))
        else:
            acc = mma(p, vt[:, :, keys], acc, accum_bits)
        m = m_new
    return acc / row_sum[..., None] * v_descale.double()[:, None, None]


@torch.no_grad()
def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float, q_pos: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """float64 softmax(q·kᵀ·scale)·v for the same rows: the reference the emulator is measured against.

    Shapes as ``fa3_attention``: q [H, R, D], k and v [H, N, D] → [H, R, D].
    """
    q, k, v = q.double(), k.double(), v.double()
    s = torch.einsum("hrd,hnd->hrn", q, k) * softmax_scale  # [H, R, N]
    visible = _visible(q_pos, torch.arange(k.shape[1], device=q_pos.device), window)  # [R, N]
    p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
    return torch.einsum("hrn,hnd->hrd", p, v)


@torch.no_grad()
def same_sign_bias(n_keys: int, *, mode: str, accum_bits: int | None, head_dim: int = 64, seed: int = 0) -> float:
    """Relative bias of the modelled P·V on the worst case of docs/fa3-numerics.md: same-sign V, near-uniform P.

    One query row attends ``n_keys`` keys with scores within ±0.01 of each other and V uniform in
    [0.5, 1] (e4m3 values); the result is (emulated − exact) / exact of the mean output, with
    P quantization off so that only the accumulator is measured. Used to validate the emulator
    and to state in the report what the accumulator does at a given context length.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(1, 1, head_dim, dtype=torch.float64)
    q[..., 0] = 1.0
    k = torch.zeros(1, n_keys, head_dim, dtype=torch.float64)
    k[..., 0] = _e4m3(0.01 * (2 * torch.rand(1, n_keys, generator=g, dtype=torch.float64) - 1))
    v = _e4m3(0.5 + 0.5 * torch.rand(1, n_keys, head_dim, generator=g, dtype=torch.float64))
    one = torch.ones(1, dtype=torch.float64)
    pos = torch.tensor([n_keys - 1])
    got = fa3_attention(q, k, v, descale=one, v_descale=one, softmax_scale=1.0, q_pos=pos, mode=mode,
                        accum_bits=accum_bits, quantize_p=False)
    want = exact_attention(q, k, v, softmax_scale=1.0, q_pos=pos)
    return float(got.mean() / want.mean() - 1)


# ---- verify's FA3 probe: the model run on query rows captured by the reference pass ---------------------------------


def query_rows(seq_len: int, chunk_len: int, n: int) -> torch.Tensor:
    """Query positions for the FA3 model: up to n, spread over the second half of the last chunk (longest contexts)."""
    last = seq_len - 2  # the last position that runs (the final token is only a target)
    start = max((last // chunk_len) * chunk_len, last // 2)
    return torch.linspace(start, last, n).round().long().unique()  # [R]


def layer_rows(requested: list[int] | None, layer_idx: list[int]) -> list[int]:
    """Rows (indices into ``layer_idx``, the attention layers) the FA3 model runs on: those asked for, else first, middle and last."""
    if requested is None:
        return sorted({0, len(layer_idx) // 2, len(layer_idx) - 1})
    row_of = {idx: row for row, idx in enumerate(layer_idx)}
    unknown = [i for i in requested if i not in row_of]
    if unknown:
        raise ValueError(f"--fa3-layers {unknown} are not attention layers of this model (layer_idx {layer_idx[0]}..{layer_idx[-1]})")
    return sorted(row_of[i] for i in requested)


def _error(o: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative RMS error and magnitude bias (Σ ref·(o − ref) / Σ ref², negative = shrunk) of o against ref."""
    d = o - ref
    return {"rel_error": (d.norm() / ref.norm()).item(), "bias": ((ref * d).sum() / ref.square().sum()).item()}


@torch.no_grad()
def probe(
    capture: dict[int, dict], rows: torch.Tensor, scales: dict[str, dict[str, torch.Tensor]], fmt: FP8Format, *,
    layer_idx: list[int], groups: int, head_dim: int, accum_bits: int, unmodelled: list[str],
) -> dict:
    """Run the FA3 FP8 model (both P·V modes) on the captured rows for every static scheme; validate it.

    Each output is compared with float64 attention on the unquantized q, k, v. "fp8_inputs" is the
    same quantization with exact arithmetic, so the rest of the error is P's FP8 cast and the accumulator.

    Args:
        capture: layer row → the reference pass's inputs and output at ``rows`` (verify's ``ReferenceProbe``).
        scales: static scheme name → kind → [L, H] dequantization multipliers (x ≈ fp8 × scale).
        layer_idx: the model's layer index of each row; groups: query heads per KV head.
        unmodelled: schemes FA3 does not run (per-token scales), named in the notes.
    """
    results, exact_check = {}, None
    notes = [f"{scheme_label(name)}: not an FA3 mode (vLLM runs it on Triton), not emulated" for name in unmodelled]
    for row, cap in sorted(capture.items()):
        idx = layer_idx[row]
        if cap["softcap"]:
            notes.append(f"layer {idx}: attention logit softcapping is not modelled; skipped")
            continue
        q, k, v = cap["q"], cap["k"].repeat_interleave(groups, 0), cap["v"].repeat_interleave(groups, 0)  # [Hq, R|N, D]
        shape = dict(softmax_scale=cap["scaling"], q_pos=rows, window=cap["window"])
        ref = exact_attention(q, k, v, **shape)  # [Hq, R, D]
        layer = {"model_check": _error(cap["model_out"], ref)["rel_error"], "schemes": {}}
        for name, scheme_scales in scales.items():
            qs = scheme_scales["q"][row].double()  # [Hq]
            ks, vs = (scheme_scales[kind][row].double().repeat_interleave(groups) for kind in ("k", "v"))  # [Hq]
            q8, k8, v8 = (quantize(x, sc.view(-1, 1, 1), fmt).double() for x, sc in ((q, qs), (k, ks), (v, vs)))
            fp8_inputs = exact_attention(q8 * qs.view(-1, 1, 1), k8 * ks.view(-1, 1, 1), v8 * vs.view(-1, 1, 1), **shape)
            run = dict(descale=qs * ks, v_descale=vs, **shape)
            layer["schemes"][name] = {
                "fp8_inputs": _error(fp8_inputs, ref),
                **{m: _error(fa3_attention(q8, k8, v8, mode=m, accum_bits=accum_bits, **run), ref) for m in MODES},
            }
            if exact_check is None:  # the emulator with exact arithmetic must reproduce fp8_inputs
                exact_check = _error(fa3_attention(q8, k8, v8, accum_bits=None, quantize_p=False, **run), fp8_inputs)["rel_error"]
        results[idx] = layer
    n_keys = int(rows.max()) + 1
    bits = sorted({accum_bits, B200_ACCUM_BITS})
    return {
        "parameters": {
            "format": "e4m3fn, round to nearest even, saturate ±448 (Q, K, V and P)", "k_step": K_STEP,
            "accum_bits": accum_bits, "accumulator": "per-term aligned, truncate toward zero (MMA-Sim model)",
            "p": "exp2(S·scale·log2e − (m − 8)) in [0, 256], e4m3; row sum from fp32 P",
            "kblock_n": {m: block_n(head_dim, m) for m in MODES},
        },
        "query_positions": rows.tolist(),
        "layers": results,
        "validation": {
            "exact_arithmetic_vs_float64": exact_check,
            f"same_sign_bias_{n_keys}_keys": {m: {b: same_sign_bias(n_keys, mode=m, accum_bits=b) for b in bits} for m in MODES},
        },
        "notes": notes,
    }

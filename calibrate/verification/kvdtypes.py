"""vLLM's (vllm_facts.release.READ_IN) ``--kv-cache-dtype`` choices: what attention reads back from the cache, and its size.

Every fact used here (kernel arithmetic, rounding, layouts, with vLLM file:line) is in docs/kv-dtypes.md; this
module is that sheet written as code. Scales follow kvcal's convention: a scale is the dequantization multiplier,
``x ≈ q · scale``. Arithmetic is float32 like the kernels; round trips return x's dtype.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from .. import fp8
from ..choices import CACHE_DTYPES, check_table

NVFP4_BLOCK = 16  # elements along head_dim that share one e4m3 block scale
E2M1_MAX = 6.0
RHT_SEED = 0x9E3779B9  # vLLM's seed for the int4 rotation's sign vector


def round_half_away(t: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as the Triton writers do (``t ± 0.5`` in t's dtype, then truncation)."""
    return torch.sign(t) * torch.floor(t.abs() + 0.5)


@torch.no_grad()
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 e2m1 value (±0, .5, 1, 1.5, 2, 3, 4, 6), ties to the even code, saturating at ±6.

    This is PTX ``cvt.rn.satfinite.e2m1x2.f32``, the nvfp4 writer's conversion. On each binade the grid is evenly
    spaced and an even code is an even multiple of the spacing, so ``torch.round`` (half to even) is exact.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(a.dtype)  # grid spacing around a
    return torch.copysign(torch.round(a / step) * step, x)


def rht_block(head_dim: int) -> int:
    """Size b of the int4 rotation's Hadamard blocks: the largest power of two dividing head_dim."""
    return head_dim & -head_dim


def rht_signs(block: int) -> torch.Tensor:
    """vLLM's fixed ±1 vector for the int4 rotation, float32 [block]: one vector reused for every block."""
    gen = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    return 2 * torch.bernoulli(torch.full((block,), 0.5, dtype=torch.float32), generator=gen) - 1


def _walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform (H·Hᵀ = b·I) of the last dim, a power of two b, by butterflies.

    Pairs the same elements in the same order as vLLM's CPU fallback, so float32 rounding matches it.
    """
    b = x.shape[-1]
    h = 1
    while h < b:
        halves = x.unflatten(-1, (b // (2 * h), 2, h))  # [..., b/2h, 2, h]
        lo, hi = halves.unbind(-2)  # [..., b/2h, h] each
        x = torch.stack((lo + hi, lo - hi), dim=-2).flatten(-3)  # [..., b]
        h *= 2
    return x


@torch.no_grad()
def rht(x: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """vLLM's int4 rotation of the last dim: signs then Hadamard per block of b (``inverse``: Hadamard then signs).

    Unnormalized, so ``rht(rht(x), inverse=True) == b · x``. x: float32 [..., D].
    """
    d = x.shape[-1]
    b = rht_block(d)
    signs = rht_signs(b).to(x.device)
    blocks = x.unflatten(-1, (d // b, b))  # [..., D/b, b]
    out = _walsh_hadamard(blocks) * signs if inverse else _walsh_hadamard(blocks * signs)
    return out.flatten(-2)  # [..., D]


def _fp8_per_token_head(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp8_per_token_head on e4m3fn: ``fp8.per_token_head_round_trip``, the function verify's ``token`` scheme runs."""
    return fp8.per_token_head_round_trip(x)


def _int8_per_token_head(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """int8_per_token_head: s = max(amax/127, 1e-6) per (token, head); x · (1/s) rounded half away from zero.

    |x · (1/s)| ≤ 127 up to rounding, so the clamp to [−128, 127] never yields −128.
    """
    x = x.float()
    s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6)  # [B, H, S, 1]
    return round_half_away(x * s.reciprocal()).clamp(-128, 127) * s


@torch.no_grad()
def int4_round_trip_rotated(r: torch.Tensor) -> torch.Tensor:
    """vLLM's asymmetric 4-bit write and read of rotated values r (float32 [..., D]), per row, float32.

    s = max((max − min)/15, 1e-6), zp and codes rounded half away from zero to 0..15. The writer hides zp in the
    4 low mantissa bits of s; the reader masks them off, so it dequantizes with a slightly smaller s.
    """
    lo, hi = r.amin(-1, keepdim=True), r.amax(-1, keepdim=True)  # [..., 1]
    s = ((hi - lo) / 15).clamp(min=1e-6)
    zp = round_half_away(-lo / s).clamp(0, 15)
    q = round_half_away(r * s.reciprocal() + zp).clamp(0, 15)
    s_read = (s.view(torch.int32) & -16).view(torch.float32)
    return (q - zp) * s_read


def _int4_per_token_head(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """int4_per_token_head, brought back to the original (unrotated) space.

    vLLM rotates K and V (``rht``), rounds them to the model dtype, then stores 4-bit codes. It never unrotates K
    or V: it rotates Q the same way, divides the softmax scale by b and unrotates the attention output (÷ b).
    As the rotation is b times an orthogonal map, that equals attention over the values returned here, up to
    the rounding of the rotated Q and of the output.
    """
    d = x.shape[-1]
    _int4_cell(d, d)  # refuses an odd head_dim
    r = rht(x.float()).to(x.dtype).float()  # [B, H, S, D], rotated, stored by vLLM in the model dtype
    return rht(int4_round_trip_rotated(r), inverse=True) / rht_block(d)


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """float32 t to e4m3, nearest even, saturating at 448 (``__nv_fp8_e4m3(t)``), and back to float32."""
    return t.clamp(max=448.0).to(torch.float8_e4m3fn).float()  # clamped first: not every torch saturates the cast


def _flashinfer_block_scale(m: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's nvfp4 append (vLLM's writer on SM80, SM90 and SM120): sf = e4m3(m / (6 · k)), os = 1 / (sf · k).

    k is the checkpoint's decode scale itself; os is 0 where sf is 0. IEEE division in place of the fast-math
    division FlashInfer is built with (within 2 ulp). Both float32, shaped like m.
    """
    sf = _e4m3(m / (E2M1_MAX * k))
    os = torch.where(sf == 0, 0.0, 1 / (sf * k))
    return sf, os


def _sm100_block_scale(m: torch.Tensor, k: torch.Tensor, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own nvfp4 kernel (SM100): g = 1 / k, sf = e4m3(g · (m · (1/divisor))), os = 1 / (sf · (1/g)).

    os is 0 where sf is 0. The kernel's order of operations, with exact reciprocals in place of ``rcp.approx``.
    Both float32, shaped like m.
    """
    g = k.reciprocal()  # the kernel's "global scale"
    sf = _e4m3(g * (m * (1.0 / torch.tensor(divisor, dtype=torch.float32))))
    os = torch.where(sf == 0, 0.0, 1 / (sf * g.reciprocal()))
    return sf, os


def _nvfp4(x: torch.Tensor, scale: torch.Tensor, four_over_six: bool = False) -> torch.Tensor:
    """nvfp4: per 16 elements, e2m1(x · os) · sf · scale, sf an e4m3 block scale under the per-tensor ``scale``.

    ``scale`` is vLLM's ``_k_scale``/``_v_scale`` as loaded (1.0 without checkpoint scales); both writers take it as
    the decode multiplier, unchanged. nvfp4 is FlashInfer's writer (SM100 runs vLLM's, equal but for float32 rounding
    at e4m3 ties, docs/kv-dtypes.md); ``four_over_six`` (nvfp4_4over6, SM100 only) vLLM's, which also tries sf from
    max/4 and keeps it where its squared reconstruction error is strictly smaller than max/6's.
    """
    d = x.shape[-1]
    if d % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 scales blocks along head_dim: it must be a multiple of {NVFP4_BLOCK}, got {d}")
    shape = (d // NVFP4_BLOCK, NVFP4_BLOCK)
    xb = x.float().unflatten(-1, shape)  # [B, H, S, D/16, 16]
    k = scale.float().broadcast_to(x.shape).unflatten(-1, shape)[..., :1]  # [B, H, S, D/16, 1]
    m = xb.abs().amax(-1, keepdim=True)  # [B, H, S, D/16, 1]
    if four_over_six:
        sf, os = _sm100_block_scale(m, k, E2M1_MAX)
        sf4, os4 = _sm100_block_scale(m, k, 4.0)
        use4 = _squared_error(xb, os4) < _squared_error(xb, os)
        sf, os = torch.where(use4, sf4, sf), torch.where(use4, os4, os)
    else:
        sf, os = _flashinfer_block_scale(m, k)
    return (round_e2m1(xb * os) * sf * k).flatten(-2)  # [B, H, S, D]


def _squared_error(xb: torch.Tensor, os: torch.Tensor) -> torch.Tensor:
    """Σ (e2m1(x · os) / os − x)² per block, float32, as nvfp4_4over6 scores a candidate (0 · x for os = 0)."""
    back = torch.where(os == 0, 0.0, os.reciprocal())
    return (round_e2m1(xb * os) * back - xb).square().sum(-1, keepdim=True)


def _int4_cell(d: int, dv: int) -> float:
    """Per (head, token): two 4-bit codes per byte and a float32 scale (zero point in its low bits), for K and V."""
    if d % 2 or dv % 2:
        raise ValueError(f"int4_per_token_head packs two values per byte: head sizes must be even, got {d} and {dv}")
    return d // 2 + dv // 2 + 8


def _nvfp4_cell(d: int, dv: int) -> float:
    """Per (head, token): fp4 data D/2 bytes plus one e4m3 scale per 16 elements, for K and V."""
    if d % NVFP4_BLOCK or d != dv:
        raise ValueError(f"nvfp4 needs head_dim == head_dim_v, a multiple of {NVFP4_BLOCK}; got {d} and {dv}")
    return (d + dv) * 9 / 16


def _turboquant_cell(key_bits: int, value_bits: int) -> Callable[[int, int], float]:
    """Slot bytes per (head, token) of a TurboQuant preset: [K packed | V packed], rounded up to even."""

    def cell(d: int, dv: int) -> float:
        if d != dv:
            raise ValueError(f"turboquant uses one head size for K and V; got {d} and {dv}")
        k = d if key_bits == 8 else math.ceil(d * key_bits / 8) + 2  # FP8 keys, or indices + fp16 norm
        v = math.ceil(d * value_bits / 8) + 4  # indices + fp16 scale and fp16 min
        return k + v + (k + v) % 2

    return cell


Emulate = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class CacheDtype:
    """One ``--kv-cache-dtype`` choice.

    ``scale``: "tensor" reads one checkpoint k/v scale per layer; "token" computes its own per (token, KV head)
    at write time and ignores checkpoint scales; "none" uses no scale (auto, turboquant).
    ``cell_bytes(D, Dv)``: bytes per (KV head, token), K and V together. ``emulate(x, scale)``: the round trip in
    float32, None where not emulated.
    """

    name: str
    scale: str
    note: str
    cell_bytes: Callable[[int, int], float] = field(repr=False)
    emulate: Emulate | None = field(repr=False)

    def bytes_per_token(self, heads: int, head_dim: int, head_dim_v: int | None = None) -> float:
        """Cache bytes per token per layer, K and V together, for ``heads`` KV heads on one rank."""
        return float(heads * self.cell_bytes(head_dim, head_dim if head_dim_v is None else head_dim_v))

    @torch.no_grad()
    def round_trip(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """What attention reads back after vLLM writes ``x`` ([B, H, S, D], K or V) to this cache, in x's dtype.

        ``scale`` (dequantization multiplier, broadcastable to x, equal within each head) is required when
        ``self.scale == "tensor"`` and ignored otherwise.
        """
        if self.emulate is None:
            raise NotImplementedError(f"{self.name}: round trip not emulated (TurboQuant's Lloyd-Max keys)")
        if self.scale == "tensor":
            if scale is None:
                raise ValueError(f"{self.name} reads a per-tensor k/v scale: pass scale= (0-d or [1, H, 1, 1])")
            scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        return self.emulate(x, scale).to(x.dtype)


DTYPES: dict[str, CacheDtype] = {
    "auto": CacheDtype("auto", "none", "model dtype (bf16/fp16), plain copy; every backend",
                       lambda d, dv: 2 * (d + dv), lambda x, scale: x),
    "fp8": CacheDtype("fp8", "tensor", "e4m3, per-tensor scale (per KV head on FA3/FA4), x/s RNE, ±448; "
                      "FA3/FA4, FlashInfer, Triton, ROCm, CPU", lambda d, dv: d + dv, fp8.quantize_dequantize),
    "fp8_e5m2": CacheDtype("fp8_e5m2", "tensor", "e5m2, per-tensor scale, x/s RNE, ±57344; FlashInfer, ROCm, CPU "
                           "(Triton stores e4m3)", lambda d, dv: d + dv,
                           partial(fp8.quantize_dequantize, fmt=fp8.E5M2)),
    "fp8_per_token_head": CacheDtype("fp8_per_token_head", "token", "e4m3, fp32 scale amax/448 per (token, KV head), "
                                     "x·(1/s) RNE; Triton", lambda d, dv: d + dv + 8, _fp8_per_token_head),
    "int8_per_token_head": CacheDtype("int8_per_token_head", "token", "int8, fp32 scale amax/127 per (token, KV "
                                      "head), half away from 0, ±127; Triton", lambda d, dv: d + dv + 8,
                                      _int8_per_token_head),
    "int4_per_token_head": CacheDtype("int4_per_token_head", "token", "uint4 after a random-sign Hadamard rotation, "
                                      "fp32 scale + 4-bit zero point per (token, KV head), half away; Triton",
                                      _int4_cell, _int4_per_token_head),
    "nvfp4": CacheDtype("nvfp4", "tensor", "e2m1, e4m3 scale per 16 elements under a per-tensor scale, RNE; "
                        "FlashInfer", _nvfp4_cell, _nvfp4),
    "nvfp4_4over6": CacheDtype("nvfp4_4over6", "tensor", "as nvfp4, block scale max/6 or max/4 by squared error; "
                               "FlashInfer on SM100", _nvfp4_cell, partial(_nvfp4, four_over_six=True)),
    "turboquant_k8v4": CacheDtype("turboquant_k8v4", "none", "K FP8 unscaled, V 4-bit per (token, head); "
                                  "TURBOQUANT; size only", _turboquant_cell(8, 4), None),
    "turboquant_4bit_nc": CacheDtype("turboquant_4bit_nc", "none", "K 4-bit Lloyd-Max + norm, V 4-bit; "
                                     "TURBOQUANT; size only", _turboquant_cell(4, 4), None),
    "turboquant_k3v4_nc": CacheDtype("turboquant_k3v4_nc", "none", "K 3-bit Lloyd-Max + norm, V 4-bit; "
                                     "TURBOQUANT; size only", _turboquant_cell(3, 4), None),
    "turboquant_3bit_nc": CacheDtype("turboquant_3bit_nc", "none", "K 3-bit Lloyd-Max + norm, V 3-bit; "
                                     "TURBOQUANT; size only", _turboquant_cell(3, 3), None),
}
check_table(DTYPES, CACHE_DTYPES, "kvdtypes.DTYPES")

"""Independent references the tests compare kvcal against: FP8 rounding in float64 (numpy and torch), Q/K/V taken
from the model's own attention inputs, and attention computed another way."""

import math
import sys

import numpy as np
import torch

GATED_QUERY = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # q_proj gives [query | gate] per head


def reference_qkv(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Q, K, V per layer computed independently: the attention module's own projections, q/k norms, multipliers and
    RoPE function, applied to the inputs a forward pre-hook sees (no attention interface involved). Covers the
    families of conftest and of tests/model/test_layers.py (hybrid and MoE)."""
    out: dict[int, dict[str, torch.Tensor]] = {}

    def pre_hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)  # [B, S, hidden]
        B, S, _ = h.shape
        D = module.head_dim
        if hasattr(module, "qkv_proj"):  # Phi-3: one fused projection
            qkv = module.qkv_proj(h)
            nq = module.config.num_attention_heads * D
            nkv = module.config.num_key_value_heads * D
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
        elif model.config.model_type in GATED_QUERY:  # the query projection carries an output gate beside the query
            q, k, v = module.q_proj(h).view(B, S, -1, 2 * D)[..., :D], module.k_proj(h), module.v_proj(h)
        else:
            q, k, v = module.q_proj(h), module.k_proj(h), module.v_proj(h)
        q, k, v = (t.reshape(B, S, -1, D) for t in (q, k, v))  # [B, S, heads, D]
        if hasattr(module, "q_norm"):
            q, k = module.q_norm(q), module.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        k = k * getattr(module, "key_multiplier", 1.0)  # Falcon-H1 scales K before the cache
        if "position_embeddings" in kwargs:  # Jamba's attention has no RoPE
            cos, sin = kwargs["position_embeddings"]
            apply_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
            q, k = apply_rope(q, k, cos, sin)
        out[module.layer_idx] = {"q": q.detach(), "k": k.detach(), "v": v.detach()}

    forward_with_attention_pre_hook(model, input_ids, pre_hook)
    return out


def forward_with_attention_pre_hook(model: torch.nn.Module, input_ids: torch.Tensor, pre_hook) -> None:
    """One plain forward of input_ids with ``pre_hook(module, args, kwargs)`` on every decoder attention module."""
    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def e4m3_codes(name: str) -> np.ndarray:
    """Value of each of the 256 codes of ``name``, float64 [256], NaN where the code is NaN."""
    bias = BIAS[name]
    values = np.empty(256)
    for code in range(256):
        sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 0x7
        if exponent == 0:  # subnormal: 0.mmm × 2**(1 - bias)
            magnitude = mantissa / 8 * 2.0 ** (1 - bias)
        else:  # normal: 1.mmm × 2**(exponent - bias)
            magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - bias)
        values[code] = -magnitude if sign else magnitude
    if name == "e4m3fn":
        values[0x7F] = values[0xFF] = np.nan
    else:
        values[0x80] = np.nan
    return values


def e4m3_round(y: np.ndarray, name: str = "e4m3fn") -> np.ndarray:
    """Nearest value of format ``name`` to each float64 ``y``, ties to the even code, saturating at ±max.

    NaN stays NaN; ±Inf saturate (what clamp-then-convert does).
    """
    grid = _positive_grid(name)  # index == code, so an even index is an even code
    a = np.minimum(np.abs(y), grid[-1])
    i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 1)  # grid[i] <= a
    j = np.minimum(i + 1, len(grid) - 1)
    below, above = a - grid[i], grid[j] - a
    pick_upper = (above < below) | ((above == below) & (j % 2 == 0) & (j != i))
    out = np.where(pick_upper, grid[j], grid[i])
    out = np.where(np.isnan(y), np.nan, out)
    return np.copysign(out, y)


def e4m3_quantize_dequantize(x: np.ndarray, scale, name: str = "e4m3fn") -> np.ndarray:
    """float64 model of reading ``x`` back from an FP8 cache: round(x / scale) × scale.

    ``x / scale`` is taken in float32 (what vLLM and kvcal compute), then rounded in float64.
    """
    y = (np.asarray(x, np.float32) / np.asarray(scale, np.float32)).astype(np.float64)
    return e4m3_round(y, name) * np.asarray(scale, np.float32).astype(np.float64)


def tie_and_neighbour_values(name: str) -> np.ndarray:
    """Every representable value, every midpoint between neighbours (a tie), and one float32 step on either side."""
    grid = _positive_grid(name)
    mids = (grid[:-1] + grid[1:]) / 2
    mids32 = mids.astype(np.float32)
    assert (mids32 == mids).all(), "midpoints of an e4m3 grid have 5 significant bits: exact in float32"
    nudged = np.concatenate([np.nextafter(mids32, np.float32(0)), np.nextafter(mids32, np.float32(np.inf))])
    values = np.concatenate([grid, mids, nudged.astype(np.float64)])
    return np.concatenate([values, -values]).astype(np.float32)


def ref_qdq(x: torch.Tensor, scale) -> torch.Tensor:
    """fp8(x / scale) × scale computed with ``e4m3_round_torch``; x's dtype."""
    scale = torch.as_tensor(scale, dtype=torch.float64)
    return (e4m3_round_torch(x.double() / scale) * scale).to(x.dtype)


def ref_attention(q, k, v, scaling) -> torch.Tensor:
    """float64 causal attention with GQA: q [B, Hq, S, D], k/v [B, Hkv, S, D] → [B, Hq, S, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = q.double() @ k.transpose(-1, -2) * scaling  # [B, Hq, S, S]
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, -math.inf), -1) @ v


# Exponent bias of each format; e4m3fn has NaN at S.1111.111, e4m3fnuz at 1.0000.000 (its "-0").
BIAS = {"e4m3fn": 7, "e4m3fnuz": 8}


def _positive_grid(name: str) -> np.ndarray:
    """Non-negative finite values in code order (codes 0, 1, ...: increasing), float64."""
    positive = e4m3_codes(name)[:128]
    return positive[np.isfinite(positive)]


def e4m3_round_torch(y: torch.Tensor) -> torch.Tensor:
    """Round float64 ``y`` to e4m3fn in float64 arithmetic only: saturate at ±448, 3 mantissa bits, nearest even."""
    a = y.abs().clamp(max=448.0)
    _, e = torch.frexp(a.clamp(min=2.0**-6))  # binade of a (subnormals share the smallest normal's spacing)
    quantum = torch.ldexp(torch.ones_like(a), e - 1 - 3)
    return torch.sign(y) * torch.round(a / quantum) * quantum  # torch.round rounds half to even

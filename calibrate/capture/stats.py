"""Mergeable statistics of the Q, K and V that attention sees: collected once, turned into any scale later.

Every field is a sum, a count or a maximum, so the statistics of two runs merge into exactly the
statistics of one run over both (float64 moments up to the order of addition). Layout, for one
tensor kind with L observed attention layers and H heads (KV heads for k/v, query heads for q):

    absmax          [L, H]        float32  max |x|
    sum, sumsq      [L, H]        float64  sum of x, sum of x²
    hist            [L, H, NB]    int64    |x| histogram (see below)
    token_hist      [L, H, NB]    int64    histogram of per-token absmax (what per-token scaling sees)
    sink_hist       [L, H, NB]    int64    |x| histogram of the first SINK_POSITIONS positions only
    pos_absmax      [L, H, P]     float32  absmax by position bucket
    pos_sumsq       [L, H, P]     float64  sum of x² by position bucket (float32 within one update)
    channel_absmax  [L, H, D]     float32  absmax by channel (outlier channels)
    nonfinite       [L, H]        int64    (token, head) rows holding a NaN or Inf
    token_sqerr     [L, H]        float64  squared error of per-token-head e4m3fn quantization

and per layer (shared by the kinds): ``tokens [L]`` and ``pos_tokens [L, P]``.

Histogram bins come straight from float32 bits: ``bits >> 18`` is the exponent followed by the top
5 mantissa bits, so each octave is cut into 32 equal bins whose edges include every FP8 e4m3 value
(3 mantissa bits) exactly. Bin 0 holds exact zeros (and float32's tiniest subnormals, below 2**-131, which
are zero to any FP8 scale), bin 1 everything else in (0, 2**HIST_MIN_EXP), the
last bin everything at or above 2**HIST_MAX_EXP (and Inf/NaN).
"""

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..files import save_tensors
from ..fp8 import FORMATS, SCALE_FLOOR
from ..model.layers import ModelSignature

E4M3 = FORMATS["e4m3fn"]  # vLLM's fp8_per_token_head cache format

FORMAT_VERSION = 1
KINDS = ("k", "v", "q")
HIST_BINS_PER_OCTAVE = 32
HIST_MIN_EXP = -40
HIST_MAX_EXP = 24
NUM_REGULAR_BINS = (HIST_MAX_EXP - HIST_MIN_EXP) * HIST_BINS_PER_OCTAVE
NUM_BINS = NUM_REGULAR_BINS + 3  # zero, underflow, regular..., overflow
SINK_POSITIONS = 4
# Position buckets: positions 0..3 alone (the attention sinks), then [4, 8), [8, 16), ... [2**21, inf).
NUM_POS_BUCKETS = SINK_POSITIONS + 20
_RAW_OFFSET = (HIST_MIN_EXP + 127) << 5  # float32 biased exponent of 2**HIST_MIN_EXP, times 32
# TensorStats fields merged by maximum; every other field (and Stats.tokens, pos_tokens) is a sum.
MAX_FIELDS = ("absmax", "pos_absmax", "channel_absmax")


def bin_edges(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Lower and upper edge of every histogram bin, shape [NUM_BINS, 2] (zero bin: [0, 0])."""
    i = torch.arange(NUM_REGULAR_BINS, dtype=torch.float64)
    octave, sub = torch.div(i, HIST_BINS_PER_OCTAVE, rounding_mode="floor"), i % HIST_BINS_PER_OCTAVE
    lo = torch.exp2(octave + HIST_MIN_EXP) * (1 + sub / HIST_BINS_PER_OCTAVE)
    hi = torch.exp2(octave + HIST_MIN_EXP) * (1 + (sub + 1) / HIST_BINS_PER_OCTAVE)
    regular = torch.stack([lo, hi], dim=1)  # [NUM_REGULAR_BINS, 2]
    zero = torch.zeros(1, 2, dtype=torch.float64)
    under = torch.tensor([[0.0, 2.0**HIST_MIN_EXP]], dtype=torch.float64)
    over = torch.tensor([[2.0**HIST_MAX_EXP, math.inf]], dtype=torch.float64)
    return torch.cat([zero, under, regular, over]).to(dtype)


def _raw_(ax: torch.Tensor) -> torch.Tensor:
    """``bits >> 18`` of float32 ``ax`` = |x| (sign bit clear), as int32 in place of ``ax``: 8 exponent bits, then
    the top 5 mantissa bits, so one raw value per 1/32 of an octave, in order."""
    return ax.view(torch.int32).bitwise_right_shift_(18)


def _bins_of_raw_(raw: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each raw value (``_raw_``), int32, in place of ``raw``.

    Raw values map onto bins in order: 0 (exact zero, and float32 subnormals below 1.2e-38) → the zero bin,
    everything under 2**HIST_MIN_EXP → the underflow bin 1, the regular range one to one from bin 2, the rest →
    the overflow bin. Three integer passes, no table lookup: min(clamp(raw − offset + 2, 1, last), raw) keeps 0 at
    0 and changes nothing else, since raw − offset + 2 ≤ raw and the clamp's floor 1 ≤ any raw ≥ 1.
    """
    bins = (raw - (_RAW_OFFSET - 2)).clamp_(1, NUM_BINS - 1)
    return torch.minimum(bins, raw, out=raw)


def bin_index(ax: torch.Tensor) -> torch.Tensor:
    """Histogram bin of each element of ``ax`` (|x|), int64, same shape."""
    return _bins_of_raw_(_raw_(ax.float().abs())).long()


def round_to_e4m3(xs: torch.Tensor) -> torch.Tensor:
    """e4m3fn value nearest to each float32 in [-448, 448] (ties to even), as float32.

    Same result as ``xs.to(torch.float8_e4m3fn).float()``, several times faster on CPU: normal values
    keep 3 mantissa bits by integer rounding of the float32 bits; below 2**-6 the step is 2**-9.
    Each chain of steps works in one buffer: on CPU a fresh buffer per step costs more than the arithmetic.
    """
    bits = xs.view(torch.int32)
    rounded = (bits >> 20).bitwise_and_(1).add_(0x7FFFF).add_(bits).bitwise_and_(~0xFFFFF).view(torch.float32)  # RNE
    # e4m3 subnormals, chosen elementwise: masked indexing would read the mask's count back to the host on CUDA.
    subnormal = (xs * 512.0).round_().div_(512.0)
    return torch.where(xs.abs() < 2.0**-6, subnormal, rounded, out=rounded)


def position_bucket(pos: torch.Tensor) -> torch.Tensor:
    """Position bucket of each absolute token position (int64 tensor, same shape)."""
    octave = torch.log2(pos.clamp(min=1).double()).floor().long()  # 4..7 -> 2, 8..15 -> 3, ...
    return torch.where(pos < SINK_POSITIONS, pos, octave + 2).clamp_(0, NUM_POS_BUCKETS - 1)


def position_bucket_starts() -> list[int]:
    """First position of each position bucket."""
    return list(range(SINK_POSITIONS)) + [2**e for e in range(2, 2 + NUM_POS_BUCKETS - SINK_POSITIONS)]


def _count(index: torch.Tensor, size: int) -> torch.Tensor:
    """How often each value in [0, size) occurs in the integer tensor ``index``, int64 [size].

    On CPU, ``torch.bincount``: the fastest count there, and a CPU has no device to wait for. Elsewhere
    ``_count_fixed``.
    """
    if index.device.type == "cpu":
        return torch.bincount(index.flatten(), minlength=size)
    return _count_fixed(index, size)


def _count_fixed(index: torch.Tensor, size: int) -> torch.Tensor:
    """``_count`` into an output of fixed size: CUDA's bincount reads the data's maximum back to the host to size
    its output, a device sync per call."""
    ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.numel())  # no memory per element
    return torch.zeros(size, dtype=torch.int64, device=index.device).index_add_(0, index.flatten(), ones)


def _head_histograms_(ax: torch.Tensor, token_group: torch.Tensor | None = None, groups: int = 1) -> torch.Tensor:
    """Histograms per (group, layer, head) of float32 ``ax`` = |x|, [Lb, H, T, E] → int64 [groups, Lb, H, NUM_BINS].

    Element (l, h, t, e) counts in group ``token_group[t]`` (int or bool [T], values < groups), or in group 0
    without it. Splitting by a group index rather than selecting tokens keeps every size fixed (selecting would
    sync with the host on CUDA) and counts all groups in the same pass. ``ax`` is consumed: its memory holds the
    bin indices (offset per group, layer and head), so that one count fills every histogram; on CPU a fresh
    buffer per step would cost more than the integer arithmetic.
    """
    Lb, H, T, _ = ax.shape
    index = _bins_of_raw_(_raw_(ax))  # [Lb, H, T, E] int32, in ax's memory
    offset = (torch.arange(Lb * H, device=ax.device, dtype=torch.int32) * NUM_BINS).view(Lb, H, 1, 1)
    if token_group is not None:
        offset = offset + (token_group.to(torch.int32) * (Lb * H * NUM_BINS)).view(1, 1, T, 1)  # [Lb, H, T, 1]
    index += offset
    return _count(index, groups * Lb * H * NUM_BINS).view(groups, Lb, H, NUM_BINS)


@dataclass
class TensorStats:
    """Statistics of one tensor kind (k, v or q) over all observed layers; shapes in the module docstring."""

    absmax: torch.Tensor
    sum: torch.Tensor
    sumsq: torch.Tensor
    hist: torch.Tensor
    token_hist: torch.Tensor
    sink_hist: torch.Tensor
    pos_absmax: torch.Tensor
    pos_sumsq: torch.Tensor
    channel_absmax: torch.Tensor
    nonfinite: torch.Tensor
    token_sqerr: torch.Tensor

    @classmethod
    def zeros(cls, num_layers: int, num_heads: int, head_dim: int, device: torch.device | str = "cpu") -> "TensorStats":
        L, H, D, P = num_layers, num_heads, head_dim, NUM_POS_BUCKETS

        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            absmax=z(L, H, dtype=torch.float32),
            sum=z(L, H, dtype=torch.float64),
            sumsq=z(L, H, dtype=torch.float64),
            hist=z(L, H, NUM_BINS, dtype=torch.int64),
            token_hist=z(L, H, NUM_BINS, dtype=torch.int64),
            sink_hist=z(L, H, NUM_BINS, dtype=torch.int64),
            pos_absmax=z(L, H, P, dtype=torch.float32),
            pos_sumsq=z(L, H, P, dtype=torch.float64),
            channel_absmax=z(L, H, D, dtype=torch.float32),
            nonfinite=z(L, H, dtype=torch.int64),
            token_sqerr=z(L, H, dtype=torch.float64),
        )

    @property
    def num_heads(self) -> int:
        return self.absmax.shape[1]

    @property
    def count(self) -> torch.Tensor:
        """Number of elements seen per (layer, head), int64 [L, H]."""
        return self.hist.sum(-1)

    def update(self, row: int, x: torch.Tensor, bucket: torch.Tensor, sink: torch.Tensor, token_error: bool) -> None:
        """Add one layer's new positions, x [B, H, S, D]; see ``update_layers``."""
        self.update_layers(row, x.unsqueeze(0), bucket, sink, token_error)

    @torch.no_grad()
    def update_layers(self, start: int, x: torch.Tensor, bucket: torch.Tensor, sink: torch.Tensor, token_error: bool) -> None:
        """Add the new positions of consecutive layers in one go (a few large ops instead of many small ones).

        Args:
            start: row of the first layer in the stats (rows start .. start + Lb - 1).
            x: [Lb, B, H, S, D] new positions only, as attention receives them, for Lb layers.
            bucket: [B, S] position bucket of each new position.
            sink: [B, S] bool, True at positions < SINK_POSITIONS.
            token_error: also accumulate the per-token-head FP8 quantization error (k and v).
        """
        Lb, B, H, S, D = x.shape
        rows = slice(start, start + Lb)
        x = x.float()  # may be the model's own tensor: never changed in place
        ax = x.abs()  # [Lb, B, H, S, D], consumed by the histogram at the end
        tok_amax = ax.amax(-1)  # [Lb, B, H, S]
        tok_sumsq = torch.linalg.vector_norm(x, dim=-1).square()  # [Lb, B, H, S], one fused pass
        self.nonfinite[rows] += (~torch.isfinite(tok_amax)).sum((1, 3))
        self.absmax[rows] = torch.maximum(self.absmax[rows], tok_amax.amax((1, 3)))
        self.channel_absmax[rows] = torch.maximum(self.channel_absmax[rows], ax.amax((1, 3)))
        self.sum[rows] += x.sum(-1).sum((1, 3), dtype=torch.float64)
        self.sumsq[rows] += tok_sumsq.sum((1, 3), dtype=torch.float64)

        by_head = tok_amax.transpose(1, 2).reshape(Lb, H, B * S)  # [Lb, H, B*S]
        flat_bucket = bucket.flatten().expand(Lb, H, B * S)  # [Lb, H, B*S]
        self.pos_absmax[rows] = self.pos_absmax[rows].scatter_reduce(2, flat_bucket, by_head, reduce="amax")
        sumsq_by_head = tok_sumsq.transpose(1, 2).reshape(Lb, H, B * S)
        by_bucket = torch.zeros(Lb, H, NUM_POS_BUCKETS, device=x.device).scatter_add_(2, flat_bucket, sumsq_by_head)
        self.pos_sumsq[rows] += by_bucket  # [Lb, H, P], float32 within one call, float64 across calls
        self.token_hist[rows] += _head_histograms_(by_head.unsqueeze(-1).clone())[0]

        if token_error:
            # vLLM's fp8_per_token_head: scale = max(amax / 448, 1e-6), x · (1/scale) cast with RNE; no value
            # can exceed 448 there, so no clamp. The error is summed in the scaled domain, times scale². RNE is
            # symmetric, so |x| has the error of x.
            scale = (tok_amax / E4M3.max).clamp(min=SCALE_FLOOR)  # [Lb, B, H, S]
            xs = ax * scale.reciprocal().unsqueeze(-1)  # [Lb, B, H, S, D]
            err = xs.sub_(round_to_e4m3(xs))
            self.token_sqerr[rows] += (torch.linalg.vector_norm(err, dim=-1) * scale).square().sum((1, 3), dtype=torch.float64)

        # One pass counts other tokens (group 0) and sink tokens (group 1) apart: [2, Lb, H, NUM_BINS].
        split = _head_histograms_(ax.transpose(1, 2).reshape(Lb, H, B * S, D), sink.flatten(), groups=2)
        self.hist[rows] += split.sum(0)
        self.sink_hist[rows] += split[1]

    def merge_(self, other: "TensorStats") -> None:
        """Fold ``other`` (same shapes) into self."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in MAX_FIELDS:
                a.copy_(torch.maximum(a, b))
            else:
                a.add_(b)


@dataclass
class Stats:
    """All statistics of one calibration: K, V and Q per observed attention layer."""

    signature: ModelSignature
    tokens: torch.Tensor  # [L] int64, positions observed per layer
    pos_tokens: torch.Tensor  # [L, P] int64, positions observed per layer and position bucket
    kinds: dict[str, TensorStats]
    meta: dict = field(default_factory=dict)  # free-form provenance carried with the file

    @classmethod
    def empty(cls, signature: ModelSignature, device: torch.device | str = "cpu") -> "Stats":
        L, D = len(signature.layers), signature.head_dim
        heads = signature.heads
        return cls(
            signature=signature,
            tokens=torch.zeros(L, dtype=torch.int64, device=device),
            pos_tokens=torch.zeros(L, NUM_POS_BUCKETS, dtype=torch.int64, device=device),
            kinds={kind: TensorStats.zeros(L, heads[kind], D, device) for kind in KINDS},
        )

    def update(self, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add one layer call. q [B, Hq, S, D], k and v [B, Hkv, S, D] (new positions only), positions [B, S]."""
        self.update_layers(row, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), positions)

    @torch.no_grad()
    def update_layers(self, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add consecutive layers at once: q [Lb, B, Hq, S, D], k and v [Lb, B, Hkv, S, D], positions [B, S]."""
        bucket = position_bucket(positions)  # [B, S]
        sink = positions < SINK_POSITIONS  # [B, S]
        rows = slice(start, start + q.shape[0])
        self.tokens[rows] += positions.numel()
        self.pos_tokens[rows] += _count(bucket, NUM_POS_BUCKETS)
        self.kinds["k"].update_layers(start, k, bucket, sink, token_error=True)
        self.kinds["v"].update_layers(start, v, bucket, sink, token_error=True)
        self.kinds["q"].update_layers(start, q, bucket, sink, token_error=False)

    def merge_(self, other: "Stats") -> "Stats":
        """Fold ``other`` into self (same model) and return self."""
        self.signature.check_matches(other.signature, "statistics being merged")
        self.tokens += other.tokens
        self.pos_tokens += other.pos_tokens
        for kind in KINDS:
            self.kinds[kind].merge_(other.kinds[kind])
        return self

    def merge_parts(self) -> list[tuple[torch.Tensor, str]]:
        """Every tensor with how ``merge_`` combines it, ``"sum"`` or ``"max"``: for merges that reduce in place
        elsewhere (``distributed.Group.merge`` across processes)."""
        parts = [(self.tokens, "sum"), (self.pos_tokens, "sum")]
        for kind in KINDS:
            s = self.kinds[kind]
            parts += [(getattr(s, f.name), "max" if f.name in MAX_FIELDS else "sum") for f in fields(s)]
        return parts

    def to(self, device: torch.device | str) -> "Stats":
        kinds = {kind: TensorStats(**{f.name: getattr(s, f.name).to(device) for f in fields(s)}) for kind, s in self.kinds.items()}
        return Stats(self.signature, self.tokens.to(device), self.pos_tokens.to(device), kinds, dict(self.meta))

    def save(self, path: str | Path) -> None:
        """Write to one safetensors file; the signature and layout constants go in its metadata."""
        tensors = {"tokens": self.tokens, "pos_tokens": self.pos_tokens}
        for kind, s in self.kinds.items():
            for f in fields(s):
                tensors[f"{kind}.{f.name}"] = getattr(s, f.name)
        header = {
            "format_version": FORMAT_VERSION,
            "signature": vars(self.signature),
            "hist": [HIST_BINS_PER_OCTAVE, HIST_MIN_EXP, HIST_MAX_EXP],
            "sink_positions": SINK_POSITIONS,
            "num_pos_buckets": NUM_POS_BUCKETS,
            "meta": self.meta,
        }
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        save_tensors(cpu, Path(path), metadata={"kvcal": json.dumps(header)})

    @classmethod
    def load(cls, path: str | Path) -> "Stats":
        """Read a file written by ``save``, checking the layout matches this version of kvcal."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no statistics file at {path}; pass a kvcal output directory or its kvcal/stats.safetensors")
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("kvcal")
        if raw is None:
            raise ValueError(f"{path} is not a kvcal statistics file (no 'kvcal' metadata)")
        header = json.loads(raw)
        expected = [HIST_BINS_PER_OCTAVE, HIST_MIN_EXP, HIST_MAX_EXP]
        if header.get("format_version") != FORMAT_VERSION or header.get("hist") != expected:
            raise ValueError(f"{path} was written by an incompatible kvcal version; recalibrate to rebuild it")
        tensors = load_file(str(path))
        try:
            sig = ModelSignature(**header["signature"])
        except (KeyError, TypeError) as e:  # no signature, or one whose fields are not ModelSignature's
            raise ValueError(f"{path} holds no complete model signature ({e}); it is damaged: recalibrate to rebuild it") from None
        stats = cls.empty(sig)
        missing = [name for name in ("tokens", "pos_tokens", *(f"{k}.{f.name}" for k, s in stats.kinds.items() for f in fields(s)))
                   if name not in tensors]
        if missing:
            raise ValueError(f"{path} lacks {missing[0]} ({len(missing)} tensors missing); it is damaged: recalibrate to rebuild it")
        stats.tokens, stats.pos_tokens, stats.meta = tensors["tokens"], tensors["pos_tokens"], header.get("meta", {})
        for kind, s in stats.kinds.items():
            for f in fields(s):
                t = tensors[f"{kind}.{f.name}"]
                want = getattr(s, f.name)
                if t.shape != want.shape or t.dtype != want.dtype:
                    raise ValueError(f"{path}: {kind}.{f.name} has shape {tuple(t.shape)} {t.dtype}, expected {tuple(want.shape)} {want.dtype}")
                setattr(s, f.name, t)
        return stats

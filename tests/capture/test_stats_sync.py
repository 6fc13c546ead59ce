"""The capture path never waits on the host, and its sync-free forms give the old results bit for bit.

On CUDA, reading a value back (``.item()``, ``if t.any()``, masked indexing, ``bincount``) stalls the
stream once per flush. scripts/gpu_check proves the absence of syncs with ``torch.cuda.set_sync_debug_mode``;
on CPU there is nothing to detect, so ``host_reads_forbidden`` refuses the Python-level calls that would sync
there, and the comparisons below pin the sync-free code to what the selecting code computed. On CPU the
statistics count with bincount (no device to wait for); these tests count as a GPU does (``_count_fixed``).
"""

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from calibrate.capture import stats as stats_module
from calibrate.capture.hooks import Collector
from calibrate.capture.stats import (
    KINDS,
    NUM_BINS,
    NUM_POS_BUCKETS,
    SINK_POSITIONS,
    Stats,
    bin_index,
    position_bucket,
    round_to_e4m3,
)
from calibrate.model.layers import AttentionLayer, ModelSignature

# Tensor methods and torch functions whose result needs the data on the host (or is sized by it).
_HOST_READS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "bincount", "nonzero", "masked_select", "unique", "tensor", "as_tensor",
}


class host_reads_forbidden(TorchFunctionMode):
    """Raise on any operation that would make the host wait for a CUDA device (see ``_HOST_READS``),
    including indexing with a boolean mask."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        indices = args[1] if name in ("__getitem__", "__setitem__", "index_put_", "index_put") and len(args) > 1 else ()
        indices = indices if isinstance(indices, (tuple, list)) else (indices,)
        if name in _HOST_READS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            raise AssertionError(f"{name} reads device data on the host")
        return func(*args, **(kwargs or {}))


_COUNT_ON_CPU = stats_module._count  # before the fixture below replaces it


@pytest.fixture(autouse=True)
def count_as_on_a_gpu(monkeypatch):
    """The capture path as it runs on CUDA: fixed-size counting instead of the CPU's bincount."""
    monkeypatch.setattr(stats_module, "_count", stats_module._count_fixed)


def test_cpu_bincount_counts_as_the_gpu_path_does():
    index = torch.randint(0, 50, (7, 300), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    index[0, :5] = 49  # the last value, and runs of one value
    assert torch.equal(_COUNT_ON_CPU(index, 53), stats_module._count_fixed(index, 53))
    assert _COUNT_ON_CPU(index, 53)[49] == (index == 49).sum()


@pytest.mark.parametrize(
    "read",
    [lambda x: bool((x > 0).any()), lambda x: x[x > 0], lambda x: x.__setitem__(x > 0, x[0]), lambda x: torch.bincount(x.long()),
     lambda x: x.sum().item(), lambda x: x.tolist()],
    ids=["if_any", "mask_get", "mask_set", "bincount", "item", "tolist"],
)
def test_the_guard_catches_host_reads(read):
    x = torch.arange(4.0)
    with host_reads_forbidden(), pytest.raises(AssertionError, match="on the host"):
        read(x)


L, HKV, HQ, D = 3, 2, 4, 16


def _signature() -> ModelSignature:
    return ModelSignature(model_type="llama", layers=[0, 1, 2], num_kv_heads=HKV, num_heads=HQ, head_dim=D)


def _inputs(positions: torch.Tensor, Lb: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [Lb, B, HQ, S, D], k and v [Lb, B, HKV, S, D] with large sink tokens, subnormal-range values and a NaN."""
    gen = torch.Generator().manual_seed(seed)
    B, S = positions.shape
    sink = (positions < SINK_POSITIONS).view(1, B, 1, S, 1)
    out = []
    for H in (HQ, HKV, HKV):
        x = torch.randn(Lb, B, H, S, D, generator=gen) * torch.logspace(-3, 1, H).view(1, 1, H, 1, 1)
        x = torch.where(sink, x * 50, x)
        x[..., 1] *= 1e-4  # per-token FP8 values in e4m3's subnormal range
        out.append(x)
    out[1][0, 0, 0, -1, 2] = float("nan")
    return out[0], out[1], out[2]


# Positions: chunks with and without sink tokens, a batch where only one row has them, and an order
# in which sink positions sit past the first SINK_POSITIONS columns.
POSITIONS = {
    "first_chunk": torch.arange(24).view(1, 24),
    "later_chunk": torch.arange(2048, 2072).view(1, 24),
    "batch_one_with_sinks": torch.stack([torch.arange(24), torch.arange(500, 524)]),
    "shuffled": torch.randperm(24, generator=torch.Generator().manual_seed(1)).view(1, 24) * 3 % 40,
}


def _selecting_reference(x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """hist, sink_hist and token_hist per (layer, head) as the selecting code computed them: pick the sink
    tokens with a boolean mask, then bincount bin indices. x [Lb, B, H, S, D] → each int64 [Lb, H, NUM_BINS]."""
    ax = x.float().abs()
    sink = positions < SINK_POSITIONS  # [B, S]
    by_head = ax.permute(0, 2, 1, 3, 4)  # [Lb, H, B, S, D]

    def hist(values: torch.Tensor) -> torch.Tensor:
        return torch.bincount(bin_index(values).flatten(), minlength=NUM_BINS)

    Lb, H = by_head.shape[:2]
    return {
        "hist": torch.stack([torch.stack([hist(by_head[i, h]) for h in range(H)]) for i in range(Lb)]),
        "sink_hist": torch.stack([torch.stack([hist(by_head[i, h][sink]) for h in range(H)]) for i in range(Lb)]),
        "token_hist": torch.stack([torch.stack([hist(by_head[i, h].amax(-1)) for h in range(H)]) for i in range(Lb)]),
    }


@pytest.mark.parametrize("case", list(POSITIONS))
def test_update_layers_reads_nothing_back_and_counts_as_selecting_did(case):
    positions = POSITIONS[case]
    q, k, v = _inputs(positions, Lb=2)
    stats = Stats.empty(_signature())
    with host_reads_forbidden():
        stats.update_layers(1, q, k, v, positions)
    for kind, x in zip(("q", "k", "v"), (q, k, v)):
        want = _selecting_reference(x, positions)
        for name, counts in want.items():
            got = getattr(stats.kinds[kind], name)
            assert torch.equal(got[1:3], counts), (kind, name)
            assert (got[0] == 0).all()
    want_pos = torch.bincount(position_bucket(positions).flatten(), minlength=NUM_POS_BUCKETS)
    assert torch.equal(stats.pos_tokens[1:3], want_pos.expand(2, -1))
    if case == "later_chunk":
        assert all((stats.kinds[kind].sink_hist == 0).all() for kind in KINDS)


def _round_to_e4m3_selecting(xs: torch.Tensor) -> torch.Tensor:
    """round_to_e4m3 as it was, fixing the subnormals up through a boolean mask: the reference for bit equality."""
    bits = xs.view(torch.int32)
    rounded = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & ~0xFFFFF).view(torch.float32)
    small = xs.abs() < 2.0**-6
    rounded[small] = torch.round(xs[small] * 512.0) / 512.0
    return rounded


def test_round_to_e4m3_reads_nothing_back_and_keeps_every_bit():
    rng = np.random.default_rng(2)
    magnitudes = np.exp2(rng.uniform(-14, np.log2(448), 50_000)) * rng.choice([-1, 1], 50_000)
    ties = np.arange(-16, 17) / 1024  # halfway between subnormal steps of 2**-9, and the steps themselves
    xs = torch.from_numpy(np.concatenate([magnitudes, ties, [0.0, -0.0, 2.0**-6, -(2.0**-6), 448.0, float("nan")]])).float()
    with host_reads_forbidden():
        got = round_to_e4m3(xs)
    assert torch.equal(got.view(torch.int32), _round_to_e4m3_selecting(xs.clone()).view(torch.int32))


class _Attention(torch.nn.Module):
    """Stands in for a model's attention module: the collector only reads ``layer_idx``."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx


def test_collector_buffers_and_flushes_without_host_reads():
    positions = torch.arange(16).view(1, 16)
    q, k, v = _inputs(positions, Lb=L)
    layers = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in range(L)]
    collector = Collector(Stats.empty(_signature()), layers)
    with host_reads_forbidden():
        for i in range(L):
            qi = q[i]  # [B, HQ, S, D]
            out = collector(_Attention(i), qi, k[i], v[i], None, lambda module, query, *a, **kw: (query,), position_ids=positions)
            assert out[0] is qi  # the base attention's result, passed through
        collector.flush()
    direct = Stats.empty(_signature())
    direct.update_layers(0, q, k, v, positions)
    for kind in KINDS:
        for name in ("hist", "sink_hist", "token_hist", "absmax"):
            torch.testing.assert_close(getattr(collector.stats.kinds[kind], name), getattr(direct.kinds[kind], name), rtol=0, atol=0, equal_nan=True)
    assert collector.stats.tokens.tolist() == [16] * L

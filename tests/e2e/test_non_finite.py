"""A NaN or Inf measurement is never a verdict (issue 36), through ``kvcal verify`` to what it prints.

Every comparison with NaN is false, so a NaN KL once passed every threshold and could be recommended and printed as
the serve line. Here: a scheme whose numbers went non-finite is named with its layer and never recommended; an
unquantized reference or floor that overflows float16 (a real tiny model whose residual stream passes 65,504) refuses
the verify in one line.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import kjv_jsonl, save_tiny_checkpoint
from runners import assert_refused
from safetensors.torch import load_file, save_file

from calibrate import calibrate
from calibrate.cli import main

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
SAMPLE = ("--seq-len", "64", "--max-tokens", "128", "--quiet")


def _overflowing(directory: Path, o_proj: float) -> Path:
    """The tiny model with embeddings of ±60,000 (float16's largest is 65,504) and layer 0's o_proj times ``o_proj``:
    finite in float32 and bfloat16, while float16 overflows once attention adds to the residual stream."""
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"] = torch.sign(tensors["model.embed_tokens.weight"]) * 6e4
    tensors["model.layers.0.self_attn.o_proj.weight"] *= o_proj
    weights.unlink()
    save_file(tensors, weights, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    root = tmp_path_factory.mktemp("non-finite")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    _overflowing(save_tiny_checkpoint(root / "fp16-overflow", "llama", smol_tokenizer), 2e5)
    _overflowing(save_tiny_checkpoint(root / "floor-overflow", "llama", smol_tokenizer), 1e6)
    kjv_jsonl(root / "data.jsonl", 200)
    calibrate(str(root / "llama"), [str(root / "data.jsonl")], str(root / "out"), seq_len=64, max_tokens=128,
              progress=False, verify=False)
    return root


def test_a_scheme_whose_kl_went_non_finite_is_named_and_never_recommended(root, capsys, monkeypatch):
    """The checkpoint's own per-tensor scales (the scheme verify prefers) measured NaN at its second layer (as a real
    overflow would leave them): verify still ends, says so, and recommends a scheme it could judge."""
    import calibrate.verification.judgment as judgment

    real = judgment.scheme_result

    def nan_tensor(scheme, tally, ref_sq, ref_nll):
        result = real(scheme, tally, ref_sq, ref_nll)
        if scheme.name == "tensor":
            result["layer_rel_error"][1] = float("nan")
            result.update(kl=float("nan"), kl_per_sequence=[float("nan")] * len(result["kl_per_sequence"]))
        return result

    monkeypatch.setattr(judgment, "scheme_result", nan_tensor)
    report = root / "report-nan"
    code = main(["verify", str(root / "out"), "--data", str(root / "data.jsonl"), *SAMPLE, "--schemes",
                 "bf16,scale1,tensor,token", "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 0
    out = (report / "report.md").read_text().replace("- ", "") + out  # the reasoning is in report.md (and --verbose)
    assert "fp8, calibrated per tensor measured non-finite numbers (kl nan, per-layer error at layers [1]): it has no verdict" in out
    recommended = next(line for line in out.splitlines() if line.startswith("Recommended: "))
    assert not recommended.startswith("Recommended: fp8, calibrated per tensor"), recommended
    serve = out.split("serve it with:")[1].strip().splitlines()[0]
    assert serve.startswith("vllm serve") and "--kv-cache-dtype fp8 " not in serve + " ", serve
    assert "per tensor vs" not in out and "vs fp8, calibrated per tensor" not in out  # no comparison with a NaN


@pytest.mark.parametrize("model, dtype, fragment", [
    pytest.param("fp16-overflow", "float16", "the unquantized reference model computed a non-finite loss", id="reference"),
    pytest.param("floor-overflow", "bfloat16", "the floor (the unquantized model computed in another precision) went "
                 "non-finite", id="floor"),
])
def test_an_fp16_overflow_in_the_unquantized_model_refuses_the_verify_in_one_line(root, model, dtype, fragment):
    """float16 reference: its own loss is NaN. bfloat16 reference: it is finite, but the floor, computed in float16,
    overflows. Either way no verdict could mean anything."""
    report = root / f"report-{model}"
    result = subprocess.run([sys.executable, "-m", "calibrate", "verify", str(root / model), "--data",
                             str(root / "data.jsonl"), *SAMPLE, "--dtype", dtype, "--report", str(report)],
                            capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    err = "\n".join(line for line in result.stderr.splitlines() if "Loading weights" not in line)
    assert_refused(result.returncode, err, fragment, "--dtype float32")
    assert not report.exists()

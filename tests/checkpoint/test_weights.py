"""`--weights fp8`: llm-compressor's data-free FP8 weights and kvcal's KV scales in one checkpoint.

llm-compressor pins transformers<=5.17, so the run happens in its own venv (scripts/setup-llmcompressor), importing
kvcal from this checkout; the checks happen here. The KV scales come from the unquantized model, so they must equal
those of a plain kvcal run on the same model and data.
"""

import importlib.util
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from builders import save_tiny_checkpoint
from runners import client_python
from safetensors import safe_open

from calibrate import calibrate
from calibrate.checkpoint.weights import check_available
from calibrate.checkpoint.write import check_index, scales_file
from calibrate.config import CalibrationConfig
from calibrate.files import file_mode
from calibrate.model.description import describe
from calibrate.model.directory import INDEX_FILE

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(seq_len=64, max_tokens=128, verify=False, progress=False)


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def test_fp8_weights_and_kv_scales_in_one_checkpoint(tmp_path, smol_tokenizer, text_file):
    llmc_python = client_python("llm-compressor")
    model_dir = save_tiny_checkpoint(tmp_path / "tiny", "llama", smol_tokenizer)
    plain = calibrate(str(model_dir), [str(text_file)], str(tmp_path / "plain"), **OPTIONS)

    out = tmp_path / "fp8"
    script = textwrap.dedent(f"""
        import calibrate
        calibrate.calibrate({str(model_dir)!r}, [{str(text_file)!r}], {str(out)!r}, weights="fp8", **{OPTIONS!r})
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([str(llmc_python), "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list(tmp_path.glob(".fp8.kvcal-*")), "temporary directories left beside OUT"

    # config.json: llm-compressor's FP8 weight group and kvcal's kv_cache_scheme in one compressed-tensors config.
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    (group,) = quant["config_groups"].values()
    assert group["weights"]["num_bits"] == 8 and group["weights"]["type"] == "float"
    assert group["input_activations"]["dynamic"] is True
    assert quant["kv_cache_scheme"]["strategy"] == "tensor" and quant["kv_cache_scheme"]["dynamic"] is False
    assert "lm_head" in quant["ignore"]

    # Weights: FP8 projections with per-channel scales; lm_head and norms untouched.
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    dtypes = {}
    for name in set(index.values()) - {scales_file(out).name}:
        dtypes.update({k: v["dtype"] for k, v in _header(out / name).items() if k != "__metadata__"})
    projections = [n for n in dtypes if n.endswith("_proj.weight")]
    assert projections and all(dtypes[n] == "F8_E4M3" for n in projections)
    assert all(f"{n}_scale" in dtypes for n in projections)
    assert dtypes["lm_head.weight"] != "F8_E4M3"
    check_index(out)
    assert (out / "tokenizer.json").is_file()
    # llm-compressor's shards are written 0600; what kvcal publishes follows the umask.
    assert {p.name: p.stat().st_mode & 0o777 for p in out.glob("*.safetensors")} == dict.fromkeys(index.values(), file_mode())

    # KV scales: those of the unquantized model, i.e. of the plain run.
    with safe_open(str(scales_file(out)), "pt") as mine, safe_open(str(scales_file(plain.out)), "pt") as ref:
        assert sorted(mine.keys()) == sorted(ref.keys())
        assert {k.rsplit(".", 1)[1] for k in ref.keys()} == {"k_scale", "v_scale", "q_scale"}
        for name in ref.keys():
            torch.testing.assert_close(mine.get_tensor(name), ref.get_tensor(name), rtol=1e-6, atol=0, msg=name)
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert provenance["weights"] == "fp8 (llm-compressor FP8_DYNAMIC, data-free)"
    assert provenance["settings"]["weights"] == "fp8"


def test_weights_option_is_checked(tmp_path, smol_tokenizer, text_file):
    """A bad value is refused by the config; a missing llm-compressor and a quantized source before any model loads."""
    model_dir = save_tiny_checkpoint(tmp_path / "tiny", "llama", smol_tokenizer)
    with pytest.raises(ValueError, match="--weights 'int4'"):
        CalibrationConfig(model=str(model_dir), data=[str(text_file)], out=str(tmp_path / "o"), weights="int4").validate()
    if importlib.util.find_spec("llmcompressor") is None:  # the main venv: the extra lives in its own
        with pytest.raises(ValueError, match=r"pip install 'kvcal\[llmcompressor\]'"):
            calibrate(str(model_dir), [str(text_file)], str(tmp_path / "o"), weights="fp8", **OPTIONS)
        assert not (tmp_path / "o").exists()
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already quantized"):
        check_available(describe(model_dir), "fp8")

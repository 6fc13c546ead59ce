"""calibrate/run/inputs.py: step 1 of a calibration reads config.json once, checks everything without loading a
model, and writes nothing."""

import pytest
from transformers import AutoModelForCausalLM

from calibrate.checkpoint.space import config_stats_bytes
from calibrate.config import CalibrationConfig
from calibrate.data.config import DataConfig
from calibrate.model import directory
from calibrate.model.description import describe
from calibrate.run import inputs as step1
from calibrate.run.distributed import Group


def config_for(model, data, out) -> CalibrationConfig:
    return CalibrationConfig(model=str(model), out=str(out), data=DataConfig(sources=[str(data)], seq_len=64,
                                                                             max_tokens=128)).validate()


@pytest.mark.smoke
def test_step_one_reads_config_json_once_and_loads_no_model(tiny_dir, text_file, tmp_path, monkeypatch):
    """Counted where every reader of config.json ends (``directory.read_config_json`` reads it through
    ``read_json_object``), so a second read by any route, however named, fails the test."""
    reads = []
    read_json = directory.read_json_object
    monkeypatch.setattr(directory, "read_json_object", lambda path, fix: reads.append(path) or read_json(path, fix))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("step 1 loaded a model"))
    got = step1.check_inputs(config_for(tiny_dir, text_file, tmp_path / "out"), Group(device="cpu"))
    assert [p for p in reads if p.name == "config.json"] == [tiny_dir / "config.json"]
    assert got.described.config == describe(tiny_dir).config and got.described.num_layers == 3
    assert got.statistics == config_stats_bytes(got.described) > 0
    assert got.fmt.name == "e4m3fn" and got.saved is None and got.seen is None
    assert sum(s.numel() for s in got.stream) == 128
    assert not (tmp_path / "out").exists()


def test_a_quantized_source_with_fp8_weights_is_refused_from_the_same_description(tiny_dir, text_file, tmp_path):
    """``--weights fp8`` needs an unquantized source: judged from step 1's description, hf_quant_config.json
    included (a ModelOpt checkpoint keeps its quantization config there only)."""
    (tiny_dir / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "FP8"}}')
    config = config_for(tiny_dir, text_file, tmp_path / "out")
    config.weights = "fp8"
    with pytest.raises(ValueError, match="already quantized"):
        step1.check_inputs(config, Group(device="cpu"))
    assert not (tmp_path / "out").exists()

"""Models bigger than the device: accelerate's device map (--device-map, --max-memory, --offload-folder).

Weights forced onto disk must change nothing: the same forward runs with each offloaded layer's weights read
back for it, so scales are equal and statistics equal (float64 moments to rounding). Bad placement settings are
one-line errors before anything is written.
"""

import json
from dataclasses import fields

import pytest
import torch
from builders import save_tiny_checkpoint
from safetensors.torch import load_file

import calibrate.model.load
import calibrate.run.load_and_capture
from calibrate import calibrate as run
from calibrate.checkpoint.write import scales_file
from calibrate.choices import parse_size
from calibrate.cli import main
from calibrate.config import parse_max_memory

OPTIONS = {"seq_len": 64, "max_tokens": 256, "progress": False, "verify": False}
EXACT = ("absmax", "hist", "token_hist", "sink_hist", "pos_absmax", "channel_absmax", "nonfinite")
MOMENTS = ("sum", "sumsq", "pos_sumsq", "token_sqerr")


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    """A tiny llama checkpoint, real text, and its calibration with the whole model in memory."""
    root = tmp_path_factory.mktemp("offload")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    with open(kjv_path) as src, open(root / "data.jsonl", "w") as dst:
        for _, line in zip(range(200), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return root


@pytest.fixture(scope="module")
def in_memory(root):
    return run(str(root / "llama"), [str(root / "data.jsonl")], str(root / "in-memory"), device="cpu", **OPTIONS)


@pytest.fixture
def device_maps(monkeypatch) -> list:
    """The ``hf_device_map`` of every model calibrate loads (None: placed without one)."""
    maps, load = [], calibrate.model.load.load_model

    def spy(*args, **kwargs):
        model, tokenizer = load(*args, **kwargs)
        maps.append(getattr(model, "hf_device_map", None))
        return model, tokenizer

    monkeypatch.setattr(calibrate.run.load_and_capture, "load_model", spy)  # the name calibrate calls
    return maps


def model_bytes(root) -> tuple[int, int]:
    """Bytes of the whole tiny model and of one decoder layer, float32."""
    from transformers import AutoConfig

    weights = load_file(root / "llama" / "model.safetensors")
    layer = calibrate.model.load.decoder_layer_bytes(AutoConfig.from_pretrained(root / "llama"), torch.float32)
    return sum(t.numel() * 4 for t in weights.values()), layer


def assert_same(result, reference) -> None:
    """Scales bit for bit; statistics exactly, float64 sums to rounding."""
    for kind, scales in reference.scale_set.scales.items():
        assert torch.equal(result.scale_set.scales[kind], scales), kind
    assert torch.equal(result.stats.tokens, reference.stats.tokens)
    assert torch.equal(result.stats.pos_tokens, reference.stats.pos_tokens)
    for kind, ref in reference.stats.kinds.items():
        got = result.stats.kinds[kind]
        assert {f.name for f in fields(ref)} == set(EXACT + MOMENTS)
        for name in EXACT:
            assert torch.equal(getattr(got, name), getattr(ref, name)), (kind, name)
        for name in MOMENTS:
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-12, atol=0)


@pytest.mark.parametrize("split", ["some layers on disk", "everything on disk"])
def test_weights_on_disk_give_the_in_memory_scales_and_statistics(root, in_memory, device_maps, tmp_path, split):
    total, layer = model_bytes(root)
    # Room for all but ~1.5 layers (accelerate keeps the largest module's size free): the last layers, the norm
    # and lm_head go to disk. 1 MiB holds one layer but not the embedding: the whole model is read from disk.
    budget = {"cpu": total - layer * 3 // 2} if split == "some layers on disk" else "cpu=1MiB"
    result = run(str(root / "llama"), [str(root / "data.jsonl")], str(tmp_path / "out"), max_memory=budget,
                 offload_folder=str(tmp_path / "offload"), **OPTIONS)

    (device_map,) = device_maps
    assert "disk" in device_map.values()
    if split == "some layers on disk":
        assert device_map["model.embed_tokens"] == "cpu"
        on_disk = [name for name, device in device_map.items() if name.startswith("model.layers.") and device == "disk"]
        assert on_disk and len(on_disk) < 3, device_map
    else:
        assert device_map == {"": "disk"}
    assert_same(result, in_memory)
    assert torch.equal(load_file(scales_file(tmp_path / "out"))["model.layers.2.self_attn.k_scale"],
                       load_file(scales_file(root / "in-memory"))["model.layers.2.self_attn.k_scale"])
    assert result.provenance["settings"]["max_memory"] == budget


def test_device_map_auto_on_cpu_is_the_cpu_run(root, in_memory, device_maps, tmp_path):
    result = run(str(root / "llama"), [str(root / "data.jsonl")], str(tmp_path / "out"), device_map="auto", **OPTIONS)
    assert device_maps in ([None], [{"": "cpu"}])  # one device: transformers places it without hooks
    assert_same(result, in_memory)


def test_cli_offloads_and_writes_the_same_scales(root, in_memory, capsys, tmp_path):
    out = tmp_path / "out"
    code = main(["calibrate", str(root / "llama"), "--data", str(root / "data.jsonl"), "--out", str(out), "--seq-len", "64",
                 "--max-tokens", "256", "--max-memory", "cpu=1MiB,disk=1GiB", "--offload-folder", str(tmp_path / "off"),
                 "--quiet", "--no-verify"])
    assert code == 0, capsys.readouterr().err
    written, reference = load_file(scales_file(out)), load_file(scales_file(root / "in-memory"))
    assert written.keys() == reference.keys()
    assert all(torch.equal(written[name], reference[name]) for name in reference)
    settings = json.loads((out / "kvcal" / "calibration.json").read_text())["settings"]
    assert settings["max_memory"] == "cpu=1MiB,disk=1GiB" and settings["offload_folder"] == str(tmp_path / "off")


@pytest.mark.parametrize("text, expected", [
    ("0=70GiB,cpu=200GiB", {0: 70 * 2**30, "cpu": 200 * 2**30}),
    ("cuda:1=500MB, cpu = 1.5GB,disk=1TiB", {1: 500 * 10**6, "cpu": 1_500_000_000, "disk": 2**40}),
    ({"cpu": "64KiB", 0: 1024, "cuda:2": "2gib"}, {"cpu": 65536, 0: 1024, 2: 2 * 2**30}),
])
def test_max_memory_parses_accelerates_names(text, expected):
    assert parse_max_memory(text) == expected


def test_sizes():
    assert parse_size("70GiB") == 70 * 2**30 and parse_size("500MB") == 500 * 10**6 and parse_size("1.5GB") == 1.5e9
    assert parse_size(".5KiB") == 512 and parse_size("3 B") == 3 and parse_size(7) == 7
    assert [parse_size(bad) for bad in ("70", "GiB", "1.5 parsecs", -1, True, None)] == [None] * 6


def test_max_memory_and_gpu_read_sizes_alike():
    """One parser (choices.parse_size): --max-memory's sizes and verify's --gpu agree, each refusing in its words."""
    from calibrate.verification.capacity import parse_memory

    for text in ("80GB", "141gib", "24000 MiB", ".5TB"):
        assert parse_memory(text) == parse_max_memory({"cpu": text})["cpu"] == parse_size(text)
    with pytest.raises(ValueError, match="--max-memory size '8 parsecs' is not a size"):
        parse_max_memory("cpu=8 parsecs")
    with pytest.raises(ValueError, match="memory '8 parsecs' is neither a GPU"):
        parse_memory("8 parsecs")


def kvcal(capsys, root, out, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``kvcal calibrate`` on the tiny model with ARGV."""
    try:
        code = main(["calibrate", str(root / "llama"), "--data", str(root / "data.jsonl"), "--out", str(out),
                     "--seq-len", "64", "--max-tokens", "256", "--quiet", "--no-verify", *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, out, *fragments: str) -> None:
    """Exit 2, one line ``kvcal: error: ...`` holding each fragment, nothing written."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvcal: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("argv, fragments", [
    (["--max-memory", "cpu=70"], ["'70' is not a size", "e.g. 70GiB"]),
    (["--max-memory", "cpu=70XB"], ["'70XB' is not a size"]),
    (["--max-memory", "cpu=-1GiB"], ["'-1GiB' is not a size"]),
    (["--max-memory", "cpu=GiB"], ["'GiB' is not a size"]),
    (["--max-memory", "cpu"], ["'cpu' is not DEVICE=SIZE", "0=70GiB,cpu=200GiB"]),
    (["--max-memory", "cpu=1GiB,"], ["'' is not DEVICE=SIZE"]),
    (["--max-memory", "=1GiB"], ["'=1GiB' is not DEVICE=SIZE"]),
    (["--max-memory", "gpu=1GiB"], ["device 'gpu' is not a device", "0, 1, cuda:0"]),
    (["--max-memory", "cuda:x=1GiB"], ["device 'cuda:x' is not a device"]),
    (["--max-memory", "0=1GiB,cuda:0=2GiB"], ["names device 0 twice"]),
    (["--max-memory", "disk=100GiB"], ["names only disk", "cpu=8GiB"]),
    (["--max-memory", "99=1GiB"], ["names GPU 99, but"]),
    (["--device", "cpu", "--max-memory", "0=1GiB"], ["--device cpu and a GPU in --max-memory"]),
    (["--device", "cuda:0", "--device-map", "auto"], ["--device cuda:0 puts the whole model on one device"]),
    (["--device-map", "balanced"], ["--device-map", "invalid choice"]),
    (["--max-memory", "cpu=100KB"], ["cannot hold one decoder layer", "needs 144.5 KiB in float32", "cpu=1MiB"]),
])
def test_bad_placement_is_one_line_and_writes_nothing(root, capsys, tmp_path, argv, fragments):
    out = tmp_path / "out"
    assert_refused(*kvcal(capsys, root, out, *argv), out, *fragments)


def test_a_budget_below_one_layer_is_refused_from_python_too(root, tmp_path):
    with pytest.raises(ValueError, match=r"cpu=97.7 KiB cannot hold one decoder layer .* needs 144.5 KiB in float32"):
        run(str(root / "llama"), [str(root / "data.jsonl")], str(tmp_path / "out"), max_memory={"cpu": 100_000}, **OPTIONS)
    assert not (tmp_path / "out").exists()


# (A read-only folder is not among the cases: the suite runs as root, where permissions do not stop writes.)
@pytest.mark.parametrize("case", ["parent is a file", "/proc"])
def test_an_offload_folder_that_cannot_be_written_is_refused(root, capsys, tmp_path, case):
    out = tmp_path / "out"
    (tmp_path / "a-file").write_text("x")
    if case == "parent is a file":
        folder, fragment = tmp_path / "a-file" / "offload", "a-file is not a directory"
    else:
        folder, fragment = "/proc/kvcal-offload", "cannot be written"
    assert_refused(*kvcal(capsys, root, out, "--max-memory", "cpu=1MiB", "--offload-folder", str(folder)), out, fragment)


def test_an_offload_folder_on_a_full_disk_is_refused(root, capsys, tmp_path, monkeypatch):
    import calibrate.config

    real = calibrate.config.shutil.disk_usage
    monkeypatch.setattr(calibrate.config.shutil, "disk_usage", lambda path: real(path)._replace(free=0))
    out = tmp_path / "out"
    code, err = kvcal(capsys, root, out, "--offload-folder", str(tmp_path / "offload"))
    assert_refused(code, err, out, "is on a full disk")

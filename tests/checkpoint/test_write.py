"""checkpoint/write.py and api.calibrate: the checkpoint vLLM loads, written atomically, the source untouched."""

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from calibrate import calibrate
from calibrate.checkpoint.write import check_index, scales_file, shard_name, write_checkpoint
from calibrate.model.description import describe
from calibrate.model.directory import INDEX_FILE, tensor_names


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def run(tiny_dir, text_file, out, **options):
    options = {"seq_len": 64, "max_tokens": 256, "progress": False, "verify": False, **options}
    return calibrate(str(tiny_dir), [str(text_file)], str(out), **options)


@pytest.mark.smoke
def test_output_reloads_with_same_logits_and_lists_every_tensor_once(tiny_dir, text_file, tmp_path):
    before = digest(tiny_dir)
    out = tmp_path / "out"
    result = run(tiny_dir, text_file, out)

    assert digest(tiny_dir) == before  # the source is never modified
    # No model.safetensors (transformers would read it alone): the weights and the scales are two shards.
    assert sorted(p.name for p in out.glob("*.safetensors")) == [shard_name(1, 2), shard_name(2, 2)]
    src_weights, out_weights = tiny_dir / "model.safetensors", out / shard_name(1, 2)
    assert os.stat(src_weights).st_ino == os.stat(out_weights).st_ino  # hardlinked, not copied
    assert scales_file(out) == out / shard_name(2, 2)

    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    names = tensor_names(out_weights) + tensor_names(scales_file(out))
    assert sorted(names) == sorted(index) and len(names) == len(set(names))
    check_index(out)

    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)

    scales = load_file(scales_file(out))
    for row, layer in enumerate(result.layers):
        for kind in ("k", "v", "q"):
            value = scales[f"{layer.prefix}.{kind}_scale"]
            assert value.dtype == torch.float32 and value.shape == (1,)
            expected = result.stats.kinds[kind].absmax[row].max().double() / 448
            assert value.item() == pytest.approx(float(expected), rel=1e-6)
            assert value.item() > 0


def test_config_parses_with_compressed_tensors(tiny_dir, text_file, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    run(tiny_dir, text_file, tmp_path / "out", granularity="head")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.kv_cache_scheme.strategy == "attn_head" and qc.kv_cache_scheme.dynamic is False
    assert qc.kv_cache_scheme.num_bits == 8 and qc.kv_cache_scheme.type == "float"
    scales = load_file(scales_file(tmp_path / "out"))
    assert scales["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
    assert scales["model.layers.0.self_attn.q_scale"].shape == (4, 1, 1)


def test_provenance_and_statistics_are_saved(tiny_dir, text_file, tmp_path):
    result = run(tiny_dir, text_file, tmp_path / "out")
    prov = json.loads((tmp_path / "out" / "kvcal" / "calibration.json").read_text())
    assert prov["tokens"] == 256 and prov["settings"]["seq_len"] == 64
    assert prov["data"][0]["files"][0]["sha256"] == hashlib.sha256(text_file.read_bytes()).hexdigest()
    assert len(prov["scales"]["scales"]["k"]) == len(result.layers)
    from calibrate import Stats

    saved = Stats.load(tmp_path / "out" / "kvcal" / "stats.safetensors")
    recorded = json.loads((tmp_path / "out" / "kvcal" / "calibration.json").read_text())["stats_sha256"]
    assert recorded == hashlib.sha256((tmp_path / "out" / "kvcal" / "stats.safetensors").read_bytes()).hexdigest()
    torch.testing.assert_close(saved.kinds["k"].hist, result.stats.kinds["k"].hist, rtol=0, atol=0)


def test_existing_output_is_refused_and_overwrite_replaces_only_a_kvcal_output(tiny_dir, text_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists; pass --overwrite"):
        run(tiny_dir, text_file, out)
    with pytest.raises(ValueError, match="was not written by kvcal"):
        run(tiny_dir, text_file, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    run(tiny_dir, text_file, out, overwrite=True)  # an empty directory is taken
    first = scales_file(out).read_bytes()
    run(tiny_dir, text_file, out, overwrite=True, observer="mse")  # a kvcal output is replaced
    assert scales_file(out).read_bytes() != first


def test_overwrite_never_removes_an_input(tiny_dir, text_file, tmp_path):
    """An OUT that holds the source, the data or a calibration is refused, ``--overwrite`` or not."""
    from calibrate import apply, export

    src = tmp_path / "src"
    run(tiny_dir, text_file, src)
    before = {"tiny": digest(tiny_dir), "src": digest(src), "data": text_file.read_bytes()}
    with pytest.raises(ValueError, match="holds the input"):
        export(str(src), str(tmp_path), overwrite=True)
    with pytest.raises(ValueError, match="holds the input"):
        apply(str(src), str(tiny_dir), str(tmp_path), overwrite=True)
    (tmp_path / "d").mkdir()
    data = tmp_path / "d" / "data.jsonl"
    data.write_bytes(text_file.read_bytes())
    with pytest.raises(ValueError, match="holds the input .*data.jsonl"):
        run(tiny_dir, data, tmp_path / "d", overwrite=True)
    assert data.read_bytes() == text_file.read_bytes()
    with pytest.raises(ValueError, match="holds the input"):
        run(tiny_dir, text_file, tmp_path, overwrite=True)
    assert before == {"tiny": digest(tiny_dir), "src": digest(src), "data": text_file.read_bytes()}


def test_interrupted_write_leaves_nothing(tiny_dir, tmp_path):
    out = tmp_path / "out"

    def interrupted(directory):
        raise KeyboardInterrupt

    scales = {"model.layers.0.self_attn.k_scale": torch.ones(1)}
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(describe(tiny_dir), out, scales=scales, strategy="tensor", write_extras=interrupted)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "tiny"] == []


def test_bad_scales_are_refused_before_writing(tiny_dir, tmp_path):
    from calibrate.checkpoint.write import scale_tensors

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="zero, negative or not finite"):
            scale_tensors(["a", "b"], {"k": torch.tensor([1.0, bad])})


def test_old_kv_scales_are_replaced_without_duplicates(tiny_dir, text_file, tmp_path):
    """An llm-compressor-style checkpoint with old scales in a weight shard: the shard is rewritten."""
    src = tmp_path / "old"
    src.mkdir()
    for p in tiny_dir.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor([0.0])  # the zero scale of a broken tool
    weights["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([3.0])
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})

    run(src, text_file, tmp_path / "out")
    out = tmp_path / "out"
    assert "model.layers.1.self_attn.k_proj.output_scale" not in tensor_names(out / shard_name(1, 2))
    assert os.stat(out / shard_name(1, 2)).st_ino != os.stat(src / "model.safetensors").st_ino
    assert load_file(scales_file(out))["model.layers.0.self_attn.k_scale"].item() > 0
    check_index(out)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "no .safetensors weight files"),
    ],
    ids=["no-config", "no-weights"],
)
def test_bad_model_directories(tiny_dir, text_file, tmp_path, change, message):
    change(tiny_dir)
    with pytest.raises(ValueError, match=message):
        run(tiny_dir, text_file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_causal_lm_and_missing_dir(tiny_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        run(tmp_path / "nope", text_file, tmp_path / "out")
    config = json.loads((tiny_dir / "config.json").read_text())
    config["architectures"] = ["BertModel"]
    (tiny_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kvcal calibrates the decoders vLLM serves with a KV cache"):
        run(tiny_dir, text_file, tmp_path / "out")


def test_seq_len_above_context_is_refused(tiny_dir, text_file, tmp_path):
    with pytest.raises(ValueError, match="longer than the model's context"):
        run(tiny_dir, text_file, tmp_path / "out", seq_len=8192, max_tokens=8192)
    assert not (tmp_path / "out").exists()


def test_an_out_that_appears_while_running_is_never_replaced(tiny_dir, tmp_path):
    """Two runs with the same --out: the one that finishes second refuses, and keeps nothing half-written."""
    out = tmp_path / "out"

    def other_run_finishes_first(directory):
        out.mkdir()
        (out / "theirs.txt").write_text("first run's output")

    scales = {"model.layers.0.self_attn.k_scale": torch.ones(1)}
    with pytest.raises(ValueError, match="appeared while this run was working"):
        write_checkpoint(describe(tiny_dir), out, scales=scales, strategy="tensor", write_extras=other_run_finishes_first)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]  # no temporary left behind


def test_written_files_follow_the_umask(tiny_dir, text_file, tmp_path):
    """safetensors creates files 0600; a server running as another user must still read the scales."""
    old = os.umask(0o027)
    try:
        run(tiny_dir, text_file, tmp_path / "out")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    written = [scales_file(out), out / "kvcal" / "stats.safetensors", out / "kvcal" / "calibration.json", out / "config.json"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(0o640) for p in written}


def test_damaged_weights_are_named_before_anything_is_written(tiny_dir, text_file, tmp_path):
    weights = tiny_dir / "model.safetensors"
    os.truncate(weights, 100)
    with pytest.raises(ValueError, match="model.safetensors is damaged"):
        run(tiny_dir, text_file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_kv_cache_scheme_equals_compressed_tensors_own(tiny_dir):
    """kvcal writes the scheme by hand (importing compressed-tensors costs seconds); it must be the library's."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    from calibrate.checkpoint.write import kv_cache_scheme, quantization_config

    for strategy, theirs in (("tensor", "tensor"), ("head", "attn_head")):
        args = QuantizationArgs(num_bits=8, type="float", strategy=theirs, dynamic=False, symmetric=True)
        assert kv_cache_scheme(strategy) == args.model_dump(mode="json", exclude_none=True)
        config = QuantizationConfig(config_groups={}, kv_cache_scheme=args, quantization_status="compressed", format="dense")
        assert quantization_config(None, strategy) == config.model_dump(mode="json", exclude_none=True)


@pytest.mark.parametrize("source_mode", [0o600, 0o755])
def test_copied_files_follow_the_umask_not_the_source(tiny_dir, tmp_path, source_mode):
    """The tokenizer, chat template and generation config are copied: they get the umask's mode, not the source's."""
    copied = ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
    (tiny_dir / "chat_template.jinja").write_text("{{ messages }}")
    (tiny_dir / "extra").mkdir()
    (tiny_dir / "extra" / "notes.txt").write_text("x")
    for name in [*copied, "extra/notes.txt"]:
        os.chmod(tiny_dir / name, source_mode)
    os.chmod(tiny_dir / "extra", 0o700)
    old = os.umask(0o022)
    try:
        scales = {"model.layers.0.self_attn.k_scale": torch.ones(1)}
        write_checkpoint(describe(tiny_dir), tmp_path / "out", scales=scales, strategy="tensor", write_extras=lambda d: None)
    finally:
        os.umask(old)
    out = tmp_path / "out"
    modes = {name: oct((out / name).stat().st_mode & 0o777) for name in [*copied, "extra/notes.txt", "extra"]}
    assert modes == {**{name: oct(0o644) for name in [*copied, "extra/notes.txt"]}, "extra": oct(0o755)}


def test_overwrite_refuses_an_out_replaced_while_the_run_worked(tiny_dir, tmp_path):
    """Two runs onto one --out with --overwrite: the one finishing second finds another OUT than it started with and
    refuses (nothing written) instead of replacing the first run's output."""
    out, scales = tmp_path / "out", {"model.layers.0.self_attn.k_scale": torch.ones(1)}
    write_checkpoint(describe(tiny_dir), out, scales=scales, strategy="tensor", write_extras=lambda d: None)
    (out / "kvcal" / "calibration.json").write_text("{}")  # the OUT this run starts with
    theirs = tmp_path / "theirs"
    write_checkpoint(describe(tiny_dir), theirs, scales=scales, strategy="tensor", write_extras=lambda d: None)
    (theirs / "kvcal" / "calibration.json").write_text('{"run": "theirs"}')

    def other_run_swaps_out(directory):  # between this run's checks and its swap
        shutil.rmtree(out)
        os.rename(theirs, out)

    with pytest.raises(ValueError, match="was replaced while this run was working .* nothing was written"):
        write_checkpoint(describe(tiny_dir), out, scales=scales, strategy="tensor", write_extras=other_run_swaps_out, overwrite=True)
    assert json.loads((out / "kvcal" / "calibration.json").read_text()) == {"run": "theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny"]  # no temporary left behind
    # Unchanged since the start, OUT is replaced as before.
    write_checkpoint(describe(tiny_dir), out, scales=scales, strategy="tensor", write_extras=lambda d: None, overwrite=True)
    assert not (out / "kvcal" / "calibration.json").exists()

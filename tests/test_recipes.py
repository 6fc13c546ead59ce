"""Tests for calibrate/recipes.py and ``kvcal calibrate --recipe``: every shipped recipe on a tiny model of its family.

Each family test runs the real command on a tiny random model and checks the written scales against K, V and Q
captured here independently (by wrapping the model's own eager attention function), so a recipe that does not reach
the run, or a family quirk (k-norm, sliding windows, sinks, fused qkv) that the capture mishandles, fails.
"""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from builders import save_tiny_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from calibrate import api, recipes
from calibrate.checkpoint.write import scales_file
from calibrate.cli import main
from calibrate.config import CalibrationConfig, ScaleConfig
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.thresholds import Thresholds

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
SEQ_LEN, MAX_TOKENS = 64, 192
# Tiny model family → the shipped recipe that should fit it (None: run without --recipe, i.e. the default one).
FAMILY_RECIPES = {
    "llama": "llama3",
    "qwen2": "qwen2_5",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "phi3": "phi3",
    "gpt_oss": "gpt_oss",
}


def gpt_oss_checkpoint(directory: Path, tokenizer) -> Path:
    """A tiny gpt-oss: one sliding and one full layer, attention sinks, a 4-expert MoE."""
    from transformers import GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, vocab_size=len(tokenizer),
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():  # the sinks start at zero; make them matter
            if hasattr(module, "sinks"):
                module.sinks.normal_()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_checkpoint(directory: Path, family: str, tokenizer) -> Path:
    if family == "gpt_oss":
        return gpt_oss_checkpoint(directory, tokenizer)
    return save_tiny_checkpoint(directory, family, tokenizer)


def yaml_value(name: str, section: str, key: str):
    """A setting read straight from the recipe files (the child's, else default.yaml's)."""
    for file in (RECIPE_DIR / f"{name}.yaml", RECIPE_DIR / "default.yaml"):
        value = (yaml.safe_load(file.read_text()).get(section) or {}).get(key)
        if value is not None:
            return value
    raise KeyError(f"{section}.{key}")


def captured_absmax(model_dir: Path, sequences: list[torch.Tensor], monkeypatch) -> dict[int, dict[str, float]]:
    """layer_idx → absmax of q, k and v as the model's own eager attention receives them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    record: dict[int, dict[str, float]] = {}
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}
    for module in modules:
        original = module.eager_attention_forward

        def eager(attn, query, key, value, attention_mask, _original=original, **kwargs):
            seen = record.setdefault(attn.layer_idx, {"q": 0.0, "k": 0.0, "v": 0.0})
            for kind, t in (("q", query), ("k", key), ("v", value)):  # [batch, heads, seq, head_dim]
                seen[kind] = max(seen[kind], t.abs().max().item())
            return _original(attn, query, key, value, attention_mask, **kwargs)

        monkeypatch.setattr(module, "eager_attention_forward", eager)
    with torch.no_grad():
        for ids in sequences:
            model(ids.unsqueeze(0), use_cache=False)
    return record


@pytest.mark.parametrize("family", list(FAMILY_RECIPES))
def test_family_recipe_calibrates_its_tiny_model(family, tmp_path, smol_tokenizer, text_file, monkeypatch, capsys):
    name = FAMILY_RECIPES[family]
    model_dir = tiny_checkpoint(tmp_path / family, family, smol_tokenizer)
    run_calibration = api.run_calibration  # without the short verify, which has tests of its own
    monkeypatch.setattr(api, "run_calibration", lambda config: run_calibration(dataclasses.replace(config, verify=False)))
    out = tmp_path / "out"
    argv = ["calibrate", str(model_dir), "--recipe", name, "--data", str(text_file), "--out", str(out),
            "--seq-len", str(SEQ_LEN), "--max-tokens", str(MAX_TOKENS), "--quiet"]
    assert main(argv) == 0
    printed = capsys.readouterr().out

    # The resolved recipe is saved: the file's values, with the two flags given on the command line on top.
    saved = json.loads((out / "kvcal" / "calibration.json").read_text())
    recipe = saved["recipe"]
    assert recipe["name"] == name
    assert recipe["data"]["seq_len"] == SEQ_LEN and recipe["data"]["max_tokens"] == MAX_TOKENS
    assert recipe["data"]["chunk_len"] == yaml_value(name, "data", "chunk_len") == saved["settings"]["chunk_len"]
    assert saved["settings"]["observer"] == yaml_value(name, "scales", "observer") == "max"
    skip = yaml.safe_load((RECIPE_DIR / f"{name}.yaml").read_text()).get("skip_layers", [])
    assert recipe["skip_layers"] == skip
    assert ("--kv-cache-dtype-skip-layers sliding_window" in printed.split("recipe ")[-1]) == (skip == ["sliding_window"])

    # The scales are absmax / 448 of what the model's attention really receives.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sequences = list(iter_sequences(DataConfig(sources=[str(text_file)], seq_len=SEQ_LEN, max_tokens=MAX_TOKENS), tokenizer))
    expected = captured_absmax(model_dir, sequences, monkeypatch)
    scales = load_file(scales_file(out))
    assert len(scales) == 3 * len(expected)
    for idx, absmax in expected.items():
        for kind in "kvq":
            got = scales[f"model.layers.{idx}.self_attn.{kind}_scale"]
            torch.testing.assert_close(got, torch.tensor([absmax[kind] / 448.0]), rtol=1e-4, atol=0)


def test_no_recipe_uses_default_and_flags_equal_to_defaults_still_override(tmp_path, smol_tokenizer, text_file):
    model_dir = save_tiny_checkpoint(tmp_path / "llama", "llama", smol_tokenizer)
    user = tmp_path / "mine.yaml"
    user.write_text(f"extends: llama3\nscales:\n  observer: mse\ndata:\n  sources: [{text_file}]\n  seed: 3\n")

    plain = recipes.calibration_config(recipe=None, model=str(model_dir), out=str(tmp_path / "a"), data=[str(text_file)])
    assert plain.recipe["name"] == "default" and plain.data.seq_len == 2048 and plain.scales.observer == "max"

    # Not given: the recipe's values (mse from mine.yaml, chunk_len from llama3, max_tokens from default).
    config = recipes.calibration_config(recipe=str(user), model=str(model_dir), out=str(tmp_path / "b"), seq_len=128, observer=None)
    assert (config.scales.observer, config.data.seq_len, config.data.chunk_len, config.data.max_tokens, config.data.seed) == ("mse", 128, 4096, 500_000, 3)
    assert config.data.sources == [str(text_file)] and config.recipe["extends"] == "llama3" and config.recipe["name"] == "mine"

    # Given, even with the default's value: the flag wins, and the saved recipe says so.
    config = recipes.calibration_config(recipe=str(user), model=str(model_dir), out=str(tmp_path / "c"), observer="max", pack=False)
    assert config.scales.observer == "max" and config.recipe["scales"]["observer"] == "max"
    assert config.data.pack is False and config.recipe["data"]["pack"] is False

    # The saved recipe is itself a recipe that resolves to the same thing.
    again = tmp_path / "again.json"
    again.write_text(json.dumps(config.recipe))
    assert recipes.load_recipe(str(again)) == config.recipe


def test_cli_flag_parsing_keeps_untyped_flags_out(tmp_path, smol_tokenizer, text_file, monkeypatch):
    model_dir = save_tiny_checkpoint(tmp_path / "llama", "llama", smol_tokenizer)
    seen = {}

    def stop_before_the_run(config):
        seen["config"] = config
        raise ValueError("stopped before the model run")

    monkeypatch.setattr("calibrate.api.run_calibration", stop_before_the_run)
    user = tmp_path / "mine.yaml"
    user.write_text("extends: default\nscales:\n  observer: mse\n  headroom: 1.5\n")
    assert main(["calibrate", str(model_dir), "--recipe", str(user), "--data", str(text_file), "--out", str(tmp_path / "o"), "--headroom", "1.0"]) == 2
    config = seen["config"]
    assert config.scales.observer == "mse" and config.scales.headroom == 1.0 and config.data.seq_len == 2048 and config.scales.query_scale is True


def test_recipe_for_another_family_is_refused_unless_forced(tmp_path, smol_tokenizer, text_file, capsys):
    model_dir = save_tiny_checkpoint(tmp_path / "llama", "llama", smol_tokenizer)
    argv = ["calibrate", str(model_dir), "--recipe", "qwen3", "--data", str(text_file), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "recipe 'qwen3' is written for qwen3" in err and "--force" in err and not (tmp_path / "o").exists()
    with pytest.warns(UserWarning, match="because of --force"):
        config = recipes.calibration_config(recipe="qwen3", model=str(model_dir), out=str(tmp_path / "o"), data=[str(text_file)], force=True)
    assert config.recipe["name"] == "qwen3"


@pytest.mark.parametrize(
    "text, message",
    [
        ("scales:\n  observr: max\n", "unknown key 'scales.observr'; did you mean 'observer'?"),
        ("observer: mse\n", "unknown key 'observer'; did you mean 'scales.observer'?"),
        ("data:\n  seq_lenght: 10\n", "did you mean 'seq_len'?"),
        ("skip_layer: [1]\n", "did you mean 'skip_layers'?"),
        ("data:\n  seq_len: '4096'\n", "data.seq_len must be int, got '4096' (str)"),
        ("scales:\n  query_scale: 1\n", "scales.query_scale must be bool"),
        ("fits:\n  model_types: llama\n", "fits.model_types must be list[str]"),
        ("scales: max\n", "scales must be a mapping"),
        ("scales:\n  observer: maximum\n", "scales.observer: unknown observer 'maximum'"),
        ("skip_layers: [sliding]\n", "skip_layers holds 'sliding'"),
        ("export:\n  form: modelop\n", "export.form: unknown export form 'modelop'; did you mean 'modelopt'?"),
        ("verify:\n  thresholds:\n    max_kld: 0.1\n", "unknown key 'verify.thresholds.max_kld'; did you mean 'max_kl'?"),
        ("verify:\n  schemes: [tensr]\n", "verify.schemes: unknown verify scheme 'tensr'; did you mean 'tensor'?"),
        ("data:\n  seq_len: 0\n", "data.seq_len: --seq-len must be an integer ≥ 2"),
        ("extends: lama3\n", "no recipe named 'lama3'; did you mean 'llama3'?"),
        ("scales: [\n", "is not valid YAML"),
    ],
)
def test_bad_recipe_names_the_key_and_the_fix(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        recipes.load_recipe(str(path))
    assert message in str(error.value)


def test_extends_cycle_and_unknown_recipe(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: ./b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: ./a.yaml\n")
    with pytest.raises(ValueError, match="makes a cycle"):
        recipes.load_recipe(str(tmp_path / "a.yaml"))
    with pytest.raises(ValueError, match="did you mean 'gemma'"):
        recipes.load_recipe("gema")
    with pytest.raises(ValueError, match="does not exist"):
        recipes.load_recipe(str(tmp_path / "missing.yaml"))


def test_extends_merges_sections_and_replaces_lists(tmp_path):
    path = tmp_path / "child.yaml"
    path.write_text("extends: gemma\nscales:\n  headroom: 1.25\nskip_layers: [0, 3]\n")
    child, parent = recipes.load_recipe(str(path)), recipes.load_recipe("gemma")
    assert child["scales"] == {**parent["scales"], "headroom": 1.25}
    assert child["skip_layers"] == [0, 3] and child["data"] == parent["data"] and child["fits"] == parent["fits"]
    # One entry per layer, space-separated: vLLM's parser takes "0,3" as one entry that matches no layer.
    assert "(--kv-cache-dtype-skip-layers 0 3;" in recipes.serve_notes(child)[-1]


@pytest.mark.smoke
def test_recipes_list_and_show(capsys):
    assert main(["recipes", "list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in listed) == sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    assert main(["recipes", "show", "qwen3"]) == 0
    shown = capsys.readouterr().out
    assert "# Known: K is post-norm." in shown  # the reasoning comments, as written
    resolved = yaml.safe_load(shown.split("# resolved (after extends):\n")[1])
    assert resolved["fits"]["model_types"] == ["qwen3"] and resolved["data"]["max_tokens"] == 500000
    assert main(["recipes", "show"]) == 2


def test_every_shipped_recipe_is_documented_and_fits_a_family():
    for path in RECIPE_DIR.glob("*.yaml"):
        text = path.read_text()
        recipe = recipes.load_recipe(path.stem)
        assert text.startswith("#") and recipe.get("description"), f"{path.name} needs its reasoning and a description"
        assert (path.stem == "default") != bool(recipe["fits"]), f"{path.name}: only the default recipe fits every model"
        assert recipe["name"] == path.stem


def test_shipped_recipes_are_found_without_the_checkout(tmp_path, monkeypatch):
    package = tmp_path / "recipe_files"
    package.mkdir()
    (package / "default.yaml").write_text((RECIPE_DIR / "default.yaml").read_text())
    monkeypatch.setattr(recipes, "_CHECKOUT_DIR", tmp_path / "no-such-dir")
    monkeypatch.setattr(recipes, "_PACKAGE_DIR", package)
    assert recipes.shipped_recipes() == {"default": package / "default.yaml"}


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen3_moe"])
def test_families_whose_vllm_drops_scales_warn_before_calibrating(tmp_path, text_file, model_type):
    model_dir = tmp_path / model_type
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["XForCausalLM"]}))
    # Warned in the run's first step, before anything is loaded (the directory has no tokenizer: the run then stops).
    with pytest.warns(UserWarning, match=r"vllm#(35656|25047)"), pytest.raises(ValueError, match="holds no tokenizer files"):
        api.calibrate(str(model_dir), [str(text_file)], str(tmp_path / "o"))


def test_default_recipe_states_the_configuration_defaults():
    """recipes/default.yaml writes out the configuration tree's defaults: the same values, not a second set."""
    parts = recipes.config_parts(recipes.load_recipe("default"))
    assert parts["data"] == DataConfig(sources=[]) and parts["scales"] == ScaleConfig() and parts["thresholds"] == Thresholds()
    own = {f.name: f.default for f in dataclasses.fields(CalibrationConfig)}
    run_fields = set(parts) - {"data", "scales", "thresholds"}
    assert run_fields == set(recipes.RUN_FIELDS.values())  # every run field the recipe can hold, compared whole
    assert {k: parts[k] for k in run_fields} == {k: own[k] for k in run_fields}


def test_python_api_resolves_like_the_cli(tmp_path, smol_tokenizer, text_file, monkeypatch):
    model_dir = save_tiny_checkpoint(tmp_path / "llama", "llama", smol_tokenizer)
    seen = []
    monkeypatch.setattr(api, "run_calibration", seen.append)
    out = str(tmp_path / "o")
    api.calibrate(str(model_dir), [str(text_file)], out, seq_len=128, observer="mse", recipe="llama3", force=True)
    assert main(["calibrate", str(model_dir), "--data", str(text_file), "--out", out, "--seq-len", "128",
                 "--observer", "mse", "--recipe", "llama3", "--force"]) == 0
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0].recipe["name"] == "llama3" and seen[0].data.chunk_len == 4096  # the recipe's, under both
    with pytest.raises(ValueError, match="unknown calibration option 'seqlen'"):
        api.calibrate(str(model_dir), [str(text_file)], out, seqlen=128)

"""hub.py: models named as on the Hub, from a Hub cache built in the test (no network), and remote code."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from builders import kjv_jsonl, save_tiny_checkpoint
from safetensors.torch import load_file
from transformers import AutoTokenizer

from calibrate.checkpoint.write import scales_file
from calibrate.hub import _SNAPSHOT, NEEDED, REMOTE_CODE, fetch, is_repo_id, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def kvcal(*args: str, env: dict) -> subprocess.CompletedProcess:
    """The CLI in a fresh process (huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported)."""
    return subprocess.run([sys.executable, "-m", "calibrate", *args], capture_output=True, text=True, env={**os.environ, **env},
                          timeout=600)


@pytest.fixture(scope="module")
def tokenizer():
    from calibrate.demo import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture
def hub_cache(tmp_path, tokenizer):
    """HF_HOME holding kvcal-test/tiny at COMMIT as huggingface_hub lays out its cache: each snapshot file a
    relative symlink into ``blobs/`` (named by content hash), and refs/main → COMMIT."""
    repo = tmp_path / "hf" / "hub" / "models--kvcal-test--tiny"
    snapshot = save_tiny_checkpoint(repo / "snapshots" / COMMIT, "llama", tokenizer)
    (repo / "blobs").mkdir()
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        path.replace(blob)
        path.symlink_to(os.path.relpath(blob, path.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hf"


def test_names_are_hub_ids_only_when_not_local(tmp_path, monkeypatch):
    assert is_repo_id("meta-llama/Llama-3.1-8B") and is_repo_id("org/name.v2")
    (tmp_path / "org").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir()
    assert not is_repo_id("org/name")  # a local directory wins
    assert not any(is_repo_id(n) for n in ("/abs/path", "./rel/x", "one", "a/b/c"))
    assert resolve(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="--revision picks a commit of a Hub model; .* is a local path: drop --revision"):
        resolve(str(tmp_path), "main")
    m = _SNAPSHOT.search(f"/x/hub/models--kvcal-test--tiny/snapshots/{COMMIT}")
    assert (m["org"], m["name"], m["commit"]) == ("kvcal-test", "tiny", COMMIT)
    assert "*.safetensors" in NEEDED and "*.bin" not in NEEDED


def test_fetch_brings_the_small_files_first_and_the_weights_when_asked(tmp_path, monkeypatch):
    import huggingface_hub

    asked, questions = [], []

    def unreachable(self, repo, revision, timeout):
        questions.append(repo)
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, revision, local_files_only, allow_patterns:
                        asked.append((repo, revision, local_files_only, allow_patterns)))
    snapshot = str(tmp_path / "hub" / "models--org--name" / "snapshots" / COMMIT)
    offline = fetch(snapshot, weights=False)
    assert offline and questions == ["org/name"]
    assert not fetch(snapshot, trust_remote_code=True, offline=False)  # told it is reachable: no question asked
    assert fetch(str(tmp_path)) is False and questions == ["org/name"]  # a local directory: nothing to fetch
    (_, _, cache_only, small), (repo, revision, from_hub, everything) = asked
    assert (repo, revision, cache_only, from_hub) == ("org/name", COMMIT, True, False)
    assert "tokenizer.model" in small and "*.json" in small and not any("safetensors" in p for p in small)
    assert set(everything) == set(small) | {"*.safetensors"} | set(REMOTE_CODE)


def test_a_cached_hub_model_calibrates_offline_by_its_name(hub_cache, tmp_path):
    data = kjv_jsonl(tmp_path / "d.jsonl", 100)
    env = {"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    for extra in ([], ["--revision", COMMIT]):
        out = tmp_path / f"out{len(extra)}"
        run = kvcal("calibrate", "kvcal-test/tiny", *extra, "--data", str(data), "--out", str(out), "--seq-len", "64",
                    "--max-tokens", "256", "--no-verify", "--quiet", env=env)
        assert run.returncode == 0, run.stderr
        provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
        assert provenance["model"].endswith(f"models--kvcal-test--tiny/snapshots/{COMMIT}")
        assert "model.layers.2.self_attn.k_scale" in load_file(scales_file(out))
        # The cache's relative symlinks are followed: OUT holds the files themselves, the weights hard-linked.
        assert not any(p.is_symlink() for p in out.rglob("*"))
        blobs = {p.stat().st_ino for p in (hub_cache / "hub" / "models--kvcal-test--tiny" / "blobs").iterdir()}
        assert (out / "model-00001-of-00002.safetensors").stat().st_ino in blobs


@pytest.mark.parametrize(
    "name, extra, message",
    [
        ("kvcal-test/absent", [], "kvcal: error: cannot reach the Hugging Face Hub for kvcal-test/absent and it is not in "
                                  "the local cache: connect once, or pass a local model directory"),
        ("kvcal-test/tiny", ["--revision", "v9"], "kvcal: error: cannot reach the Hugging Face Hub for kvcal-test/tiny and it "
                                                  "is not in the local cache: connect once, or pass a local model directory"),
    ],
)
def test_an_unreachable_uncached_model_is_one_line_and_nothing_written(hub_cache, tmp_path, name, extra, message):
    data = kjv_jsonl(tmp_path / "d.jsonl", 20)
    run = kvcal("calibrate", name, *extra, "--data", str(data), "--out", str(tmp_path / "out"),
                env={"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    assert (run.returncode, run.stderr.strip()) == (2, message)
    assert not (tmp_path / "out").exists()


CONFIGURATION = """from transformers import LlamaConfig


class KvTestConfig(LlamaConfig):
    model_type = "kvcal_remote_test"
"""
MODELING = """from transformers import LlamaForCausalLM

from .configuration_kvtest import KvTestConfig


class KvTestForCausalLM(LlamaForCausalLM):
    config_class = KvTestConfig
"""


def remote_code_model(directory, tokenizer, architecture: str, modeling: str):
    """A tiny Llama saved as a model with its own code: model type kvcal_remote_test, ``architecture`` in ``modeling``."""
    model = save_tiny_checkpoint(directory, "llama", tokenizer)
    config = json.loads((model / "config.json").read_text())
    config |= {"model_type": "kvcal_remote_test", "architectures": [architecture],
               "auto_map": {"AutoConfig": "configuration_kvtest.KvTestConfig", "AutoModelForCausalLM": f"modeling_kvtest.{architecture}"}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "configuration_kvtest.py").write_text(CONFIGURATION)
    (model / "modeling_kvtest.py").write_text(modeling)
    return model


def test_a_model_with_its_own_code_runs_only_when_trusted(tmp_path, tokenizer):
    model = remote_code_model(tmp_path / "remote", tokenizer, "KvTestForCausalLM", MODELING)
    data = kjv_jsonl(tmp_path / "d.jsonl", 100)
    args = ["calibrate", str(model), "--data", str(data), "--seq-len", "64", "--max-tokens", "256", "--no-verify", "--quiet"]
    env = {"HF_HOME": str(tmp_path / "hf")}  # where transformers copies the model's code
    refused = kvcal(*args, "--out", str(tmp_path / "refused"), env=env)
    assert refused.returncode == 2 and refused.stderr.strip() == (
        f"kvcal: error: {model} (kvcal_remote_test) ships its own modeling code (auto_map in config.json), which "
        "transformers runs only when asked: pass --trust-remote-code if you trust it")
    assert not (tmp_path / "refused").exists()
    trusted = kvcal(*args, "--out", str(tmp_path / "trusted"), "--trust-remote-code", env=env)
    assert trusted.returncode == 0, trusted.stderr
    written = load_file(scales_file(tmp_path / "trusted"))
    assert {f"model.layers.{i}.self_attn.{k}_scale" for i in range(3) for k in "kvq"} <= set(written)
    assert all(torch.isfinite(t).all() and (t > 0).all() for t in written.values())


OPAQUE = MODELING + '''

class KvOpaqueForCausalLM(LlamaForCausalLM):
    """Attention computed with a configuration of its own, never through kvcal's attention implementation."""

    config_class = KvTestConfig

    def __init__(self, config):
        super().__init__(config)
        import copy

        own = copy.deepcopy(config)
        own._attn_implementation = "eager"
        for layer in self.model.layers[1:]:
            layer.self_attn.config = own
'''


def test_remote_code_that_hides_k_and_v_is_refused_before_any_data_runs(tmp_path, tokenizer):
    model = remote_code_model(tmp_path / "opaque", tokenizer, "KvOpaqueForCausalLM", OPAQUE)
    data = kjv_jsonl(tmp_path / "d.jsonl", 100)
    run = kvcal("calibrate", str(model), "--data", str(data), "--seq-len", "64", "--max-tokens", "256", "--no-verify", "--quiet",
                "--trust-remote-code", "--out", str(tmp_path / "out"), env={"HF_HOME": str(tmp_path / "hf")})
    assert run.returncode == 2 and run.stderr.strip() == (
        "kvcal: error: kvcal cannot see K and V in 2 of 3 attention layers of this kvcal_remote_test model (e.g. "
        "model.layers.1.self_attn): its modeling code computes attention without transformers' attention interface; "
        "calibrate the family with transformers' own implementation, if it has one")
    assert not (tmp_path / "out").exists()


def test_bad_data_fails_before_a_hub_models_weights_are_fetched(hub_cache, tmp_path):
    """The cache holds kvcal-test/tiny's configs and tokenizer but no weights, as after a download cut short: bad data
    is named (it was opened with the tokenizer alone); good data gets as far as the missing weights."""
    for weights in (hub_cache / "hub" / "models--kvcal-test--tiny" / "snapshots" / COMMIT).glob("*.safetensors"):
        weights.unlink()
    env = {"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "In the beginning"}\n')
    run = kvcal("calibrate", "kvcal-test/tiny", "--data", str(bad), "--out", str(tmp_path / "out"), env=env)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip() == (f"kvcal: error: {bad} has no 'input_ids' / 'messages' / 'text' column; its columns are "
                                  "body: pass text_field naming the text column")
    good = kjv_jsonl(tmp_path / "d.jsonl", 20)
    run = kvcal("calibrate", "kvcal-test/tiny", "--data", str(good), "--out", str(tmp_path / "out"), env=env)
    assert run.returncode == 2 and run.stderr.strip().endswith(f"snapshots/{COMMIT} has no .safetensors weight files; kvcal "
                                                               "writes scales beside safetensors weights"), run.stderr
    assert not (tmp_path / "out").exists()

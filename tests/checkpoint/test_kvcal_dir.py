"""calibrate/checkpoint/kvcal_dir.py: a kvcal output's statistics and provenance read back, and every way they can
be damaged refused in one line."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from calibrate.capture.stats import Stats
from calibrate.checkpoint.kvcal_dir import load_calibration
from calibrate.files import file_sha256
from calibrate.model.layers import AttentionLayer, ModelSignature

SIG = ModelSignature("llama", [0, 1, 2], num_kv_heads=2, num_heads=4, head_dim=8)
LAYERS = [AttentionLayer(i, f"model.layers.{i}.self_attn", False) for i in SIG.layers]


@pytest.fixture
def saved(tmp_path):
    """A minimal kvcal output: statistics and a provenance with its layers."""
    directory = tmp_path / "cal"
    (directory / "kvcal").mkdir(parents=True)
    stats = Stats.empty(SIG)
    stats.tokens += 7
    stats.save(directory / "kvcal" / "stats.safetensors")
    (directory / "kvcal" / "calibration.json").write_text(json.dumps({"layers": [asdict(layer) for layer in LAYERS]}))
    return directory


def test_load_calibration_reads_back_what_was_saved(saved):
    stats, provenance = load_calibration(saved)
    assert stats.signature == SIG and stats.tokens.tolist() == [7, 7, 7]
    assert provenance == {"layers": [asdict(layer) for layer in LAYERS]}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def _plain_safetensors(path: Path) -> None:
    save_file({"x": torch.zeros(1)}, str(path))


@pytest.mark.parametrize("damage, message", [
    (lambda d: shutil.rmtree(d / "kvcal"), "has no kvcal/stats.safetensors; pass a directory written by kvcal calibrate"),
    (lambda d: (d / "kvcal" / "calibration.json").unlink(), "has no kvcal/calibration.json beside its statistics"),
    (lambda d: (d / "kvcal" / "calibration.json").write_text("{"), "calibration.json is not valid JSON"),
    (lambda d: (d / "kvcal" / "calibration.json").write_text("[]"), "holds a list, not a JSON object"),
    (lambda d: (d / "kvcal" / "calibration.json").write_text('{"layers": {}}'), "holds no 'layers' list"),
    (lambda d: _truncate(d / "kvcal" / "stats.safetensors"), "is not a readable safetensors file .* calibrate again"),
    (lambda d: _plain_safetensors(d / "kvcal" / "stats.safetensors"), "is not a kvcal statistics file"),
], ids=["no-kvcal-dir", "no-provenance", "provenance-not-json", "provenance-not-an-object", "no-layers",
        "stats-truncated", "stats-not-kvcal"])
def test_load_calibration_errors_are_one_line(saved, damage, message):
    damage(saved)
    with pytest.raises(ValueError, match=message) as e:
        load_calibration(saved)
    assert "\n" not in str(e.value)


def test_statistics_changed_since_the_calibration_are_refused_in_one_line(saved):
    """calibration.json records the statistics' sha256: a file re-saved with other values (still a valid statistics
    file) is refused, where it used to be re-exported without a word."""
    provenance_file = saved / "kvcal" / "calibration.json"
    provenance = json.loads(provenance_file.read_text())
    provenance_file.write_text(json.dumps(provenance | {"stats_sha256": file_sha256(saved / "kvcal" / "stats.safetensors")}))
    load_calibration(saved)  # the recorded file reads
    stats = Stats.load(saved / "kvcal" / "stats.safetensors")
    stats.tokens += 1  # tampered, still well formed
    stats.save(saved / "kvcal" / "stats.safetensors")
    with pytest.raises(ValueError, match="stats.safetensors is not the file this calibration wrote .* calibrate again") as e:
        load_calibration(saved)
    assert "\n" not in str(e.value)

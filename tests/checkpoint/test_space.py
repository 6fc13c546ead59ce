"""checkpoint/space.py: the size of an output, known before it is written, against what writing it really takes."""

import errno
import os

import pytest
from safetensors import SafetensorError

from calibrate.capture.stats import Stats
from calibrate.checkpoint.space import HEADER_BYTES, output_room, stats_bytes
from calibrate.checkpoint.write import tensor_bytes, weight_files
from calibrate.files import no_room
from calibrate.model.description import describe
from calibrate.model.layers import ModelSignature


@pytest.mark.parametrize("signature", [
    pytest.param(ModelSignature("llama", [0, 1, 2], num_kv_heads=2, num_heads=4, head_dim=16), id="gqa"),
    pytest.param(ModelSignature("deepseek_v3", list(range(5)), num_kv_heads=1, num_heads=8, head_dim=96, latent_dim=64), id="mla"),
])
def test_the_statistics_size_is_the_saved_files_tensor_bytes(tmp_path, signature):
    """Sized from the signature alone (no tensor allocated), against a file Stats.save really wrote."""
    Stats.empty(signature).save(tmp_path / "stats.safetensors")
    written = (tmp_path / "stats.safetensors").stat().st_size
    assert stats_bytes(signature) - HEADER_BYTES == tensor_bytes(tmp_path / "stats.safetensors")
    assert written <= stats_bytes(signature)


def test_weights_on_outs_file_system_are_linked_and_cost_nothing(tiny_dir, tmp_path):
    """Same file system (hard links): no weight bytes; the tokenizer and other files are copied whatever happens."""
    room = output_room(tiny_dir, tmp_path / "out", weight_files(describe(tiny_dir)), 1000)
    assert os.stat(tiny_dir).st_dev == os.stat(tmp_path).st_dev
    assert not any(what.startswith("weights") for what in room.parts)
    others = sum(p.stat().st_size for p in tiny_dir.iterdir() if p.suffix != ".safetensors" and p.name != "config.json")
    assert room.parts["tokenizer and other files"] == others and room.parts["statistics"] == 1000
    assert room.largest == max(1000, *(p.stat().st_size for p in tiny_dir.iterdir() if p.suffix != ".safetensors"
                                       and p.name != "config.json"))


@pytest.mark.parametrize("error, why", [
    pytest.param(OSError(errno.ENOSPC, "No space left on device"), "no space left on the device", id="enospc"),
    pytest.param(OSError(errno.EFBIG, "File too large"), "file-size limit", id="efbig"),
    pytest.param(OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota", id="edquot"),
    # safetensors' own words for save_file onto a full tmpfs (0.8, measured)
    pytest.param(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
                 "no space left on the device", id="safetensors-28"),
    pytest.param(OSError(errno.EACCES, "Permission denied"), None, id="other-oserror"),
    pytest.param(ValueError("bad"), None, id="not-an-io-error"),
])
def test_no_room_knows_a_full_disk_in_either_words(error, why):
    assert (no_room(error) is None) if why is None else why in no_room(error)

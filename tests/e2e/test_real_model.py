"""The packaged real model (SmolLM2-135M-Instruct) on packaged real text, end to end on CPU."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from calibrate import calibrate, export
from calibrate.checkpoint.write import check_index, scales_file

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_out(smol_dir, kjv_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "out"
    return calibrate(str(smol_dir), [str(kjv_path)], str(out), seq_len=256, max_tokens=1024, progress=False, verify=False)


def test_every_layer_has_finite_positive_scales(smol_out):
    scales = load_file(scales_file(smol_out.out))
    assert len(smol_out.layers) == 30
    for layer in smol_out.layers:
        for kind in ("k", "v", "q"):
            value = scales[f"{layer.prefix}.{kind}_scale"]
            assert torch.isfinite(value).all() and (value > 0).all() and value.item() != 1.0
    check_index(smol_out.out)
    # Real K/V ranges on this model (docs/figures.md, "The demo model's K and V"): K absmax per layer 10.8-25.7, V 0.60-17.0.
    k = smol_out.stats.kinds["k"].absmax.amax(1)
    v = smol_out.stats.kinds["v"].absmax.amax(1)
    assert 3 < k.min() and k.max() < 40 and 0.1 < v.min() and v.max() < 30


def test_real_statistics_are_consistent(smol_out):
    stats = smol_out.stats
    for s in stats.kinds.values():
        dim = 64
        # Every element lands in exactly one histogram bin; the token histogram counts (token, head) rows.
        assert (s.hist.sum(-1) == stats.tokens[:, None] * dim).all()
        assert (s.token_hist.sum(-1) == stats.tokens[:, None]).all()
        assert (s.nonfinite == 0).all()
        # The position profile's maximum over buckets is the absmax.
        torch.testing.assert_close(s.pos_absmax.amax(-1), s.absmax, rtol=0, atol=0)
        assert math.isfinite(float(s.sumsq.sum()))


def test_reexport_gives_other_observers_without_the_model(smol_out, tmp_path):
    for observer in ("percentile:99.9", "mse", "sink-aware"):
        result = export(str(smol_out.out), str(tmp_path / observer.replace(":", "_")), observer=observer, granularity="head")
        prov = json.loads((result.out / "kvcal" / "calibration.json").read_text())
        assert prov["scales"]["observer"] == observer
        k = torch.tensor(prov["scales"]["scales"]["k"])
        assert k.shape == (30, 3) and (k > 0).all()
        # No observer picks more range than the data has.
        assert (k <= smol_out.stats.kinds["k"].absmax / 448 * (1 + 1e-6)).all()

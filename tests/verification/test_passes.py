"""verify's passes: the per-position KL against float64, and the reference's log-probabilities the reference pass
keeps for the engine against the model's own whole-sequence forward."""

import errno

import numpy as np
import pytest
import torch
from builders import tiny_model
from runners import QUIET

from calibrate.model.layers import attention_layers
from calibrate.verification import engine, engine_runs
from calibrate.verification.config import VerifyConfig
from calibrate.verification.passes import measure, token_kl


def _kl64(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref ‖ other) per position in float64, written as the definition: Σ p_ref (log p_ref − log p_other)."""
    ref_lp, lp = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return (ref_lp.exp() * (ref_lp - lp)).sum(-1)


@pytest.mark.parametrize("shift", [0.0, 0.5, 7.0])  # raw logits' normalisers differ between two runs
@pytest.mark.parametrize(("size", "rel"), [(1e-4, 5e-2), (0.05, 1e-4), (3.0, 1e-5)])  # a KL of ~4e-9, ~1e-3 and ~3.5
def test_token_kl_equals_the_float64_definition(shift, size, rel):
    gen = torch.Generator().manual_seed(0)
    ref = 4 * torch.randn(64, 4096, generator=gen)
    other = ref + size * torch.randn(64, 4096, generator=gen) + shift  # a constant shift changes no probability
    got = token_kl(ref, torch.softmax(ref, -1), other).double()
    want = _kl64(ref, other)
    assert ((got - want).abs() / want).max() < rel


def test_the_engines_figures_equal_float64_sums(tmp_path):
    """``engine.figures`` reads each run's array once for both comparisons: KL and top-1 against the unquantized run
    and the reference, and the mean NLL of the next tokens, each against float64 sums written out."""
    gen = torch.Generator().manual_seed(1)
    arrays = {}
    for name, size in (("reference", 0.0), ("auto", 0.02), ("run", 0.3)):
        base = arrays["reference"] if arrays else 3 * torch.randn(3, 50, 512, generator=gen)
        arrays[name] = torch.log_softmax(base + size * torch.randn(base.shape, generator=gen), -1)
        np.save(tmp_path / f"{name}.npy", arrays[name].numpy())
    on_disk = {name: np.load(tmp_path / f"{name}.npy", mmap_mode="r") for name in arrays}
    targets = torch.randint(0, 512, (3, 50), generator=gen)
    got = engine.figures(on_disk["run"], on_disk["auto"], on_disk["reference"], targets.numpy())
    run = arrays["run"]
    for side in ("auto", "reference"):
        base = arrays[side]
        assert got[f"kl_vs_{side}"] == pytest.approx(_kl64(base, run).mean(-1).tolist(), rel=2e-3)
        assert got[f"top1_vs_{side}"] == pytest.approx((base.argmax(-1) == run.argmax(-1)).double().mean(-1).tolist())
    assert got["nll"] == pytest.approx(-run.double().gather(-1, targets[..., None]).mean().item(), rel=1e-6)
    alone = engine.figures(on_disk["auto"], None, on_disk["reference"], None)
    assert alone["kl_vs_auto"] is None and alone["nll"] is None and alone["kl_vs_reference"] is not None


def test_the_reference_pass_keeps_the_models_own_log_probabilities(tmp_path, tiny_dir, text_file):
    """What the engine's runs are compared with: the chunked reference pass's log-probabilities, kept chunk by chunk,
    equal the model's own forward over each whole sequence."""
    model = tiny_model("llama")
    sequences = [torch.randint(0, model.config.vocab_size, (96,)) for _ in range(3)]
    config = VerifyConfig(str(tiny_dir), [str(text_file)], **QUIET)
    config.data.chunk_len = 40  # three chunks per sequence, the last short
    work = engine_runs.Scratch(tmp_path, len(sequences))
    measure(model, attention_layers(model), [], sequences, config, None, work.keep)
    kept = work.reference()
    assert kept.shape == (3, 95, model.config.vocab_size) and kept.dtype == np.float32
    with torch.no_grad():
        whole = torch.stack([torch.log_softmax(model(s[None]).logits[0, :-1].double(), -1) for s in sequences])
    assert np.abs(kept - whole.numpy()).max() < 1e-4


def test_a_full_disk_for_the_reference_is_one_line_and_the_pass_goes_on(tmp_path, tiny_dir, text_file, monkeypatch):
    def full(path, shape):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(engine_runs, "reserved_array", full)
    model = tiny_model("llama")
    sequences = [torch.randint(0, model.config.vocab_size, (48,)) for _ in range(2)]
    work = engine_runs.Scratch(tmp_path, len(sequences))
    _, _, nll, _ = measure(model, attention_layers(model), [], sequences,
                           VerifyConfig(str(tiny_dir), [str(text_file)], **QUIET), None, work.keep)
    assert len(nll) == 2 and all(np.isfinite(nll))  # the emulation's own figures are whole
    assert not work.path.exists()
    with pytest.raises(ValueError, match=r"writing the reference log-probabilities in .* failed: no space left on the "
                                         r"device; free space there"):
        work.reference()

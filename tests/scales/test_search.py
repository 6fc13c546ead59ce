"""scales/search.py: scales picked by attention-output error on held-back data, against a float64 search of our own."""

import json

import pytest
import torch
from builders import save_tiny_checkpoint
from references import ref_attention, ref_qdq
from runners import QUIET
from safetensors.torch import load_file
from transformers import AutoTokenizer

from calibrate import api, cli
from calibrate.capture.hooks import hooked_attention
from calibrate.capture.stats import Stats
from calibrate.choices import scheme_label
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences, read_digests
from calibrate.fp8 import FORMATS
from calibrate.layout import KVCAL_DIR, records_path
from calibrate.model.load import load_model
from calibrate.scales.observers import derive_scales
from calibrate.scales.search import CANDIDATES
from calibrate.verification.run import verify

SEQ_LEN, BUDGET = 64, 1024


def sharp_queries(model, tokenizer):
    """Queries 30× sharper in every layer: a random model's attention is nearly uniform, so K's error barely shows."""
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight *= 30.0


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tokenizer, data_file):
    root = tmp_path_factory.mktemp("output")
    save_tiny_checkpoint(root / "model", "llama", tokenizer, plant=sharp_queries)
    api.calibrate(str(root / "model"), [str(data_file)], str(root / "out"), seq_len=SEQ_LEN, max_tokens=BUDGET,
                  observer="output", verify=False, **QUIET)
    return root / "out"


def held_back(ckpt, data_file) -> list[torch.Tensor]:
    """The data without the records the calibration read (OUT's records.txt): what the search must have run on."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    stream = iter_sequences(DataConfig([str(data_file)], seq_len=SEQ_LEN, max_tokens=4 * SEQ_LEN), tok,
                            exclude=read_digests(records_path(ckpt)))
    return list(stream)


def test_each_layer_gets_the_candidate_with_the_least_attention_output_error(searched, data_file):
    provenance = json.loads((searched / KVCAL_DIR / "calibration.json").read_text())
    search = provenance["output_observer"]
    assert search["candidates"] == list(CANDIDATES) and search["sequences"] == 4
    stats = Stats.load(searched / KVCAL_DIR / "stats.safetensors")
    fmt = FORMATS["e4m3fn"]
    candidates = [derive_scales(stats.kinds, observer=name, granularity="tensor", fmt=fmt).scales for name in CANDIDATES]
    # Independent: every layer's q, k, v on the held-back sequences, attention and FP8 rounding in float64.
    model, _ = load_model(searched, device=torch.device("cpu"))
    seen = {}

    def record(module, q, k, v, mask, base, **kw):
        seen.setdefault(module.layer_idx, []).append((q, k, v, kw["scaling"]))
        return base(module, q, k, v, mask, **kw)

    with torch.no_grad(), hooked_attention(model, record):
        for seq in held_back(searched, data_file):
            model(input_ids=seq[None])
    written = {}
    for path in searched.glob("*.safetensors"):
        written |= load_file(path)
    differs = 0
    for row, layer in enumerate(sorted(seen)):
        for kind in ("k", "v"):
            err = torch.zeros(len(CANDIDATES), dtype=torch.float64)
            ref_sq = 0.0
            for q, k, v, scaling in seen[layer]:
                ref = ref_attention(q, k, v, scaling)
                ref_sq += ref.square().sum().item()
                for c, scales in enumerate(candidates):
                    s = scales[kind][row]
                    o = ref_attention(q, ref_qdq(k, s), v, scaling) if kind == "k" else ref_attention(q, k, ref_qdq(v, s), scaling)
                    err[c] += (o - ref).square().sum()
            rel = (err / ref_sq).sqrt()
            assert search[kind]["rel_error"][row] == pytest.approx(rel.tolist(), rel=1e-3)
            chosen = CANDIDATES.index(search[kind]["chosen"][row])
            assert rel[chosen] <= rel.min() * (1 + 1e-3)  # the least, up to a near-tie in float32 attention
            scale = written[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert scale.item() == candidates[chosen][kind][row].item()
            differs += chosen != 0
    assert differs > 0  # on this model some layer prefers a candidate other than max: the search decided something


def test_verify_sets_the_searched_scales_beside_max_and_mse(searched, data_file):
    result = verify(searched, str(data_file), schemes="tensor,max,mse", seq_len=SEQ_LEN, max_tokens=4 * SEQ_LEN,
                    seed=3, kv_only=True, probe_layers=0, **QUIET)
    assert list(result.schemes) == ["tensor", "max", "mse"]
    assert result.schemes["max"]["source"] == "the max observer on the checkpoint's kvcal statistics"
    lines = result.report["recommendation"]
    tensor = scheme_label("tensor")  # the lines name schemes as a user types them (choices.SCHEMES' labels)
    assert any(line.startswith(f"{tensor} vs {scheme_label('max')}: KL") for line in lines)
    assert any(line.startswith(f"{tensor} vs {scheme_label('mse')}: KL") for line in lines)


def test_output_needs_the_model_and_held_back_data(searched, tokenizer, data_file, tmp_path, capsys):
    assert cli.main(["export", str(searched), "--out", str(tmp_path / "e"), "--observer", "output"]) == 2
    assert "the output observer runs the model on held-back data" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    save_tiny_checkpoint(tmp_path / "model", "llama", tokenizer)
    with pytest.raises(ValueError, match="needs held-back sequences to search on.*add records beyond --max-tokens"):
        api.calibrate(str(tmp_path / "model"), [str(data_file)], str(tmp_path / "out"), seq_len=SEQ_LEN, max_tokens=10**6,
                      observer="output", verify=False, **QUIET)
    assert not (tmp_path / "out").exists()

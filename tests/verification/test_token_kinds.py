"""verification/token_kinds.py (KL by kind of token): against an independent float64 recomputation on a chat and a JSON
fixture, and the much-worse rule against hand computations."""

import json

import numpy as np
import pytest
import torch
from builders import report_dict, tiny_config
from references import ref_qdq
from runners import QUIET
from transformers import AutoModelForCausalLM

from calibrate.capture.hooks import hooked_attention
from calibrate.data import kinds
from calibrate.data.config import DataConfig
from calibrate.data.stream import Layout, iter_sequences
from calibrate.fp8 import FORMATS
from calibrate.model.layers import attention_layers
from calibrate.verification import token_kinds
from calibrate.verification.config import VerifyConfig
from calibrate.verification.passes import measure
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.run import _evidence_reasons
from calibrate.verification.schemes import Mode, Scheme

E4M3 = FORMATS["e4m3fn"]
SCALE = 0.02
# Tiny fixtures: chats with every role and a JSON answer; JSON records and prose with a code fence.
CHATS = [[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": f"Count to {i}."},
          {"role": "assistant", "content": json.dumps({"numbers": list(range(i))})}] for i in range(2, 8)]
TEXTS = [json.dumps({"id": i, "name": f"thing {i}", "ok": i % 2 == 0}) for i in range(6)] + [
    f"Run this:\n```\nprint({i})\n```\nthen stop." for i in range(6)]


def code(role: str | None = None, form: str | None = None) -> int:
    return (kinds.ROLES.index(role) + 1 if role else 0) | ((kinds.FORMS.index(form) + 1) << kinds.FORM_SHIFT if form else 0)


@pytest.mark.slow  # about 35 s on a loaded 2-core machine: a 49K-vocabulary model's passes and whole-sequence forwards
def test_kind_kls_weighted_by_tokens_give_back_the_kl_of_the_same_tokens(tmp_path, smol_tokenizer):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    stream = iter_sequences(DataConfig(sources=[str(tmp_path / "chat.jsonl"), str(tmp_path / "text.jsonl")], seq_len=96,
                                       max_tokens=96 * 6), smol_tokenizer, layouts=True)
    sequences, layouts = list(stream), stream.layouts()
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.vocab_size = len(smol_tokenizer)
    model = AutoModelForCausalLM.from_config(config).eval()
    layers = attention_layers(model)
    heads = {"k": config.num_key_value_heads, "v": config.num_key_value_heads, "q": config.num_attention_heads}
    scheme = Scheme("tensor", Mode.STATIC, "test", E4M3, "tensor", {k: torch.full((len(layers), h), SCALE) for k, h in heads.items()}, True)
    verify_config = VerifyConfig("unused", ["unused"], **QUIET)
    verify_config.data.chunk_len = 40
    tally = measure(model, layers, [scheme], sequences, verify_config, None)[0]["tensor"]
    got = token_kinds.by_kind(tally.token_kl, tally.token_top1, layouts)
    assert set(got) == {"role", "form"} and {"system", "user", "assistant", "template"} <= set(got["role"]["kinds"])
    assert set(got["form"]["kinds"]) == {"prose", "json", "code"}

    def quantize_all(module, q, k, v, mask, base, **kw):
        return base(module, ref_qdq(q, SCALE), ref_qdq(k, SCALE), ref_qdq(v, SCALE), mask, **kw)

    rows = []  # the independent per-token KL, float64, from whole-sequence forwards
    with torch.no_grad():
        for seq in sequences:
            ref = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)
            with hooked_attention(model, quantize_all):
                lp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1].double(), -1)
            rows.append((ref.exp() * (ref - lp)).sum(-1))
    x = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=float("nan")).numpy()  # [S, P]
    predicted = np.zeros(x.shape, dtype=np.uint8)  # the kind of each position's next token; none past a shorter end
    for row, layout in zip(predicted, layouts):
        row[: len(layout.kind) - 1] = layout.kind[1:].numpy()
    for classification, name_of in (("role", kinds.role_of), ("form", kinds.form_of)):
        labelled = np.vectorize(lambda c, f=name_of: f(int(c)) is not None)(predicted)
        c = got[classification]
        assert c["labelled_tokens"] == labelled.sum()
        weighted = sum(k["tokens"] * k["kl"] for k in c["kinds"].values()) / sum(k["tokens"] for k in c["kinds"].values())
        assert weighted == pytest.approx(x[labelled].mean(), rel=2e-2)
        for name, k in c["kinds"].items():
            mine = np.vectorize(lambda v, f=name_of, n=name: f(int(v)) == n)(predicted)
            assert k["tokens"] == mine.sum() and k["kl"] == pytest.approx(x[mine].mean(), rel=5e-2)


def synthetic(json_factor: float, json_tokens: int, sequences: int = 4, positions: int = 400, seed: int = 0):
    """Sequences whose first ``json_tokens`` predicted tokens are JSON, the rest prose; JSON KL × ``json_factor``."""
    rng = np.random.default_rng(seed)
    kl = rng.lognormal(-8, 0.5, size=(sequences, positions))
    kl[:, :json_tokens] *= json_factor
    kind = torch.full((positions + 1,), code(form="prose"), dtype=torch.uint8)
    kind[1 : json_tokens + 1] = code(form="json")
    layouts = [Layout(torch.zeros(positions + 1, dtype=torch.long), kind.clone()) for _ in range(sequences)]
    return torch.from_numpy(kl).float(), layouts


def test_a_much_worse_kind_needs_twice_the_rest_fifty_tokens_and_two_standard_errors():
    kl, layouts = synthetic(3.0, 40)  # 4 × 40 = 160 JSON tokens at 3× prose
    got = token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)["form"]
    x = kl.double().numpy()
    vs = got["kinds"]["json"]["vs_rest"]
    diffs = x[:, :40].mean(1) - x[:, 40:].mean(1)  # by hand, per sequence
    assert vs["ratio"] == pytest.approx(x[:, :40].mean() / x[:, 40:].mean(), rel=1e-9)
    assert vs["difference"] == pytest.approx(diffs.mean(), rel=1e-9)
    assert vs["stderr"] == pytest.approx(diffs.std(ddof=1) / 2, rel=1e-9)
    assert got["much_worse"] == ["json"] and not got["kinds"]["prose"]["vs_rest"]["much_worse"]
    small = token_kinds.by_kind(*synthetic(3.0, 12)[:1], torch.ones(4, 400, dtype=torch.bool), synthetic(3.0, 12)[1])
    assert small["form"]["kinds"]["json"]["tokens"] == 48 and small["form"]["much_worse"] == []  # under 50 tokens
    kl, layouts = synthetic(1.5, 40)
    assert token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)["form"]["much_worse"] == []  # under 2×


def test_the_report_and_the_reasons_name_a_much_worse_kind():
    kl, layouts = synthetic(3.0, 40)
    result = token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)
    reasons = _evidence_reasons({"token_kinds": result, "depth": None})
    assert len(reasons) == 1 and reasons[0].startswith("json tokens' KL is ") and "(160 tokens)" in reasons[0]
    rep = report_dict()
    rep["schemes"]["tensor"]["token_kinds"] = result
    rep["token_kinds"] = {"rule": token_kinds.rule()}
    section = verify_markdown(rep, {}).split("## KL by kind of token", 1)[1].split("\n## ", 1)[0]
    assert "| fp8, calibrated per tensor | form | json | 160 |" in section and "**much worse**" in section
    assert "## KL by kind of token" not in verify_markdown(report_dict(), {})

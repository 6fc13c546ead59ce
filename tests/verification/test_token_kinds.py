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
from calibrate.verification.judgment import evidence_reasons
from calibrate.verification.passes import measure
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.schemes import Mode, Scheme
from calibrate.verification.significance import critical_value

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


def test_under_two_sequences_it_is_too_few_to_tell():
    kl, layouts = synthetic(3.0, 100, sequences=1)
    vs = token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)["form"]["kinds"]["json"]["vs_rest"]
    assert not vs["much_worse"] and vs["too_few"] == "too few sequences to tell (1 of the 2 this rule needs)"
    rep = report_dict()
    rep["schemes"]["tensor"]["token_kinds"] = token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)
    rep["token_kinds"] = {"rule": token_kinds.rule()}
    assert "(too few sequences to tell (1 of the 2 this rule needs)) |" in verify_markdown(rep, {})
    assert "over ≥ 2 sequences holding both (fewer: too few sequences to tell)" in token_kinds.rule()


# ---- simulation: how often a kind is called much worse that is not ---------------------------------------------------

TRIALS = 1000
ALLOWANCE = 3 * np.sqrt(0.05 * 0.95 / TRIALS)  # 3 binomial standard errors of a 5% rate over TRIALS: 0.0207


def _much_worse(n: int, factor: float, seed: int, trials: int = TRIALS) -> tuple[float, float]:
    """Over ``trials`` samples of ``n`` sequences of 200 positions, 60 of them JSON whose per-token KL is truly ``factor`` ×
    prose's (log-normal σ 1.5, each sequence's level log-normal σ 1): how often the rule calls JSON much worse, and how
    often the rule it replaces did (the kind's minus the rest's significant, from the same figures)."""
    rng = np.random.default_rng(seed)
    kind = torch.full((201,), code(form="prose"), dtype=torch.uint8)
    kind[1:61] = code(form="json")
    layouts = [Layout(torch.zeros(201, dtype=torch.long), kind) for _ in range(n)]
    calls = old = 0
    for _ in range(trials):
        kl = rng.lognormal(0, 1.0, (n, 1)) * rng.lognormal(-8, 1.5, (n, 200))
        kl[:, :60] *= factor
        json = token_kinds.by_kind(torch.from_numpy(kl), torch.ones(n, 200, dtype=torch.bool), layouts)["form"]["kinds"]["json"]
        vs = json["vs_rest"]
        calls += vs["much_worse"]
        old += (vs["ratio"] >= token_kinds.RATIO and vs["stderr"] is not None and vs["difference"] > 0
                and abs(vs["difference"]) > critical_value(n) * vs["stderr"])
    return calls / trials, old / trials


@pytest.mark.parametrize("n", [pytest.param(n, id=f"{n}-sequences") for n in (1, 2, 3, 16)])
def test_at_most_five_percent_false_much_worse(n):
    """JSON truly exactly 2× prose, the rule's own limit: called much worse at most 1 time in 20."""
    assert _much_worse(n, token_kinds.RATIO, seed=n)[0] <= 0.05 + ALLOWANCE


def test_at_sixteen_sequences_a_much_worse_kind_is_found_and_the_old_rule_over_claimed():
    assert _much_worse(16, 4.0, seed=99, trials=300)[0] >= 0.8  # 89% over 1,000
    assert _much_worse(16, token_kinds.RATIO, seed=16, trials=300)[1] > 0.3  # testing against zero: 42% at the limit


def test_the_report_and_the_reasons_name_a_much_worse_kind():
    kl, layouts = synthetic(3.0, 40)
    result = token_kinds.by_kind(kl, torch.ones(kl.shape, dtype=torch.bool), layouts)
    reasons = evidence_reasons({"token_kinds": result, "depth": None})
    assert len(reasons) == 1 and reasons[0].startswith("json tokens' KL is ") and "(160 tokens)" in reasons[0]
    rep = report_dict()
    rep["schemes"]["tensor"]["token_kinds"] = result
    rep["token_kinds"] = {"rule": token_kinds.rule()}
    section = verify_markdown(rep, {}).split("## KL by kind of token", 1)[1].split("\n## ", 1)[0]
    assert "| fp8, calibrated per tensor | form | json | 160 |" in section and "**much worse**" in section
    assert "## KL by kind of token" not in verify_markdown(report_dict(), {})

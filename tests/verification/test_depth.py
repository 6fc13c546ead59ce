"""verification/depth.py (KL by real context depth) against hand computations in numpy, and through a whole verify."""

import json

import numpy as np
import pytest
import torch
from builders import report_dict
from runners import QUIET

from calibrate.data.stream import Layout
from calibrate.verification import depth
from calibrate.verification.report import verify_text
from calibrate.verification.report_md import verify_markdown
from calibrate.verification.run import verify
from calibrate.verification.verdict_table import depth_lines


def layout(lengths: list[int], bos: bool = True) -> Layout:
    """A packed sequence of records of these lengths (EOS counted in), after a BOS when ``bos``."""
    record = [-1] * bos + [n for n, length in enumerate(lengths) for _ in range(length)]
    return Layout(torch.tensor(record), torch.zeros(len(record), dtype=torch.uint8))


def test_buckets_grow_fourfold_and_stop_at_the_sample():
    assert depth.buckets(2047) == [(0, 128), (128, 512), (512, 2047)]
    assert depth.buckets(32767) == [(0, 128), (128, 512), (512, 2048), (2048, 8192), (8192, 32767)]
    assert depth.buckets(100) == [(0, 100)]
    assert [depth.label(*b) for b in depth.buckets(32768)] == ["0–127", "128–511", "512–2K", "2K–8K", "8K–32K"]


def test_buckets_use_only_records_that_cover_them_and_packed_positions_apart():
    P = 600  # positions measured: sequences of 601 tokens
    lengths = [[601], [601], [300, 301], [100, 501], [601]]  # leading records of 601, 601, 300, 100 and 601 tokens
    layouts = [layout(ls, bos=False) for ls in lengths]
    rng = np.random.default_rng(0)
    kl = torch.from_numpy(rng.lognormal(-8, 1, size=(5, P))).float()
    kl[2, 128:300] = 1e3  # the 300-token record's deep part: never in the 128–511 bucket, which it does not cover
    top1 = torch.from_numpy(rng.random((5, P)) < 0.9)
    got = depth.by_depth(kl, top1, layouts)
    x, a = kl.double().numpy(), top1.numpy()
    ends = [600, 600, 300, 100, 600]
    expect = {(0, 128): [0, 1, 2, 4], (128, 512): [0, 1, 4], (512, 600): [0, 1, 4]}
    assert [(b["start"], b["end"]) for b in got["buckets"]] == list(expect)
    for b in got["buckets"]:
        rows = expect[(b["start"], b["end"])]
        assert b["sequences"] == len(rows) and b["tokens"] == len(rows) * (b["end"] - b["start"])
        assert b["kl"] == pytest.approx(x[rows, b["start"]:b["end"]].mean(), rel=1e-12)
        assert b["top1"] == pytest.approx(a[rows, b["start"]:b["end"]].mean(), rel=1e-12)
    assert got["buckets"][1]["kl"] < 1  # the 1e3 tokens of the short record stayed out
    assert got["excluded_tokens"] == (300 - 128) + (100 - 0)  # leading-record positions no bucket covered
    packed = {(p["start"], p["end"]): p for p in got["packed"]}
    for (lo, hi), p in packed.items():
        mask = np.array([[lo <= j < hi and j >= ends[i] for j in range(P)] for i in range(5)])
        assert p["tokens"] == mask.sum() and p["kl"] == pytest.approx(x[mask].mean(), rel=1e-12)
    # Weighted by their token counts, the buckets and the packed positions give back the mean KL of the same tokens.
    counted = np.zeros((5, P), dtype=bool)
    for (lo, hi), rows in expect.items():
        counted[rows, lo:hi] = True
    counted |= np.array([[j >= ends[i] for j in range(P)] for i in range(5)])
    rows = got["buckets"] + got["packed"]
    assert sum(r["tokens"] * r["kl"] for r in rows) / sum(r["tokens"] for r in rows) == pytest.approx(x[counted].mean(), rel=1e-12)
    assert sum(r["tokens"] for r in rows) + got["excluded_tokens"] == 5 * P


def test_the_trend_is_last_bucket_minus_first_paired_by_sequence():
    P = 1000
    rng = np.random.default_rng(1)
    kl = rng.lognormal(-8, 0.3, size=(6, P))
    kl[:, 512:] *= np.linspace(2, 4, 6)[:, None]  # deeper positions worse, by a different factor per sequence
    layouts = [layout([1001], bos=True) for _ in range(5)] + [layout([200, 801])]  # the last reaches only the first bucket
    got = depth.by_depth(torch.from_numpy(kl).float(), torch.ones(6, P, dtype=torch.bool), layouts)
    x = torch.from_numpy(kl).float().double().numpy()
    diffs = x[:5, 512:1000].mean(1) - x[:5, 0:128].mean(1)  # by hand: the five sequences that reach the last bucket
    t = got["trend"]
    assert (t["first"], t["last"], t["sequences"]) == ("0–127", "512–999", 5)
    assert t["difference"] == pytest.approx(diffs.mean(), rel=1e-9)
    assert t["stderr"] == pytest.approx(diffs.std(ddof=1) / np.sqrt(5), rel=1e-9)
    assert t["verdict"] == "grows" and "grows with depth" in depth.trend_text(got)
    flat = depth.by_depth(torch.from_numpy(rng.lognormal(-8, 0.3, size=(6, P))).float(), torch.ones(6, P, dtype=torch.bool), layouts)
    assert flat["trend"]["verdict"] == "flat"
    assert depth.by_depth(torch.from_numpy(-kl + 1).float(), torch.ones(6, P, dtype=torch.bool), layouts)["trend"]["verdict"] == "shrinks"


def test_a_shorter_last_sequence_counts_only_its_own_positions():
    kl = torch.rand(2, 300)
    kl[1, 201:] = float("nan")  # padding past the second sequence's end (BOS + 201 tokens: 201 positions)
    got = depth.by_depth(kl, torch.ones(2, 300, dtype=torch.bool), [layout([301]), layout([50, 151])])
    assert got["packed"] and all(p["kl"] == p["kl"] for p in got["packed"])  # no NaN
    assert sum(p["tokens"] for p in got["packed"]) == 201 - 51  # after BOS and the 50-token record
    assert got["excluded_tokens"] == 51  # the second's leading record, shorter than the first bucket


def test_no_trend_without_two_records_reaching_a_second_bucket():
    kl, top1 = torch.rand(3, 300), torch.ones(3, 300, dtype=torch.bool)
    got = depth.by_depth(kl, top1, [layout([301]), layout([100, 201]), layout([50, 251])])
    why = "too few sequences to tell: the trend needs 2 sequences whose leading record reaches position 300, the sample has 1"
    assert got["trend"]["verdict"] is None and got["trend"]["why"] == why and depth.trend_text(got) == why
    short = depth.by_depth(torch.rand(2, 100), torch.ones(2, 100, dtype=torch.bool), [layout([101]), layout([101])])
    assert depth.trend_text(short) == "not measured: the sample's sequences hold one depth bucket"


TRIALS = 2000
ALLOWANCE = 3 * np.sqrt(0.05 * 0.95 / TRIALS)  # 3 binomial standard errors of a 5% rate over TRIALS: 0.0146


def _trend_calls(n: int, deeper: float, seed: int) -> dict[str, float]:
    """How often ``depth.trend`` says each verdict over TRIALS samples of ``n`` sequences 600 positions long (buckets
    0–127, 128–511, 512–599), whose per-token KL is log-normal (σ 1.5, a sequence's level log-normal σ 1 across
    sequences) and ``deeper`` × as large in the deepest bucket (1: no trend). Bucket means by numpy, handed to trend as
    by_depth hands them."""
    rng = np.random.default_rng(seed)
    calls = {"grows": 0, "shrinks": 0, "flat": 0, None: 0}
    ends = torch.full((n,), 600)
    for _ in range(TRIALS):
        kl = rng.lognormal(0, 1.0, (n, 1)) * rng.lognormal(-8, 1.5, (n, 600))
        kl[:, 512:] *= deeper
        rows = [{"label": depth.label(a, b), "end": b, "sequences": n, "kl_per_sequence": kl[:, a:b].mean(1).tolist()}
                for a, b in depth.buckets(600)]
        calls[depth.trend(rows, ends)["verdict"]] += 1
    return {k: v / TRIALS for k, v in calls.items()}


@pytest.mark.parametrize("n", [pytest.param(n, id=f"{n}-sequences") for n in (1, 2, 3, 16)])
def test_at_most_five_percent_false_trends(n):
    calls = _trend_calls(n, 1.0, seed=n)
    assert calls["grows"] + calls["shrinks"] <= 0.05 + ALLOWANCE
    assert (calls[None] == 1.0) == (n < depth.MIN_SEQUENCES)  # one sequence: too few to tell, every time


def test_at_sixteen_sequences_a_real_trend_is_found():
    assert _trend_calls(16, 2.0, seed=99)["grows"] >= 0.8


def test_the_report_shows_buckets_packed_positions_and_one_trend_line_per_scheme():
    rep = report_dict()
    layouts = [layout([700]) for _ in range(3)] + [layout([50, 650])]
    for i, name in enumerate(("tensor", "scale1", "token")):
        rep["schemes"][name]["depth"] = depth.by_depth(torch.rand(4, 699) * (i + 1), torch.ones(4, 699, dtype=torch.bool), layouts)
    rep["depth"] = {"rule": depth.rule()}
    text = verify_text(rep, verbose=True)
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("depth, ")] == [
        "depth, fp8, calibrated per tensor", "depth, fp8, scale 1.0", "depth, fp8_per_token_head"]
    assert not any(line.startswith("depth, ") for line in verify_text(rep).splitlines())  # --verbose and report.md only
    section = verify_markdown(rep, {"depth": "kl_by_depth.png"}).split("## KL by context depth", 1)[1].split("\n## ", 1)[0]
    assert "![KL by depth](kl_by_depth.png)" in section and "**Packed positions**" in section
    assert "| fp8, calibrated per tensor | 512–698 | 3 | 561 |" in section
    assert all(f"- {line}" in section for line in depth_lines(rep))
    assert "## KL by context depth" not in verify_markdown(report_dict(), {})  # an older report: no section


@pytest.mark.slow  # about 70 s on a loaded 2-core machine: six sequences of a 49K-vocabulary model, three passes
def test_verify_reports_depth_on_long_records(tmp_path, tiny_dir, kjv_path):
    """Records long enough for three buckets (chapters of Genesis, one record each), packed."""
    chapters: dict[int, list[str]] = {}
    with open(kjv_path) as f:
        for line in f:
            verse = json.loads(line)
            if verse["chapter"] > 12:
                break
            chapters.setdefault(verse["chapter"], []).append(verse["text"])
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(v)}) + "\n" for v in chapters.values()))
    result = verify(str(tiny_dir), str(data), schemes="token", seq_len=600, max_tokens=600 * 6, probe_layers=0, generate=0,
                    report_dir=str(tmp_path / "r"), **QUIET)
    d = result.schemes["token"]["depth"]
    assert [b["label"] for b in d["buckets"]] == ["0–127", "128–511", "512–598"]
    assert d["buckets"][-1]["sequences"] >= 2 and d["trend"]["verdict"] in ("grows", "flat", "shrinks")
    assert result.report["floor"]["depth"]["buckets"][0]["tokens"] > 0 and d["packed"]
    assert (tmp_path / "r" / "kl_by_depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## KL by context depth" in (tmp_path / "r" / "report.md").read_text()
    assert "depth, fp8_per_token_head: KL" in result.summary(verbose=True)

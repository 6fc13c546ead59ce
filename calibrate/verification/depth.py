"""KL by real context depth: does a quantized cache hurt more the further back a token has to read?

A packed sample puts short records one after another, so a late position of a sequence is often an early position of
an unrelated record: its depth in the sequence is not context it uses. Here a position's depth counts only inside the
record the sequence starts with (its *leading record*: the one the first token after any BOS belongs to; a record
split over sequences leads the next one with its remaining tokens), and a bucket of depths is measured only over the
sequences whose leading record covers the whole bucket, so every bucket sees the same kind of text and the deepest
bucket's sequences are also in the first. The positions after the leading record ends are reported apart, as
*packed*: by their position in the sequence, which is not their context.

Position p of a sequence reads tokens 0..p and predicts token p + 1; its depth is p, and it belongs to the record of
token p (a record's closing EOS is its own).

The trend: the mean KL of the deepest bucket that at least ``MIN_SEQUENCES`` sequences reach, minus that of the first
bucket, paired by sequence (the same sequences, each its own difference): *grows* or *shrinks* when the difference is
significant (``significance.significant``: Student's t, two-sided 5%), else *flat*; under ``MIN_SEQUENCES`` in every
deeper bucket, too few sequences to tell. Per-token KL at any depth is heavy-tailed, and the first bucket's mean
(128 positions) is noisier than a deeper one's, but on a depth that changes nothing the rule calls a trend at most 1
time in 20 from 2 sequences on (tests/verification/test_depth.py simulates it).

Plain numbers in, numbers out: nothing here runs a model.
"""

import torch

from ..data.stream import Layout

# MIN_SEQUENCES: what a bucket needs for the trend
from .significance import MIN_SEQUENCES, RULE, TOO_FEW, mean_stderr, significant

FIRST_END = 128  # the first bucket is positions 0-127
GROWTH = 4  # each next bucket ends GROWTH times further: 512, 2048, 8192, 32768...


def buckets(positions: int) -> list[tuple[int, int]]:
    """[start, end) buckets of positions 0..positions-1: 0-127, 128-511, 512-2047, ..., the last cut at ``positions``."""
    out, start, end = [], 0, FIRST_END
    while start < positions:
        out.append((start, min(end, positions)))
        start, end = end, end * GROWTH
    return out


def label(start: int, end: int) -> str:
    """A bucket as people write it: 0–127, 2K–8K (K = 1024 where it divides evenly)."""
    def n(x: int) -> str:
        return f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x)

    return f"{n(start)}–{n(end - 1) if end < 1024 or end % 1024 else n(end)}"


def leading_end(record: torch.Tensor, positions: int) -> int:
    """How many of the first ``positions`` positions read the leading record (a BOS before it included)."""
    r = record[:positions]
    own = r[r >= 0]
    if not own.numel():
        return positions
    other = ((r >= 0) & (r != own[0])).nonzero()
    return int(other[0]) if other.numel() else positions


def _stats(kl: torch.Tensor, top1: torch.Tensor) -> dict:
    """Mean KL and top-1 agreement over some tokens (float64), with their count."""
    n = kl.numel()
    return {"tokens": n, "kl": kl.double().mean().item() if n else None, "top1": top1.double().mean().item() if n else None}


def by_depth(token_kl: torch.Tensor, token_top1: torch.Tensor, layouts: list[Layout]) -> dict:
    """One scheme's KL and top-1 by depth.

    Args:
        token_kl, token_top1: per position [sequences, positions] (``passes.Tally``; a shorter sequence padded past
            its end, which no figure counts).
        layouts: each sequence's ``Layout`` (the data stage's).

    Returns:
        {"buckets": per bucket {"start", "end", "label", "sequences", "tokens", "kl", "top1", "kl_per_sequence"} over the
        leading records that cover it; "packed": per bucket the positions after the leading record ends, with the same
        figures but no per-sequence values; "excluded_tokens": leading-record positions in no bucket (the record ends
        inside it); "trend": ``trend``}.
    """
    positions = token_kl.shape[1]
    lengths = torch.tensor([min(positions, layout.record.numel() - 1) for layout in layouts])  # [S] positions measured
    ends = torch.tensor([leading_end(layout.record, n) for layout, n in zip(layouts, lengths.tolist())])  # [S]
    rows, packed = [], []
    covered = torch.zeros(token_kl.shape, dtype=torch.bool)
    for start, end in buckets(positions):
        reach = (ends >= end).nonzero().flatten()  # sequences whose leading record covers the bucket
        kl, top1 = token_kl[reach, start:end], token_top1[reach, start:end]
        covered[reach, start:end] = True
        rows.append({"start": start, "end": end, "label": label(start, end), "sequences": len(reach), **_stats(kl, top1),
                     "kl_per_sequence": kl.double().mean(1).tolist()})
        j = torch.arange(start, end)[None, :]
        after = (j >= ends[:, None]) & (j < lengths[:, None])  # [S, w] positions past the leading record
        packed.append({"start": start, "end": end, "label": label(start, end), "sequences": int(after.any(1).sum()),
                       **_stats(token_kl[:, start:end][after], token_top1[:, start:end][after])})
    lead = torch.arange(positions)[None, :] < ends[:, None]
    return {"buckets": rows, "packed": [p for p in packed if p["tokens"]], "excluded_tokens": int((lead & ~covered).sum()),
            "trend": trend(rows, ends)}


def trend(rows: list[dict], ends: torch.Tensor) -> dict:
    """Last bucket minus first, paired by sequence: {"first", "last" (bucket labels), "sequences", "difference",
    "stderr", "verdict": grows | shrinks | flat | None, "why" when None (the line said instead)}."""
    deep = [i for i, row in enumerate(rows) if i > 0 and row["sequences"] >= MIN_SEQUENCES]
    if not deep:
        why = ("not measured: the sample's sequences hold one depth bucket" if len(rows) < 2 else
               f"{TOO_FEW}: the trend needs {MIN_SEQUENCES} sequences whose leading record reaches position "
               f"{rows[1]['end']}, the sample has {rows[1]['sequences']}")
        return {"first": rows[0]["label"] if rows else None, "last": None, "sequences": 0, "difference": None,
                "stderr": None, "verdict": None, "why": why}
    first, last = rows[0], rows[deep[-1]]
    reach_first = (ends >= first["end"]).nonzero().flatten().tolist()
    reach_last = set((ends >= last["end"]).nonzero().flatten().tolist())
    base = {s: v for s, v in zip(reach_first, first["kl_per_sequence"])}
    diffs = [v - base[s] for s, v in zip(sorted(reach_last), last["kl_per_sequence"])]
    mean, se = mean_stderr(diffs)
    verdict = ("grows" if mean > 0 else "shrinks") if significant(mean, se, len(diffs)) else "flat"
    return {"first": first["label"], "last": last["label"], "sequences": len(diffs), "difference": mean, "stderr": se,
            "verdict": verdict}


def trend_text(d: dict) -> str:
    """One scheme's depth trend in one line: the first and last bucket's KL, the paired difference, the verdict."""
    t = d["trend"]
    if t["verdict"] is None:
        return t["why"]
    rows = {row["label"]: row for row in d["buckets"]}
    first, last = rows[t["first"]], rows[t["last"]]
    words = {"grows": "grows with depth", "shrinks": "shrinks with depth", "flat": "no trend beyond noise"}[t["verdict"]]
    return (f"KL {first['kl']:.3g} at {t['first']} → {last['kl']:.3g} at {t['last']}; paired over {t['sequences']} "
            f"records {t['difference']:+.3g} ± {t['stderr']:.2g}: {words}")


def rule() -> str:
    """The depth rule in words a user reads."""
    return (f"KL of positions inside the record a sequence starts with, in buckets from 0–{FIRST_END - 1} growing "
            f"{GROWTH}× each, a bucket only over records that cover it; the trend is the deepest bucket (with ≥ "
            f"{MIN_SEQUENCES} records; with fewer, {TOO_FEW}) minus the first, paired by record, judged by {RULE}")

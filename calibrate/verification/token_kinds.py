"""KL by kind of token, where the data says what its tokens are: chat roles, and JSON or code against prose.

The kinds come from the data stage (``data/kinds.py``, carried through packing in each sequence's ``Layout``). A
position is counted under the kind of the token it predicts (position p predicts token p + 1): what goes wrong in a
JSON answer is a JSON token predicted wrongly. Two classifications, each over the tokens that have a label in it:
*role* (system, user, assistant, tool, other, template, reasoning; chat records only) and *form* (prose, json, code).

A kind is *much worse* when its mean KL is at least ``RATIO`` times that of the rest of its classification, it holds
at least ``MIN_TOKENS`` tokens, and that it is at least ``RATIO`` times worse is shown over the sequences: the kind's
mean minus ``RATIO`` × the rest's, within each sequence that holds both, averaged over those sequences, is above zero
and significant (``significance.significant``: Student's t, two-sided 5%). Testing only that the kind is worse at all
called a kind truly exactly 2× the rest "much worse" 42% of the time at 16 sequences (simulated,
tests/verification/test_token_kinds.py); this test, 1% or less at 1 to 16. Under ``significance.MIN_SEQUENCES`` such
sequences: too few sequences to tell.

Plain numbers in, numbers out: nothing here runs a model.
"""

import torch

from ..data.kinds import FORM_SHIFT, FORMS, ROLES
from ..data.stream import Layout
from .significance import MIN_SEQUENCES, RULE, TOO_FEW, mean_stderr, significant, too_few

RATIO = 2.0  # a kind's KL over the rest's for it to be much worse
MIN_TOKENS = 50  # tokens a kind needs to be judged
CLASSIFICATIONS = {"role": ROLES, "form": FORMS}


def kind_index(codes: torch.Tensor, classification: str) -> torch.Tensor:
    """Each token's kind in ``classification`` as an index into its names, -1 where it has none ([...] int64)."""
    codes = codes.long()
    raw = codes & ((1 << FORM_SHIFT) - 1) if classification == "role" else codes >> FORM_SHIFT
    return raw - 1


def targets(layouts: list[Layout], positions: int) -> torch.Tensor:
    """The kinds code of the token each position predicts, [sequences, positions] uint8 (0 past a shorter sequence's end,
    where the per-token KL is NaN padding)."""
    out = torch.zeros(len(layouts), positions, dtype=torch.uint8)
    for row, layout in zip(out, layouts):
        codes = layout.kind[1 : positions + 1]
        row[: len(codes)] = codes
    return out


def by_kind(token_kl: torch.Tensor, token_top1: torch.Tensor, layouts: list[Layout]) -> dict:
    """One scheme's KL and top-1 per kind of token.

    Returns:
        classification → {"kinds": name → {"tokens", "sequences", "kl", "top1"}, "labelled_tokens", "much_worse":
        names of the kinds that are (with their ratio and paired difference)}; a classification no token has is left
        out.
    """
    codes = targets(layouts, token_kl.shape[1])
    out = {}
    for classification, names in CLASSIFICATIONS.items():
        index = kind_index(codes, classification)  # [S, P]
        if not (index >= 0).any():
            continue
        kinds, worse = {}, []
        for k, name in enumerate(names):
            mine = index == k
            if not mine.any():
                continue
            n = int(mine.sum())
            kl = token_kl[mine].double().mean().item()
            kinds[name] = {"tokens": n, "sequences": int(mine.any(1).sum()), "kl": kl,
                           "top1": token_top1[mine].double().mean().item()}
            judged = _judge(token_kl, mine, (index >= 0) & ~mine)
            if judged is not None:
                kinds[name]["vs_rest"] = judged
                if judged["much_worse"]:
                    worse.append(name)
        out[classification] = {"kinds": kinds, "labelled_tokens": int((index >= 0).sum()), "much_worse": worse}
    return out


def _judge(token_kl: torch.Tensor, mine: torch.Tensor, rest: torch.Tensor) -> dict | None:
    """A kind against the rest of its classification; None when the rest is empty. ``difference``: the kind's mean
    minus the rest's, per sequence, averaged; ``excess``: the kind's minus ``RATIO`` × the rest's, what is tested."""
    if not rest.any():
        return None
    kl, rest_kl = token_kl[mine].double().mean().item(), token_kl[rest].double().mean().item()
    both = (mine.any(1) & rest.any(1)).nonzero().flatten().tolist()
    pairs = [(token_kl[s][mine[s]].double().mean().item(), token_kl[s][rest[s]].double().mean().item()) for s in both]
    mean, se = mean_stderr([a - b for a, b in pairs]) if pairs else (None, None)
    excess, excess_se = mean_stderr([a - RATIO * b for a, b in pairs]) if pairs else (None, None)
    ratio = kl / rest_kl if rest_kl > 0 else None
    worse = (ratio is not None and ratio >= RATIO and int(mine.sum()) >= MIN_TOKENS and excess is not None and excess > 0
             and significant(excess, excess_se, len(pairs)))
    return {"rest_kl": rest_kl, "ratio": ratio, "paired_sequences": len(pairs), "difference": mean, "stderr": se,
            "excess": excess, "excess_stderr": excess_se, "much_worse": worse, "too_few": too_few(len(pairs))}


def worse_text(d: dict) -> list[str]:
    """The kinds much worse than the rest of their classification, one phrase each (empty: none)."""
    return [f"{name} tokens' KL is {c['kinds'][name]['vs_rest']['ratio']:.3g}× the other {classification}s' "
            f"({c['kinds'][name]['tokens']:,} tokens)"
            for classification, c in d.items() for name in c["much_worse"]]


def rule() -> str:
    """The rule in words a user reads."""
    return (f"token kinds: a kind (chat role, or JSON/code/prose) is much worse when its KL is ≥ {RATIO:g}× the rest of "
            f"its classification's over ≥ {MIN_TOKENS} tokens and, per sequence, its KL minus {RATIO:g}× the rest's is "
            f"above zero and significant ({RULE}), over ≥ {MIN_SEQUENCES} sequences holding both (fewer: {TOO_FEW})")

"""Decode drift: where a scheme's free-running greedy continuation first parts from the reference's.

Teacher-forced KL measures one step at a time on the reference's own text; in generation the model reads its own
quantized past, and errors compound. Here each prompt (the first tokens of a held-out record) is continued greedily
for ``steps`` tokens by the reference and by every scheme, the scheme's cache quantized as vLLM writes it: the
scheme's attention hook (``passes.ApplyScheme``) quantizes K and V as each token is written (per-token scales per
decoded token, static scales applied to each new token), in a transformers ``DynamicCache`` that keeps them
unquantized so that every step reads the same quantized values a cache written once would hold.

Near-ties: where the reference's top-1 leads the runner-up by less than ``NEAR_TIE_NATS``, any rounding may flip the
choice, the floor's included; a flip there is no evidence of damage. The emulated scheme then takes the reference's
token and goes on (counted as a near-tie followed). ``compare`` also takes free-running tokens that parted at a
near-tie (a serving engine's, which cannot be steered): the comparison stops there, as the texts differ from then on.
"""

import copy
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..capture.hooks import cache_kwarg, hooked_attention
from ..model.load import input_device
from .config import ENGINE_NEAR_TIE_NATS, NEAR_TIE_NATS
from .passes import ApplyScheme, token_kl, top1_margin
from .schemes import Mode, Scheme
from .significance import mean_stderr


@dataclass
class Continuation:
    """A greedy continuation: its tokens [N] and the float32 logits [N, V] each was chosen from."""

    tokens: list[int]
    logits: torch.Tensor

    def margins(self) -> list[float]:
        """The top-1 lead over the runner-up at each step, nats."""
        return top1_margin(torch.log_softmax(self.logits, -1)).tolist()


@dataclass
class PromptDrift:
    """One prompt's continuation by a scheme against the reference's (``compare``)."""

    first_divergence: int | None  # the first generated token (0-based) differing where the reference was clear; None: none
    parted_at_tie: int | None  # free-running tokens only: where they parted from the reference's at a near-tie
    agreement: float  # fraction of the continuation's positions holding the reference's token


def compare(ref_tokens: list[int], ref_margins: list[float], tokens: list[int], eps: float = NEAR_TIE_NATS) -> PromptDrift:
    """A scheme's greedy tokens against the reference's, given the reference's top-1 margin (nats) at each step.

    The first position where the tokens differ is the divergence, unless the reference's margin there is below
    ``eps``: the continuations then parted at a near-tie, and no later position can be compared (``parted_at_tie``).
    Agreement is over every position, as generated. The emulated decode never parts at a near-tie (it follows the
    reference there); an engine's free-running tokens can.
    """
    if len(tokens) != len(ref_tokens):
        raise ValueError(f"a continuation of {len(tokens)} tokens cannot be compared with the reference's {len(ref_tokens)}")
    agreement = sum(a == b for a, b in zip(ref_tokens, tokens)) / max(1, len(tokens))
    first = next((t for t, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
    if first is not None and ref_margins[first] < eps:
        return PromptDrift(None, first, agreement)
    return PromptDrift(first, None, agreement)


def summarize(drifts: list[PromptDrift], decode_kl: list[float] | None, steps: int, ties_followed: int = 0) -> dict:
    """One scheme's drift over the prompts, as report.json holds it.

    A prompt without a divergence counts as ``steps`` (none within the continuation) in the median and minimum.
    ``decode_kl`` None: free-running tokens only (an engine's), no teacher-forced KL.
    """
    first = [d.first_divergence if d.first_divergence is not None else steps for d in drifts]
    summary = {
        "prompts": len(drifts), "steps": steps,
        "first_divergence": [d.first_divergence for d in drifts],
        "first_divergence_median": statistics.median(first), "first_divergence_min": min(first),
        "identical": sum(d.first_divergence is None and d.parted_at_tie is None for d in drifts) / len(drifts),
        "agreement": sum(d.agreement for d in drifts) / len(drifts),
        "parted_at_near_tie": sum(d.parted_at_tie is not None for d in drifts),
        "near_ties_followed": ties_followed,
    }
    if decode_kl is not None:
        kl, kl_se = mean_stderr(decode_kl)
        summary.update(decode_kl=kl, decode_kl_stderr=kl_se, decode_kl_per_prompt=decode_kl)
    return summary


def engine_drift(reference: list[dict], run: list[dict], steps: int) -> dict:
    """An engine's free-running greedy continuations (``run``) against its own reference cache's (``reference``), each
    {"tokens", "margins"} per prompt as the engine job returns them; near-ties by the reference's margins, at the
    engine's ``ENGINE_NEAR_TIE_NATS``."""
    drifts = [compare(r["tokens"], r["margins"], x["tokens"], ENGINE_NEAR_TIE_NATS) for r, x in zip(reference, run)]
    return {**summarize(drifts, None, steps), "near_tie_nats": ENGINE_NEAR_TIE_NATS}


def prompts_from(sequences: list[torch.Tensor], eos_id: int | None, count: int, length: int) -> tuple[list[torch.Tensor], str]:
    """Up to ``count`` prompts of ``length`` tokens from the sample, each starting at a record boundary, and where
    they came from, in words.

    A boundary is an EOS that ends one packed record: the prompt is that EOS and the next record's first tokens (running
    into the records after it when the record is shorter), as the sample holds them; sequences take turns, so the
    prompts come from as many sequences as there are. Data without such boundaries (token ids, unpacked records) gives
    the sequences' own starts.
    """
    per_sequence = []
    for seq in sequences:  # seq [S]
        ends = (seq[: max(0, len(seq) - length + 1)] == eos_id).nonzero().flatten().tolist() if eos_id is not None else []
        per_sequence.append(ends)
    where = "each an EOS and the first tokens of the next held-out record"
    if not any(per_sequence):
        per_sequence = [[0] if len(seq) >= length else [] for seq in sequences]
        where = "each the start of a sample sequence (the data has no record boundary with room for a prompt)"
    prompts = []
    for turn in range(max(map(len, per_sequence), default=0)):
        for seq, starts in zip(sequences, per_sequence):
            if turn < len(starts) and len(prompts) < count:
                prompts.append(seq[starts[turn] : starts[turn] + length])  # [length]
    if not prompts:
        raise ValueError(f"the sample has no {length} tokens to take a prompt from: lower --prompt-len, or --generate 0")
    return prompts, where


class _Decoder:
    """One KV cache advanced a token at a time; ``fork`` copies it (the cache holds unquantized K/V: the hook quantizes)."""

    def __init__(self, model, prompt: torch.Tensor):
        self.model, self.kwarg = model, cache_kwarg(model)
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.device = input_device(model)
        self.logits = self.step(prompt)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` [c] at the next positions; returns the float32 logits [V] after the last."""
        ids = ids.to(self.device)[None]  # [1, c]
        positions = torch.arange(self.length, self.length + ids.shape[1], device=self.device)[None]  # [1, c]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.kwarg: self.cache})
        self.length += ids.shape[1]
        self.logits = out.logits[0, -1].float()  # [V]
        return self.logits

    def fork(self) -> "_Decoder":
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        return other


@torch.no_grad()
def reference_continuation(model, prompt: torch.Tensor, steps: int) -> Continuation:
    """The reference's greedy continuation of ``prompt`` [P]: the unquantized model, no hook."""
    decoder, tokens, logits = _Decoder(model, prompt), [], []
    for t in range(steps):
        logits.append(decoder.logits.cpu())
        tokens.append(int(decoder.logits.argmax()))
        if t + 1 < steps:
            decoder.step(torch.tensor([tokens[-1]]))
    return Continuation(tokens, torch.stack(logits))  # logits [N, V]


@torch.no_grad()
def scheme_continuation(model, prompt: torch.Tensor, reference: Continuation, hook: Callable | None = None,
                        eps: float = NEAR_TIE_NATS) -> tuple[Continuation, Continuation, int]:
    """A scheme's greedy continuation of ``prompt`` under ``hook`` (None: the model as it is), and its teacher-forced
    one on the reference's tokens, and how many near-ties it followed the reference through.

    Both come from one decode while the scheme's text equals the reference's; at its first clear divergence the cache
    is copied, one copy going on with the scheme's own tokens, the other with the reference's (teacher forcing).

    Returns:
        (free-running continuation, teacher-forced continuation: its logits [N, V] predict the reference's tokens,
        near-ties followed).
    """
    margins = reference.margins()
    steps = len(reference.tokens)
    with hooked_attention(model, hook) if hook is not None else nullcontext():
        free = _Decoder(model, prompt)
        forced: _Decoder | None = None  # the teacher-forced copy, once the texts differ
        tokens, free_logits, forced_logits, ties = [], [], [], 0
        for t in range(steps):
            choice = int(free.logits.argmax())
            free_logits.append(free.logits.cpu())
            if forced is None:
                forced_logits.append(free.logits.cpu())
                if choice != reference.tokens[t] and margins[t] < eps:
                    choice, ties = reference.tokens[t], ties + 1
                if choice != reference.tokens[t] and t + 1 < steps:
                    forced = free.fork()
            else:
                forced_logits.append(forced.logits.cpu())
            tokens.append(choice)
            if t + 1 < steps:
                free.step(torch.tensor([choice]))
                if forced is not None:
                    forced.step(torch.tensor([reference.tokens[t]]))
    return Continuation(tokens, torch.stack(free_logits)), Continuation(reference.tokens, torch.stack(forced_logits)), ties


def decode_kl(reference: Continuation, forced: Continuation) -> float:
    """Mean KL(reference ‖ scheme) over the continuation's positions, the scheme teacher-forced on the reference's tokens."""
    ref_p = torch.softmax(reference.logits, -1)  # [N, V]
    return token_kl(reference.logits, ref_p, forced.logits).mean(dtype=torch.float64).item()


@torch.no_grad()
def measure_drift(model, layers, schemes: list[Scheme], prompts: list[torch.Tensor], steps: int, *,
                  progress: bool = True) -> dict[str, dict]:
    """Every scheme's drift (``summarize``) over ``prompts``: the reference's greedy continuation of ``steps`` tokens
    against each scheme's under its end-to-end hook. The reference scheme itself is not run (it is the reference)."""
    row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
    device = next(model.parameters()).device
    runs = [s for s in schemes if s.mode != Mode.REFERENCE]
    found = {s.name: ([], [], 0) for s in runs}  # name → (PromptDrift per prompt, decode KL per prompt, near-ties followed)
    for prompt in tqdm(prompts, desc="decode drift", unit="prompt", disable=not progress):
        reference = reference_continuation(model, prompt, steps)
        margins = reference.margins()
        for scheme in runs:
            with scheme.precision(device):
                free, forced, ties = scheme_continuation(model, prompt, reference, ApplyScheme(scheme, row_of))
            drifts, kls, followed = found[scheme.name]
            drifts.append(compare(reference.tokens, margins, free.tokens))
            kls.append(decode_kl(reference, forced))
            found[scheme.name] = (drifts, kls, followed + ties)
    return {name: summarize(drifts, kls, steps, ties) for name, (drifts, kls, ties) in found.items()}

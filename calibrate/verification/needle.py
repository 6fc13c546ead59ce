"""The needle probe of ``kvcal verify --needle``: is a planted fact still retrieved with an FP8 KV cache?

A short sentence with a random code is planted at a depth of a haystack of the user's own text; the
question at the end is answered teacher-forced, under the reference and under every scheme's hook.
Long contexts are where a cache's rounding errors add up, and retrieval is what users notice.
"""

import random

import torch
from tqdm.auto import tqdm

from ..capture.hooks import AttentionHook, prefill_chunks
from ..data.config import DataConfig
from ..data.stream import iter_sequences

NEEDLE = "The secret code is {code}."
NEEDLE_QUESTION = "What is the secret code? The secret code is"


def needle_prompt(tokenizer, hay: list[int], length: int, depth: float, code: str) -> tuple[list[int], int, int]:
    """Haystack with the needle at ``depth``, then the question and the answer: (ids of ``length`` tokens, needle position, answer tokens)."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    needle, question, answer = encode("\n" + NEEDLE.format(code=code) + "\n"), encode("\n" + NEEDLE_QUESTION), encode(" " + code)
    body = length - len(needle) - len(question) - len(answer)
    if body < 16:
        raise ValueError(f"--needle {length} leaves no room for a haystack (needle and question take {length - body} tokens); use a longer length")
    hay = hay[:body]
    pos = min(body, max(1, round(depth * body)))  # never before the first token (BOS, when the tokenizer adds one)
    return hay[:pos] + needle + hay[pos:] + question + answer, pos, len(answer)


def _haystack(data: DataConfig, tokenizer, length: int, context: int | None) -> list[int]:
    """The first ``length`` tokens of the user's data (its sources, text field and seed), as one packed sequence."""
    dc = DataConfig(sources=data.sources, seq_len=length, max_tokens=length, text_field=data.text_field, seed=data.seed)
    seq = next(iter(iter_sequences(dc, tokenizer, max_context=context)), None)
    if seq is None or seq.numel() < length:
        got = 0 if seq is None else seq.numel()
        raise ValueError(f"the data holds only {got} tokens but --needle {length} needs a haystack of {length}; add data or use shorter lengths")
    return seq.tolist()


@torch.no_grad()
def needle_probe(
    model, tokenizer, hooks: dict[str, AttentionHook], *, reference: str, lengths: list[int], depths: tuple[float, ...],
    data: DataConfig, context: int | None, progress: bool,
) -> dict:
    """Teacher-forced retrieval of a planted fact at each length and depth, for every run in ``hooks``.

    Args:
        hooks: run name → the attention hook of its pass, ``reference`` (the unquantized run) among them.
        data: the sample's data: the haystack's sources, text field and seed, and the prefill's chunk length.
    """
    device = next(model.parameters()).device
    cases = []
    for length in lengths:
        hay = _haystack(data, tokenizer, length, context)
        code = str(random.Random(data.seed * 100_003 + length).randint(1000, 9999))
        for depth in depths:
            ids, pos, n = needle_prompt(tokenizer, hay, length, depth, code)
            ids = torch.tensor(ids, device=device)[None]  # [1, length]
            answer = ids[0, -n:]
            first = ids.shape[1] - n - 1  # the position that predicts the answer's first token
            case = {"length": length, "depth": depth, "needle_token": pos, "code": code, "schemes": {}}
            for name, hook in tqdm(hooks.items(), desc=f"needle {length}@{depth:g}", disable=not progress, leave=False):
                kept = torch.cat(list(prefill_chunks(model, ids, data.chunk_len, hook=hook, keep_from=first)))  # [chunks before first + n + 1, V]
                logits = kept[-(n + 1) : -1]  # [n, V]: positions first .. length − 2 predict the answer
                logprob = torch.log_softmax(logits, -1).gather(-1, answer[:, None]).sum().item()
                case["schemes"][name] = {"logprob": logprob, "greedy": bool((logits.argmax(-1) == answer).all())}
            cases.append(case)
    summary = {}
    for name in hooks:
        if name == reference:
            continue
        lost = sum(c["schemes"][reference]["greedy"] and not c["schemes"][name]["greedy"] for c in cases)
        delta = [c["schemes"][name]["logprob"] - c["schemes"][reference]["logprob"] for c in cases]
        summary[name] = {"lost": lost, "found": sum(c["schemes"][name]["greedy"] for c in cases), "mean_logprob_change": sum(delta) / len(delta)}
    summary[reference] = {"found": sum(c["schemes"][reference]["greedy"] for c in cases)}
    return {"needle": NEEDLE, "question": NEEDLE_QUESTION, "cases": cases, "summary": summary}

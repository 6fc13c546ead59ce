"""The job that loads a checkpoint in vLLM and reads back the k/v/q scales every attention layer holds.

Request: ``{"model": DIR, "kv_cache_dtype": NAME, "dtype": "bfloat16", "max_model_len": 256,
"kv_cache_space_gib": 1}``. Result: what the load audit reads of the engine (``jobkit.loaded_facts``: vLLM's
version, platform and model dtype, whether its FP8 is e4m3fnuz, what the engine shows of itself), and per attention
layer (``read_layers``, which the delivery job calls too) the scale buffers (``_k_scale`` ..., one value per head or
one) and the host-side floats the CPU and FlashInfer kernels read (``_k_scale_float`` ...), with the layer's cache
dtype and KV-cache method.
"""

import os
import re

from jobkit import attention_layers, device_memory, loaded_facts, run

os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model sends our function to the in-process worker
KINDS = ("k", "v", "q")


def _flat(tensor) -> list[float]:
    return [float(x) for x in tensor.detach().float().cpu().flatten().tolist()]


def read_layers(model) -> list[dict]:
    """Inside vLLM's worker: every Attention (and MLA) module's scales, in module order."""
    layers = []
    for name, module, mla in attention_layers(model):
        index = re.search(r"\.(\d+)\.", f".{name}.")
        method = getattr(module, "quant_method", None)
        layers.append({
            "name": name,
            "index": int(index.group(1)) if index else None,
            "mla": mla,
            "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", "")),
            "kv_cache_method": type(method).__name__ if method is not None else None,
            **{f"{kind}_scale": _flat(getattr(module, f"_{kind}_scale")) for kind in KINDS},
            **{f"{kind}_scale_float": float(getattr(module, f"_{kind}_scale_float")) for kind in KINDS},
        })
    return layers


def work(request: dict) -> dict:
    from vllm import LLM

    llm = LLM(model=request["model"], kv_cache_dtype=request["kv_cache_dtype"], dtype=request.get("dtype", "bfloat16"),
              enforce_eager=True, max_model_len=request.get("max_model_len", 256), enable_prefix_caching=False,
              **device_memory())
    (layers,) = llm.apply_model(read_layers)  # one worker
    return {**loaded_facts(llm, request["kv_cache_dtype"]), "layers": layers}


if __name__ == "__main__":
    run(work)

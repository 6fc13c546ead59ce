"""What every engine job shares: vLLM's environment, the ISA denial, and refusals turned into results.

A job is ``python JOB.py IN.json OUT.json`` (run from engine/launch.py). ``run(work)`` reads IN.json, calls
``work(request)`` and writes ``{"result": ..., "error": null}``, or ``{"result": null, "error": "Type: message"}``
when vLLM refused (the innermost cause, which is the line vLLM wrote for the user).
"""

import json
import os
import sys
from collections.abc import Callable

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's errors raised in this process, not an engine process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _deny(features: list[str]) -> None:
    """Make torch say this CPU lacks ``features``: vLLM's CPU backend asks torch.cpu before it allows a quantized
    cache, so its own refusal runs (the real one an AVX2-only CPU gets)."""
    import torch

    probes = {"avx512": "_is_avx512_supported", "amx": "_is_amx_tile_supported"}
    for feature in features:
        setattr(torch.cpu, probes[feature], lambda: False)


def run(work: Callable[[dict], object]) -> None:
    in_path, out_path = sys.argv[1:3]
    with open(in_path) as f:
        request = json.load(f)
    if "kv_cache_space_gib" in request:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_space_gib"])
    _deny(request.get("deny_isa", []))
    answer: dict = {"result": None, "error": None}
    try:
        answer["result"] = work(request)
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the job's result
        while e.__cause__ is not None:
            e = e.__cause__
        answer["error"] = f"{type(e).__name__}: {e}"[:2000]
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, out_path)

"""What every engine job shares: vLLM's environment, the ISA denial, and refusals turned into results.

A job is ``python JOB.py IN.json OUT.json`` (run from engine/launch.py). ``run(work)`` reads IN.json, calls
``work(request)`` and writes ``{"result": ..., "error": null}``, or ``{"result": null, "error": "Type: message"}``
when vLLM refused (the innermost cause, which is the line vLLM wrote for the user), or ``{"fault": "Type: message"}``
when the job itself could not run (out of memory, a full disk): no finding about the checkpoint, a check that did
not happen, which ``launch.run_job`` raises as such.
"""

import errno
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


# The machine's faults, not vLLM's answer about the checkpoint: memory or disk ran out under the job.
OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG)


def _is_fault(error: BaseException) -> bool:
    """Whether ``error`` is the machine's (out of memory, disk full) rather than vLLM refusing the request."""
    return (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"  # torch's, CUDA or not
            or (isinstance(error, OSError) and error.errno in OUT_OF_ROOM))


def run(work: Callable[[dict], object]) -> None:
    in_path, out_path = sys.argv[1:3]
    with open(in_path) as f:
        request = json.load(f)
    if "kv_cache_space_gib" in request:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_space_gib"])
    _deny(request.get("deny_isa", []))
    answer: dict = {"result": None, "error": None, "fault": None}
    try:
        answer["result"] = work(request)
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the job's result
        fault = _is_fault(e)
        while e.__cause__ is not None:
            e = e.__cause__
            fault = fault or _is_fault(e)
        answer["fault" if fault else "error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:2000]
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, out_path)

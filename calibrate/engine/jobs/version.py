"""The job that only imports vLLM: its version and platform, whether its CPU backend would take an FP8 cache, and
its own list of ``--kv-cache-dtype`` names (the ``CacheDType`` type its cache config validates against), without
building an engine: what verify and inspect ask before any engine start, in one import."""

import typing

from jobkit import run


def work(request: dict) -> dict:
    import torch
    import vllm
    from vllm.config.cache import CacheDType
    from vllm.platforms import current_platform

    return {"vllm_version": vllm.__version__, "platform": type(current_platform).__name__,
            "avx512": bool(torch.cpu._is_avx512_supported()), "amx": bool(torch.cpu._is_amx_tile_supported()),
            "cache_dtypes": list(typing.get_args(CacheDType))}


if __name__ == "__main__":
    run(work)

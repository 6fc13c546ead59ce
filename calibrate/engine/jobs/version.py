"""The job that only imports vLLM: its version and platform, and whether its CPU backend would take an FP8 cache."""

from jobkit import run


def work(request: dict) -> dict:
    import torch
    import vllm
    from vllm.platforms import current_platform

    return {"vllm_version": vllm.__version__, "platform": type(current_platform).__name__,
            "avx512": bool(torch.cpu._is_avx512_supported()), "amx": bool(torch.cpu._is_amx_tile_supported())}


if __name__ == "__main__":
    run(work)

"""The job that reads the installed vLLM's own list of ``--kv-cache-dtype`` names (the ``CacheDType`` type its
cache config validates against), without building an engine."""

import typing

from jobkit import run


def work(request: dict) -> dict:
    import vllm
    from vllm.config.cache import CacheDType

    return {"vllm_version": vllm.__version__, "cache_dtypes": list(typing.get_args(CacheDType))}


if __name__ == "__main__":
    run(work)

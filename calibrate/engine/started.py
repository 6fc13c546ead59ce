"""What a started engine showed of itself, and what verify makes of it before the emulation runs: the hooks kvcal's
jobs need (a release without one is refused in one line), and the emulation like for like with the attention backend
the engine chose (whether it quantizes the query, and on a GPU which cache writer it runs).

The load audit and the delivery check each start vLLM before the emulation; their jobs report ``engine``
(``jobs/jobkit.py`` ``engine_facts``): the cache dtype it ran, the attention backend, whether its attention layers
quantize the query (``query_quant`` set), and the private hooks it lacks. docs/engine.md, "Which vLLM" and "The GPU
path", says which releases have each hook and why the backend decides Q.
"""

from collections.abc import Iterable

from ..vllm_facts.platforms import TRITON_BACKENDS, Emulation, Platform
from .audit import UNQUANTIZED


def shown(facts: Iterable[dict | None]) -> dict | None:
    """Of the starts' ``engine`` reports (None: that job did not start vLLM), the one under a quantized cache (its
    backend is the one an FP8 cache gets), else the first; None when no start reported."""
    reports = [f for f in facts if f]
    return next((f for f in reports if f["kv_cache_dtype"] not in UNQUANTIZED), reports[0] if reports else None)


def check_hooks(facts: dict | None, version: str) -> None:
    """Refuse, in one line naming the release, a vLLM whose running engine lacks a hook the log-probability and
    delivery jobs reach (nothing to check where no start reported)."""
    if facts and facts["missing_hooks"]:
        raise ValueError(f"vLLM {version}'s engine lacks what kvcal's engine jobs read ({', '.join(facts['missing_hooks'])}"
                         f", model runner {facts['runner']}): --engine vllm runs releases whose V1 model runner has them "
                         "(docs/engine.md, \"Which vLLM\"); verify without --engine, or with --vllm-python a venv of one")


def emulation_for(platform: Platform, facts: dict | None) -> tuple[Emulation, str] | None:
    """The emulation like for like with the engine as started, and the writer it has in words: the query quantized
    exactly where the engine's attention layers quantize it, Triton's writer where a GPU runs TRITON_ATTN. None where
    the engine showed neither (no start under a quantized cache, or latent attention): the platform's own then."""
    base, why = platform.emulation, platform.why
    if not facts or facts["q_quantized"] is None or facts["kv_cache_dtype"] in UNQUANTIZED:
        return None
    backend = "triton" if platform.target != "cpu" and facts["attention_backend"] in TRITON_BACKENDS else base.backend
    emulation = Emulation(backend, base.dtype, not facts["q_quantized"])
    if emulation == base:
        return base, why
    q = "Q quantized" if facts["q_quantized"] else "Q unquantized"
    return emulation, f"vLLM's {backend} cache writer under {facts['attention_backend']}, {q} as that backend does"

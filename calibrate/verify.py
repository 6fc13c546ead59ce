"""``kvcal verify``: what a quantized KV cache costs a checkpoint, measured against the unquantized model.

A *scheme* is one way vLLM could store attention's inputs (``SCHEMES``, or a scales file the user names).
Every scheme is emulated as vLLM's cache write does it: FP8 schemes as x / scale, saturated to the format's
finite max, rounded to nearest even, times scale — K and V always, Q too where the backend quantizes queries
(FA3 on Hopper; ``kv_only`` models the Triton/FlashInfer backends); vLLM's other cache dtypes (int8 and int4 per
token-head, nvfp4) by ``kvdtypes``, K and V only.

Cost: one reference forward of the sample (which also runs each scheme's attention on every layer's own inputs,
for the per-layer errors), one forward per scheme with every layer quantized at once, one for the *floor* (the
unquantized model in another precision, what the verdicts are relative to), and for the recommended scheme one
per probed layer left unquantized (plus a reference): about 3 + S + P forwards. The FA3 accumulator model
(``fa3.probe``) and the needle probe (``needle.py``) are extra. What the numbers mean, verdicts and the
recommendation, is ``verdict.py``'s; the memory arithmetic ``capacity.py``'s.
"""

import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import fa3, report
from .capture import cached_latent, latent_view, prefill_chunks
from .config import DEFAULT_VERIFY_SCHEMES, VERIFY_SCHEMES, Thresholds, check_fp8_format, flat_settings, route_options
from .capacity import LayerKV, parse_memory, per_token, plan
from .data import DataConfig, as_sources, check_int, iter_sequences
from .checkpoint import MLA_SCALES_IGNORED, LoadedScale, fill_missing, layer_sources, loaded_multiplier, quant_config, quant_method, read_tensor, tensor_names
from .export import KVCAL_DIR, tensor_bytes, weight_files
from .fa3 import HOPPER_ACCUM_BITS
from .fp8 import E5M2, SATURATION_SLACK, FP8Format, get_format, per_token_scale, quantize_dequantize
from .kvdtypes import DTYPES, CacheDtype
from .model import AttentionLayer, attention_layers, check_tokenizer_fits, checkpoint_named, is_latent, load_model, load_tokenizer, max_context, read_config, resolve_device, signature
from .needle import NEEDLE_DEPTHS, needle_probe
from .observers import derive_scales
from .stats import KINDS, ModelSignature, Stats, position_bucket_starts
from .verdict import SCHEME_NOTES, check_measured, choose, judge, mean_stderr, recommend, skip_choice

REFERENCE = "bf16"  # the name users know; the reference runs in the dtype the report states
FLOOR = "floor"
SCHEMES = VERIFY_SCHEMES
STATS_PATH = Path(KVCAL_DIR) / "stats.safetensors"  # written by api.run_calibration


@dataclass
class VerifyConfig:
    """Everything one verify run needs; ``validate()`` normalizes CLI strings and raises ValueError with the fix.

    Attributes:
        checkpoint: model directory, with or without kvcal scales and statistics.
        data: the sample: ``max_tokens // seq_len`` whole sequences of ``seq_len`` tokens; longer than ``chunk_len``
            they run as chunked prefill (a list of sources alone takes ``SAMPLE``'s sizes).
        schemes: names from SCHEMES (default the first five, the FP8 ones) or paths to safetensors scale files,
            list or comma-separated.
        thresholds: the verdict's pass and fail limits.
        kv_only: quantize only K and V in the static schemes (Triton/FlashInfer); default also Q (FA3).
        fa3: run the FA3 FP8 numeric model on ``fa3_rows`` query rows of ``fa3_layers`` (default first, middle, last).
        accum_bits: accumulator fractional bits of the FA3 model (13 Hopper, 25 B200).
        needle: context lengths of the needle probe, at ``needle_depths`` (fractions of the haystack).
        dtype: reference dtype; None = float32 on CPU, the checkpoint's dtype on GPU.
        report_dir: write report.json, report.md and PNG plots there.
        floor: measure the floor (the unquantized model in another precision, ``FLOOR_DTYPES``) that verdicts are
            relative to; off, unset thresholds take ``Thresholds.ABSOLUTE``.
        probe_layers: layers whose unquantized end-to-end gain is measured for the recommended scheme (0: none);
            one extra pass each.
        max_model_len, gpu, tp: the serving setup the memory arithmetic (``capacity.plan``) sizes: context per
            sequence (None: the model's maximum), one GPU's memory (a name in ``capacity.GPUS`` or a size), and the
            tensor-parallel GPUs.
    """

    checkpoint: str
    data: DataConfig | list[str]
    schemes: str | list[str] = ",".join(DEFAULT_VERIFY_SCHEMES)
    thresholds: Thresholds = field(default_factory=Thresholds)
    kv_only: bool = False
    fa3: bool = False
    accum_bits: int = HOPPER_ACCUM_BITS
    fa3_rows: int = 8
    fa3_layers: str | list[int] | None = None
    needle: str | list[int] | None = None
    needle_depths: tuple[float, ...] = NEEDLE_DEPTHS
    device: str = "auto"
    dtype: str | None = None
    fp8_format: str = "e4m3fn"
    report_dir: str | None = None
    floor: bool = True
    probe_layers: int = 4
    max_model_len: int | None = None
    gpu: str = "H100"
    tp: int = 1
    progress: bool = True

    # The sample's sizes unless given: a few sequences, enough for a verdict in minutes on a CPU.
    SAMPLE = {"seq_len": 1024, "max_tokens": 4096, "chunk_len": 1024}
    PARTS = {"data": DataConfig, "thresholds": Thresholds}
    # report.json's "settings", in their order.
    SETTINGS = ["schemes", "seq_len", "max_tokens", "chunk_len", "text_field", "seed", "kv_only", "fa3", "accum_bits",
                "fa3_rows", "fa3_layers", "needle", "needle_depths", "max_kl", "fail_kl", "min_top1", "fail_top1",
                "floor_pass", "floor_fail", "floor", "probe_layers", "max_model_len", "gpu", "tp", "device", "dtype",
                "fp8_format", "report_dir"]

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataConfig):
            self.data = DataConfig(as_sources(self.data), **self.SAMPLE)

    @classmethod
    def from_options(cls, checkpoint: str | Path, data: str | Path | list[str], **options) -> "VerifyConfig":
        """A config from flat keyword options (``seq_len=``, ``max_kl=``, ``fa3=``...), each to the part that owns it."""
        parts, rest = route_options(options, cls.PARTS)
        own = {f.name for f in fields(cls)} - {"checkpoint", "data", *cls.PARTS}
        unknown = sorted(set(rest) - own)
        if unknown:
            raise ValueError(f"unknown verify option {unknown[0]!r}; options: {', '.join(sorted(cls.SETTINGS + ['progress']))}")
        sample = DataConfig(as_sources(data), **{**cls.SAMPLE, **parts["data"]})
        return cls(str(checkpoint), sample, thresholds=Thresholds(**parts["thresholds"]), **rest)

    @classmethod
    def defaults(cls) -> dict:
        """Every flat option's default, as ``kvcal verify --help`` shows them."""
        return flat_settings(cls("", []), cls.SETTINGS)

    def settings(self) -> dict:
        """The run's settings as report.json holds them (flat, as they always were)."""
        return flat_settings(self, self.SETTINGS)

    def validate(self) -> "VerifyConfig":
        """Cheap checks of every field, before any model is loaded; returns self with lists parsed."""
        read_config(self.checkpoint)
        self.data.validate()
        self.data.check_budget()
        if not self.data.pack:
            raise ValueError("verify measures whole packed sequences of --seq-len tokens; leave pack on")
        self.thresholds.validate()
        self.schemes = _split(self.schemes)
        if not self.schemes:
            raise ValueError(f"--schemes names no scheme; choose from {', '.join(SCHEMES)} or name a .safetensors scales file")
        for name in self.schemes:
            if name not in SCHEMES and not (name.endswith(".safetensors") and Path(name).is_file()):
                raise ValueError(f"unknown scheme {name!r}: choose from {', '.join(SCHEMES)} or name an existing .safetensors scales file")
        if not 1 <= self.accum_bits <= 40:
            raise ValueError(f"--accum-bits must be between 1 and 40 (13 models Hopper, 25 B200), got {self.accum_bits}")
        if isinstance(self.probe_layers, bool) or not isinstance(self.probe_layers, int) or self.probe_layers < 0:
            raise ValueError(f"--probe-layers must be a whole number ≥ 0 (0 measures no layer), got {self.probe_layers!r}")
        parse_memory(self.gpu)
        check_int("tp", self.tp, 1)
        if self.max_model_len is not None:
            check_int("max-model-len", self.max_model_len, 1)
        if self.fa3_rows < 1:
            raise ValueError(f"--fa3-rows must be ≥ 1, got {self.fa3_rows}")
        self.fa3_layers = _integers("fa3-layers", self.fa3_layers) if self.fa3_layers is not None else None
        self.needle = _integers("needle", self.needle)
        if any(n < 64 for n in self.needle):
            raise ValueError(f"--needle lengths must be ≥ 64 tokens, got {self.needle}")
        if not all(0 <= d <= 1 for d in self.needle_depths):
            raise ValueError(f"needle depths are fractions of the haystack in [0, 1], got {self.needle_depths}")
        check_fp8_format(self.fp8_format)
        other = [name for name in self.schemes if name in DTYPES and name != "fp8_e5m2"]
        if other and self.fp8_format != "e4m3fn":
            raise ValueError(f"--schemes {other[0]} is NVIDIA's or Triton's cache, emulated with e4m3fn scales; drop it or use --fp8-format e4m3fn")
        if self.fa3 and self.fp8_format != "e4m3fn":
            raise ValueError("--fa3 models NVIDIA Hopper's e4m3fn path; drop --fa3 or use --fp8-format e4m3fn")
        if self.report_dir is not None:
            check_report_dir(Path(self.report_dir))
        return self


def check_report_dir(directory: Path) -> None:
    """The report directory is one kvcal can write into, or create (with its missing parents) in a writable directory."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if existing == directory and not existing.is_dir():
        raise ValueError(f"--report {directory} is a file; name a directory for the report")
    if not existing.is_dir():
        raise ValueError(f"--report {directory}: {existing} is a file, not a directory; name a directory for the report")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--report {directory}: {existing} is not writable; name a directory you can write")


def _integers(flag: str, value: str | list | None) -> list[int]:
    """Comma-separated integers of a flag, with an error naming the flag."""
    try:
        return [int(x) for x in _split(value)]
    except ValueError:
        raise ValueError(f"--{flag} takes comma-separated whole numbers, e.g. 4096,8192; got {value!r}") from None


def _split(value: str | list | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return [item.strip() for item in items if item.strip()]


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

    def scale(self, kind: str, row: int, x: torch.Tensor) -> torch.Tensor:
        """Scale broadcastable to x [B, H, S, D]: per (token, head) for ``token``, else [1, H, 1, 1]."""
        if self.mode == Mode.TOKEN:
            return per_token_scale(x, self.fmt)  # [B, H, S, 1]
        return self.scales[kind][row].to(x.device).view(1, -1, 1, 1)

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
        return tuple(quantize_dequantize(x, self.scale("k", row, x), self.fmt) for x in (kv_c, k_pe))

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
        return lambda q: quantize_dequantize(q, self.scale("q", row, q), self.fmt)

    def apply(self, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(q, k, v) as attention reads them back after this scheme's FP8 round trip."""
        out = {"q": q, "k": k, "v": v}
        if row in self.skip:
            return q, k, v
        for kind in self.kinds():
            if self.mode == Mode.CACHE:
                scale = self.scale(kind, row, out[kind]) if self.cache.scale == "tensor" else None
                out[kind] = self.cache.round_trip(out[kind], scale)
            else:
                out[kind] = quantize_dequantize(out[kind], self.scale(kind, row, out[kind]), self.fmt)
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


# ---- scales: from the checkpoint, its statistics, or a file --------------------------------------------------------


def read_scales(files: list[Path], layers: list[AttentionLayer], sig: ModelSignature, method: str | None) -> tuple[dict[str, torch.Tensor], str | None, list[str]]:
    """KV scales stored in safetensors ``files``, as vLLM would load them for each attention layer.

    Names, and what a missing scale becomes, follow ``checkpoint`` (the rules ``kvcal inspect`` reports by).

    Args:
        method: the checkpoint's quantization method (vLLM maps some names only under some methods).

    Returns:
        (kind → [L, H] float32 scales as stored (before any loader multiplier), granularity
        "tensor"/"head"/None when no k/v scale exists, notes for the report). A zero or negative scale is
        treated as 1.0, as vLLM does.

    Raises:
        ValueError: a scale whose shape does not fit the model's heads, or that is NaN/Inf.
    """
    where = {name: path for path in files for name in tensor_names(path)}
    sources, ignored = layer_sources(where, {layer.layer_idx: layer.prefix for layer in layers}, method)
    notes = [message for _, message in ignored]
    if not any(kind in ("k", "v") for _, kind in sources):
        return {}, None, notes
    heads = {"k": sig.num_kv_heads, "v": sig.num_kv_heads, "q": sig.num_heads}
    rows: dict[str, list[torch.Tensor]] = {kind: [] for kind in KINDS}
    per_head = False
    for layer in layers:
        loaded = {}
        for kind in KINDS:
            if (layer.layer_idx, kind) not in sources:
                continue
            name = sources[layer.layer_idx, kind][-1]
            t = read_tensor(where[name], name)
            if t.numel() != 1 and t.shape not in ((heads[kind], 1, 1), (heads[kind],)):
                raise ValueError(
                    f"{name} in {where[name].name} has shape {list(t.shape)}, but this model has {heads[kind]} "
                    f"{'query' if kind == 'q' else 'KV'} heads: expected [1] or [{heads[kind]}, 1, 1]; were these "
                    "scales written for another model?"
                )
            if not torch.isfinite(t).all():
                raise ValueError(f"{name} is NaN or Inf; vLLM would produce garbage with it: recalibrate")
            per_head |= t.numel() > 1
            loaded[kind] = LoadedScale(t.flatten().tolist(), name, where[name].name)
        notes += [f"layer {layer.layer_idx}: {message}; so does this verify" for _, message in fill_missing(loaded, any_scales=True)]
        for kind in KINDS:
            value = torch.tensor(loaded[kind].value).expand(heads[kind]).clone()  # [H]
            if (value <= 0).any():
                notes.append(f"{loaded[kind].tensor} is zero or negative: vLLM treats it as absent and uses 1.0, and so does this verify")
                value = torch.where(value > 0, value, torch.ones_like(value))
            rows[kind].append(value)
    return {kind: torch.stack(r) for kind, r in rows.items()}, ("head" if per_head else "tensor"), notes  # kind → [L, H]


def build_schemes(
    config: VerifyConfig, files: list[Path], layers, sig, stats: Stats | None, fmt: FP8Format
) -> tuple[list[Scheme], dict, dict]:
    """The schemes to run, those that cannot run with the reason, and what the checkpoint holds.

    ``files`` are the checkpoint's safetensors files as vLLM reads them (``export.weight_files``).
    """
    directory = Path(config.checkpoint)
    method = quant_method(quant_config(directory, read_config(directory)))
    ckpt, granularity, notes = read_scales(files, layers, sig, method)
    ckpt = {k: v * loaded_multiplier(method, fmt.name) for k, v in ckpt.items()}
    if granularity is None:
        notes.append("the checkpoint has no KV scales: vLLM would load it with 1.0 for every layer (scheme scale1)")
    held = {"granularity": granularity, "notes": notes, "statistics": stats is not None, "serving": []}
    q = not config.kv_only
    heads = {"k": sig.num_kv_heads, "v": sig.num_kv_heads, "q": sig.num_heads}
    schemes, skipped = [], {}
    ones = {k: torch.ones(len(layers), h) for k, h in heads.items()}

    def derived(observer: str, wanted: str) -> dict[str, torch.Tensor]:
        """kind → [L, H] scales of ``observer`` at ``wanted`` granularity, from the checkpoint's statistics."""
        scales = derive_scales(stats.kinds, observer=observer, granularity=wanted, fmt=fmt).scales
        return {k: (v if v.dim() == 2 else v[:, None].expand(-1, heads[k])).clone() for k, v in scales.items()}

    def static_scales(name: str, wanted: str) -> tuple[dict | None, str]:
        """(kind → [L, H] scales, source) of ``wanted`` granularity, or (None, why not)."""
        if granularity == wanted:
            return ckpt, "checkpoint"
        if stats is not None:
            return derived("max", wanted), "derived from the checkpoint's kvcal statistics (max observer; not in the checkpoint: export them)"
        if granularity is None and name != wanted:  # a cache dtype that reads checkpoint scales gets vLLM's 1.0
            return ones, "1.0: the checkpoint has no KV scales"
        has = f"holds {granularity} scales" if granularity else "has no KV scales"
        return None, f"the checkpoint {has} and no kvcal statistics to derive {wanted} scales from"

    for name in dict.fromkeys(config.schemes):  # a name given twice runs once
        if name in DTYPES:
            try:  # a cache layout this model's head size does not fit (nvfp4: multiples of 16; int4: even)
                DTYPES[name].bytes_per_token(1, sig.head_dim)
            except ValueError as e:
                skipped[name] = str(e)
                continue
        if name == REFERENCE:
            schemes.append(Scheme(name, Mode.REFERENCE, "none: the unquantized reference", fmt))
        elif name == "scale1":
            schemes.append(Scheme(name, Mode.STATIC, "1.0", fmt, "tensor", ones, q))
        elif name == "token":
            schemes.append(Scheme(name, Mode.TOKEN, "computed per token at cache write", fmt, "token"))
        elif name in ("max", "mse"):  # another observer's per-tensor scales, to set beside the checkpoint's
            if stats is None:
                skipped[name] = f"the checkpoint has no kvcal statistics to derive {name} scales from"
                continue
            source = f"the {name} observer on the checkpoint's kvcal statistics"
            schemes.append(Scheme(name, Mode.STATIC, source, fmt, "tensor", derived(name, "tensor"), q))
        elif name in ("tensor", "head") or name in DTYPES and DTYPES[name].scale == "tensor":
            # fp8_e5m2 and nvfp4 read the per-tensor k/v scales vLLM loads for fp8; neither quantizes queries.
            wanted = "head" if name == "head" else "tensor"
            scales, source = static_scales(name, wanted)
            if scales is None:
                skipped[name] = source
            elif name in ("tensor", "head"):
                schemes.append(Scheme(name, Mode.STATIC, source, fmt, name, scales, q))
            elif name == "fp8_e5m2":
                schemes.append(Scheme(name, Mode.STATIC, source, E5M2, "tensor", scales))
            else:
                schemes.append(Scheme(name, Mode.CACHE, source, fmt, "tensor", scales, cache=DTYPES[name]))
        elif name in DTYPES:
            schemes.append(Scheme(name, Mode.CACHE, "computed per token at cache write", fmt, "token", cache=DTYPES[name]))
        else:
            scales, file_granularity, file_notes = read_scales([Path(name)], layers, sig, method)
            if file_granularity is None:
                raise ValueError(f"{name} holds no k/v scales under this model's attention prefixes (e.g. {layers[0].prefix}.k_scale)")
            notes += [f"{Path(name).name}: {n}" for n in file_notes]
            scaled = {k: v * loaded_multiplier(method, fmt.name) for k, v in scales.items()}
            schemes.append(Scheme(Path(name).stem, Mode.STATIC, str(Path(name).resolve()), fmt, file_granularity, scaled, q))
    if sig.latent_dim:  # MLA: the latent cache in an fp8 format under one per-tensor k scale (docs/vllm-notes.md, MLA)
        other = [s for s in schemes if s.mode in (Mode.TOKEN, Mode.CACHE) or s.granularity == "head"]
        for scheme in other:
            skipped[scheme.name] = "not a cache vLLM's MLA layers take: kvcal emulates the latent cache in fp8 with per-tensor scales"
        schemes = [s for s in schemes if s not in other]
        if "scale1" not in config.schemes:
            schemes.append(Scheme("scale1", Mode.STATIC, "1.0: what vLLM 0.32 uses for MLA layers, whatever the checkpoint holds", fmt, "tensor", ones, q))
        held["serving"].append(f"{MLA_SCALES_IGNORED[1]}: the scale1 row is what serving gives today.")
        notes.append("MLA: K and V are decompressed from the quantized latent; unless --kv-only, the absorbed query is "
                     "quantized too and attention runs in vLLM's decode form, as on FlashMLA and the other backends that "
                     "take an FP8 query")
    return schemes, skipped, held


# ---- the passes ---------------------------------------------------------------------------------------------------


class _Apply:
    """Attention hook of a scheme's end-to-end pass: every layer quantized, then the model's own attention."""

    def __init__(self, scheme: Scheme, row_of: dict[int, int]):
        self.scheme, self.row_of = scheme, row_of

    def latent_transform(self, module, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA: the model decompresses K and V from the latent as the quantized cache would hold it."""
        return self.scheme.latent(self.row_of[module.layer_idx], kv_c, k_pe)

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        row = self.row_of[module.layer_idx]
        if is_latent(module):  # K and V come from the quantized latent already (latent_transform)
            if not self.scheme.latent_query(row):
                return base_attention(module, query, key, value, attention_mask, **kwargs)
            kv_c, k_pe = cached_latent(module)
            return absorbed_attention(module, query, kv_c, k_pe, self.scheme.query_quantizer(row), attention_mask, base_attention, **kwargs)
        # The cache holds unquantized K/V, so quantizing past + new here equals quantizing each position once on write.
        q, k, v = self.scheme.apply(self.row_of[module.layer_idx], query, key, value)
        return base_attention(module, q, k, v, attention_mask, **kwargs)


@dataclass
class _Tally:
    """Running sums of one scheme over the sample."""

    err_sq: torch.Tensor  # [L] float64, Σ‖o_scheme − o_ref‖² of each layer's attention output (its own inputs)
    counts: dict[str, torch.Tensor]  # kind → [L, 3] int64: saturated, underflowed (subnormal or zero), total
    seq_kl: list[float] = field(default_factory=list)  # per sequence: mean KL(ref ‖ scheme), nats/token
    seq_nll: list[float] = field(default_factory=list)  # per sequence: mean next-token NLL
    seq_top1: list[float] = field(default_factory=list)  # per sequence: top-1 agreement with the reference
    seconds: float = 0.0


class _ReferenceProbe:
    """Hook of the reference pass: the model's own attention, plus every scheme's on the same inputs."""

    def __init__(self, schemes: list[Scheme], tallies: dict[str, _Tally], row_of: dict[int, int], num_layers: int):
        self.schemes, self.tallies, self.row_of = schemes, tallies, row_of
        self.ref_sq = torch.zeros(num_layers, dtype=torch.float64)
        self.capture: dict[int, dict] = {}  # layer row → FA3 inputs, filled while ``fa3_rows`` is set
        self.fa3_rows: torch.Tensor | None = None  # absolute positions to capture for the FA3 model
        self.fa3_layers: set[int] = set()

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        out = base_attention(module, query, key, value, attention_mask, **kwargs)
        row, S = self.row_of[module.layer_idx], query.shape[2]
        ref = out[0].float()  # [B, S, Hq, D]
        self.ref_sq[row] += ref.square().sum(dtype=torch.float64)
        latent = cached_latent(module) if is_latent(module) else None
        if latent is not None:  # MLA: the latent row is what is cached, K and V alike, and the absorbed query
            q_abs, cached = latent_view(module, query, *latent)
            new = {"q": q_abs, "k": cached[:, :, -S:], "v": cached[:, :, -S:]}
        else:
            new = {"q": query, "k": key[:, :, -S:], "v": value[:, :, -S:]}  # count each position once
        for scheme in self.schemes:
            if not scheme.kinds():
                continue
            tally = self.tallies[scheme.name]
            if latent is not None:
                o = scheme.latent_attention(row, module, query, *latent, attention_mask, base_attention, **kwargs)[0]
            else:
                o = base_attention(module, *scheme.apply(row, query, key, value), attention_mask, **kwargs)[0]
            tally.err_sq[row] += (o.float() - ref).square().sum(dtype=torch.float64)
            for kind in scheme.counted():
                tally.counts[kind][row] += range_counts(new[kind], scheme.scale(kind, row, new[kind]), scheme.fmt)
        if self.fa3_rows is not None and row in self.fa3_layers and latent is None:
            start = key.shape[2] - S
            local = self.fa3_rows - start  # [R] row index inside this chunk
            if (local >= 0).all() and (local < S).all():
                self.capture[row] = {
                    "q": query[0, :, local].double().cpu(),  # [Hq, R, D]
                    "k": key[0].double().cpu(), "v": value[0].double().cpu(),  # [Hkv, N, D]
                    "model_out": out[0][0, local].transpose(0, 1).double().cpu(),  # [Hq, R, D]
                    "scaling": kwargs.get("scaling") or module.head_dim**-0.5,
                    "window": kwargs.get("sliding_window"),
                    "softcap": kwargs.get("softcap"),
                }
        return out


@torch.no_grad()
def range_counts(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """[saturated, underflowed, total] counts (int64, CPU) of ``x / scale`` in ``fmt``.

    Saturated: beyond the largest finite value by more than float32 rounding of the scale (a
    per-token scale of amax / 448 puts the largest element at 448 up to one rounding). Underflowed:
    non-zero but below the smallest normal, so stored as a subnormal or zero.
    """
    a = (x.float() / scale).abs()
    saturated = (a > fmt.max * (1 + SATURATION_SLACK)).sum()
    underflow = ((a > 0) & (a < fmt.min_normal)).sum()
    return torch.stack([saturated, underflow, torch.tensor(a.numel(), device=a.device)]).cpu()


def _positions_metrics(ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor], logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """Sums over positions of KL(ref ‖ scheme), NLL of ``targets`` and top-1 agreement.

    ``ref`` is the reference's (logits [n, V], probabilities [n, V], argmax [n]), computed once per chunk;
    ``logits`` [n, V] are the scheme's.
    """
    ref_logits, ref_p, ref_top = ref
    lp = torch.log_softmax(logits, -1)  # [n, V]
    # KL = Σ p·(lp_ref − lp) = log Σ p·exp(−d) with d = ref_logits − logits centred under p (KL ignores a constant
    # shift). Two logits of one position differ little, so d keeps float32's precision, and KL its own relative
    # precision even at 1e-8 nats, where Σ p·(lp_ref − lp) is all rounding (numbers near ln V subtracted).
    d = ref_logits - logits  # [n, V]
    d = d - (ref_p * d).sum(-1, keepdim=True)
    kl = torch.log1p((ref_p * torch.expm1(-d)).sum(-1)).clamp(min=0)  # [n]
    nll = -lp.gather(-1, targets[:, None]).squeeze(-1)  # [n]
    agree = ref_top == lp.argmax(-1)  # [n]
    return kl.sum(dtype=torch.float64).item(), nll.sum(dtype=torch.float64).item(), agree.sum().item()


@torch.no_grad()
def measure(
    model, layers, schemes: list[Scheme], sequences: list[torch.Tensor], config: VerifyConfig, fa3_rows: torch.Tensor | None
) -> tuple[dict[str, _Tally], _ReferenceProbe, list[float], float]:
    """Reference pass and one end-to-end pass per scheme over every sequence, chunk by chunk.

    Each chunk runs through the reference and then every scheme, each with its own KV cache, so only
    one chunk's logits per run are held at a time.

    Returns:
        (tallies per scheme, the reference probe with its per-layer sums and FA3 capture,
        reference NLL per sequence, seconds spent in reference passes).
    """
    device = next(model.parameters()).device
    row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
    L = len(layers)
    tallies = {s.name: _Tally(torch.zeros(L, dtype=torch.float64), {k: torch.zeros(L, 3, dtype=torch.int64) for k in s.counted()}) for s in schemes}
    probe = _ReferenceProbe(schemes, tallies, row_of, L)
    probe.fa3_layers = set(fa3.layer_rows(config.fa3_layers, [layer.layer_idx for layer in layers])) if fa3_rows is not None else set()
    ref_nll, ref_seconds = [], 0.0
    for i, seq in enumerate(tqdm(sequences, desc="verifying", unit="seq", disable=not config.progress)):
        ids = seq.to(device)[None]  # [1, S]
        probe.fa3_rows = fa3_rows if i == 0 else None
        # One chunked prefill per run, each with its own cache and hook, advanced chunk by chunk in turn.
        chunk_len = config.data.chunk_len
        ref_run = prefill_chunks(model, ids, chunk_len, hook=probe, keep_from=0)
        runs = {s.name: prefill_chunks(model, ids, chunk_len, hook=_Apply(s, row_of), keep_from=0) for s in schemes}
        sums = {name: [0.0, 0.0, 0.0] for name in tallies}
        nll = 0.0
        for start in range(0, ids.shape[1] - 1, chunk_len):  # a last chunk of only the final token never runs
            targets = ids[0, start + 1 : start + 1 + chunk_len]  # [n] next tokens; the last position has none
            t0 = time.perf_counter()
            ref_logits = next(ref_run)[: len(targets)]  # [n, V]
            ref_lp = torch.log_softmax(ref_logits, -1)  # [n, V]
            ref = (ref_logits, ref_lp.exp(), ref_lp.argmax(-1))
            nll -= ref_lp.gather(-1, targets[:, None]).sum(dtype=torch.float64).item()
            ref_seconds += time.perf_counter() - t0
            for scheme in schemes:
                t0 = time.perf_counter()
                with scheme.precision(device):
                    logits = next(runs[scheme.name])[: len(targets)]  # [n, V]
                tallies[scheme.name].seconds += time.perf_counter() - t0
                for j, value in enumerate(_positions_metrics(ref, logits, targets)):
                    sums[scheme.name][j] += value
        n = ids.shape[1] - 1
        ref_nll.append(nll / n)
        for name, (kl, scheme_nll, agree) in sums.items():
            tallies[name].seq_kl.append(kl / n)
            tallies[name].seq_nll.append(scheme_nll / n)
            tallies[name].seq_top1.append(agree / n)
    return tallies, probe, ref_nll, ref_seconds


def _fa3(probe: _ReferenceProbe, rows: torch.Tensor, schemes: list[Scheme], layers, sig: ModelSignature, config: VerifyConfig) -> dict:
    """``fa3.probe`` on the rows the reference pass captured, for every static scheme."""
    return fa3.probe(
        probe.capture, rows, {s.name: s.scales for s in schemes if s.mode == Mode.STATIC}, get_format(config.fp8_format),
        layer_idx=[layer.layer_idx for layer in layers], groups=sig.num_heads // sig.num_kv_heads, head_dim=sig.head_dim,
        accum_bits=config.accum_bits, unmodelled=[s.name for s in schemes if s.mode == Mode.TOKEN],
    )


def _needle(model, tokenizer, layers, schemes: list[Scheme], config: VerifyConfig, context: int | None) -> dict:
    """``needle.needle_probe`` under each scheme's end-to-end hook, the reference first when not among the schemes."""
    row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
    runs = schemes if any(s.mode == Mode.REFERENCE for s in schemes) else [Scheme(REFERENCE, Mode.REFERENCE, "", schemes[0].fmt), *schemes]
    return needle_probe(
        model, tokenizer, {s.name: _Apply(s, row_of) for s in runs}, reference=REFERENCE, lengths=config.needle,
        depths=config.needle_depths, data=config.data, context=context, progress=config.progress,
    )


# ---- derived results ----------------------------------------------------------------------------------------------


def scheme_result(scheme: Scheme, tally: _Tally, ref_sq: torch.Tensor, ref_nll: list[float]) -> dict:
    """Every number of one scheme, as plain JSON-able values (the verdict comes once the floor is known)."""
    kl, kl_se = mean_stderr(tally.seq_kl)
    nll, ref_mean_nll = sum(tally.seq_nll) / len(tally.seq_nll), sum(ref_nll) / len(ref_nll)
    top1 = sum(tally.seq_top1) / len(tally.seq_top1)
    frac = {k: {"saturated": (c[:, 0] / c[:, 2].clamp(min=1)).tolist(), "underflow": (c[:, 1] / c[:, 2].clamp(min=1)).tolist()} for k, c in tally.counts.items()}
    result = {
        "mode": scheme.mode, "granularity": scheme.granularity, "source": scheme.source, "quantizes_query": scheme.quantize_query,
        "note": SCHEME_NOTES.get(scheme.name, "static scales from a file"),
        "layer_rel_error": (tally.err_sq / ref_sq.clamp(min=1e-300)).sqrt().tolist() if scheme.kinds() else [0.0] * len(ref_sq),
        "fractions": frac,
        "kl": kl, "kl_stderr": kl_se, "kl_per_sequence": tally.seq_kl,
        "nll": nll, "ppl": math.exp(nll), "ppl_reference": math.exp(ref_mean_nll), "ppl_change": math.exp(nll - ref_mean_nll) - 1,
        "top1": top1, "seconds": tally.seconds,
        "scales": {k: v.tolist() for k, v in scheme.scales.items()},
    }
    return result


# What the floor computes in, by the reference's dtype: bf16 against float32, and for a half-precision reference
# the other half precision (float16 rounds finer than bf16, so bf16 vs float16 is about bf16's own rounding).
FLOOR_DTYPES = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


def floor_scheme(reference_dtype: torch.dtype, fmt: FP8Format) -> Scheme:
    """The floor: the unquantized model computed in ``FLOOR_DTYPES[reference_dtype]`` (autocast), KV cache included."""
    other = FLOOR_DTYPES[reference_dtype]
    name = str(other).removeprefix("torch.")
    return Scheme(FLOOR, Mode.FLOOR, f"{name} compute against the {str(reference_dtype).removeprefix('torch.')} reference", fmt,
                  autocast=other)


@torch.no_grad()
def probe_skip_layers(model, layers, scheme: Scheme, result: dict, sequences: list[torch.Tensor], config: VerifyConfig) -> dict:
    """What keeping each layer unquantized gains end to end, for ``scheme``: estimated for every layer, measured for some.

    The estimate is each layer's own attention-output error (``layer_rel_error``: the layer quantized alone on
    the reference's inputs). The ``probe_layers`` layers measured are the ones the estimate ranks highest, plus
    the median-ranked one as a control: one pass each with every other layer quantized, paired with the
    scheme's own pass over the same sequences. ``verdict.skip_choice`` then picks the layers worth keeping.
    """
    start = time.perf_counter()
    estimate = result["layer_rel_error"]
    ranked = sorted(range(len(layers)), key=lambda row: -estimate[row])
    rows = ranked[: config.probe_layers]
    if 2 <= config.probe_layers < len(ranked):  # the last one measured is the control
        rows = ranked[: config.probe_layers - 1] + [ranked[(config.probe_layers - 1 + len(ranked)) // 2]]
    variants = [replace(scheme, name=f"{scheme.name} skip {layers[row].layer_idx}", skip=frozenset({row})) for row in rows]
    tallies = measure(model, layers, variants, sequences, config, None)[0]
    measured = []
    for row, variant in zip(rows, variants):
        gain = [a - b for a, b in zip(result["kl_per_sequence"], tallies[variant.name].seq_kl)]
        mean, se = mean_stderr(gain)
        measured.append({"layer": layers[row].layer_idx, "row": row, "estimate": estimate[row], "kl_without": sum(tallies[variant.name].seq_kl) / len(sequences),
                         "gain": mean, "gain_stderr": se})
    return {"scheme": scheme.name, "kl": result["kl"], "estimate": estimate, "layers": [layer.layer_idx for layer in layers],
            "measured": measured, "seconds": time.perf_counter() - start, **skip_choice(result["kl"], measured, len(layers))}


def scheme_dtype(scheme: Scheme) -> str:
    """The ``--kv-cache-dtype`` a scheme stands for (``kvdtypes.DTYPES``'s name)."""
    if scheme.mode == Mode.CACHE:
        return scheme.cache.name
    if scheme.mode == Mode.TOKEN:
        return "fp8_per_token_head"
    if scheme.mode == Mode.STATIC:
        return "fp8_e5m2" if scheme.fmt == E5M2 else "fp8"
    return "auto"


def _kv_layers(model_config, layers: list[AttentionLayer], sig: ModelSignature) -> list[LayerKV]:
    """The attention layers as ``capacity`` sizes them: vLLM's index, KV heads, head size, sliding window."""
    window = getattr(model_config.get_text_config(), "sliding_window", None)
    return [LayerKV(layer.layer_idx, sig.num_kv_heads, sig.head_dim, _value_dim(sig), window if layer.sliding_window else None)
            for layer in layers]


def _value_dim(sig: ModelSignature) -> int:
    """Width of a cached V head: MLA caches no V (the latent row serves both), other models one as wide as K."""
    return 0 if sig.latent_dim else sig.head_dim


def _bytes_of(name: str):
    """``capacity``'s bytes per token of a layer in cache dtype ``name``."""
    return lambda layer: DTYPES[name].bytes_per_token(layer.heads, layer.head_dim, layer.head_dim_v)


def does_it_pay(config: VerifyConfig, kv_layers: list[LayerKV], files: list[Path], results: dict, context: int) -> dict:
    """``capacity.plan`` for bf16 and every measured scheme's cache dtype at ``--max-model-len`` on ``--gpu``."""
    names = dict.fromkeys(["auto", *(r["kv_dtype"] for r in results.values())])
    result = plan(kv_layers, sum(tensor_bytes(f) for f in files), config.max_model_len or context, config.gpu,
                  {name: _bytes_of(name) for name in names}, tp=config.tp)
    return {**result, "gpu": config.gpu}


def skip_cost(kv_layers: list[LayerKV], dtype: str, skip: list[int], context: int) -> dict:
    """KV bytes per token at ``context`` with every layer in ``dtype``, and with the ``skip`` layers in bf16."""
    return {"all_quantized": per_token(kv_layers, _bytes_of(dtype), context),
            "with_skip": per_token(kv_layers, _bytes_of(dtype), context, skip=set(skip), bf16_bytes_of=_bytes_of("auto"))}


# ---- the command --------------------------------------------------------------------------------------------------


@dataclass
class VerifyResult:
    """Every number of a verify run (``report``, as written to report.json) and where the report went."""

    report: dict
    report_dir: Path | None

    @property
    def schemes(self) -> dict[str, dict]:
        return self.report["schemes"]

    def summary(self) -> str:
        """The verdict table, the recommendation and the serve command, for a person."""
        text = report.verify_text(self.report)
        return text + (f"\nreport: {self.report_dir / 'report.md'}" if self.report_dir else "")


def _load_stats(directory: Path, sig: ModelSignature) -> Stats | None:
    """The checkpoint's kvcal statistics, checked against the model, or None when it has none."""
    path = directory / STATS_PATH
    if not path.is_file():
        return None
    stats = Stats.load(path)
    stats.signature.check_matches(sig, f"the statistics in {path}")
    return stats


def _sample(data_config: DataConfig, tokenizer, context: int | None) -> tuple[list[torch.Tensor], list[dict]]:
    """Whole sequences of exactly seq_len tokens (a shorter last one is dropped), and the data manifest."""
    stream = iter_sequences(data_config, tokenizer, max_context=context)
    sequences = [s for s in stream if s.numel() == data_config.seq_len]
    if not sequences:
        raise ValueError(f"the data gives {stream.tokens_yielded} tokens, less than one sequence of --seq-len "
                         f"{data_config.seq_len}; lower --seq-len or add data")
    return sequences, stream.manifest()


def _position_profile(stats: Stats | None) -> dict | None:
    """Absmax by position bucket (max over heads) from the statistics, for the report's position plot."""
    if stats is None:
        return None
    return {
        "bucket_starts": position_bucket_starts(),
        "tokens": stats.pos_tokens.tolist(),  # [L, P]
        **{kind: stats.kinds[kind].pos_absmax.amax(1).tolist() for kind in ("k", "v", "q")},  # [L, P]
    }


def verify(checkpoint: str | Path, data: str | Path | list[str], **options) -> VerifyResult:
    """Measure what an FP8 KV cache costs ``checkpoint`` on ``data``, per scheme, and recommend how to serve it.

    ``options`` are flat settings, each going to the part of ``VerifyConfig`` that owns it: ``seq_len``,
    ``max_tokens``, ``chunk_len``, ``text_field``, ``seed`` (the sample), ``max_kl``, ``fail_kl``, ``min_top1``,
    ``fail_top1`` (the thresholds) and VerifyConfig's own fields (schemes, fa3, accum_bits, needle, report_dir...).
    """
    return run_verify(VerifyConfig.from_options(checkpoint, data, **options))


def run_verify(config: VerifyConfig) -> VerifyResult:
    """Run a verify; see ``verify``."""
    start = time.perf_counter()
    # 1. Cheap checks of every option and data source before the model is loaded.
    config.validate()
    fmt = get_format(config.fp8_format)
    files = weight_files(Path(config.checkpoint))  # vLLM's files, every header checked

    # 2. The sample, before the model is loaded: data too short for one sequence is refused cheaply.
    device = resolve_device(config.device)
    model_config = read_config(config.checkpoint)
    context = max_context(model_config)
    tokenizer = load_tokenizer(config.checkpoint)
    check_tokenizer_fits(config.checkpoint, model_config, tokenizer)
    sequences, manifest = _sample(config.data, tokenizer, context)
    sampled = time.perf_counter()

    # 3. The reference model (float32 on CPU by default, K and V unquantized) and its attention layers.
    model, _ = load_model(config.checkpoint, device=device, dtype=getattr(torch, config.dtype) if config.dtype else None,
                          tokenizer=tokenizer)
    layers = checkpoint_named(attention_layers(model), config.checkpoint)
    sig = signature(model, layers)
    if sig.latent_dim and config.fa3:
        raise ValueError("--fa3 models FlashAttention-3, which vLLM does not run for latent attention (MLA): drop --fa3")
    loaded = time.perf_counter()

    # 4. Schemes (the checkpoint's scales, scales derived from its statistics, named files), then the reference
    # pass and one pass per scheme.
    stats = _load_stats(Path(config.checkpoint), sig)
    schemes, skipped, held = build_schemes(config, files, layers, sig, stats, fmt)
    floor = [floor_scheme(model.dtype, fmt)] if config.floor else []
    fa3_rows = fa3.query_rows(config.data.seq_len, config.data.chunk_len, config.fa3_rows) if config.fa3 else None
    tallies, probe, ref_nll, ref_seconds = measure(model, layers, schemes + floor, sequences, config, fa3_rows)
    measured = time.perf_counter()

    # 5. Optional probes: the FA3 numeric model on sampled rows, and the needle.
    fa3_result = _fa3(probe, fa3_rows, schemes, layers, sig, config) if config.fa3 else None
    probed = time.perf_counter()
    needle_result = _needle(model, tokenizer, layers, schemes, config, context) if config.needle else None

    # 6. Numbers; the limits, from the floor unless set; verdicts; which layers to keep unquantized; the recommendation.
    results = {s.name: scheme_result(s, tallies[s.name], probe.ref_sq, ref_nll) for s in schemes + floor}
    for name, r in results.items():
        check_measured(name, r)
    floor_result = results.pop(FLOOR, None)
    limits = config.thresholds.resolve(floor_result)
    for name, r in results.items():
        if needle_result and r["mode"] != Mode.REFERENCE:
            r["needle_lost"] = needle_result["summary"][name]["lost"]
        r["verdict"], r["reasons"] = judge(r, limits)
    choice = choose(results)
    skip_probe = None
    if choice is not None and config.probe_layers and len(layers) > 1 and results[choice]["mode"] != Mode.REFERENCE:
        skip_probe = probe_skip_layers(model, layers, next(s for s in schemes if s.name == choice), results[choice], sequences, config)
    for name, r in results.items():
        r["kv_dtype"] = scheme_dtype(next(s for s in schemes if s.name == name))
        r["bytes_per_token"] = len(layers) * DTYPES[r["kv_dtype"]].bytes_per_token(sig.num_kv_heads, sig.head_dim, _value_dim(sig))
        r["bytes_vs_bf16"] = DTYPES[r["kv_dtype"]].bytes_per_token(1, sig.head_dim, _value_dim(sig)) / DTYPES["auto"].bytes_per_token(1, sig.head_dim, _value_dim(sig))
    kv_layers = _kv_layers(model.config, layers, sig)
    pays = does_it_pay(config, kv_layers, files, results, context or config.data.seq_len)
    if skip_probe is not None:
        skip_probe["bytes_per_token"] = skip_cost(kv_layers, results[skip_probe["scheme"]]["kv_dtype"], skip_probe["skip"], pays["context"])
    recommendation, serve = recommend(results, held, layers, config.checkpoint, skip_probe, pays)
    dtype = str(model.dtype).removeprefix("torch.")
    rep = {
        "kvcal_version": report.kvcal_version(),
        "checkpoint": str(Path(config.checkpoint).resolve()),
        "reference": {"name": REFERENCE, "dtype": dtype, "device": str(device),
                      "note": f"the reference is the unquantized model in {dtype}, called {REFERENCE} as vLLM would serve it"},
        "fp8_format": fmt.name,
        "settings": config.settings(),
        "data": manifest,
        "sample": {"sequences": len(sequences), "seq_len": config.data.seq_len, "tokens": len(sequences) * config.data.seq_len},
        "layers": [vars(layer) for layer in layers],
        "checkpoint_scales": held,
        "floor": floor_result,
        "thresholds": {**{name: getattr(limits, name) for name in Thresholds.LIMITS}, "origin": config.thresholds.origin(),
                       "floor_pass": limits.floor_pass, "floor_fail": limits.floor_fail,
                       "relative_to_floor": floor_result is not None and floor_result["kl"] > 0},
        "schemes": results,
        "skip_layers": skip_probe,
        "does_it_pay": pays,
        "skipped": skipped,
        "fa3": fa3_result,
        "needle": needle_result,
        "recommendation": recommendation,
        "serve_command": serve,
        "position_profile": _position_profile(stats),
        "timings": {
            "sample_s": sampled - start, "load_s": loaded - sampled, "passes_s": measured - loaded,
            "reference_pass_s": ref_seconds, "scheme_pass_s": {n: t.seconds for n, t in tallies.items()},
            "skip_probe_s": skip_probe["seconds"] if skip_probe else 0.0, "fa3_s": probed - measured, "needle_s": time.perf_counter() - probed, "total_s": time.perf_counter() - start,
        },
    }
    # 7. Report files.
    out = None
    if config.report_dir is not None:
        out = Path(config.report_dir)
        report.write_verify_report(out, rep)
    return VerifyResult(rep, out)

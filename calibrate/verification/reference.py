"""verify's reference: the model K and V are measured against, unquantized, under the checkpoint's layer names.

The checkpoint's kvcal statistics are checked against it; without statistics, its scales are checked on a short
held-out sample through it (``scale_check.sample_statistics``). Under ``--engine`` the model leaves the GPU while vLLM
runs there, and comes back for the passes after.
"""

from dataclasses import dataclass

import torch

from ..capture.stats import Stats
from ..checkpoint.scale_check import checkpoint_findings, refuse, sample_statistics
from ..fp8 import get_format
from ..layout import stats_path
from ..model.layers import AttentionLayer, ModelSignature, attention_layers, checkpoint_named, signature
from ..model.load import load_model
from .config import VerifyConfig
from .subject import Subject


@dataclass(frozen=True)
class Reference:
    """The reference model on its device, its attention layers under the checkpoint's names, their signature and the
    checkpoint's kvcal statistics (None: it has none)."""

    model: torch.nn.Module
    device: torch.device
    layers: list[AttentionLayer]
    sig: ModelSignature
    stats: Stats | None


def load_reference(config: VerifyConfig, subject: Subject, device: torch.device, tokenizer,
                   sequences: list[torch.Tensor]) -> Reference:
    """The reference model (float32 on CPU by default, K and V unquantized), its attention layers under the names the
    checkpoint's files give them, and the checkpoint's statistics checked against it; without statistics, its scales
    checked on the first tokens of ``sequences`` (``scale_check.sample_statistics``)."""
    model, _ = load_model(config.checkpoint, device=device, dtype=getattr(torch, config.dtype) if config.dtype else None,
                          tokenizer=tokenizer, config=subject.described.config)
    layers = checkpoint_named(attention_layers(model), subject.prefixes)
    sig = signature(model, layers)
    if sig.latent_dim and config.fa3:
        raise ValueError("--fa3 models FlashAttention-3, which vLLM does not run for latent attention (MLA): drop --fa3")
    path = stats_path(config.checkpoint)
    stats = Stats.load(path) if path.is_file() else None
    if stats is not None:
        stats.signature.check_matches(sig, f"the statistics in {path}")
    else:  # no statistics to hold the scales to: a short held-out sample through the model instead
        refuse(checkpoint_findings(config.checkpoint, subject.files, subject.described.config, subject.described.quant,
                                   lambda: sample_statistics(model, layers, sig, sequences), get_format(config.fp8_format)),
               config.checkpoint)
    return Reference(model, device, layers, sig, stats)


def reference_model(quant: dict | None, model: torch.nn.Module, dtype: str) -> str:
    """What the reference is, in words: the unquantized model, or a ``quant_method: fp8`` release's FP8-weight model
    as it is served (transformers runs its e4m3 block weights natively on GPUs that can, and elsewhere, CPU included,
    dequantizes them, e4m3 × block scale, to the load dtype); K and V unquantized either way."""
    if quant is None or quant.get("quant_method") != "fp8":  # quant: the quantization config vLLM uses (quant_config)
        return "unquantized model"
    if any(p.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) for p in model.parameters()):
        return "FP8-weight model as served (quant_method fp8: its e4m3 block weights run natively by transformers)"
    return (f"FP8-weight model as served (quant_method fp8: its e4m3 block weights, the ones vLLM computes with, "
            f"dequantized by transformers to {dtype})")


def off_gpu(ref: Reference, on_gpu: bool) -> None:
    """Move the reference model off the GPU the engine will run on (``on_gpu``): each vLLM start sizes its share of
    the card from the memory free then (``jobs/jobkit.py`` ``device_memory``), which the model would otherwise hold.
    ``on_device`` moves it back for the emulation's later passes."""
    if on_gpu:
        ref.model.to("cpu")
        torch.cuda.empty_cache()


def on_device(ref: Reference) -> None:
    """The reference model back on its device, for a pass after the engine ran (the skip-layer probe)."""
    if next(ref.model.parameters()).device != ref.device:
        ref.model.to(ref.device)

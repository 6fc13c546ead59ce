"""FP8 weights from llm-compressor, so that one ``kvcal calibrate --weights fp8`` run writes FP8 weights and KV scales.

llm-compressor (the ``kvcal[llmcompressor]`` extra) quantizes the weights with its data-free ``FP8_DYNAMIC``
scheme: FP8 weights with one scale per output channel, activations quantized per token at serve time, every
``Linear`` except ``lm_head``. The result is a compressed-tensors checkpoint, into which kvcal's export then
merges its ``kv_cache_scheme`` and scale tensors like into any other compressed-tensors checkpoint.

llm-compressor pins transformers<=5.17, so install it in a virtual environment of its own.
"""

from pathlib import Path

from ..choices import check_weights
from ..files import apply_umask
from ..model.description import ModelDescription
from .write import copy_other_files

SCHEMES = {"fp8": "FP8_DYNAMIC"}  # --weights value → llm-compressor preset scheme
PROVENANCE = {"fp8": "fp8 (llm-compressor FP8_DYNAMIC, data-free)"}
_MISSING = (
    "--weights fp8 needs llm-compressor: pip install 'kvcal[llmcompressor]' "
    "(it pins transformers<=5.17; use its own virtualenv)"
)
# Source files that save_pretrained writes itself, or that describe the old weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SKIP = {"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json", "kvcal"}


def check_available(described: ModelDescription, scheme: str) -> None:
    """Cheap checks before any model is loaded: llm-compressor imports and the source is not quantized already."""
    check_weights(scheme)
    quant = described.quant
    if quant is not None:
        raise ValueError(
            f"{described.directory} is already quantized ({quant.get('quant_method', 'unknown method')}); "
            "--weights fp8 needs an unquantized checkpoint (drop --weights to add KV scales to this one)"
        )
    _check_installed()


def _check_installed() -> None:
    try:
        import llmcompressor  # noqa: F401
    except ImportError:
        raise ValueError(_MISSING) from None


def quantize_weights(model_dir: Path, out_dir: Path, scheme: str = "fp8") -> Path:
    """Write ``model_dir`` with FP8 weights (llm-compressor, data-free) as a compressed-tensors checkpoint in ``out_dir``.

    ``out_dir`` is created (it must not exist) and owned by the caller, who removes it. Tokenizer, generation
    config, chat template and any other non-weight files of the source are copied alongside.
    """
    check_weights(scheme)  # the source's own checks are step 1's (``check_available``), on the command's description
    _check_installed()
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    # oneshot needs the model's name_or_path to be the real directory; dtype as stored (bf16 stays bf16).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    recipe = QuantizationModifier(targets="Linear", scheme=SCHEMES[scheme], ignore=["lm_head"])
    with torch.no_grad():
        oneshot(model=model, recipe=recipe)
    out_dir.mkdir()
    model.save_pretrained(out_dir, save_compressed=True)
    written = {p.name for p in out_dir.iterdir()}
    copy_other_files(model_dir, out_dir, skip=written | _SKIP, weight_suffixes=_WEIGHT_SUFFIXES)
    apply_umask(out_dir)  # save_pretrained's safetensors shards are 0600; the output links them
    return out_dir

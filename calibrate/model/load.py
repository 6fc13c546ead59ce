"""Load a Hugging Face causal LM for calibration, place it, and describe its attention layers."""

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..choices import size_text
from .description import read_config
from .directory import KV_SCALE_PATTERN, text_part

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def resolve_device(device: str) -> torch.device:
    """``auto`` → the first CUDA device when there is one, else CPU; refuse an unavailable CUDA."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was asked for but no CUDA GPU is visible; use --device cpu or auto")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None


def transformers_reason(error: BaseException) -> str:
    """The first sentence of a transformers error, at most 160 characters: its reason, without the paragraphs of
    advice that follow it, so that kvcal's refusal stays one line."""
    text = " ".join(str(error).split())
    first = text.split(". ")[0].rstrip(".:")
    return first if len(first) <= 160 else first[:157] + "..."


@dataclass(frozen=True)
class Placement:
    """Where the model goes: wholly on ``device``, or (``device_map`` set) by accelerate over GPUs, CPU and disk.

    With a device map, ``device`` is the one the run expects to compute on (the first GPU given, else CPU): it
    picks the default dtype; the device inputs really go to is read back from the loaded model (``input_device``).
    """

    device: torch.device
    device_map: str | None = None
    max_memory: dict[int | str, int] | None = None
    offload_folder: str | None = None


def resolve_placement(
    device: str, *, device_map: str | None = None, max_memory: dict[int | str, int] | None = None, offload_folder: str | None = None,
) -> Placement:
    """The placement of validated settings (``CalibrationConfig``): any device-map setting means accelerate's map.

    ``device`` is ``auto`` or ``cpu`` then (config.validate refuses others); ``cpu`` keeps the GPUs out of the map.
    Refuses a GPU index that is not visible.
    """
    if device_map is None and max_memory is None and offload_folder is None:
        return Placement(resolve_device(device))
    visible = torch.cuda.device_count()
    gpus = sorted(k for k in max_memory if isinstance(k, int)) if max_memory is not None else []
    missing = [g for g in gpus if g >= visible]
    if missing:
        fix = f"name GPUs 0 to {visible - 1}" if visible else "give cpu=SIZE (and disk) only"
        raise ValueError(f"--max-memory names GPU {missing[0]}, but {visible} GPUs are visible; {fix}")
    if max_memory is None and device == "cpu" and visible:
        from accelerate.utils import get_max_memory

        max_memory = {"cpu": get_max_memory()["cpu"]}  # only the CPU (and disk): --device cpu keeps the GPUs out
    if max_memory is None:
        main = torch.device("cuda:0" if visible else "cpu")
    else:
        main = torch.device(f"cuda:{gpus[0]}" if gpus else "cpu")
    return Placement(main, device_map or "auto", max_memory, offload_folder)


def input_device(model: nn.Module) -> torch.device:
    """Where input ids must go: the embedding's device, or, when accelerate offloads it, the device it runs on."""
    embedding = model.get_input_embeddings()
    hook = getattr(embedding, "_hf_hook", None)
    execution = getattr(hook, "execution_device", None)
    return torch.device(execution) if execution is not None else embedding.weight.device


def decoder_layer_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of the largest block accelerate never splits across devices (a decoder layer), in ``dtype``.

    Measured on a weightless (meta) copy of the model, so any architecture, MoE included, is counted as
    transformers builds it. Quantized weights count at ``dtype`` (an overestimate for FP8 weights).
    """
    with torch.device("meta"), _quiet_transformers():
        meta = auto_class(hf_config).from_config(hf_config, dtype=dtype)
    no_split = set(meta._no_split_modules or ())
    blocks = [m for m in meta.modules() if type(m).__name__ in no_split] or [meta]
    return max(sum(t.numel() * t.element_size() for t in (*b.parameters(), *b.buffers())) for b in blocks)


def check_fits_one_layer(model_dir: str | Path, hf_config, dtype: torch.dtype, max_memory: dict[int | str, int]) -> None:
    """Refuse budgets in which no computing device (a GPU or the CPU) can hold one decoder layer.

    accelerate runs each layer on a GPU or the CPU, bringing offloaded weights there for it; with less room
    than one layer it would silently put the whole model on disk and still need that room while it runs.
    """
    needed = decoder_layer_bytes(hf_config, dtype)
    compute = {k: v for k, v in max_memory.items() if k != "disk"}
    if max(compute.values(), default=0) < needed:
        given = ",".join(f"{k}={size_text(v)}" for k, v in compute.items())
        name = "cpu" if "cpu" in compute or not compute else next(iter(compute))
        raise ValueError(
            f"--max-memory {given} cannot hold one decoder layer of {model_dir}, which needs {size_text(needed)} in "
            f"{str(dtype).removeprefix('torch.')}; give one device at least that, e.g. {name}={-(-needed // 2**20)}MiB"
        )


def default_dtype(device: torch.device, config: dict) -> torch.dtype:
    """Checkpoint dtype on GPU; float32 on CPU, where bf16 matmuls are slow and add their own rounding."""
    if device.type == "cpu":
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16


def without_kv_quantization(config) -> None:
    """Drop the KV-cache part of a checkpoint's compressed-tensors ``quantization_config``, in place.

    kvcal measures and captures K and V itself, so the model it runs must not quantize them. Left in,
    the compressed-tensors integration of transformers quantizes K and V with its own scale parameters,
    which hold garbage when the loader misses the checkpoint's scales (and double-quantize otherwise).
    A config with nothing else (KV-only) is removed; quantized weights stay as the checkpoint has them.
    """
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        quant = getattr(cfg, "quantization_config", None)
        if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
            continue
        rest = {k: v for k, v in quant.items() if k != "kv_cache_scheme"}
        if rest.get("config_groups"):
            cfg.quantization_config = rest
        else:
            del cfg.quantization_config


def load_model(
    model_dir: str | Path, *, device: torch.device, dtype: torch.dtype | None = None, placement: Placement | None = None,
    trust_remote_code: bool = False, tokenizer: "PreTrainedTokenizerBase | None" = None, config: dict | None = None,
):
    """Load model and tokenizer from a local directory, in eval mode, on ``device``, without KV quantization.

    A caller that opened its data first passes the ``tokenizer`` it loaded for that, which is then returned as it is,
    and a caller that read config.json (``read_config``) passes it as ``config``, so that it is read once.

    With a ``placement`` that has a device map, transformers places the model with accelerate instead (GPUs, then
    CPU, then disk, within ``max_memory``): layers offloaded to CPU or disk run on ``input_device(model)``, their
    weights brought there for each forward; ``device`` is ignored.

    Returns:
        (model, tokenizer). Errors name the directory and say what is wrong; a load that leaves any
        parameter uninitialised (transformers' "missing" or "mismatched" keys), or a weight NaN or Inf, is refused.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig

    mapped = placement is not None and placement.device_map is not None
    config = read_config(model_dir) if config is None else config
    dtype = dtype or default_dtype(placement.device if mapped else device, config)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load {model_dir} as a causal language model (transformers: {transformers_reason(e)}); "
                         "check its config.json") from None
    without_kv_quantization(hf_config)
    place = {}
    if mapped:
        if placement.max_memory is not None:
            check_fits_one_layer(model_dir, hf_config, dtype, placement.max_memory)
        place = {"device_map": placement.device_map, "max_memory": placement.max_memory, "offload_folder": placement.offload_folder}
    try:
        with _quiet_transformers(), _quiet_accelerate():
            # A weight of the wrong shape is reported in ``info`` (refused by check_loaded), not raised as a RuntimeError.
            model, info = auto_class(hf_config).from_pretrained(
                model_dir, config=hf_config, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True,
                trust_remote_code=trust_remote_code, **place
            )
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        if mapped and "offload_folder" in str(e):
            raise ValueError(f"{model_dir}'s weights offloaded to disk must be re-saved (not safetensors, or converted on "
                             "load, as in most MoE models): pass --offload-folder DIR on a disk with room") from None
        if mapped and placement.offload_folder is not None and "No space left on device" in str(e):
            raise ValueError(f"--offload-folder {placement.offload_folder} ran out of space for the offloaded weights; "
                             "free space there or pass a directory on a larger disk") from None
        if isinstance(e, SafetensorError):
            raise ValueError(f"a weight file of {model_dir} is damaged ({e}); re-download or re-save the checkpoint") from None
        raise ValueError(f"could not load {model_dir} as a causal language model (transformers: {transformers_reason(e)}); "
                         "check its config.json and weight files") from None
    check_loaded(model_dir, info)
    check_finite_weights(model_dir, model)
    check_no_kv_quantization(model)
    if not mapped:
        model = model.to(device)
    return model.eval(), tokenizer


@contextmanager
def _quiet_accelerate() -> Iterator[None]:
    """No "parameters are on the meta device because they were offloaded" warning: the offload was asked for."""
    logger = logging.getLogger("accelerate.big_modeling")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# Files a tokenizer is loaded from, any one of which a model directory needs (fast, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "spiece.model", "vocab.txt",
                   "tiktoken.model", "merges.txt")


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, with an error naming the directory and saying what to do."""
    from transformers import AutoTokenizer

    if Path(model_dir).is_dir() and not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): copy the "
                         "original model's tokenizer files into it")
    try:
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {model_dir} (transformers: {transformers_reason(e)}): check "
                         "its tokenizer files, or copy the original model's into it") from None


def check_tokenizer_fits(model_dir: str | Path, config: dict, tokenizer) -> None:
    """Refuse a tokenizer with more tokens than the embedding has rows (``config`` as ``read_config`` returns it):
    its higher ids would index past the embedding halfway through a run."""
    rows = text_part(config).get("vocab_size")
    if rows is not None and len(tokenizer) > rows:
        raise ValueError(
            f"the tokenizer of {model_dir} has {len(tokenizer)} tokens but the model's embedding has {rows} rows "
            f"(vocab_size {rows} in config.json); the tokenizer belongs to another model: put the model's own beside it"
        )


@contextmanager
def _quiet_transformers():
    """No load report or progress bar from transformers: kvcal checks the load itself (``check_loaded``), and
    the scale tensors it does not load on purpose would be listed as "unexpected" on every run."""
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()


def check_loaded(model_dir: str | Path, info: dict) -> None:
    """Refuse a load that left parameters freshly initialised: the model would compute garbage."""
    bad = sorted(info.get("missing_keys") or []) + sorted(str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys") or [])
    if bad:
        raise ValueError(
            f"transformers loaded {model_dir} with {len(bad)} parameters missing or of the wrong shape, left freshly "
            f"initialised (e.g. {', '.join(bad[:3])}); the checkpoint is incomplete, its index misses a shard, or a "
            f"header gives a wrong shape: run kvcal inspect {model_dir}"
        )


# The dtypes a forward computes in; weights stored quantized (FP8, packed integers) are left to their loaders.
_COMPUTE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


@torch.no_grad()
def check_finite_weights(model_dir: str | Path, model: nn.Module) -> None:
    """Refuse a weight holding NaN or Inf: it poisons the activations after it, or (lm_head) every logit verify compares.

    Read in chunks of 64M elements, so the check needs little memory beside the largest weight; weights offloaded by a
    device map (on the meta device here) are not read.
    """
    for name, p in model.named_parameters():
        if p.dtype in _COMPUTE_DTYPES and p.device.type != "meta":
            if not all(bool(torch.isfinite(chunk).all()) for chunk in p.reshape(-1).split(1 << 26)):
                raise ValueError(f"{name} of {model_dir} is not finite (it holds NaN or Inf); the checkpoint is damaged: "
                                 "re-download or re-save it")


def check_no_kv_quantization(model: nn.Module) -> None:
    """Refuse a model that quantizes K/V itself: kvcal's reference and capture must see unquantized K and V."""
    found = [name for name, _ in [*model.named_parameters(), *model.named_buffers()] if KV_SCALE_PATTERN.search(name)]
    if found:
        raise ValueError(
            f"the loaded model quantizes its KV cache itself ({found[0]}{f' and {len(found) - 1} more' if len(found) > 1 else ''}), "
            "so its outputs are not an unquantized reference; remove kv_cache_scheme from the checkpoint's "
            "quantization_config, or report this to kvcal"
        )


def auto_class(hf_config):
    """The transformers auto class that builds this config's generating model: a causal LM, or (Qwen2.5-VL and
    other multimodal models with no causal-LM mapping) an image-text-to-text model around the language model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if type(hf_config) not in AutoModelForCausalLM._model_mapping and type(hf_config) in AutoModelForImageTextToText._model_mapping:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM



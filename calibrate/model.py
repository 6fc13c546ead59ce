"""Load a Hugging Face causal LM for calibration, place it, and describe its attention layers."""

import json
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .stats import ModelSignature


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module: its ``layer_idx`` and the prefix its tensors have in the checkpoint."""

    layer_idx: int
    prefix: str  # e.g. "model.layers.3.self_attn"
    sliding_window: bool


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


def read_config(model_dir: str | Path) -> dict:
    """The checkpoint's config.json, after cheap checks that it is a causal LM directory."""
    model_dir = Path(model_dir)
    if model_dir.is_file():
        raise ValueError(f"{model_dir} is a file; pass the model's directory (the one holding config.json)")
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist; pass a local Hugging Face model directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json, so it is not a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}); fix or replace it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} holds a {type(config).__name__}, not a model configuration; fix or replace it")
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        raise ValueError(
            f"{model_dir} holds a {', '.join(architectures)}, not a causal language model; "
            "kvcal calibrates decoder models that vLLM serves with a KV cache"
        )
    return config


def default_dtype(device: torch.device, config: dict) -> torch.dtype:
    """Checkpoint dtype on GPU; float32 on CPU, where bf16 matmuls are slow and add their own rounding."""
    if device.type == "cpu":
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else torch.bfloat16


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


def load_model(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype | None = None):
    """Load model and tokenizer from a local directory, in eval mode, on ``device``, without KV quantization.

    Returns:
        (model, tokenizer). Errors name the directory and say what is wrong; a load that leaves any
        parameter uninitialised (transformers' "missing" or "mismatched" keys) is refused.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_config(model_dir)
    dtype = dtype or default_dtype(device, config)
    tokenizer = load_tokenizer(model_dir)
    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
        without_kv_quantization(hf_config)
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(model_dir, config=hf_config, dtype=dtype, output_loading_info=True)
    except SafetensorError as e:
        raise ValueError(f"a weight file of {model_dir} is damaged ({e}); re-download or re-save the checkpoint") from None
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load {model_dir} as a causal language model: {e}") from e
    check_loaded(model_dir, info)
    check_no_kv_quantization(model)
    return model.to(device).eval(), tokenizer


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer, with an error naming the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {model_dir}: {e}") from e


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
            f"initialised (e.g. {', '.join(bad[:3])}); the checkpoint is incomplete or its index misses a shard: "
            f"run kvcal inspect {model_dir}"
        )


def check_no_kv_quantization(model: nn.Module) -> None:
    """Refuse a model that quantizes K/V itself: kvcal's reference and capture must see unquantized K and V."""
    found = [name for name, _ in [*model.named_parameters(), *model.named_buffers()]
             if name.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "q_scale", "kv_scale")]
    if found:
        raise ValueError(
            f"the loaded model quantizes its KV cache itself ({found[0]} and {len(found) - 1} more scale parameters), "
            "so its outputs are not an unquantized reference; remove kv_cache_scheme from the checkpoint's "
            "quantization_config, or report this to kvcal"
        )


def text_config(model: nn.Module):
    """The decoder's config (multimodal models nest it)."""
    return model.config.get_text_config()


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every self-attention module of the decoder, in layer order.

    Found as the modules that carry a ``layer_idx`` and have q/k projections or a config of their own,
    which is how transformers' attention-interface models are built; the prefix is the module's name,
    which is also the name its parameters have in the checkpoint.
    """
    layer_types = getattr(text_config(model), "layer_types", None) or []
    layers = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            if "vision" in name or "audio" in name:
                continue
            idx = module.layer_idx
            sliding = idx < len(layer_types) and layer_types[idx] == "sliding_attention"
            layers.append(AttentionLayer(idx, name, sliding))
    if not layers:
        raise ValueError(
            f"found no attention modules with a layer_idx in {type(model).__name__}; kvcal needs a model "
            "built on transformers' attention interface"
        )
    return sorted(layers, key=lambda layer: layer.layer_idx)


def signature(model: nn.Module, layers: list[AttentionLayer]) -> ModelSignature:
    """The shape facts that statistics and scales must agree with."""
    cfg = text_config(model)
    num_heads = cfg.num_attention_heads
    return ModelSignature(
        model_type=cfg.model_type,
        layers=[layer.layer_idx for layer in layers],
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        num_heads=num_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
    )


def max_context(config: dict) -> int | None:
    """The longest sequence the model was built for, if its config.json (as ``read_config`` returns it) says."""
    return config.get("text_config", config).get("max_position_embeddings")

"""Load a Hugging Face causal LM for calibration, place it, and describe its attention layers."""

import json
import warnings
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
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist; pass a local Hugging Face model directory")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir} has no config.json, so it is not a Hugging Face model directory")
    config = json.loads(config_path.read_text())
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


def load_model(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype | None = None):
    """Load model and tokenizer from a local directory, in eval mode, on ``device``.

    Returns:
        (model, tokenizer). Errors name the directory and say what is wrong.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = read_config(model_dir)
    dtype = dtype or default_dtype(device, config)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {model_dir}: {e}") from e
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load {model_dir} as a causal language model: {e}") from e
    return model.to(device).eval(), tokenizer


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


def max_context(model: nn.Module) -> int | None:
    """The longest sequence the model was built for, if its config says."""
    return getattr(text_config(model), "max_position_embeddings", None)

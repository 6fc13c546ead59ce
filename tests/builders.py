"""What the tests build: one tiny random model per family (one config shape for all), real checkpoints of it in
kvcal's and other tools' layouts (ModelOpt, an fp8 release), and KJV text files."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=4096)


GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_config(family: str):
    """A small random-model config of ``family`` that still exercises its attention quirks."""
    configs = {
        "llama": lambda: LlamaConfig(**COMMON),
        "qwen2": lambda: Qwen2Config(**COMMON),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
        "mistral": lambda: MistralConfig(**COMMON),
        "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=8),
        "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0),
    }
    return configs[family]()


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


def save_tiny_checkpoint(directory, family: str, tokenizer, seed: int = 0, plant=None, **changes):
    """A tiny random ``family`` model saved as a real checkpoint with the SmolLM2 tokenizer (vocab 49152): ``changes``
    set on its config first, ``plant(model, tokenizer)`` applied to its weights before saving."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    config.vocab_size = len(tokenizer)
    for key, value in changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config).eval()
    if plant is not None:
        with torch.no_grad():
            plant(model, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def multimodal_config() -> Gemma3Config:
    """A tiny Gemma 3 image-text model: the decoder's config nests in ``text_config``, beside a vision tower."""
    text = dict(COMMON, head_dim=32, sliding_window=8, layer_types=GEMMA3_TYPES)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# Each case: a config, and which layers are sliding-window by that family's own rule (written out here).
CONFIGS = {
    "llama": (lambda: tiny_config("llama"), [False, False, False]),
    # head_dim 32 while hidden_size // heads is 16: the signature must take the config's head_dim.
    "qwen3-wide-heads": (lambda: Qwen3Config(**COMMON, head_dim=32), [False, False, False]),
    # Qwen2 slides on the layers from max_window_layers on.
    "qwen2-sliding": (lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1), [False, True, True]),
    "gemma3-text": (lambda: tiny_config("gemma3"), [True, True, False]),
    "gemma3-multimodal": (multimodal_config, [True, False, True]),
}


def kjv_jsonl(path, verses: int):
    """The first ``verses`` verses of the KJV as JSON lines of ``{"text": ...}`` records; returns ``path``."""
    from calibrate.demo import kjv_path

    with open(kjv_path()) as src, open(path, "w") as dst:
        for _, line in zip(range(verses), src):
            dst.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    return path


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, dequantization scale): per output channel [out, 1], or per tensor []."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().max()
    scale = (amax / 448).float()
    return (weight / scale).to(torch.float8_e4m3fn), scale


def modelopt_fp8(target: Path, directory: Path, *, in_config: bool) -> Path:
    """A ModelOpt FP8 checkpoint of ``target`` with old ModelOpt KV scales (9.0); its quantization config in
    hf_quant_config.json only (ModelOpt ≤ 0.29) or also in config.json (≥ 0.31)."""
    tensors = {}
    for name, value in load_file(target / "model.safetensors").items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEARS)):
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = fp8(value, per_channel=False)
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
        else:
            tensors[name] = value
    for i in range(json.loads((target / "config.json").read_text())["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(9.0)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(9.0)
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    hf_quant = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    config = json.loads((target / "config.json").read_text())
    if in_config:
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
                                         "producer": {"name": "modelopt", "version": "0.37.0"}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


FP8_BLOCK = 128  # the weight block of quant_method fp8 releases (Qwen3-*-FP8, DeepSeek-V3): 128 × 128


FP8_RELEASE_CONFIG = {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "activation_scheme": "dynamic"}


def block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3fn weight, weight_scale_inv): one float32 dequantization scale per 128 × 128 block, as fp8 releases store
    them (``weight ≈ fp8 × weight_scale_inv`` blockwise). ``weight`` [N, K], both multiples of 128."""
    n, k = weight.shape
    blocks = weight.float().reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)  # [N/128, 128, K/128, 128]
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N/128, K/128]
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return q, scale


def fp8_release(directory: Path, tokenizer, seed: int = 0) -> Path:
    """A tiny Qwen3 in the ``quant_method: fp8`` release format: head_dim 128 so every Linear is whole 128 × 128
    blocks, each Linear weight block-quantized to e4m3fn with its ``weight_scale_inv`` grid, embeddings, norms and
    lm_head in bf16, and config.json's quantization_config as releases write it."""
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=128, vocab_size=len(tokenizer), max_position_embeddings=4096,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    tensors = {}
    for name, value in model.state_dict().items():
        if name.endswith(tuple(f"{proj}.weight" for proj in LINEARS)):
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = block_fp8(value)
        else:
            tensors[name] = value.contiguous()
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict() | {"architectures": ["Qwen3ForCausalLM"], "dtype": "bfloat16",
                                "quantization_config": dict(FP8_RELEASE_CONFIG)}
    (directory / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.save_pretrained(directory)
    return directory

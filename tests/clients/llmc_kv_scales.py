"""Calibrate FP8 KV-cache scales with llm-compressor on given token sequences and dump them, for cross-checks.

Usage (in the venv made by scripts/setup-llmcompressor; not importable from the main venv):

    .venv-llmc/bin/python tests/clients/llmc_kv_scales.py MODEL_DIR TOKENS.safetensors OUT.json
        [--observer minmax|static_minmax] [--strategy tensor|attn_head] [--save DIR]

TOKENS.safetensors holds `input_ids`, int64 [N, seq_len]: each row is fed as one calibration sample (batch size 1,
in order, all-ones attention mask, no re-tokenization, no shuffling). The model is loaded in float32.

The recipe is llm-compressor 0.14's KV-cache-only FP8 scheme (num_bits 8, float, symmetric, static), run with
`oneshot(pipeline="basic")`. Its scale is the dequantization multiplier: scale = max(|min|, |max|) / 448 over the
post-RoPE K (resp. V) the attention hands to the cache. How min/max combine across samples depends on the observer:
  - minmax (llm-compressor's default for the KV cache): a moving average per sample,
    m <- m + 0.01 * (m_sample - m), separately for min and for max, so the first sample dominates;
  - static_minmax: the running min/max over all samples, i.e. scale = amax / 448 exactly.

With --save DIR, also saves the calibrated model and its tokenizer there as llm-compressor does
(`save_pretrained(DIR, save_compressed=True)`): a compressed-tensors checkpoint vLLM loads, for tests that need a
checkpoint kvcal did not write.

Writes OUT.json:
    {"llmcompressor_version": str, "observer": str, "strategy": str, "num_sequences": N, "seq_len": L,
     "oneshot_seconds": float,
     "layers": [{"name": "model.layers.0.self_attn", "index": 0,
                 "k_scale": [...], "k_scale_shape": [...], "v_scale": ..., "v_scale_shape": ...}]}
    (scales flattened; shapes as llm-compressor holds them: [1] per tensor, [num_kv_heads, 1, 1] per head;
    a KV-cache-only recipe produces no q_scale, which would appear as "q_scale" if it did)
"""

import argparse
import json
import re
import time

import llmcompressor
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("tokens")
    parser.add_argument("out")
    parser.add_argument("--observer", default="minmax", choices=["minmax", "static_minmax"])
    parser.add_argument("--strategy", default="tensor", choices=["tensor", "attn_head"])
    parser.add_argument("--save", help="also save the calibrated checkpoint in this directory")
    args = parser.parse_args()

    input_ids = load_file(args.tokens)["input_ids"]  # [N, seq_len] int64
    if input_ids.ndim != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64 [N, seq_len], got {input_ids.dtype} {tuple(input_ids.shape)}")
    num_sequences, seq_len = input_ids.shape

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    # Already tokenized (llm-compressor sees `input_ids` and skips its tokenizer); one row per sample.
    dataset = Dataset.from_dict({
        "input_ids": input_ids.tolist(),
        "attention_mask": torch.ones_like(input_ids).tolist(),
    })
    recipe = QuantizationModifier(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": args.strategy, "dynamic": False, "symmetric": True,
        "observer": args.observer,
    })

    start = time.perf_counter()
    oneshot(model=model, processor=tokenizer, dataset=dataset, recipe=recipe, pipeline="basic",
            num_calibration_samples=num_sequences, max_seq_length=seq_len, batch_size=1,
            shuffle_calibration_samples=False)
    seconds = time.perf_counter() - start

    layers = []
    for name, module in model.named_modules():
        if not hasattr(module, "k_scale"):
            continue
        index = re.search(r"\.(\d+)\.", f".{name}.")
        layer = {"name": name, "index": int(index.group(1)) if index else None}
        for kind in ("k", "v", "q"):
            scale = getattr(module, f"{kind}_scale", None)
            if scale is not None:
                layer[f"{kind}_scale"] = scale.detach().float().flatten().tolist()
                layer[f"{kind}_scale_shape"] = list(scale.shape)
        layers.append(layer)
    if not layers:
        raise SystemExit("llm-compressor produced no k_scale on any module")
    if args.save:
        model.save_pretrained(args.save, save_compressed=True)
        tokenizer.save_pretrained(args.save)

    with open(args.out, "w") as f:
        json.dump({
            "llmcompressor_version": llmcompressor.__version__, "observer": args.observer,
            "strategy": args.strategy, "num_sequences": num_sequences, "seq_len": seq_len,
            "oneshot_seconds": round(seconds, 2), "layers": layers,
        }, f, indent=1)


if __name__ == "__main__":
    main()

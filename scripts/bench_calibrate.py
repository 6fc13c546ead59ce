"""Calibration cost against a bare forward over the same token sequences, measured in one run.

    .venv/bin/python scripts/bench_calibrate.py [--sequences 8] [--seq-len 512] [--rounds 3] [--model DIR | --shape llama-1b]

Both sides make the same model calls (batch 1, use_cache=False, logits of the last position only,
the same chunking); kvcal's side adds the attention hook and all statistics. Rounds alternate the
two sides so that machine noise hits both; the ratio of the summed times is printed. Target ≤ 1.10.

The statistics cost per cached element while the forward costs per weight, so the ratio falls as models grow.
``--shape`` measures that without a download: a Llama of a larger model's shape with random weights (float32, its
vocabulary cut to 32K, which only the embedding and the one logit row see), fed random token ids.
"""

import argparse
import time

import torch

from calibrate.capture import forward_chunked, run_capture
from calibrate.data import DataConfig, iter_sequences
from calibrate.demo import kjv_path, smollm2_dir
from calibrate.model import attention_layers, load_model, signature
from calibrate.stats import Stats

# Llama-3.2-1B's shape (vocabulary cut to 32K): 16 layers, 32 query and 8 KV heads of 64.
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=32000),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="model directory (default: the packaged SmolLM2-135M-Instruct)")
    which.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this shape instead of a model directory")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    if args.shape:
        model, sequences = random_model(SHAPES[args.shape], args.sequences, args.seq_len, device)
    else:
        model, tokenizer = load_model(args.model or smollm2_dir(), device=device)
        config = DataConfig(sources=[str(kjv_path())], seq_len=args.seq_len, max_tokens=args.sequences * args.seq_len)
        sequences = [s.to(device) for s in iter_sequences(config, tokenizer)]
    layers = attention_layers(model)
    tokens = sum(s.numel() for s in sequences)

    def bare() -> None:
        for s in sequences:
            forward_chunked(model, s.unsqueeze(0), chunk_len=args.seq_len)

    def kvcal() -> None:
        stats = Stats.empty(signature(model, layers), device)
        run_capture(model, layers, sequences, stats, chunk_len=args.seq_len, progress=False)

    def timed(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    bare(), kvcal()  # warm-up
    totals = {"bare": 0.0, "kvcal": 0.0}
    for r in range(args.rounds):
        order = [("bare", bare), ("kvcal", kvcal)] if r % 2 == 0 else [("kvcal", kvcal), ("bare", bare)]
        for name, fn in order:
            seconds = timed(fn)
            totals[name] += seconds
            print(f"round {r}: {name:5s} {seconds:7.2f} s  ({tokens / seconds:,.0f} tok/s)")
    print(f"\n{tokens} tokens x {args.rounds} rounds, {len(layers)} layers, torch threads {torch.get_num_threads()}, {device}")
    print(f"bare forward {totals['bare']:.2f} s, kvcal calibration {totals['kvcal']:.2f} s")
    print(f"ratio kvcal / bare = {totals['kvcal'] / totals['bare']:.3f}  (target <= 1.10)")


def random_model(shape: dict, n: int, length: int, device: torch.device) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A float32 Llama of ``shape`` with random weights, and ``n`` sequences of random token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(device).eval()
    ids = torch.randint(shape["vocab_size"], (n, length), generator=torch.Generator().manual_seed(0))
    return model, [row.to(device) for row in ids]


if __name__ == "__main__":
    main()

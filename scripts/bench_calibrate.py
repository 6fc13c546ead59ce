"""Calibration cost against a bare forward over the same token sequences, measured in one run.

    .venv/bin/python scripts/bench_calibrate.py [--sequences 8] [--seq-len 512] [--rounds 3] [--model DIR | --shape llama-1b]

Both sides make the same model calls (batch 1, use_cache=False, logits of the last position only,
the same chunking); kvcal's side adds the attention hook and all statistics. The two sides alternate
sequence by sequence (the same sequence on each side, in turns that swap every round), so that the
machine's drift hits both within a fraction of a second. Printed: the ratio of the summed times, and
the median and quartiles of the per-sequence ratios, which a stall in one round moves less. Target ≤ 1.10.
kvcal's side enters the hook once per sequence (a real run enters it once), so it errs against kvcal.

The statistics cost per cached element while the forward costs per weight, so the ratio falls as models grow.
``--shape`` measures that without a download: a Llama of a larger model's shape with random weights (float32, its
vocabulary cut to 32K, which only the embedding and the one logit row see), fed random token ids.
"""

import argparse
import statistics
import time

import torch

from calibrate.capture.hooks import forward_chunked, run_capture
from calibrate.capture.stats import Stats
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.demo import kjv_path, smollm2_dir
from calibrate.model.layers import attention_layers, signature
from calibrate.model.load import load_model

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

    stats = Stats.empty(signature(model, layers), device)

    def bare(seq: torch.Tensor) -> None:
        forward_chunked(model, seq.unsqueeze(0), chunk_len=args.seq_len)

    def kvcal(seq: torch.Tensor) -> None:  # the statistics of every round pile up in one Stats: the same work
        run_capture(model, layers, [seq], stats, chunk_len=args.seq_len, progress=False)

    def timed(fn, seq: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(seq)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    bare(sequences[0]), kvcal(sequences[0])  # warm-up
    sides = {"bare": bare, "kvcal": kvcal}
    pairs: list[dict[str, float]] = []  # seconds of each side, one per sequence and round
    for r in range(args.rounds):
        for i, seq in enumerate(sequences):
            order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]
            pairs.append({name: timed(sides[name], seq) for name in order})
        totals = {name: sum(p[name] for p in pairs[-len(sequences):]) for name in sides}
        print(f"round {r}: bare {totals['bare']:7.2f} s, kvcal {totals['kvcal']:7.2f} s, ratio {totals['kvcal'] / totals['bare']:.3f}"
              f"  ({tokens / totals['kvcal']:,.0f} tok/s calibrating)")
    grand = {name: sum(p[name] for p in pairs) for name in sides}
    q1, median, q3 = statistics.quantiles([p["kvcal"] / p["bare"] for p in pairs], n=4)
    print(f"\n{tokens} tokens x {args.rounds} rounds, {len(layers)} layers, torch threads {torch.get_num_threads()}, {device}")
    print(f"bare forward {grand['bare']:.2f} s, kvcal calibration {grand['kvcal']:.2f} s")
    print(f"ratio kvcal / bare = {grand['kvcal'] / grand['bare']:.3f}  (target <= 1.10); per sequence: median {median:.3f}, "
          f"quartiles {q1:.3f}-{q3:.3f} over {len(pairs)} pairs")


def random_model(shape: dict, n: int, length: int, device: torch.device) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A float32 Llama of ``shape`` with random weights, and ``n`` sequences of random token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa")).to(device).eval()
    ids = torch.randint(shape["vocab_size"], (n, length), generator=torch.Generator().manual_seed(0))
    return model, [row.to(device) for row in ids]


if __name__ == "__main__":
    main()

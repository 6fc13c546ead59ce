"""Calibration cost against a bare forward over the same token sequences, measured in one run.

    .venv/bin/python scripts/bench_calibrate.py [--sequences 8] [--seq-len 512] [--rounds 3] [--model DIR]

Both sides make the same model calls (batch 1, use_cache=False, logits of the last position only,
the same chunking); kvcal's side adds the attention hook and all statistics. Rounds alternate the
two sides so that machine noise hits both; the ratio of the summed times is printed. Target ≤ 1.10.
"""

import argparse
import time

import torch

from calibrate.capture import forward_chunked, run_capture
from calibrate.data import DataConfig, iter_sequences
from calibrate.demo import kjv_path, smollm2_dir
from calibrate.model import attention_layers, load_model, signature
from calibrate.stats import Stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    model, tokenizer = load_model(args.model or smollm2_dir(), device=device)
    layers = attention_layers(model)
    config = DataConfig(sources=[str(kjv_path())], seq_len=args.seq_len, max_tokens=args.sequences * args.seq_len)
    sequences = [s.to(device) for s in iter_sequences(config, tokenizer)]
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


if __name__ == "__main__":
    main()

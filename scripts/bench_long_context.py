"""Peak memory and time per token of calibration at long context, one subprocess per length.

    .venv/bin/python scripts/bench_long_context.py [--lengths 2048,8192,32768] [--layers 4] [--chunk-len 2048]

The model has SmolLM2-135M's attention and width (9 heads, 3 KV heads, head_dim 64, hidden 576) with
``--layers`` layers and a context long enough for the lengths asked, randomly initialised: memory and
time do not depend on the weights' values, and fewer layers keep 32K within minutes on 2 CPU cores.
Each length runs one sequence as chunked prefill through a KV cache, in a fresh process, and reports the
peak resident memory above what the process held before calibration. Memory should grow linearly with
length (KV cache plus one chunk's attention), not quadratically.
"""

import argparse
import json
import resource
import subprocess
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one_length(length: int, layers: int, chunk_len: int, device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from calibrate.capture.hooks import run_capture
    from calibrate.capture.stats import Stats
    from calibrate.model.layers import attention_layers, signature

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=max(length, 8192), tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    found = attention_layers(model)
    sequence = torch.randint(0, 49152, (length,))
    before = rss_mib()
    start = time.perf_counter()
    stats = run_capture(model, found, [sequence], Stats.empty(signature(model, found), device), chunk_len=chunk_len, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB → MiB
    assert int(stats.tokens[0]) == length
    return {"length": length, "seconds": seconds, "ms_per_token": 1000 * seconds / length, "peak_mib_above_start": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192,32768")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk-len", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one length and print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_length(args.one, args.layers, args.chunk_len, args.device)))
        return

    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        cmd = [sys.executable, __file__, "--one", str(length), "--layers", str(args.layers),
               "--chunk-len", str(args.chunk_len), "--device", args.device]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['length']:>7} tokens: {r['seconds']:8.1f} s, {r['ms_per_token']:6.2f} ms/token, "
              f"peak +{r['peak_mib_above_start']:7.0f} MiB", flush=True)
    first, last = rows[0], rows[-1]
    print(f"\nlength x{last['length'] / first['length']:.0f}: memory x{last['peak_mib_above_start'] / max(first['peak_mib_above_start'], 1):.1f}, "
          f"time per token x{last['ms_per_token'] / first['ms_per_token']:.1f}  ({args.layers} layers, chunk {args.chunk_len}, {args.device})")


if __name__ == "__main__":
    main()

"""What disk offload costs per calibrated token: SmolLM2 with its weights forced to disk against it in memory.

    .venv/bin/python scripts/bench_offload.py [--sequences 4] [--seq-len 512] [--rounds 5] [--max-memory cpu=64MiB]

Both models are loaded in this one process: once wholly on the CPU, once placed by accelerate's device map with
``--max-memory`` (the default holds one SmolLM2 layer but not its 113 MB embedding, so every weight is on disk and
read back for each forward). Both sides run kvcal's capture (hook and statistics) over the same token sequences;
rounds alternate the order so that machine noise hits both. Prints each side's median ms/token and their ratio.
The weights are read through the page cache after the first round: this measures accelerate's per-module loading
(and dtype conversion), not the disk, which on a cold cache adds the checkpoint's size / disk bandwidth per forward.
"""

import argparse
import statistics
import tempfile
import time

import torch

from calibrate.capture.hooks import run_capture
from calibrate.capture.stats import Stats
from calibrate.config import parse_max_memory
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.demo import kjv_path, smollm2_dir
from calibrate.model.layers import attention_layers, signature
from calibrate.model.load import load_model, resolve_placement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-memory", default="cpu=64MiB", help="the offloaded side's budget (default cpu=64MiB)")
    args = parser.parse_args()

    model_dir, cpu = args.model or smollm2_dir(), torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="kvcal-bench-offload-") as folder:
        placement = resolve_placement("cpu", max_memory=parse_max_memory(args.max_memory), offload_folder=folder)
        offloaded, tokenizer = load_model(model_dir, device=cpu, placement=placement)
        in_memory, _ = load_model(model_dir, device=cpu)
        device_map = getattr(offloaded, "hf_device_map", {})
        on_disk = sorted(name or "(the whole model)" for name, device in device_map.items() if device == "disk")
        if not on_disk:
            raise SystemExit(f"--max-memory {args.max_memory} put nothing on disk ({device_map}); lower it")

        layers = attention_layers(in_memory)
        config = DataConfig(sources=[str(kjv_path())], seq_len=args.seq_len, max_tokens=args.sequences * args.seq_len)
        sequences = list(iter_sequences(config, tokenizer))
        tokens = sum(s.numel() for s in sequences)

        def capture(model) -> Stats:
            stats = Stats.empty(signature(model, layers), cpu)
            return run_capture(model, layers, sequences, stats, chunk_len=args.seq_len, progress=False)

        same = torch.equal(capture(in_memory).kinds["k"].absmax, capture(offloaded).kinds["k"].absmax)  # also the warm-up
        ms_per_token: dict[str, list[float]] = {"in memory": [], "disk offload": []}
        sides = [("in memory", in_memory), ("disk offload", offloaded)]
        for r in range(args.rounds):
            for name, model in sides if r % 2 == 0 else sides[::-1]:
                start = time.perf_counter()
                capture(model)
                ms_per_token[name].append((time.perf_counter() - start) * 1000 / tokens)
                print(f"round {r}: {name:12s} {ms_per_token[name][-1]:8.3f} ms/token")

    median = {name: statistics.median(values) for name, values in ms_per_token.items()}
    print(f"\n{tokens} tokens x {args.rounds} rounds, {len(layers)} layers, {in_memory.dtype}, "
          f"torch threads {torch.get_num_threads()}; on disk: {', '.join(on_disk)}")
    print(f"statistics identical on both sides: {same}")
    for name, value in median.items():
        print(f"{name:12s} median {value:8.3f} ms/token")
    print(f"ratio disk offload / in memory = {median['disk offload'] / median['in memory']:.2f}x")


if __name__ == "__main__":
    main()

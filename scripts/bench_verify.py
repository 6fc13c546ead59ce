"""What ``kvcal verify`` costs, in plain forwards of its own sample; prints the ratio measured in one run.

    python scripts/bench_verify.py [--checkpoint DIR] [--data SRC] [--seq-len 512] [--sequences 2] [--schemes ...]

Defaults: the demo model (SmolLM2-135M, with or without kvcal scales) and the packaged KJV text. The
expectation is about 1 + S forwards for S schemes: one reference forward, which also runs every
scheme's attention on each layer's own inputs, and one forward per scheme. Both sides are the same
stage code in one process, timed in CPU seconds with one thread, so that other work on a shared
machine does not enter the ratio; model loading and data reading are excluded from both.
"""

import argparse
import time

import torch

from calibrate.checkpoint.kvcal_dir import load_calibration
from calibrate.checkpoint.write import weight_files
from calibrate.choices import VERIFY_SCHEMES
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
from calibrate.demo import kjv_path, smollm2_dir
from calibrate.fp8 import get_format
from calibrate.model.description import describe
from calibrate.model.layers import attention_layers, signature
from calibrate.model.load import load_model
from calibrate.verification.config import VerifyConfig
from calibrate.verification.passes import measure
from calibrate.verification.schemes import build_schemes


@torch.no_grad()
def plain_forwards(model, sequences: list[torch.Tensor]) -> None:
    """One ordinary forward (all logits, no cache, no hook) over every sequence."""
    for seq in sequences:
        model(input_ids=seq[None], use_cache=False)


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="model directory (default: the demo's SmolLM2)")
    parser.add_argument("--data", default=None, help="data source (default: packaged KJV text)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=2)
    parser.add_argument("--schemes", default=",".join(VERIFY_SCHEMES))
    args = parser.parse_args()
    checkpoint, data = str(args.checkpoint or smollm2_dir()), str(args.data or kjv_path())
    torch.set_num_threads(1)

    config = VerifyConfig.from_options(checkpoint, [data], schemes=args.schemes, seq_len=args.seq_len,
                                       max_tokens=args.seq_len * args.sequences, progress=False).validate()
    model, tokenizer = load_model(checkpoint, device=torch.device("cpu"))
    layers = attention_layers(model)
    try:
        stats = load_calibration(checkpoint)[0]
    except ValueError:  # a checkpoint without kvcal statistics: tensor/head run only if it holds scales
        stats = None
    described = describe(checkpoint)
    schemes, skipped, _ = build_schemes(config, described, weight_files(described), layers, signature(model, layers), stats,
                                        get_format("e4m3fn"))
    stream = iter_sequences(DataConfig([data], seq_len=args.seq_len, max_tokens=config.data.max_tokens), tokenizer)
    sequences = [s for s in stream if s.numel() == args.seq_len]

    plain_forwards(model, [sequences[0][:16]])  # warm-up
    forward = cpu_seconds(lambda: plain_forwards(model, sequences))
    passes = cpu_seconds(lambda: measure(model, layers, schemes, sequences, config, None))
    forward = (forward + cpu_seconds(lambda: plain_forwards(model, sequences))) / 2  # before and after

    S = len(schemes)
    print(f"{len(sequences)} sequences of {args.seq_len} tokens; schemes: {', '.join(s.name for s in schemes)} (S = {S}); skipped: {list(skipped)}")
    print(f"plain forward of the sample: {forward:.2f} CPU s (one thread)")
    print(f"verify passes (reference with per-layer scheme attention, then one pass per scheme, metrics): {passes:.2f} CPU s")
    print(f"ratio: {passes / forward:.2f} forwards (1 + S = {1 + S})")


if __name__ == "__main__":
    main()

"""``kvcal`` command line: argument parsing only; every subcommand calls one library function."""

import argparse
import signal
import sys

from . import api
from .config import CalibrationConfig
from .observers import GRANULARITIES, OBSERVERS


def _scale_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--observer", default="max", help=f"how statistics become scales: {', '.join(OBSERVERS)} (default max)")
    p.add_argument("--granularity", default="tensor", choices=GRANULARITIES, help="one scale per layer, per KV head, or per token at serve time")
    p.add_argument("--headroom", type=float, default=1.0, help="multiply every scale by this (≥ 1) to leave range for unseen data")
    p.add_argument("--no-query-scale", dest="query_scale", action="store_false", help="do not write q_scale (vLLM then uses 1.0 for queries)")
    p.add_argument("--fp8-format", default="e4m3fn", choices=["e4m3fn", "e4m3fnuz"], help="e4m3fn (NVIDIA, CPU) or e4m3fnuz (ROCm MI300)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")


def _calibrate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sequence (default 2048)")
    p.add_argument("--max-tokens", type=int, default=500_000, help="token budget (default 500000)")
    p.add_argument("--chunk-len", type=int, default=2048, help="longer sequences run as chunked prefill through a KV cache")
    p.add_argument("--text-field", help="column holding the text (default: text, messages or input_ids, found automatically)")
    p.add_argument("--no-pack", dest="pack", action="store_false", help="one record per sequence instead of packing")
    p.add_argument("--seed", type=int, default=0, help="shuffling seed")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="model dtype (default: checkpoint's on GPU, float32 on CPU)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no progress bar")
    _scale_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcal", description="Offline FP8 KV-cache scale calibration for vLLM.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("calibrate", help="run data through a model and write a checkpoint with FP8 KV scales")
    p.add_argument("model", help="local Hugging Face model directory")
    p.add_argument("--data", action="append", required=True, help="data source (repeatable); SRC::WEIGHT for a mixture")
    p.add_argument("--out", required=True, help="output checkpoint directory (created atomically)")
    _calibrate_options(p)

    p = sub.add_parser("export", help="re-derive scales from a kvcal output's statistics, without running the model")
    p.add_argument("source", help="a directory written by kvcal calibrate")
    p.add_argument("--out", required=True, help="new output checkpoint directory")
    p.add_argument("--model", help="write into this checkpoint instead of SOURCE's model files")
    _scale_options(p)

    p = sub.add_parser("demo", help="calibrate SmolLM2-135M-Instruct on packaged text, fully offline")
    p.add_argument("--out", default="demo-out", help="output directory (default demo-out)")
    p.add_argument("--max-tokens", type=int, default=16_384, help="token budget (default 16384)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A kill (SIGTERM) unwinds like Ctrl-C, so temporary output is removed.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    options = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        if args.command == "calibrate":
            result = api.run_calibration(CalibrationConfig(**options))
        elif args.command == "export":
            result = api.export(**options)
        else:
            from .demo import run_demo

            result = run_demo(**options)
    except ValueError as e:
        print(f"kvcal: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvcal: interrupted; nothing was written", file=sys.stderr)
        return 130
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())

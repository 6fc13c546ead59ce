"""Memory and time of reading one huge record (a 32 MiB JSON line) into a small token budget.

    .venv/bin/python scripts/bench_huge_record.py [--mib 32] [--max-tokens 4096] [--rounds 3]

Each round is a fresh process that builds the stream with the demo model's tokenizer and reads it to the end, then
prints its peak RSS; a second process that reads a one-line file of 1 KiB gives the baseline (Python, transformers
and the tokenizer alone), measured in the same round. Medians over the rounds.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import resource, sys, time
sys.path.insert(0, {repo!r})
from transformers import AutoTokenizer
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences
tokenizer = AutoTokenizer.from_pretrained({model!r})
start = time.perf_counter()
tokens = sum(s.numel() for s in iter_sequences(DataConfig(sources=[{path!r}], seq_len=512, max_tokens={budget}), tokenizer))
print(tokens, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def run(path: Path, model: str, budget: int) -> tuple[int, float, int]:
    code = CHILD.format(repo=str(REPO), model=model, path=str(path), budget=budget)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1]), int(out[2])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from calibrate.demo import smollm2_dir

    model = str(smollm2_dir())
    with tempfile.TemporaryDirectory() as tmp:
        huge, small = Path(tmp) / "huge.jsonl", Path(tmp) / "small.jsonl"
        text = " ".join(f"w{i % 9973}" for i in range(args.mib << 18))[: args.mib << 20]
        huge.write_text(json.dumps({"text": text}) + "\n")
        small.write_text(json.dumps({"text": text[:1024]}) + "\n")
        rows = []
        for r in range(args.rounds):
            tokens, seconds, rss = run(huge, model, args.max_tokens)
            _, _, base = run(small, model, args.max_tokens)
            rows.append((seconds, rss, base))
            print(f"round {r + 1}: {tokens} tokens from a {args.mib} MiB record in {seconds:.1f} s, peak RSS "
                  f"{rss / 2**20:.0f} MiB (1 KiB record: {base / 2**20:.0f} MiB)")
    seconds, rss, base = (statistics.median(column) for column in zip(*rows))
    print(f"median: {seconds:.1f} s, peak RSS {rss / 2**20:.0f} MiB, {(rss - base) / 2**20:.0f} MiB above the 1 KiB record's")


if __name__ == "__main__":
    main()

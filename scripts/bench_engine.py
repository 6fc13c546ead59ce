"""What ``kvcal verify --engine vllm`` costs beside the emulation alone; prints both sides measured in one run.

    python scripts/bench_engine.py [--sequences 4] [--seq-len 1024] [--schemes scale1,tensor,token,int8_per_token_head]
                                   [--rounds 1] [--out DIR]

The checkpoint is the demo model (SmolLM2-135M) calibrated on 2,048 KJV tokens; the held-out text is Python's pydoc
topics, which kvcal never calibrates on. Each round runs, as whole processes one after the other: ``kvcal verify``
without the engine (the emulation), the same command with ``--engine vllm`` (emulation, engine start, load audit,
delivery check and one engine run per cache dtype plus two unquantized ones), and the delivery check alone. Printed per
round and as medians: wall seconds and peak resident memory of each verify (the largest process of its tree, from
``wait4``), the engine start's seconds (describe, version, cache dtypes, audit, delivery), the engine runs' own
seconds and the largest vLLM job's memory growth (report.json), the delivery check's seconds, and the ratio of the
two verify runs. No decode drift and no skip-layer probe (``--generate 0 --probe-layers 0``), so
the two sides run the same passes. Run it on a quiet machine: the figures are wall time.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from calibrate.demo import kjv_path, smollm2_dir


def run(argv: list[str], cwd: Path) -> tuple[float, float]:
    """Run ``python ARGV`` in ``cwd`` to completion: (wall seconds, peak resident memory in MiB of the largest process
    of its tree, from ``wait4``: kvcal's own, or a vLLM job's where that was larger)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"failed: python {' '.join(argv)}\n{out[-3000:]}")
    return wall, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--schemes", default="scale1,tensor,token,int8_per_token_head")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None, help="keep the checkpoint and reports here (default: a temporary folder)")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="kvcal-bench-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "ckpt" / "config.json").is_file():
        run(["-m", "calibrate", "calibrate", str(smollm2_dir()), "--data", str(kjv_path()), "--out", "ckpt",
             "--seq-len", "512", "--max-tokens", "2048", "--no-verify", "--quiet"], work)
    from pydoc_data.topics import topics

    (work / "held.jsonl").write_text(json.dumps({"text": "\n\n".join(topics[k] for k in sorted(topics))}) + "\n")
    verify = ["-m", "calibrate", "verify", "ckpt", "--data", "held.jsonl", "--seq-len", str(args.seq_len), "--max-tokens",
              str(args.seq_len * args.sequences), "--schemes", args.schemes, "--generate", "0", "--probe-layers", "0", "--quiet"]
    delivery = ["-c", "from calibrate import check_delivery; print(check_delivery('ckpt').text())"]
    rows = []
    for i in range(args.rounds):
        emulation = run([*verify, "--backend", "cpu", "--dtype", "bfloat16", "--kv-only", "--target", "cpu",
                         "--report", f"emulation-{i}"], work)
        engine = run([*verify, "--engine", "vllm", "--report", f"engine-{i}"], work)
        alone = run(delivery, work)
        rep = json.loads((work / f"engine-{i}" / "report.json").read_text())
        job_mib = max(r.get("rss_peak_delta_mib", 0.0) for r in rep["engine"]["schemes"].values() if "kl" in r)
        rows.append({"emulation_s": emulation[0], "emulation_peak_mib": emulation[1], "engine_verify_s": engine[0],
                     "engine_verify_peak_mib": engine[1], "engine_start_s": rep["timings"]["engine_start_s"],
                     "engine_runs_s": rep["engine"]["seconds"],
                     "vllm_job_growth_mib": job_mib, "delivery_s": alone[0], "ratio": engine[0] / emulation[0]})
        print(f"round {i + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows[-1].items()), flush=True)
    print(f"median of {len(rows)} round(s), {args.sequences} x {args.seq_len} tokens, schemes {args.schemes}:")
    for key in rows[0]:
        print(f"  {key}: {statistics.median(r[key] for r in rows):.3g}")


if __name__ == "__main__":
    main()

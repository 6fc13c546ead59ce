"""The KL and top-1 agreement the round-trip tests see when transformers applies kvcal's FP8 K/V scales, over seeds.

    .venv/bin/python scripts/measure_roundtrip_band.py [--seeds 3] [--clients transformers-main,transformers-llmc]
    .venv/bin/python scripts/measure_roundtrip_band.py --spread 1,2 --clients transformers-llmc   # the margin's figure

tests/e2e/test_roundtrip.py loads kvcal's outputs of SmolLM2 with plain ``from_pretrained`` and compares them with the
same checkpoint without kvcal's scales (tests/clients/hf_load.py). Where the client applies the ``kv_cache_scheme``
(transformers 5.17 + compressed-tensors 0.19, the llm-compressor venv), K and V are quantized with kvcal's scales and
the outputs differ by a small, repeatable amount; the test's band around it is set from what this script prints.

For each seed: calibrate on the KJV text shuffled with that seed (128-token sequences, 512 tokens, as the test does),
export the per-head form and, where the llm-compressor venv exists, calibrate beside its FP8 weights
(``--weights fp8``, compared with those weights alone); compare on two 128-token sequences taken at a seed-dependent
place in the text. Each client (a venv's interpreter) runs hf_load.py on every form. Prints one row per (client, form, seed) and, per form,
the range over the seeds where the scheme was applied: top-1 min, KL min and max. The band the test asserts is that
range widened by the stated margin for noise (docs/checkpoints.md, "Round trips").

``--spread THREADS`` measures what the margin is for instead: the test's own inputs (seed 0), calibrated and compared
once per torch thread count given (each count changes the order of the float reductions, as another machine's
kernels do), and each comparison run twice. Per form it prints the KL's spread, max/min over those runs; the
test's MARGIN is derived from it (docs/checkpoints.md, "Round trips").
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from calibrate import calibrate, export  # noqa: E402
from calibrate.demo import kjv_path, smollm2_dir  # noqa: E402

SEQ_LEN = 128  # as tests/e2e/test_roundtrip.py
CLIENTS = {"transformers-main": Path(sys.executable), "transformers-llmc": REPO / ".venv-llmc" / "bin" / "python"}


def tokens(path: Path, seed: int) -> None:
    """Two SEQ_LEN-token sequences of KJV text from verse 400·seed on (seed 0: the test's own)."""
    lines = open(kjv_path()).readlines()[400 * seed: 400 * (seed + 1)]
    text = " ".join(json.loads(line)["text"] for line in lines)
    ids = AutoTokenizer.from_pretrained(smollm2_dir())(text, return_tensors="pt").input_ids[0, : 2 * SEQ_LEN]
    save_file({"input_ids": ids.reshape(2, SEQ_LEN).contiguous()}, str(path))


def fp8_weights(root: Path, seed: int, model: Path, data: Path) -> tuple[Path, Path]:
    """The fp8-weights form and its reference (llm-compressor's FP8 weights alone), built in the llm-compressor venv
    as the test builds them."""
    out, reference = root / f"fp8-{seed}", root / "fp8-reference"
    script = (f"from pathlib import Path\nimport calibrate\nfrom calibrate.checkpoint.weights import quantize_weights\n"
              f"if not Path({str(reference)!r}).exists():\n"
              f"    quantize_weights(Path({str(model)!r}), Path({str(reference)!r}), 'fp8')\n"
              f"calibrate.calibrate({str(model)!r}, [{str(data)!r}], {str(out)!r}, weights='fp8', seq_len={SEQ_LEN}, "
              f"max_tokens={4 * SEQ_LEN}, seed={seed}, verify=False, progress=False)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(CLIENTS["transformers-llmc"]), "-c", script], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"--weights fp8 failed in the llm-compressor venv:\n{proc.stderr[-3000:]}")
    return out, reference


def run_client(python: Path, *args, threads: int | None = None) -> dict:
    """hf_load.py under ``python``, as the tests run it (no VIRTUAL_ENV or PYTHONPATH of this process), on ``threads``
    torch threads (OMP_NUM_THREADS) where given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    out = Path(args[-1])
    proc = subprocess.run([str(python), str(REPO / "tests" / "clients" / "hf_load.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"hf_load.py failed under {python}:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def spread(clients: dict[str, Path], threads: list[int], root: Path) -> None:
    """The test's inputs (seed 0) calibrated and compared on each torch thread count in ``threads``, each comparison
    twice: per form, the KL of every run and its spread (max/min)."""
    model, data = smollm2_dir(), kjv_path()
    ids = root / "tokens-0.safetensors"
    tokens(ids, 0)
    kls: dict[str, list[float]] = {}
    print(f"{'client':<18} {'form':<11} {'threads':>7} {'run':>3} {'top-1':>7} {'KL':>9}")
    for n in threads:
        torch.set_num_threads(n)
        kv = calibrate(str(model), [str(data)], str(root / f"kv-t{n}"), seq_len=SEQ_LEN, max_tokens=4 * SEQ_LEN,
                       progress=False, verify=False)
        head = export(str(kv.out), str(root / f"head-t{n}"), granularity="head")
        for name, python in clients.items():
            for form, out in {"kv-only": kv.out, "per-head": head.out}.items():
                for run in range(2):
                    r = run_client(python, out, model, ids, root / "hf.json", threads=n)
                    if not any(k.endswith(".k_scale") for k in r["scales"]):
                        sys.exit(f"{name} did not apply the kv_cache_scheme: run --spread with transformers-llmc")
                    print(f"{name:<18} {form:<11} {n:>7} {run:>3} {r['top1']:>7.4f} {r['mean_kl']:>9.6f}", flush=True)
                    kls.setdefault(form, []).append(r["mean_kl"])
    for form, values in kls.items():
        print(f"{form}: {len(values)} runs, KL {min(values):.6f}–{max(values):.6f}, spread (max/min) "
              f"{max(values) / min(values):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="calibration seeds 0..N-1 (default 3)")
    parser.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS)}")
    parser.add_argument("--spread", metavar="THREADS", help="comma-separated torch thread counts: measure the KL's "
                        "spread on the test's inputs over these and repeated runs, instead of the seeds")
    args = parser.parse_args()
    clients = {name: CLIENTS[name] for name in args.clients.split(",")}
    missing = [name for name, python in clients.items() if not python.is_file()]
    if missing:
        sys.exit(f"no interpreter for {', '.join(missing)} (scripts/setup-llmcompressor builds .venv-llmc)")
    if args.spread:
        with tempfile.TemporaryDirectory() as tmp:
            spread(clients, [int(n) for n in args.spread.split(",")], Path(tmp))
        return
    model, data = smollm2_dir(), kjv_path()
    applied: dict[str, list[tuple[float, float]]] = {}
    print(f"{'client':<18} {'transformers':<13} {'form':<11} {'seed':>4} {'applied':>7} {'top-1':>7} {'KL':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in range(args.seeds):
            kv = calibrate(str(model), [str(data)], str(root / f"kv-{seed}"), seq_len=SEQ_LEN, max_tokens=4 * SEQ_LEN,
                           seed=seed, progress=False, verify=False)
            head = export(str(kv.out), str(root / f"head-{seed}"), granularity="head")
            ids = root / f"tokens-{seed}.safetensors"
            tokens(ids, seed)
            forms = {"kv-only": (kv.out, model), "per-head": (head.out, model)}
            if CLIENTS["transformers-llmc"].is_file():
                forms["fp8-weights"] = fp8_weights(root, seed, model, data)
            for name, python in clients.items():
                for form, (out, reference) in forms.items():
                    r = run_client(python, out, reference, ids, root / "hf.json")
                    on = any(n.endswith(".k_scale") for n in r["scales"])
                    print(f"{name:<18} {r['transformers']:<13} {form:<11} {seed:>4} {'yes' if on else 'no':>7} "
                          f"{r['top1']:>7.4f} {r['mean_kl']:>8.5f}", flush=True)
                    if on:
                        applied.setdefault(form, []).append((r["top1"], r["mean_kl"]))
    for form, rows in applied.items():
        top1, kl = [t for t, _ in rows], [k for _, k in rows]
        print(f"{form}: {len(rows)} runs with the scheme applied: top-1 min {min(top1):.4f}, KL {min(kl):.5f}–{max(kl):.5f}")
    if not applied:
        print("no client applied the kv_cache_scheme: nothing to measure (run with transformers-llmc)")


if __name__ == "__main__":
    main()

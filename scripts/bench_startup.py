#!/usr/bin/env python
"""Start-up cost of kvcal's light commands against a bare ``import torch``, measured side by side.

    scripts/bench_startup.py               # 7 rounds
    scripts/bench_startup.py --rounds 1    # a quick check that it runs

Each command runs in a fresh interpreter, the commands interleaved round by round (their order rotated
each round, so none always runs first), and the medians are compared. ``kvcal export`` runs on a small
kvcal output made once beforehand: a tiny random Llama saved with ``save_pretrained`` (SmolLM2's
tokenizer, from the ``kvcal[demo]`` packages) calibrated on a generated text file. Targets: ``kvcal
--help`` and ``kvcal recipes list`` import no torch, so they take a fraction of ``import torch``;
a whole ``kvcal export`` takes at most 1.5× ``import torch``.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXPORT_TARGET = 1.5  # kvcal export / import torch
# Import this checkout's package even when run from elsewhere (an editable install may resolve it as a namespace).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def kvcal_command() -> list[str]:
    """How a user starts kvcal: the console script beside this interpreter, else ``python -m calibrate``."""
    script = Path(sys.executable).parent / "kvcal"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "calibrate"]


def build_output(workdir: Path) -> Path:
    """A kvcal output of a tiny random Llama, calibrated on a generated text file (seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from calibrate import calibrate
    from calibrate.demo import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model_dir = workdir / "tiny-model"
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = workdir / "data.txt"
    data.write_text("\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(200)))
    out = workdir / "calibrated"
    calibrate(str(model_dir), [str(data)], str(out), seq_len=128, max_tokens=1024, min_tokens=128, progress=False,
              verify=False, device="cpu")
    return out


def run_once(argv: list[str], cleanup: Path | None) -> float:
    """Wall seconds of one command in a fresh process; it must succeed. ``cleanup`` is removed afterwards."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr}")
    if cleanup is not None:
        shutil.rmtree(cleanup)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every command (default 7)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    with tempfile.TemporaryDirectory(prefix="kvcal-bench-startup-") as tmp:
        workdir = Path(tmp)
        print("preparing a small kvcal output ...", file=sys.stderr)
        source, exported = build_output(workdir), workdir / "exported"
        kvcal = kvcal_command()
        commands = {
            "python -c 'import torch'": ([sys.executable, "-c", "import torch"], None),
            "kvcal --help": ([*kvcal, "--help"], None),
            "kvcal recipes list": ([*kvcal, "recipes", "list"], None),
            "kvcal export": ([*kvcal, "export", str(source), "--out", str(exported)], exported),
        }
        names = list(commands)
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(run_once(*commands[name]))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    medians = {name: statistics.median(t) for name, t in times.items()}
    torch_s = medians[names[0]]
    width = max(map(len, names))
    print(f"{'command':<{width}}  median s  × import torch   ({args.rounds} rounds, interleaved)")
    for name in names:
        print(f"{name:<{width}}  {medians[name]:>8.3f}  {medians[name] / torch_s:>13.2f}")
    ratio = medians["kvcal export"] / torch_s
    verdict = "met" if ratio <= EXPORT_TARGET else "NOT met"
    print(f"kvcal export is {ratio:.2f}× import torch (target ≤ {EXPORT_TARGET}×: {verdict})")


if __name__ == "__main__":
    main()

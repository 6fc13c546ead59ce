"""Bad input through the real ``kvcal`` console script: exit 2, one line ``kvcal: error: ...``, nothing written.

Every row runs one command in a process of its own, as a user would, against the checkout this file lives in
(PYTHONPATH points at it), and checks what the user sees and what is left on disk:

* exit status 2, and stderr exactly one line starting ``kvcal: error: `` (transformers' "Loading weights" bar
  aside) holding the row's fragments, with no traceback;
* the sha256 of every input file the command names (model directories, data, the calibrated output) unchanged;
* no new entry beside OUT (nor OUT itself, nor a hidden ``.OUT.kvcal-*`` temporary).

tests/e2e/test_bad_input.py runs most of these cases in-process; the inputs here are built once for the module. Rows
that need a read-only directory run without CAP_DAC_OVERRIDE when the tests run as root (``runners.as_a_user``).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest
from builders import kjv_jsonl, save_tiny_checkpoint, tiny_config
from runners import as_a_user

from calibrate import apply, calibrate, export_pack

REPO = Path(__file__).resolve().parents[2]  # the checkout whose code the subprocesses run
TIMEOUT_S = 300  # one command; the slowest rows load a tiny model


def _kvcal() -> list[str]:
    """The installed console script, else the module (the script imports whatever PYTHONPATH puts first)."""
    script = shutil.which("kvcal", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "calibrate"]


def _link_copy(src: Path, dst: Path) -> Path:
    """A copy of the directory ``src`` whose files are hard links (replace a file with ``_replace``, never in place)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return dst


def _replace(path: Path, content: bytes) -> None:
    """Give ``path`` new content without touching the file it may share with a hard-linked copy."""
    path.unlink()
    path.write_bytes(content)


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    _replace(model / "config.json", json.dumps(config | changes).encode())


def _edit_header(weights: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header with ``edit(header)``; the tensor bytes stay as they are."""
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    _replace(weights, len(text).to_bytes(8, "little") + text + raw[8 + n :])


@pytest.fixture(scope="module")
def root(tmp_path_factory, smol_tokenizer, kjv_path):
    """One directory of inputs shared by the rows: models, data, a calibrated output, broken copies of each."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoModelForCausalLM,
        BertConfig,
        BertForMaskedLM,
        BloomConfig,
        FalconConfig,
        FalconForCausalLM,
        MptConfig,
    )

    root = tmp_path_factory.mktemp("bad-cli")
    save_tiny_checkpoint(root / "llama", "llama", smol_tokenizer)
    save_tiny_checkpoint(root / "qwen3", "qwen3", smol_tokenizer)
    config = tiny_config("llama")
    config.vocab_size, config.num_hidden_layers = len(smol_tokenizer), 2
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama-2-layers")
    kjv_jsonl(root / "data.jsonl", 200)
    (root / "hi.jsonl").write_text('{"text": "hi"}\n')
    (root / "wrong-column.jsonl").write_text('{"body": "In the beginning"}\n')
    (root / "empty.jsonl").write_text("")
    (root / "a-file").write_text("x")
    (root / "no-data").mkdir()
    calibrate(str(root / "llama"), [str(root / "data.jsonl")], str(root / "out"), seq_len=64, max_tokens=128,
              progress=False, verify=False)

    def broken(name: str, path: str, content: bytes | None) -> None:
        """A copy of the calibrated output with one file replaced (None: removed)."""
        target = _link_copy(root / "out", root / name) / path
        target.unlink() if content is None else _replace(target, content)

    broken("no-provenance", "kvcal/calibration.json", None)
    broken("provenance-not-json", "kvcal/calibration.json", b"{not json")
    broken("provenance-list", "kvcal/calibration.json", b"[]")
    broken("stats-damaged", "kvcal/stats.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    broken("config-not-json", "config.json", b"{")
    (root / "recipe-not-yaml.yaml").write_text("scales: [\n")
    (root / "recipe-unknown-key.yaml").write_text("scales:\n  observr: max\n")
    (root / "recipe-list.yaml").write_text("- a\n- b\n")
    weights = _link_copy(root / "llama", root / "truncated") / "model.safetensors"
    _replace(weights, weights.read_bytes()[: weights.stat().st_size // 2])

    # Outputs that are, hold or lie beside inputs; directories kvcal did not write.
    (root / "user-dir").mkdir()
    (root / "user-dir" / "keep.txt").write_text("mine")
    (root / "empty-dir").mkdir()
    (root / "d").mkdir()
    shutil.copy(root / "data.jsonl", root / "d" / "data.jsonl")
    _link_copy(root / "out", root / "old-out")
    (root / "demo-cache").mkdir()  # KVCAL_CACHE of the demo row: converting the demo model would fill it
    (root / "ro").mkdir()
    (root / "ro" / "keep.txt").write_text("mine")
    (root / "ro").chmod(0o555)
    # A data file whose name is a glob matching another file.
    (root / "glob").mkdir()
    (root / "glob" / "x[1].jsonl").write_text('{"body": "In the beginning"}\n')
    shutil.copy(root / "data.jsonl", root / "glob" / "x1.jsonl")

    # Models vLLM serves without a KV cache, or whose attention kvcal cannot see.
    bert = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      vocab_size=len(smol_tokenizer)))
    for name in ("bert", "bert-no-architectures"):
        bert.save_pretrained(root / name)
        smol_tokenizer.save_pretrained(root / name)
    bert_config = json.loads((root / "bert-no-architectures" / "config.json").read_text())
    del bert_config["architectures"]
    _replace(root / "bert-no-architectures" / "config.json", json.dumps(bert_config).encode())
    FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=len(smol_tokenizer))).save_pretrained(root / "falcon")
    smol_tokenizer.save_pretrained(root / "falcon")
    # Families whose configs spell the head count their own way (n_head, n_heads): read through attribute_map.
    for name, config in (("bloom", BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=len(smol_tokenizer))),
                         ("mpt", MptConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=len(smol_tokenizer)))):
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        smol_tokenizer.save_pretrained(root / name)

    # Damaged configs, tokenizers and weights.
    _edit_config(_link_copy(root / "llama", root / "heads-not-int"), num_attention_heads="eight")
    _edit_config(_link_copy(root / "llama", root / "quant-string"), quantization_config="fp8")
    small = tiny_config("llama")  # vocab_size 256, against the tokenizer's 49,152
    AutoModelForCausalLM.from_config(small).save_pretrained(root / "small-vocab")
    smol_tokenizer.save_pretrained(root / "small-vocab")
    k_proj, q_proj = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    _edit_header(_link_copy(root / "llama", root / "transposed") / "model.safetensors",
                 lambda header: header[k_proj].update(shape=header[k_proj]["shape"][::-1]))
    _edit_header(_link_copy(root / "llama", root / "int-label") / "model.safetensors",
                 lambda header: header[q_proj].update(dtype="I32"))
    weights = _link_copy(root / "llama", root / "nan-lm-head") / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"][7] = float("nan")
    weights.unlink()
    save_file(tensors, weights, metadata={"format": "pt"})
    os.symlink("loop", _link_copy(root / "llama", root / "link-loop") / "loop")
    # Issue 36: configs of the wrong shape, a link back into the model's own folder, refusals in transformers' words,
    # a calibration whose layer names were edited.
    _edit_config(_link_copy(root / "llama", root / "text-config-string"), text_config="llama")
    _edit_config(_link_copy(root / "llama", root / "text-config-list"), text_config=[1, 2])
    _edit_config(_link_copy(root / "llama", root / "layer-types-a-string"), layer_types="full_attention")
    os.symlink(".", _link_copy(root / "llama", root / "link-dot") / "loop")
    _edit_config(_link_copy(root / "llama", root / "unknown-type"), model_type="foollama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (_link_copy(root / "llama", root / "no-tokenizer") if name == "tokenizer.json" else root / "no-tokenizer").joinpath(name).unlink()
    _replace(_link_copy(root / "llama", root / "tokenizer-damaged") / "tokenizer.json", b"{")
    provenance = _link_copy(root / "out", root / "tampered") / "kvcal" / "calibration.json"
    edited = json.loads(provenance.read_text())
    for layer in edited["layers"]:
        layer["prefix"] = layer["prefix"].replace("model.layers", "foo.layers").replace("self_attn", "attn")
    _replace(provenance, json.dumps(edited).encode())
    stats_path = _link_copy(root / "out", root / "stats-no-field") / "kvcal" / "stats.safetensors"
    with safe_open(str(stats_path), "pt") as f:
        header = json.loads(f.metadata()["kvcal"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    del header["signature"]["head_dim"]
    stats_path.unlink()
    save_file(tensors, stats_path, metadata={"kvcal": json.dumps(header)})
    # Issue 51: a pack that lost its manifest, the pack's own applied output, a Parquet file of empty rows.
    export_pack(str(root / "out"), str(root / "pack"))
    shutil.copytree(root / "pack", root / "pack-no-manifest")
    (root / "pack-no-manifest" / "manifest.json").unlink()
    apply(str(root / "pack"), str(root / "llama"), str(root / "applied"))
    pd.DataFrame({"text": [""] * 50}).to_parquet(root / "empty-rows.parquet")
    yield root
    (root / "ro").chmod(0o755)


@dataclass
class Case:
    """One command after ``kvcal``; ``{root}`` stands for the inputs' directory in every string."""

    argv: list[str]
    fragments: list[str]
    out: str | None = None  # what the command would write (OUT, or verify's report directory)
    cwd: str = "{root}"
    env: dict[str, str] = field(default_factory=dict)
    read_only: bool = False  # needs directories that the process cannot write into (root: drop CAP_DAC_OVERRIDE)


def _calibrate(*args: str, out: str = "{root}/new", fragments: list[str], **kw) -> Case:
    return Case(["calibrate", *args, "--out", out, "--quiet", "--no-verify"], fragments, out, **kw)


def _export(*args: str, out: str = "{root}/new", fragments: list[str], **kw) -> Case:
    return Case(["export", *args, "--out", out], fragments, out, **kw)


def _apply(*args: str, out: str = "{root}/new", fragments: list[str], **kw) -> Case:
    return Case(["apply", *args, "--out", out], fragments, out, **kw)


def _verify(*args: str, report: str = "{root}/report", fragments: list[str], **kw) -> Case:
    return Case(["verify", *args, "--report", report, "--quiet"], fragments, report, **kw)


DATA = ("--data", "{root}/data.jsonl")
SHORT = ("--seq-len", "64", "--max-tokens", "64")  # verify: one sequence of the sample
TINY = ("--seq-len", "64", "--max-tokens", "128")  # calibrate: two sequences

# tests/e2e/test_bad_input.py's cases, through the console script.
KNOWN = {
    # calibrate
    "calibrate-model-missing": _calibrate("{root}/missing", *DATA, fragments=["missing does not exist"]),
    "calibrate-model-is-a-file": _calibrate("{root}/a-file", *DATA, fragments=["a-file is a file"]),
    "calibrate-model-without-config": _calibrate("{root}/no-data", *DATA, fragments=["has no config.json"]),
    "calibrate-config-not-json": _calibrate("{root}/config-not-json", *DATA, fragments=["config.json is not valid JSON"]),
    "calibrate-seq-len-not-int": _calibrate("{root}/llama", *DATA, "--seq-len", "many", fragments=["--seq-len: invalid int value: 'many'"]),
    "calibrate-max-tokens-negative": _calibrate("{root}/llama", *DATA, "--max-tokens", "-1", fragments=["--max-tokens must be a positive integer"]),
    "calibrate-unknown-granularity": _calibrate("{root}/llama", *DATA, "--granularity", "channel", fragments=["invalid choice: 'channel'"]),
    "calibrate-headroom-inf": _calibrate("{root}/llama", *DATA, "--headroom", "inf", fragments=["--headroom must be a number ≥ 1.0"]),
    "calibrate-min-tokens-zero": _calibrate("{root}/llama", *DATA, "--min-tokens", "0", fragments=["--min-tokens must be a positive integer"]),
    "calibrate-min-tokens-above-budget": _calibrate("{root}/llama", *DATA, "--min-tokens", "999999",
                                                    fragments=["--min-tokens 999999 is more than --max-tokens"]),
    "calibrate-empty-data": _calibrate("{root}/llama", "--data", "{root}/empty.jsonl", fragments=["empty.jsonl is empty"]),
    "calibrate-data-dir-without-data": _calibrate("{root}/llama", "--data", "{root}/no-data", fragments=["holds no .txt/.jsonl"]),
    "calibrate-bad-weight": _calibrate("{root}/llama", "--data", "{root}/data.jsonl::heavy", fragments=["must be a positive number"]),
    "calibrate-recipe-not-yaml": _calibrate("{root}/llama", *DATA, "--recipe", "{root}/recipe-not-yaml.yaml",
                                            fragments=["is not valid YAML", "(line 2, column 1)"]),
    "calibrate-recipe-unknown-key": _calibrate("{root}/llama", *DATA, "--recipe", "{root}/recipe-unknown-key.yaml",
                                               fragments=["unknown key 'scales.observr'; did you mean 'observer'?"]),
    "calibrate-recipe-not-a-mapping": _calibrate("{root}/llama", *DATA, "--recipe", "{root}/recipe-list.yaml", fragments=["must be a mapping of keys"]),
    "calibrate-recipe-misspelt": _calibrate("{root}/llama", *DATA, "--recipe", "lama3", fragments=["no recipe named 'lama3'; did you mean 'llama3'?"]),
    "calibrate-recipe-other-family": _calibrate("{root}/llama", *DATA, "--recipe", "qwen3", fragments=["written for qwen3"]),
    "calibrate-out-parent-missing": _calibrate("{root}/llama", *DATA, out="{root}/missing/new", fragments=["parent directory"]),
    "calibrate-out-inside-model": _calibrate("{root}/llama", *DATA, out="{root}/llama/new", fragments=["inside it"]),
    "calibrate-out-exists": _calibrate("{root}/llama", *DATA, out="{root}/out", fragments=["already exists"]),
    "calibrate-data-shorter-than-a-sequence": _calibrate(
        "{root}/llama", "--data", "{root}/hi.jsonl", *TINY,
        fragments=["the data gave 2 tokens per layer, fewer than the 64 needed", "one --seq-len 64 sequence", "--min-tokens 2"]),
    "calibrate-min-tokens-not-met": _calibrate("{root}/llama", "--data", "{root}/hi.jsonl", *TINY, "--min-tokens", "3",
                                               fragments=["fewer than the 3 needed (--min-tokens 3)"]),
    "calibrate-truncated-weights": _calibrate("{root}/truncated", *DATA, *TINY, fragments=["model.safetensors"]),
    "calibrate-data-no-known-column": _calibrate("{root}/llama", "--data", "{root}/wrong-column.jsonl",
                                                 fragments=["has no 'input_ids' / 'messages' / 'text' column; its columns are body"]),
    "calibrate-text-field-missing": _calibrate("{root}/llama", *DATA, "--text-field", "content",
                                               fragments=["has no 'content' column; its columns are text"]),
    # export
    "export-source-missing": _export("{root}/missing", fragments=["missing has no kvcal/stats.safetensors"]),
    "export-source-is-a-file": _export("{root}/a-file", fragments=["a-file has no kvcal/stats.safetensors"]),
    "export-source-not-kvcal": _export("{root}/llama", fragments=["llama has no kvcal/stats.safetensors; pass a directory written by kvcal calibrate"]),
    "export-provenance-missing": _export("{root}/no-provenance", fragments=["has no kvcal/calibration.json"]),
    "export-provenance-not-json": _export("{root}/provenance-not-json", fragments=["calibration.json is not valid JSON"]),
    "export-provenance-not-kvcal": _export("{root}/provenance-list", fragments=["calibration.json holds a list, not a JSON object"]),
    "export-stats-damaged": _export("{root}/stats-damaged", fragments=["stats.safetensors is not a readable safetensors file"]),
    "export-unknown-observer": _export("{root}/out", "--observer", "median", fragments=["unknown observer 'median'"]),
    "export-bad-percentile": _export("{root}/out", "--observer", "percentile:0", fragments=["the percentile must be in (0, 100]"]),
    "export-unknown-granularity": _export("{root}/out", "--granularity", "channel", fragments=["invalid choice: 'channel'"]),
    "export-headroom-below-1": _export("{root}/out", "--headroom", "0.5", fragments=["--headroom must be a number ≥ 1.0"]),
    "export-headroom-not-a-number": _export("{root}/out", "--headroom", "lots", fragments=["--headroom: invalid float value: 'lots'"]),
    "export-model-missing": _export("{root}/out", "--model", "{root}/missing", fragments=["does not exist"]),
    "export-model-other-architecture": _export("{root}/out", "--model", "{root}/qwen3", fragments=["model_type is 'llama' in the statistics but 'qwen3'"]),
    "export-model-other-depth": _export("{root}/out", "--model", "{root}/llama-2-layers", fragments=["has 2 layers and", "calibrated on a model with 3"]),
    "export-model-config-not-json": _export("{root}/out", "--model", "{root}/config-not-json", fragments=["config.json"]),
    # inspect
    "inspect-missing": Case(["inspect", "{root}/missing"], ["missing is not a checkpoint"]),
    "inspect-a-file": Case(["inspect", "{root}/a-file"], ["a-file is not a checkpoint"]),
    "inspect-no-config": Case(["inspect", "{root}/no-data"], ["no-data is not a checkpoint: it has no config.json"]),
    "inspect-config-not-json": Case(["inspect", "{root}/config-not-json"], ["config.json is not valid JSON"]),
    # apply
    "apply-source-not-kvcal": _apply("{root}/llama", "{root}/llama", fragments=["llama has no kvcal/stats.safetensors"]),
    "apply-source-damaged": _apply("{root}/provenance-list", "{root}/llama", fragments=["calibration.json holds a list, not a JSON object"]),
    "apply-target-missing": _apply("{root}/out", "{root}/missing", fragments=["missing is not a checkpoint"]),
    "apply-target-other-architecture": _apply("{root}/out", "{root}/qwen3", fragments=["'qwen3'"]),
    "apply-target-other-depth": _apply("{root}/out", "{root}/llama-2-layers", fragments=["has 2 attention layers", "calibrated on 3"]),
    # recipes
    "recipes-show-without-name": Case(["recipes", "show"], ["needs a NAME"]),
    "recipes-list-with-name": Case(["recipes", "list", "llama3"], ["takes no NAME", "kvcal recipes show llama3"]),
    "recipes-misspelt": Case(["recipes", "show", "lama3"], ["did you mean 'llama3'?"]),
    "recipes-not-yaml": Case(["recipes", "show", "{root}/recipe-not-yaml.yaml"], ["is not valid YAML"]),
    "recipes-unknown-key": Case(["recipes", "show", "{root}/recipe-unknown-key.yaml"], ["unknown key 'scales.observr'"]),
    "recipes-missing-file": Case(["recipes", "show", "{root}/missing.yaml"], ["does not exist"]),
    "recipes-unknown-action": Case(["recipes", "edit"], ["invalid choice: 'edit'"]),
    # verify
    "verify-checkpoint-missing": _verify("{root}/missing", *DATA, fragments=["does not exist"]),
    "verify-checkpoint-is-a-file": _verify("{root}/a-file", *DATA, fragments=["a-file is a file"]),
    "verify-data-missing": _verify("{root}/out", "--data", "{root}/missing.jsonl", fragments=["missing.jsonl: no such file"]),
    "verify-data-empty": _verify("{root}/out", "--data", "{root}/empty.jsonl", fragments=["empty.jsonl is empty"]),
    "verify-unknown-scheme": _verify("{root}/out", *DATA, "--schemes", "fp4", fragments=["unknown verify scheme 'fp4'"]),
    "verify-empty-scheme-list": _verify("{root}/out", *DATA, "--schemes", ",", *SHORT, fragments=["--schemes"]),
    "verify-seq-len-zero": _verify("{root}/out", *DATA, "--seq-len", "0", fragments=["--seq-len must be an integer"]),
    "verify-budget-below-a-sequence": _verify("{root}/out", *DATA, "--seq-len", "64", "--max-tokens", "10", fragments=["less than one sequence"]),
    "verify-negative-threshold": _verify("{root}/out", *DATA, "--max-kl", "-1", fragments=["thresholds must satisfy"]),
    "verify-accum-bits-zero": _verify("{root}/out", *DATA, "--accum-bits", "0", fragments=["--accum-bits must be between"]),
    "verify-threshold-not-a-number": _verify("{root}/out", *DATA, "--max-kl", "low", fragments=["--max-kl: invalid float value: 'low'"]),
    "verify-bad-needle": _verify("{root}/out", *DATA, "--needle", "long", fragments=["--needle"]),
    "verify-data-shorter-than-a-sequence": _verify("{root}/out", "--data", "{root}/hi.jsonl", "--seq-len", "64", "--max-tokens", "128",
                                                   fragments=["2 tokens"]),
    "verify-report-is-a-file": _verify("{root}/out", *DATA, *SHORT, report="{root}/a-file", fragments=["a-file"]),
}

# Issue 26: inputs that crashed, wrote, or removed something.
READ_ONLY_OUT = "{root}/ro/new"
NEW = {
    # An OUT that holds an input, or that kvcal did not write, is never replaced (--overwrite or not).
    "export-out-holds-the-source": _export("{root}/out", "--overwrite", out="{root}", fragments=["holds the input"]),
    "apply-out-holds-the-target": _apply("{root}/out", "{root}/llama", "--overwrite", out="{root}", fragments=["holds the input"]),
    "calibrate-out-holds-the-model": _calibrate("{root}/llama", *DATA, "--overwrite", out="{root}", fragments=["holds the input"]),
    "calibrate-out-holds-the-data": _calibrate("{root}/llama", "--data", "{root}/d/data.jsonl", "--overwrite", out="{root}/d",
                                               fragments=["holds the input", "data.jsonl"]),
    "calibrate-overwrite-a-user-dir": _calibrate("{root}/llama", *DATA, "--overwrite", out="{root}/user-dir", fragments=["was not written by kvcal"]),
    "export-overwrite-a-user-dir": _export("{root}/out", "--overwrite", out="{root}/user-dir", fragments=["was not written by kvcal"]),
    "apply-overwrite-a-user-dir": _apply("{root}/out", "{root}/llama", "--overwrite", out="{root}/user-dir", fragments=["was not written by kvcal"]),
    # The demo replaces its OUT: a directory it did not write is refused before the demo model is converted.
    "demo-out-a-user-dir": Case(["demo", "--out", "{root}/user-dir"], ["was not written by kvcal"], "{root}/user-dir",
                                env={"KVCAL_CACHE": "{root}/demo-cache"}),
    # --out . : the working directory.
    "calibrate-out-cwd-is-the-model": _calibrate("{root}/llama", *DATA, out=".", cwd="{root}/llama", fragments=["is the input"]),
    "calibrate-out-cwd-holds-the-model": _calibrate("{root}/llama", *DATA, "--overwrite", out=".", fragments=["holds the input"]),
    "calibrate-out-cwd-exists": _calibrate("{root}/llama", *DATA, out=".", cwd="{root}/user-dir", fragments=["already exists"]),
    "calibrate-out-cwd-a-user-dir": _calibrate("{root}/llama", *DATA, "--overwrite", out=".", cwd="{root}/user-dir",
                                               fragments=["was not written by kvcal"]),
    "calibrate-out-cwd-empty": _calibrate("{root}/llama", *DATA, *TINY, "--overwrite", out=".", cwd="{root}/empty-dir",
                                          fragments=["current directory"]),
    "export-out-cwd-a-kvcal-output": _export("{root}/out", "--overwrite", out=".", cwd="{root}/old-out", fragments=["current directory"]),
    "apply-out-cwd-empty": _apply("{root}/out", "{root}/llama", "--overwrite", out=".", cwd="{root}/empty-dir",
                                  fragments=["current directory"]),
    # A data file named like a glob is read itself, not the file the glob matches (x1.jsonl, good data).
    "calibrate-data-name-like-a-glob": _calibrate("{root}/llama", "--data", "{root}/glob/x[1].jsonl", *TINY,
                                                  fragments=["x[1].jsonl has no 'input_ids' / 'messages' / 'text' column"]),
    # Models vLLM serves without a KV cache, or whose attention kvcal cannot see.
    "calibrate-bert": _calibrate("{root}/bert", *DATA, *TINY, fragments=["kvcal calibrates the decoders vLLM serves with a KV cache"]),
    "calibrate-bert-without-architectures": _calibrate("{root}/bert-no-architectures", *DATA, *TINY, fragments=["bert", "encoder"]),
    "verify-bert-without-architectures": _verify("{root}/bert-no-architectures", *DATA, *SHORT, fragments=["bert", "encoder"]),
    "calibrate-attention-outside-the-interface": _calibrate("{root}/falcon", *DATA, *TINY,
                                                            fragments=["no attention call reaches kvcal's hook", "FalconForCausalLM"]),
    "calibrate-bloom-n-head": _calibrate("{root}/bloom", *DATA, *TINY, fragments=["no attention call reaches kvcal's hook", "BloomForCausalLM"]),
    "calibrate-mpt-n-heads": _calibrate("{root}/mpt", *DATA, *TINY, fragments=["no attention call reaches kvcal's hook", "MptForCausalLM"]),
    # config.json, tokenizer and weights that do not agree with each other.
    "calibrate-heads-not-an-integer": _calibrate("{root}/heads-not-int", *DATA, *TINY, fragments=["num_attention_heads", "'eight'"]),
    "export-model-heads-not-an-integer": _export("{root}/out", "--model", "{root}/heads-not-int", fragments=["num_attention_heads", "'eight'"]),
    "verify-heads-not-an-integer": _verify("{root}/heads-not-int", *DATA, *SHORT, fragments=["num_attention_heads", "'eight'"]),
    "calibrate-tokenizer-larger-than-the-embedding": _calibrate("{root}/small-vocab", *DATA, *TINY, fragments=["49152", "vocab_size 256"]),
    "verify-tokenizer-larger-than-the-embedding": _verify("{root}/small-vocab", *DATA, *SHORT, fragments=["49152", "vocab_size 256"]),
    "calibrate-weight-shape-transposed": _calibrate("{root}/transposed", *DATA, *TINY, fragments=["model.layers.0.self_attn.k_proj.weight"]),
    "calibrate-float-weight-labelled-i32": _calibrate("{root}/int-label", *DATA, *TINY, fragments=["model.layers.0.self_attn.q_proj.weight"]),
    "calibrate-nan-in-lm-head": _calibrate("{root}/nan-lm-head", *DATA, *TINY, fragments=["lm_head.weight", "not finite"]),
    "verify-nan-in-lm-head": _verify("{root}/nan-lm-head", *DATA, *SHORT, fragments=["lm_head.weight", "not finite"]),
    "calibrate-quantization-config-a-string": _calibrate("{root}/quant-string", *DATA, *TINY, fragments=["quantization_config"]),
    "inspect-quantization-config-a-string": Case(["inspect", "{root}/quant-string"], ["quantization_config"]),
    "calibrate-link-loop-in-the-model": _calibrate("{root}/link-loop", *DATA, *TINY, fragments=["link-loop/loop"]),
    "export-link-loop-in-the-model": _export("{root}/out", "--model", "{root}/link-loop", fragments=["link-loop/loop"]),
    # Issue 36: the last faults.
    "calibrate-text-config-a-string": _calibrate("{root}/text-config-string", *DATA, *TINY,
                                                 fragments=["text-config-string/config.json has text_config 'llama', a string"]),
    "inspect-text-config-a-list": Case(["inspect", "{root}/text-config-list"], ["text-config-list/config.json has text_config [1, 2], a list"]),
    "export-model-text-config-a-list": _export("{root}/out", "--model", "{root}/text-config-list", fragments=["text_config [1, 2]"]),
    "inspect-layer-types-a-string": Case(["inspect", "{root}/layer-types-a-string"], ["layer_types 'full_attention', a string", "a list"]),
    "calibrate-link-to-its-own-folder": _calibrate("{root}/link-dot", *DATA, *TINY, fragments=["link-dot/loop is a link back to"]),
    "export-link-to-its-own-folder": _export("{root}/out", "--model", "{root}/link-dot", fragments=["link-dot/loop is a link back to"]),
    "calibrate-model-type-unknown": _calibrate("{root}/unknown-type", *DATA, *TINY,
                                               fragments=["model_type 'foollama'", "does not know", "upgrade transformers"]),
    "verify-model-type-unknown": _verify("{root}/unknown-type", *DATA, *SHORT, fragments=["model_type 'foollama'", "does not know"]),
    "calibrate-no-tokenizer-files": _calibrate("{root}/no-tokenizer", *DATA, *TINY, fragments=["holds no tokenizer files", "copy the original"]),
    "verify-no-tokenizer-files": _verify("{root}/no-tokenizer", *DATA, *SHORT, fragments=["holds no tokenizer files"]),
    "calibrate-tokenizer-damaged": _calibrate("{root}/tokenizer-damaged", *DATA, *TINY, fragments=["could not load a tokenizer", "(transformers: "]),
    "export-calibration-layer-names-edited": _export("{root}/tampered", fragments=["'foo.layers.0.attn'", "not an attention module"]),
    "export-model-calibration-layer-names-edited": _export("{root}/tampered", "--model", "{root}/llama", fragments=["'foo.layers.0.attn'"]),
    "apply-calibration-layer-names-edited": _apply("{root}/tampered", "{root}/llama", fragments=["foo.layers.0.attn"]),
    # Scales that overflow float32.
    "export-headroom-overflows": _export("{root}/out", "--headroom", "1e39", fragments=["--headroom"]),
    "calibrate-headroom-overflows": _calibrate("{root}/llama", *DATA, *TINY, "--headroom", "1e39", fragments=["--headroom"]),
    # Statistics whose model signature lacks a field.
    "export-stats-signature-incomplete": _export("{root}/stats-no-field", fragments=["stats.safetensors", "head_dim"]),
    "apply-stats-signature-incomplete": _apply("{root}/stats-no-field", "{root}/llama", fragments=["stats.safetensors", "head_dim"]),
    "verify-stats-signature-incomplete": _verify("{root}/stats-no-field", *DATA, *SHORT, fragments=["stats.safetensors", "head_dim"]),
    # Issue 51: refusals that say what is true.
    "apply-pack-without-manifest": _apply("{root}/pack-no-manifest", "{root}/llama",
                                          fragments=["is an incomplete scale pack", "but no manifest.json"]),
    "apply-pack-to-its-own-applied-output": _apply("{root}/pack", "{root}/applied",
                                                   fragments=["was written by kvcal apply from", "already holds them"]),
    "calibrate-parquet-rows-empty": _calibrate("{root}/llama", "--data", "{root}/empty-rows.parquet", *TINY,
                                               fragments=["empty-rows.parquet: all 50 records are empty"]),
    # Where nothing can be written.
    "calibrate-out-parent-read-only": _calibrate("{root}/llama", *DATA, *TINY, out=READ_ONLY_OUT, read_only=True, fragments=["ro", "not writable"]),
    "export-out-parent-read-only": _export("{root}/out", out=READ_ONLY_OUT, read_only=True, fragments=["ro", "not writable"]),
    "apply-out-parent-read-only": _apply("{root}/out", "{root}/llama", out=READ_ONLY_OUT, read_only=True, fragments=["ro", "not writable"]),
    "verify-report-parent-read-only": _verify("{root}/out", *DATA, *SHORT, report="{root}/ro/report", read_only=True, fragments=["ro", "not writable"]),
    "verify-report-parent-is-a-file": _verify("{root}/out", *DATA, *SHORT, report="{root}/a-file/report", fragments=["a-file", "not a directory"]),
}
ROWS = KNOWN | NEW


def _digests(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), by relative path; links as their targets."""
    if path.is_symlink() or path.is_file():
        return {"": f"-> {os.readlink(path)}" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()}
    found = {}
    for directory, dirs, files in os.walk(path):
        for name in dirs + files:
            item = Path(directory) / name
            rel = str(item.relative_to(path))
            if item.is_symlink():
                found[rel] = f"-> {os.readlink(item)}"
            elif item.is_file():
                found[rel] = hashlib.sha256(item.read_bytes()).hexdigest()
            else:
                found[rel] = "dir"
    return found


def _inputs(argv: list[str], cwd: Path, env: dict[str, str], root: Path) -> list[Path]:
    """The existing paths under ``root`` that a command names (its inputs, an OUT that exists), and the calibration."""
    named = [cwd / arg.split("::")[0] for arg in argv] + [Path(value) for value in env.values()]
    return sorted({p for p in named if os.path.lexists(p) and (p == root or root in p.parents)} | {root / "out"})


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_is_one_line_and_changes_nothing(root, name):
    case = ROWS[name]
    fill = lambda text: text.format(root=root)  # noqa: E731
    argv, cwd = [fill(a) for a in case.argv], Path(fill(case.cwd))
    env = {k: fill(v) for k, v in case.env.items()}
    out = (cwd / fill(case.out)).resolve() if case.out else root
    beside = next(p for p in out.parents if p.is_dir()) if case.out else root  # an OUT's parent may be missing
    user = as_a_user() if case.read_only else {}  # root writes anywhere unless it drops the capability to
    inputs = _inputs(argv, cwd, env, root)
    before = {p: _digests(p) for p in inputs}
    listed = sorted(os.listdir(beside))

    result = subprocess.run(
        [*_kvcal(), *argv], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                          "HF_HUB_OFFLINE": "1"} | env, **user,
    )

    created = sorted(set(os.listdir(beside)) - set(listed))
    for entry in created:  # a row that wrote something must not spoil the rows after it
        path = beside / entry
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()

    # transformers' weight-loading progress bar is printed even with --quiet; it is no error line.
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-4000:]
    assert len(lines) == 1 and lines[0].startswith("kvcal: error: "), result.stderr[-4000:]
    for fragment in case.fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert {p: _digests(p) for p in inputs} == before, "an input changed"
    assert not created, f"{', '.join(created)} written beside {out}"
    assert sorted(os.listdir(beside)) == listed, f"entries beside {out} removed"


def test_the_rows_are_many_and_each_named_once():
    assert len(ROWS) >= 60 and not set(KNOWN) & set(NEW)

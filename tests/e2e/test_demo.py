"""The demo model's conversion: packaged GGUF -> a plain HF directory that loads, generates, and is shared safely.

The session fixture ``smol_dir`` only ever sees the cached result; these tests run the conversion itself into
a fresh cache, so a transformers release that changes what GGUF loading needs fails here, not in the demo.
"""

import os
import stat
from pathlib import Path

import pytest

from calibrate import demo

UMASK = 0o027  # not the usual 0o022, so a hard-coded 0644 cannot pass for following the umask


@pytest.fixture
def umask():
    old = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by path relative to ``root``."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return found


def assert_follows_umask(root: Path, mask: int) -> None:
    for name, mode in modes(root).items():
        expected = (0o777 if (root / name).is_dir() else 0o666) & ~mask
        assert mode == expected, f"{name}: {oct(mode)}, umask {oct(mask)} gives {oct(expected)}"


def test_publish_dir_follows_umask(tmp_path, umask):
    def write(out: Path) -> None:
        (out / "sub").mkdir()
        (out / "config.json").write_text("{}")
        fd = os.open(out / "private.bin", os.O_CREAT | os.O_WRONLY, 0o600)  # as safetensors writes
        os.close(fd)

    target = demo.publish_dir(tmp_path / "cache" / "model", write)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["model"]
    assert_follows_umask(target, umask)


def test_publish_dir_failure_leaves_nothing(tmp_path):
    def write(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        demo.publish_dir(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.smoke
def test_publish_dir_keeps_an_earlier_publish(tmp_path):
    """Two processes converting at once: the second finds the first's directory in place and keeps it."""
    first = demo.publish_dir(tmp_path / "model", lambda out: (out / "config.json").write_text('"first"'))
    second = demo.publish_dir(tmp_path / "model", lambda out: (out / "config.json").write_text('"second"'))
    assert first == second and (first / "config.json").read_text() == '"first"'
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_publish_dir_replaces_a_leftover(tmp_path):
    """A directory without config.json was never published (publishes are whole): it is replaced."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "partial.safetensors").write_text("")
    demo.publish_dir(tmp_path / "model", lambda out: (out / "config.json").write_text("{}"))
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]


@pytest.mark.slow
def test_smollm2_conversion(tmp_path, monkeypatch, umask):
    """One real conversion (~40 s of GGUF loading on 2 cores) into an empty cache, checked end to end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("KVCAL_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / demo.SMOLLM2_NAME
    renames = []
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == target:  # what the rename publishes, seen just before it happens
            renames.append((Path(src).parent, sorted(p.name for p in Path(src).iterdir()), Path(dst).exists()))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(demo.os, "replace", replace)
    assert demo.smollm2_dir() == target

    # Atomic: one rename of a complete sibling directory onto a target that did not exist yet; nothing left over.
    assert len(renames) == 1
    parent, names, existed = renames[0]
    assert parent == target.parent and not existed
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert [p.name for p in target.parent.iterdir()] == [demo.SMOLLM2_NAME]
    assert_follows_umask(target, umask)

    # A second call is the cached directory, with no conversion.
    assert demo.smollm2_dir() == target and len(renames) == 1

    # It is a plain bf16 checkpoint that loads without GGUF and continues text sensibly.
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert model.dtype == torch.bfloat16
    assert not hasattr(model.config, "quantization_config")
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
@pytest.mark.timeout(1800)  # against a hang only: 3.5 CPU-minutes, 5 min wall measured under load (load average ~9 on 2 cores)
def test_kvcal_demo_runs_to_its_verdict_table(smol_dir, tmp_path):
    """``kvcal demo`` as a user runs it, on a small budget (its own --max-tokens and --seq-len; the default budget takes
    minutes): it ends with the short verify's table, one row per scheme it measured, each with a verdict."""
    import json
    import subprocess
    import sys

    from calibrate.choices import scheme_label
    from calibrate.config import SHORT_VERIFY_SCHEMES
    from calibrate.verification.verdict_table import SHORT_COLUMNS

    out = tmp_path / "demo-out"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))  # this checkout's code
    done = subprocess.run([sys.executable, "-m", "calibrate", "demo", "--out", str(out), "--max-tokens", "512",
                           "--seq-len", "64"], capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # The short verdict table (SHORT_COLUMNS), the terminal's default.
    header = next(i for i, line in enumerate(lines) if line.startswith(SHORT_COLUMNS[0]) and SHORT_COLUMNS[1] in line)
    rows = lines[header + 2: lines.index("", header)]  # under the dashes, up to the blank line
    verdict_at = lines[header].index(SHORT_COLUMNS[-1])
    name_ends = lines[header].index(SHORT_COLUMNS[1])  # the scheme column: vLLM's labels hold single spaces
    table = {row[:name_ends].rstrip(): row[verdict_at:].split("  ")[0] for row in rows}
    # Scale 1.0, the written (per-tensor) scales and the short verify's per-token schemes, in that order.
    assert list(table) == [scheme_label(name) for name in ("scale1", "tensor", *SHORT_VERIFY_SCHEMES)], rows
    assert all(verdict in ("pass", "warn", "fail") for verdict in table.values()), table
    report = json.loads((out / "kvcal" / "verify" / "report.json").read_text())
    assert {scheme_label(name): r["verdict"] for name, r in report["schemes"].items()} == table  # the table is the report's
    assert lines[-2] == "serve it with:" and lines[-1].startswith(f"  vllm serve {out} --kv-cache-dtype ")

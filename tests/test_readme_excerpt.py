"""Tests for scripts/readme_excerpt.py: README's demo excerpt is what the code prints for the stored demo run
(tests/fixtures/demo_report.json), so a change to the labels, the columns or the serve line fails here until the
script is rerun."""

import importlib.util
import json
import re
from pathlib import Path

from calibrate.choices import scheme_label

REPO = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("readme_excerpt", REPO / "scripts" / "readme_excerpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_excerpt_is_what_the_code_prints_for_the_stored_demo_run():
    script = load_script()
    report = json.loads(script.FIXTURE.read_text())
    shown = script.readme_block(script.README.read_text())
    assert shown == script.excerpt(report), "README's demo excerpt is stale: run scripts/readme_excerpt.py"
    lines = shown.strip("`\n").splitlines()
    assert [re.split(r"\s{2,}", row)[0] for row in lines[2:2 + len(report["schemes"])]] == list(map(scheme_label, report["schemes"]))
    assert lines[-2:] == ["serve it with:", f"  {report['serve_command'].replace('YOUR-ORG/YOUR-REPO', script.DEMO_OUT)}"]
    assert len(lines) <= 2 + len(report["schemes"]) + 11 and max(map(len, lines)) <= 125

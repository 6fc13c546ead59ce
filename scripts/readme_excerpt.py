#!/usr/bin/env python3
"""The README's demo excerpt, rendered from a real demo run by the code that prints it.

    scripts/demo                                        # a real run: writes demo-out/kvcal/verify/report.json
    python scripts/readme_excerpt.py --report demo-out/kvcal/verify/report.json   # store it, rewrite README's block
    python scripts/readme_excerpt.py --check            # exit 1 when README's block is not what the code prints

The stored report (tests/fixtures/demo_report.json) is the run the README shows; the block between the markers in
README.md is ``VerifyResult.summary`` of it, the verdict table and the answer the demo ends with.
tests/test_readme_excerpt.py runs ``--check``'s comparison, so a change to the labels, the columns or the serve line
fails until this script is rerun.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from calibrate.verification.run import VerifyResult  # noqa: E402  (the repository's own code, not an installed one)

FIXTURE = REPO / "tests" / "fixtures" / "demo_report.json"
README = REPO / "README.md"
BEGIN = "<!-- demo excerpt: scripts/readme_excerpt.py writes what lies between these markers -->"
END = "<!-- demo excerpt ends -->"
DEMO_OUT = "demo-out"  # the demo's default OUT, as the terminal names it


def excerpt(report: dict) -> str:
    """What the demo prints last for ``report``: the verdict table and the answer, as a fenced block (without the
    calibration's own little-data warning, which the report does not keep)."""
    text = VerifyResult(report, Path(DEMO_OUT) / "kvcal" / "verify", DEMO_OUT).summary()
    return f"```\n{text}\n```"


def readme_block(readme: str) -> str:
    """The excerpt in ``readme``: what lies between BEGIN and END, without them."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip("\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="a demo run's report.json to store as the run the README shows")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when README's block differs")
    args = parser.parse_args()
    if args.report:
        shutil.copyfile(args.report, FIXTURE)
    wanted = excerpt(json.loads(FIXTURE.read_text()))
    readme = README.read_text()
    if readme_block(readme) == wanted:
        return 0
    if args.check:
        print(f"{README.name}'s demo excerpt is not what the code prints: run scripts/readme_excerpt.py", file=sys.stderr)
        return 1
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(f"{readme[:start]}\n{wanted}\n{readme[end:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

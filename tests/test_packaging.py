"""The wheel pip builds from pyproject.toml holds every module and recipe the source tree has.

An editable install (scripts/setup) reads the source tree, so a package left out of pyproject's list only shows in
a real install: this builds the wheel the way a user's ``pip install .`` does and compares it with the tree.
"""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    # Built from a copy: setuptools leaves build/ and egg-info beside the sources it builds.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src)
    for name in ("calibrate", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("kvcal-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_holds_every_module(wheel_names):
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "calibrate").rglob("*.py")}
    assert modules and not modules - wheel_names, f"missing from the wheel: {sorted(modules - wheel_names)}"


def test_wheel_holds_every_recipe(wheel_names):
    recipes = {f"calibrate/recipe_files/{p.name}" for p in (REPO / "recipes").glob("*.yaml")}
    assert recipes and not recipes - wheel_names, f"missing from the wheel: {sorted(recipes - wheel_names)}"

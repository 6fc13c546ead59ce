"""calibrate/version.py: the version provenance and reports record is the one pyproject.toml declares."""

import tomllib
from importlib.metadata import PackageNotFoundError
from pathlib import Path

from calibrate import version as V


def test_the_installed_version_is_pyprojects():
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert V.kvcal_version() == declared


def test_a_source_checkout_without_an_install_says_so(monkeypatch):
    def missing(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(V, "version", missing)
    assert V.kvcal_version() == "unknown (not installed)"

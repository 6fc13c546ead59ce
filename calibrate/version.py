"""kvcal's own version, as provenance and reports record it."""

from importlib.metadata import PackageNotFoundError, version


def kvcal_version() -> str:
    """kvcal's installed version; a source checkout on PYTHONPATH has none."""
    try:
        return version("kvcal")
    except PackageNotFoundError:
        return "unknown (not installed)"

"""kvcal: offline FP8 KV-cache scale calibration for vLLM.

    from calibrate import calibrate, export, verify, inspect
    result = calibrate("path/to/model", ["data.jsonl"], "out-dir", seq_len=2048)
    print(result.summary())
    print(inspect("out-dir").text())

The names below are imported on first use, so that ``kvcal --help`` and ``import calibrate.cli`` do not
pay for torch and transformers (seconds) before a command needs them.
"""

import importlib
import sys
import types

# Public name → the submodule that defines it.
_PUBLIC = {
    "CalibrationConfig": "config",
    "CalibrationResult": "api",
    "Stats": "stats",
    "VerifyResult": "verify",
    "apply": "api",
    "calibrate": "api",
    "export": "api",
    "inspect": "inspector",
    "load_calibration": "api",
    "load_recipe": "recipes",
    "run_calibration": "api",
    "verify": "verify",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    """Import a public name's module on first use and keep the name."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """``calibrate.export`` and ``calibrate.verify`` stay the functions, as with eager imports.

    Importing the submodules ``calibrate.export`` or ``calibrate.verify`` makes Python bind them on the
    package under the same names; that binding is dropped here (they stay in ``sys.modules``), so
    ``from calibrate import export`` gives the function whatever was imported before.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

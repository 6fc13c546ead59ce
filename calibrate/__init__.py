"""kvcal: offline FP8 KV-cache scale calibration for vLLM.

    from calibrate import calibrate, export, verify, inspect
    result = calibrate("path/to/model", ["data.jsonl"], "out-dir", seq_len=2048)
    print(result.summary())
    print(inspect("out-dir").text())

The names below are imported on first use, so that ``kvcal --help`` and ``import calibrate.cli`` do not
pay for torch and transformers (seconds) before a command needs them.
"""

import importlib

# Public name → the module that defines it.
_PUBLIC = {
    "CalibrationConfig": "config",
    "CalibrationResult": "result",
    "Stats": "capture.stats",
    "TasksResult": "verification.tasks",
    "VerifyResult": "verification.run",
    "apply": "api",
    "audit": "engine.audit",
    "calibrate": "api",
    "check_delivery": "engine.delivery",
    "export": "api",
    "export_pack": "api",
    "inspect": "checkpoint.inspect",
    "load_calibration": "checkpoint.kvcal_dir",
    "load_recipe": "recipes",
    "run_calibration": "api",
    "tasks": "verification.tasks",
    "verify": "verification.run",
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

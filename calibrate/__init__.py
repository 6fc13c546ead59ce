"""kvcal: offline FP8 KV-cache scale calibration for vLLM.

    from calibrate import calibrate, export, verify, inspect
    result = calibrate("path/to/model", ["data.jsonl"], "out-dir", seq_len=2048)
    print(result.summary())
    print(inspect("out-dir").text())
"""

from .api import CalibrationResult, calibrate, export, load_calibration, run_calibration
from .config import CalibrationConfig
from .inspector import apply, inspect
from .recipes import load_recipe
from .stats import Stats
from .verify import VerifyResult, verify

__all__ = [
    "CalibrationConfig", "CalibrationResult", "Stats", "VerifyResult",
    "apply", "calibrate", "export", "inspect", "load_calibration", "load_recipe", "run_calibration", "verify",
]

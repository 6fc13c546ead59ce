"""kvcal: offline FP8 KV-cache scale calibration for vLLM.

    from calibrate import calibrate
    result = calibrate("path/to/model", ["data.jsonl"], "out-dir", seq_len=2048)
"""

from .api import CalibrationResult, calibrate, export, load_calibration, run_calibration
from .config import CalibrationConfig
from .stats import Stats

__all__ = ["CalibrationConfig", "CalibrationResult", "Stats", "calibrate", "export", "load_calibration", "run_calibration"]

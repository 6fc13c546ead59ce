"""One validated configuration per calibration run, checked before any model is loaded."""

from dataclasses import dataclass, field
from pathlib import Path

from .fp8 import get_format
from .observers import parse_granularity, parse_observer


@dataclass
class CalibrationConfig:
    """Everything a calibration run needs. ``validate()`` raises ValueError with the fix.

    Attributes:
        model: local Hugging Face model directory (safetensors weights).
        data: data sources (files, globs, directories, save_to_disk dirs, hub names; ``SRC::WEIGHT``).
        out: output checkpoint directory, created atomically.
        seq_len: tokens per calibration sequence (the context length you serve, when it fits).
        max_tokens: token budget over all sequences.
        chunk_len: sequences longer than this run as chunked prefill through a KV cache.
        observer: ``max``, ``percentile:P``, ``mse`` or ``sink-aware``.
        granularity: ``tensor``, ``head`` (FA3 on Hopper only) or ``token`` (dynamic at serve time).
        headroom: multiplier ≥ 1 on every scale, range kept for unseen data.
        query_scale: also write q_scale (vLLM's FA3 path quantizes queries and uses 1.0 without it).
        fp8_format: ``e4m3fn`` (NVIDIA, CPU) or ``e4m3fnuz`` (ROCm MI300).
        weights: ``None`` (weights untouched) or ``"fp8"``: also quantize the weights with llm-compressor's
            data-free FP8_DYNAMIC scheme (needs the ``llmcompressor`` extra).
    """

    model: str
    data: list[str]
    out: str
    seq_len: int = 2048
    max_tokens: int = 500_000
    chunk_len: int = 2048
    text_field: str | None = None
    pack: bool = True
    seed: int = 0
    long_records: str = "split"
    device: str = "auto"
    dtype: str | None = None
    observer: str = "max"
    granularity: str = "tensor"
    headroom: float = 1.0
    query_scale: bool = True
    fp8_format: str = "e4m3fn"
    weights: str | None = None
    overwrite: bool = False
    verify: bool = True
    progress: bool = True
    recipe: dict = field(default_factory=dict)  # the recipe this config came from, saved with the output

    def validate(self) -> "CalibrationConfig":
        """Cheap checks of every field; returns self."""
        if not Path(self.model).is_dir():
            raise ValueError(f"model directory {self.model} does not exist; pass a local Hugging Face model directory")
        if not self.data:
            raise ValueError("no calibration data: pass --data FILE (txt, jsonl, json, parquet, csv) or a dataset name")
        for name, value in (("seq-len", self.seq_len), ("max-tokens", self.max_tokens), ("chunk-len", self.chunk_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.max_tokens < self.seq_len and self.pack:
            raise ValueError(f"--max-tokens {self.max_tokens} is less than one sequence (--seq-len {self.seq_len}); raise it")
        parse_observer(self.observer)
        parse_granularity(self.granularity)
        get_format(self.fp8_format)
        if not (isinstance(self.headroom, (int, float)) and self.headroom >= 1.0):
            raise ValueError(f"--headroom must be a number ≥ 1.0 (1.0 = none), got {self.headroom!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if self.weights not in (None, "fp8"):
            raise ValueError(f"--weights {self.weights!r}: choose fp8 (or leave it out to keep the weights as they are)")
        return self

"""One validated configuration per calibration run, checked before any model is loaded.

This module imports neither torch nor transformers: the command line parses and checks settings, and
``kvcal recipes`` validates recipes, with the names below, in a fraction of a second. The names are the
ones ``observers``, ``fp8`` and ``verify`` define (tests/test_cli.py checks they agree).
"""

from dataclasses import dataclass, field
from pathlib import Path

OBSERVERS = ("max", "percentile:P", "mse", "sink-aware")
GRANULARITIES = ("tensor", "head", "token")
FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
DTYPES = ("float32", "bfloat16", "float16")
VERIFY_SCHEMES = ("bf16", "scale1", "tensor", "head", "token")
# A run whose layers saw fewer tokens than this says so in its summary and in calibration.json.
LITTLE_DATA_TOKENS = 100_000


def check_observer(text: str) -> None:
    """Refuse an ``--observer`` value that ``observers.parse_observer`` would refuse, with the same message."""
    name, _, arg = text.strip().partition(":")
    if name == "percentile":
        try:
            p = float(arg)
        except ValueError:
            raise ValueError(f"observer {text!r}: write the percentile as a number, e.g. percentile:99.99") from None
        if not 0 < p <= 100:
            raise ValueError(f"observer {text!r}: the percentile must be in (0, 100], e.g. percentile:99.99")
    elif name not in ("max", "mse", "sink-aware") or arg:
        raise ValueError(f"unknown observer {text!r}; choose one of: {', '.join(OBSERVERS)}")


def check_granularity(text: str) -> None:
    """Refuse a granularity that ``observers.parse_granularity`` would refuse, with the same message."""
    if text not in GRANULARITIES:
        raise ValueError(f"unknown granularity {text!r}; choose one of: {', '.join(GRANULARITIES)}")


def check_fp8_format(name: str) -> None:
    """Refuse a format name that ``fp8.get_format`` would refuse, with the same message."""
    if name not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; choose one of: {', '.join(FP8_FORMATS)}")


def check_headroom(value: float) -> None:
    """Refuse a headroom below 1 or infinite (the scales would clip more, or be infinite)."""
    if not (isinstance(value, (int, float)) and 1.0 <= value < float("inf")):
        raise ValueError(f"--headroom must be a number ≥ 1.0 (1.0 = none), got {value!r}")


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
        min_tokens: fewer tokens per layer than this is an error, raised before anything is written;
            None = one full ``seq_len`` sequence (``max_tokens`` when that is smaller, as with ``pack=False``).
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
    min_tokens: int | None = None
    overwrite: bool = False
    verify: bool = True
    progress: bool = True
    recipe: dict = field(default_factory=dict)  # the recipe this config came from, saved with the output

    def validate(self) -> "CalibrationConfig":
        """Cheap checks of every field; returns self."""
        if Path(self.model).is_file():
            raise ValueError(f"{self.model} is a file; pass the model's directory (the one holding config.json)")
        if not Path(self.model).is_dir():
            raise ValueError(f"model directory {self.model} does not exist; pass a local Hugging Face model directory")
        if not self.data:
            raise ValueError("no calibration data: pass --data FILE (txt, jsonl, json, parquet, csv) or a dataset name")
        for name, value in (("seq-len", self.seq_len), ("max-tokens", self.max_tokens), ("chunk-len", self.chunk_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.max_tokens < self.seq_len and self.pack:
            raise ValueError(f"--max-tokens {self.max_tokens} is less than one sequence (--seq-len {self.seq_len}); raise it")
        if self.min_tokens is not None:
            if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens <= 0:
                raise ValueError(f"--min-tokens must be a positive integer, got {self.min_tokens!r}")
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"--min-tokens {self.min_tokens} is more than --max-tokens {self.max_tokens} allows; lower it or raise --max-tokens")
        check_observer(self.observer)
        check_granularity(self.granularity)
        check_fp8_format(self.fp8_format)
        check_headroom(self.headroom)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if self.weights not in (None, "fp8"):
            raise ValueError(f"--weights {self.weights!r}: choose fp8 (or leave it out to keep the weights as they are)")
        return self

    def needed_tokens(self) -> int:
        """Tokens per layer a run must see: ``min_tokens``, else one full sequence within the budget."""
        return self.min_tokens if self.min_tokens is not None else min(self.seq_len, self.max_tokens)

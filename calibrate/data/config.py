"""What a calibration or verify run reads and how it is cut into sequences (DataConfig), checked before any data
is read. Torch-free."""

from dataclasses import dataclass
from pathlib import Path

from ..choices import LONG_RECORDS
from .sources import resolve_sources


def as_sources(data: str | Path | list | None) -> list[str]:
    """``--data`` as given (one source, a list of them, or none) → a list of source strings."""
    return [str(data)] if isinstance(data, (str, Path)) else [str(s) for s in data or []]


def check_int(name: str, value: object, low: int) -> None:
    """The one rule for a count setting: a whole number ≥ ``low``; the error names the setting and its flag."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        rule = "a positive integer" if low == 1 else f"an integer ≥ {low}"
        raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {value!r}")


@dataclass
class DataConfig:
    """What to read and how to cut it into sequences (a recipe's ``data:`` section).

    Attributes:
        sources: files, globs, directories or hub names, each optionally ``::WEIGHT`` (module docstring).
        seq_len: tokens per sequence (the last one of a source, and of the run, may be shorter).
        max_tokens: token budget of the whole run, BOS and EOS included.
        chunk_len: a sequence longer than this runs through the model as chunked prefill through a KV cache.
        text_field: column holding plain text; None = auto-detect ``input_ids``, ``messages``, ``text``.
        pack: join documents into full ``seq_len`` sequences; False = one record per sequence.
        seed: seed of the record shuffle (and of the order in which a source's files are read).
        long_records: ``"split"`` a record longer than one sequence, or refuse it with ``"error"``.
    """

    sources: list[str]
    seq_len: int = 2048
    max_tokens: int = 500_000
    chunk_len: int = 2048
    text_field: str | None = None
    pack: bool = True
    seed: int = 0
    long_records: str = "split"

    def check_values(self) -> "DataConfig":
        """Every setting but the sources (a recipe's ``data:`` section is checked this way); returns self."""
        check_int("seq_len", self.seq_len, 2)
        check_int("max_tokens", self.max_tokens, 1)
        check_int("chunk_len", self.chunk_len, 1)
        if self.long_records not in LONG_RECORDS:
            raise ValueError(f"long_records must be one of {', '.join(LONG_RECORDS)}, got {self.long_records!r}")
        if self.text_field is not None and (not isinstance(self.text_field, str) or not self.text_field):
            raise ValueError(f"text_field must be a column name or None, got {self.text_field!r}")
        if not isinstance(self.pack, bool):
            raise ValueError(f"pack must be True or False, got {self.pack!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        return self

    def check_budget(self) -> None:
        """A run's budget holds at least one packed sequence (the data layer itself cuts the last one to it)."""
        if self.pack and self.max_tokens < self.seq_len:
            raise ValueError(f"--max-tokens {self.max_tokens} is less than one sequence (--seq-len {self.seq_len}); raise it")

    def validate(self, *, max_context: int | None = None) -> "DataConfig":
        """Cheap checks (values, sources exist and are non-empty), to run before any model is loaded; returns self.

        Args:
            max_context: the model's context length in tokens, when known; ``seq_len`` must fit in it.

        Raises:
            ValueError: saying what is wrong and how to fix it.
        """
        self.check_values()
        self.check_context(max_context)
        resolve_sources(self.sources)
        return self

    def check_context(self, max_context: int | None) -> None:
        """``seq_len`` fits in the model's context (in tokens; None: unknown, anything fits)."""
        if max_context is not None and self.seq_len > max_context:
            raise ValueError(
                f"--seq-len {self.seq_len} is longer than the model's context of {max_context} tokens; "
                f"lower it to at most {max_context}"
            )

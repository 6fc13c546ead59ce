"""The installed vLLM's cache dtypes set against the ones kvcal knows: a dtype a newer vLLM adds is "not emulated"
(the engine can still run it), and one kvcal knows that this vLLM lacks is said so, instead of either crashing."""

from dataclasses import dataclass
from pathlib import Path

from ..choices import CACHE_DTYPES, SCHEMES, VLLM_SCHEME_NAMES
from .launch import EngineError, find_vllm_python, run_job

NOT_EMULATED = "not emulated"


@dataclass(frozen=True)
class EngineDtypes:
    """The installed vLLM's ``--kv-cache-dtype`` names, in its order."""

    vllm_version: str
    names: tuple[str, ...]

    def emulation(self, name: str) -> str | None:
        """The verify scheme that emulates vLLM's ``name``, or None where kvcal emulates no such cache."""
        if name in VLLM_SCHEME_NAMES:
            return VLLM_SCHEME_NAMES[name]
        return name if name in SCHEMES else None

    def rows(self) -> list[tuple[str, str]]:
        """(name, what kvcal does with it) for every name this vLLM or kvcal knows: "emulated as SCHEME",
        NOT_EMULATED, or "not in vLLM X" for a name kvcal knows that this vLLM lacks."""
        known = (*CACHE_DTYPES, *VLLM_SCHEME_NAMES)
        out = [(name, f"emulated as {scheme}" if (scheme := self.emulation(name)) else NOT_EMULATED) for name in self.names]
        out += [(name, f"not in vLLM {self.vllm_version}") for name in dict.fromkeys(known) if name not in self.names]
        return out

    def not_emulated(self) -> list[str]:
        """This vLLM's cache dtypes that kvcal does not emulate (the engine alone can measure them)."""
        return [name for name in self.names if self.emulation(name) is None]

    def missing(self, names: list[str] | tuple[str, ...]) -> list[str]:
        """Those of ``names`` (kvcal's, or a user's) that this vLLM does not offer."""
        return [name for name in names if name not in self.names]


def engine_dtypes(python: str | Path | None = None) -> EngineDtypes:
    """The installed vLLM's cache dtypes, read from vLLM itself by the version job (about as long as importing it).

    Raises:
        launch.EngineError: no vLLM, or it has no list where 0.32 keeps it.
    """
    python = find_vllm_python(python)
    answer = run_job(python, "version", {})
    if answer["error"] is not None:
        raise EngineError(f"could not read vLLM's cache dtypes: {answer['error'].splitlines()[0]}")
    return EngineDtypes(answer["result"]["vllm_version"], tuple(answer["result"]["cache_dtypes"]))

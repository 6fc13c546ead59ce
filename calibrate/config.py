"""The configuration tree of a run, each part defined and validated once, checked before any model is loaded.

    CalibrationConfig                 one ``kvcal calibrate`` run (recipes map onto it section by section)
      ├── data: DataConfig            what to read and how to cut it (``data/stream.py`` owns it: recipe ``data:``)
      ├── scales: ScaleConfig         how statistics become scales (recipe ``scales:``; ``kvcal export`` too)
      ├── thresholds: Thresholds      the verdict's limits (``thresholds.py`` owns it: recipe ``verify.thresholds``)
      └── the run's own fields        placement, export form and weights, saves, verify on/off

``kvcal verify``'s ``VerifyConfig`` holds a DataConfig and Thresholds the same way. A flat set of keyword
options (``calibrate(model, data, out, seq_len=..., observer=...)``, the CLI's flags) goes to the part that
owns each name: for a calibration through the recipe section of that part (``recipes.recipe_paths``), for
verify directly (``route_options``).

This module imports neither torch nor transformers (nor do the parts' modules at import): the command line parses
and checks settings, and ``kvcal recipes`` validates recipes, with the names in ``choices.py``, in a fraction of a
second.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .choices import (
    DEFAULT_TARGET,
    DEVICE_MAPS,
    MODEL_DTYPES,
    check_form_name,
    check_fp8_format,
    check_granularity,
    check_headroom,
    check_observer,
    check_output_granularity,
    check_target,
    check_verify_schemes,
    check_weights,
    parse_size,
    runs_the_model,
)
from .data.config import DataConfig, as_sources, check_int
from .files import check_model_dir
from .hub import check_card_names
from .settings import flat_settings
from .thresholds import Thresholds

# The short verify after calibration compares these beside the written scales (recipes may name others).
SHORT_VERIFY_SCHEMES = ("token", "int8_per_token_head")
_MAX_MEMORY_EXAMPLE = "e.g. --max-memory 0=70GiB,cpu=200GiB (devices 0, 1, cuda:0, cpu, disk)"
# A run whose layers saw fewer tokens than this says so in its summary and in calibration.json.
LITTLE_DATA_TOKENS = 100_000
# Tokens between two saves of a resumable run (per torchrun rank). 2M tokens through an 8B model are about
# 3e16 FLOPs: half a minute even at an H100's peak bf16 rate, minutes in practice at batch 1 with the capture,
# while a save writes the statistics once (about 76 MB for an 8B model; not yet timed on a GPU machine). A kill
# then loses minutes of work at most, and the default 500K-token run never saves.
CHECKPOINT_EVERY = 2_000_000


def parse_max_memory_size(text: str | int) -> int:
    """Bytes in one --max-memory size (``choices.parse_size``), refused in --max-memory's words."""
    size = parse_size(text)
    if size is None:
        raise ValueError(f"--max-memory size {text!r} is not a size; write a number and a unit, e.g. 70GiB, 500MB, 1.5GB")
    return size


def parse_device(name: str | int) -> int | str:
    """A --max-memory device as accelerate names it: GPU index (``0``, ``cuda:0``), ``cpu`` or ``disk``."""
    text = str(name).strip().lower() if not isinstance(name, bool) else ""
    index = text.removeprefix("cuda:")
    if index.isdigit():
        return int(index)
    if text in ("cpu", "disk"):
        return text
    raise ValueError(f"--max-memory device {name!r} is not a device; name a GPU (0, 1, cuda:0), cpu or disk")


def parse_max_memory(value: str | dict) -> dict[int | str, int]:
    """``DEVICE=SIZE[,DEVICE=SIZE...]`` (or a dict of the same) → accelerate's ``max_memory``, sizes in bytes."""
    if isinstance(value, str):
        pairs = []
        for part in value.split(","):
            device, sep, size = part.partition("=")
            if not sep or not device.strip() or not size.strip():
                raise ValueError(f"--max-memory {value!r}: {part.strip()!r} is not DEVICE=SIZE; write {_MAX_MEMORY_EXAMPLE}")
            pairs.append((device, size))
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        raise ValueError(f"--max-memory must be a string or a dict, got {type(value).__name__}; write {_MAX_MEMORY_EXAMPLE}")
    if not pairs:
        raise ValueError(f"--max-memory names no device; write {_MAX_MEMORY_EXAMPLE}")
    budgets: dict[int | str, int] = {}
    for device, size in pairs:
        key = parse_device(device)
        if key in budgets:
            raise ValueError(f"--max-memory names device {key} twice; give each device one size")
        budgets[key] = parse_max_memory_size(size)
    return budgets


def check_offload_folder(folder: str) -> None:
    """Refuse an offload folder that cannot be written (a parent that is a file, read-only, a full disk).

    Checked by writing a small file there, so permission, read-only mounts and ENOSPC all show before the model loads;
    a folder that does not exist yet is probed in its nearest existing parent (transformers creates it).
    """
    path = Path(folder)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--offload-folder {folder}: {existing} is not a directory; pass a directory on a disk with room")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".kvcal-offload-probe-") as probe:
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        raise ValueError(f"--offload-folder {folder} cannot be written ({e.strerror}); pass a writable directory with free space") from None
    if shutil.disk_usage(existing).free == 0:
        raise ValueError(f"--offload-folder {folder} is on a full disk; free space there or pass another directory")


@dataclass
class ScaleConfig:
    """How statistics become scales: for ``kvcal calibrate`` and for ``kvcal export`` from saved statistics.

    Attributes:
        observer: ``max``, ``percentile:P``, ``mse`` or ``sink-aware``.
        granularity: ``tensor``, ``head`` (read by FLASH_ATTN only, ``vllm_facts.caveats.PER_HEAD_READERS``) or ``token`` (dynamic at serve time).
        headroom: multiplier ≥ 1 on every scale, range kept for unseen data.
        query_scale: also write q_scale (where vLLM quantizes queries, ``vllm_facts.caveats.Q_QUANTIZERS``, it uses 1.0 without it).
        fp8_format: ``e4m3fn`` (NVIDIA, CPU) or ``e4m3fnuz`` (ROCm MI300).
    """

    observer: str = "max"
    granularity: str = "tensor"
    headroom: float = 1.0
    query_scale: bool = True
    fp8_format: str = "e4m3fn"

    def validate(self) -> "ScaleConfig":
        """Every field checked; returns self."""
        check_observer(self.observer)
        check_granularity(self.granularity)
        if runs_the_model(self.observer):
            check_output_granularity(self.granularity)
        check_headroom(self.headroom)
        if not isinstance(self.query_scale, bool):
            raise ValueError(f"query_scale must be True or False, got {self.query_scale!r}")
        check_fp8_format(self.fp8_format)
        return self


@dataclass
class CalibrationConfig:
    """Everything a calibration run needs. ``validate()`` raises ValueError with the fix.

    Attributes:
        model: local Hugging Face model directory (safetensors weights); ``recipes.calibration_config`` turns a
            Hub id (``org/name``) into its snapshot directory in the Hub cache (``hub.resolve``).
        revision: the Hub model's branch, tag or commit (the model must be a Hub id).
        trust_remote_code: run modeling code a Hub model ships (off, as in transformers and vLLM).
        data: what to read and how to cut it (a list of sources alone takes DataConfig's defaults).
        out: output checkpoint directory, created atomically.
        scales: how statistics become scales.
        thresholds: the verdict limits of the short verify after calibration.
        verify: run that short verify of the written checkpoint.
        verify_schemes: the schemes it compares besides scale 1.0; None: the written granularity and SHORT_VERIFY_SCHEMES.
        target: where the checkpoint will be served (``choices.TARGETS``); the serve line printed is for it.
        form: checkpoint form to write (EXPORT_FORMS); ``auto`` follows the source checkpoint.
        weights: ``None`` (weights untouched) or ``"fp8"``: also quantize the weights with llm-compressor's
            data-free FP8_DYNAMIC scheme (needs the ``llmcompressor`` extra).
        min_tokens: fewer tokens per layer than this is an error, raised before anything is written;
            None = one full ``seq_len`` sequence (``max_tokens`` when that is smaller, as with ``pack=False``).
        device: ``auto`` (a GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: model dtype; None = the checkpoint's on GPU, float32 on CPU.
        device_map: ``"auto"``: place the model with accelerate's device map over every visible GPU, then CPU,
            then disk, instead of wholly on ``device``. Also implied by ``max_memory`` or ``offload_folder``.
        max_memory: budget per device for that map, ``"0=70GiB,cpu=200GiB"`` or ``{0: "70GiB", "cpu": 200 * 2**30}``;
            only the devices named are used, so ``cpu=...`` alone forces what does not fit onto disk.
        offload_folder: where weights offloaded to disk are written when they cannot be read from the
            checkpoint's own safetensors files (non-safetensors or converted weights, e.g. most MoE models).
        dist_timeout: under torchrun, seconds a rank waits for the others (to join, and at each step's end)
            before it gives up with an error: a rank that died or hangs then ends the run instead of blocking it.
        checkpoint_every: save the statistics so far and the place in the data every this many tokens (of each
            torchrun rank's share) into ``.OUT.kvcal-resume`` beside OUT, so that a killed run can resume; 0: never.
        resume: continue from that save instead of starting over; the save's settings, model, data and number
            of ranks must be this run's (see ``calibrate.run.resume``).
        recipe: the resolved recipe this config came from, saved with the output.
        base_model: ``org/name[@revision]`` of the Hub model the scales belong to, for the model card (default: the
            Hub snapshot the model came from, if it did).
        hub_id: the Hub repo OUT will be uploaded to: the model card's serve lines name it.
    """

    model: str
    data: DataConfig | list[str]
    out: str
    scales: ScaleConfig = field(default_factory=ScaleConfig)
    thresholds: Thresholds = field(default_factory=Thresholds)
    verify: bool = True
    verify_schemes: list[str] | None = None
    target: str = DEFAULT_TARGET
    form: str = "auto"
    weights: str | None = None
    min_tokens: int | None = None
    device: str = "auto"
    dtype: str | None = None
    device_map: str | None = None
    max_memory: str | dict | None = None
    offload_folder: str | None = None
    dist_timeout: float = 600.0
    checkpoint_every: int = CHECKPOINT_EVERY
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    recipe: dict = field(default_factory=dict)
    revision: str | None = None
    trust_remote_code: bool = False
    base_model: str | None = None
    hub_id: str | None = None

    # The parts (recipe sections) of the tree, and calibration.json's "settings" in their order ("sources" is
    # written as "data", the flag's name).
    PARTS = {"data": DataConfig, "scales": ScaleConfig, "thresholds": Thresholds}
    SETTINGS = ["sources", "seq_len", "max_tokens", "chunk_len", "text_field", "pack", "seed", "long_records", "device",
                "dtype", "observer", "granularity", "headroom", "query_scale", "fp8_format", "weights", "min_tokens",
                "device_map", "max_memory", "offload_folder", "dist_timeout", "checkpoint_every", "resume", "overwrite",
                "verify", "target", "progress", "revision", "trust_remote_code"]

    def __post_init__(self) -> None:
        if not isinstance(self.data, DataConfig):
            self.data = DataConfig(sources=as_sources(self.data))

    @classmethod
    def defaults(cls) -> dict:
        """Every flat setting's default, as ``kvcal calibrate --help`` shows them."""
        return cls(model="", data=[], out="").settings()

    def settings(self) -> dict:
        """The run's settings as calibration.json holds them (flat; ``data`` is the list of sources)."""
        return {("data" if k == "sources" else k): v for k, v in flat_settings(self, self.SETTINGS).items()}

    def validate(self) -> "CalibrationConfig":
        """Cheap checks of every part and field; returns self."""
        check_model_dir(self.model)
        self.data.validate()
        self.data.check_budget()
        self.scales.validate()
        self.thresholds.validate()
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, got {self.verify!r}")
        if self.verify_schemes is not None:
            check_verify_schemes(self.verify_schemes)
        check_form_name(self.form)
        check_target(self.target)
        check_card_names(self.base_model, self.hub_id)
        check_weights(self.weights)
        if self.min_tokens is not None:
            check_int("min_tokens", self.min_tokens, 1)
            if self.min_tokens > self.data.max_tokens:
                raise ValueError(f"--min-tokens {self.min_tokens} is more than --max-tokens {self.data.max_tokens} allows; lower it or raise --max-tokens")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ValueError(f"--dtype {self.dtype!r}: choose float32, bfloat16 or float16")
        if isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, (int, float)) or not 0 < self.dist_timeout < float("inf"):
            raise ValueError(f"--dist-timeout must be a positive number of seconds, got {self.dist_timeout!r}")
        if not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool) or self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be a number of tokens ≥ 0 (0: no saves), got {self.checkpoint_every!r}")
        if not isinstance(self.resume, bool):
            raise ValueError(f"resume must be True or False, got {self.resume!r}")
        self._check_placement()
        return self

    def written_schemes(self) -> list[str]:
        """What the short verify compares besides scale 1.0: the recipe's schemes, else the written granularity and
        SHORT_VERIFY_SCHEMES (vLLM's per-token-head modes, FP8 and int8, at the same bytes per token)."""
        written = self.verify_schemes or ["head" if self.scales.granularity == "head" else "tensor", *SHORT_VERIFY_SCHEMES]
        return list(dict.fromkeys(["scale1", *written]))

    def mapped(self) -> bool:
        """Whether the model is placed with a device map (any of device_map, max_memory, offload_folder)."""
        return self.device_map is not None or self.max_memory is not None or self.offload_folder is not None

    def max_memory_bytes(self) -> dict[int | str, int] | None:
        """``max_memory`` as accelerate takes it: device (GPU index, "cpu", "disk") → bytes."""
        return None if self.max_memory is None else parse_max_memory(self.max_memory)

    def _check_placement(self) -> None:
        """Device-map settings: known names, parseable sizes, a writable offload folder, no clash with --device."""
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ValueError(f"--device-map {self.device_map!r}: choose auto (or give --max-memory / --offload-folder alone)")
        budgets = self.max_memory_bytes()
        if self.offload_folder is not None:
            if not isinstance(self.offload_folder, (str, os.PathLike)) or not str(self.offload_folder).strip():
                raise ValueError(f"--offload-folder must be a directory path, got {self.offload_folder!r}")
            check_offload_folder(str(self.offload_folder))
        if not self.mapped():
            return
        if self.device not in ("auto", "cpu"):
            raise ValueError(
                f"--device {self.device} puts the whole model on one device, which --device-map/--max-memory/--offload-folder "
                "replace: leave --device out and name the GPUs in --max-memory (e.g. 0=70GiB,cpu=200GiB)"
            )
        if self.device == "cpu" and budgets and any(isinstance(k, int) for k in budgets):
            raise ValueError("--device cpu and a GPU in --max-memory contradict each other; drop one of them")
        if budgets is not None and not any(k != "disk" for k in budgets):
            raise ValueError("--max-memory names only disk, but layers run on a GPU or the CPU; add one, e.g. cpu=8GiB")

    def needed_tokens(self) -> int:
        """Tokens per layer a run must see: ``min_tokens``, else one full sequence within the budget."""
        return self.min_tokens if self.min_tokens is not None else min(self.data.seq_len, self.data.max_tokens)

"""Resume a long calibration after a kill: periodic saves of each rank's statistics and place in the data.

A run with ``checkpoint_every`` > 0 saves, each time that many more tokens of its share were captured, the
statistics so far and how many of its sequences they hold, into ``.OUT.kvcal-resume/`` beside OUT: one
``stats-rankR-N.safetensors`` and one ``state-rankR.json`` per torchrun rank R (a rank's share is fixed,
sequence i going to rank i mod the number of ranks, so each rank restores its own and the merge at the end is
unchanged). The data stream is deterministic and the statistics are sums and maxima, so a resumed run restores
them, reads past the sequences already seen without running them and ends with exactly the statistics of a run
that was never interrupted.

A save is atomic: the statistics go to a new file, then the rank's JSON is written beside and renamed over the
old one, naming that file: the rename is the commit, so a kill at any moment leaves the previous save or the
new one whole. The JSON holds what must not change for the statistics to stay exact (the settings that shape
them, the model's files, the data's hashes, the number of ranks, device type and dtype); ``--resume`` refuses
any difference with one line naming it. The directory is removed once OUT is written.
"""

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..capture.stats import Stats
from ..files import file_sha256, read_json_object, write_atomically
from ..layout import pause_at, sibling
from ..model.layers import ModelSignature

if TYPE_CHECKING:
    from ..config import CalibrationConfig

FORMAT = 1
# CalibrationConfig fields that change the captured statistics (the model is compared by its files).
STATS_SETTINGS = ("data", "seq_len", "max_tokens", "chunk_len", "text_field", "pack", "seed", "long_records", "dtype")
# Model files not hashed whole: weights (hashing them would cost minutes on a large model). They are compared by size,
# modification time (ns) and, for safetensors, the sha256 of the header (names, dtypes, shapes, offsets, metadata).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_HASH_LIMIT = 64 << 20  # bigger files are compared by size too
_REDO = "resume with the saved run's settings, model and data, or start over with --overwrite instead of --resume"


def resume_dir(out: str | Path) -> Path:
    """Where a run writing ``out`` keeps its saves: hidden, beside OUT, never taken for a stale temporary."""
    out = Path(out)
    return sibling(out, "resume")


def _state_path(directory: Path, rank: int) -> Path:
    return directory / f"state-rank{rank}.json"


def saved_states(directory: Path) -> list[Path]:
    """The committed saves in ``directory``, one per rank that saved."""
    return sorted(directory.glob("state-rank*.json")) if directory.is_dir() else []


def prepare(config: "CalibrationConfig", rank: int, world: int, manifest: list[dict]) -> dict | None:
    """Before the model loads, once the data is open (``manifest``): this rank's save to resume from (None: start
    its share from the beginning).

    Without ``resume``, a save left by an interrupted run is refused (a fresh run would replace hours of work)
    unless ``overwrite``, which removes it. With ``resume``, every rank's save is checked against this run's
    settings, model and number of ranks; a rank that had not saved yet when the run died starts afresh, but a
    directory with no save at all is an error.
    """
    directory = resume_dir(config.out)
    states = saved_states(directory)
    if not config.resume:
        if states and not config.overwrite:
            raise ValueError(
                f"{directory} holds the save of an interrupted run of this --out; pass --resume to continue it, "
                "or --overwrite to start over (the save is then removed)"
            )
        shutil.rmtree(directory, ignore_errors=True)
        return None
    if not states:
        raise ValueError(
            f"--resume: there is no save to resume from ({directory} holds none: the run ended before its first "
            "--checkpoint-every tokens, or it finished); run again without --resume"
        )
    current = run_identity(config, world, manifest)
    mine = None
    for path in states:
        state = _read_state(path)
        check_same(state, current, directory)
        if state["rank"] == rank:
            mine = state
    return mine


def run_identity(config: "CalibrationConfig", world: int, manifest: list[dict]) -> dict:
    """What a save must share with the run resuming it, as far as is known before the model loads: settings,
    model files, number of ranks and the data stream's ``manifest`` (its files' hashes, a hub dataset's revision)."""
    model = Path(config.model).resolve()
    return {
        "settings": json.loads(json.dumps({name: value for name, value in config.settings().items() if name in STATS_SETTINGS})),
        "model": {"path": str(model), "files": _model_files(model)},
        "world": world,
        "data": [{key: source[key] for key in ("source", "weight", "files", "revision")} for source in manifest],
    }


def loaded_identity(device: torch.device, dtype: torch.dtype) -> dict:
    """What a save must share with the run resuming it, known once the model is loaded: where and in what dtype
    it computes."""
    return {"device": device.type, "dtype": str(dtype).removeprefix("torch.")}


def check_same(saved: dict, current: dict, directory: Path) -> None:
    """Raise one line naming the first thing in ``current`` that differs from the save."""
    for key, now in current.items():
        then = saved.get(key)
        if then != now:
            raise ValueError(f"cannot resume from {directory}: {_difference(key, then, now)}; {_REDO}")


def _difference(key: str, then, now) -> str:
    """What differs between the saved and the current value of one identity entry, for a person."""
    if key == "settings":
        name = next(n for n in now if then.get(n) != now[n])
        return f"{name} is {now[name]!r} now but was {then.get(name)!r} in the saved run"
    if key == "world":
        return f"the saved run had {then} torchrun ranks and this one has {now} (each rank saved its own share)"
    if key == "model":
        if then["path"] != now["path"]:
            return f"the model is {now['path']} now but was {then['path']} in the saved run"
        name = next(n for n in sorted({*then["files"], *now["files"]}) if then["files"].get(n) != now["files"].get(n))
        return f"model file {name} differs from the saved run's (changed, added or removed)"
    if key == "data":
        for old, new in zip(then, now):
            if old != new:
                changed = [f["path"] for f in new["files"] if f not in old["files"]] or [f["path"] for f in old["files"] if f not in new["files"]]
                what = f"data file {changed[0]}" if changed else f"data source {new['source']}"
                return f"{what} differs from the saved run's (its contents, size or revision changed)"
        return f"the data sources differ from the saved run's ({len(now)} now, {len(then)} then)"
    return f"{key} is {now!r} now but was {then!r} in the saved run (the statistics would differ)"


def restore(saved: dict, directory: Path, signature: ModelSignature, device: torch.device) -> Stats:
    """The statistics of a rank's save, on ``device``, checked against the model and the save's own count."""
    path = directory / saved["stats"]
    try:
        stats = Stats.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot resume: the statistics of {_state_path(directory, saved['rank'])} are unreadable ({e}); "
                         "start over with --overwrite instead of --resume") from None
    stats.signature.check_matches(signature, f"the saved statistics in {path}")
    if int(stats.tokens.max()) != saved["tokens"]:
        raise ValueError(f"cannot resume: {path} holds {int(stats.tokens.max())} tokens but its save says {saved['tokens']}; "
                         "it was damaged: start over with --overwrite instead of --resume")
    return stats.to(device)


class Saver:
    """Saves one rank's statistics and place every ``every`` tokens; ``run_capture`` calls it after each sequence.

    ``stats`` is the object the capture fills; ``saved`` (a restored save) carries its counts on.
    """

    def __init__(self, directory: Path, rank: int, every: int, stats: Stats, identity: dict, saved: dict | None):
        self.directory, self.rank, self.every, self.stats, self.identity = directory, rank, every, stats, identity
        self.sequences = saved["sequences"] if saved else 0  # of this rank's share, captured into stats
        self.tokens = saved["tokens"] if saved else 0
        self.saves = saved["saves"] if saved else 0
        self._since = 0

    def __call__(self, tokens: int) -> None:
        """One more sequence of ``tokens`` tokens is in the statistics: save when ``every`` tokens have passed."""
        self.sequences += 1
        self.tokens += tokens
        self._since += tokens
        if self._since >= self.every:
            self.save()
            self._since = 0

    def save(self) -> None:
        """Write the statistics to a new file, then commit by renaming the JSON that names it over the old one."""
        self.directory.mkdir(exist_ok=True)
        self.saves += 1
        name = f"stats-rank{self.rank}-{self.saves}.safetensors"
        write_atomically(self.directory / name, self.stats.save)
        state = {"format": FORMAT, "rank": self.rank, **self.identity, "sequences": self.sequences,
                 "tokens": self.tokens, "saves": self.saves, "stats": name}
        write_atomically(_state_path(self.directory, self.rank), lambda p: p.write_text(json.dumps(state, indent=2) + "\n"))
        for old in self.directory.glob(f"stats-rank{self.rank}-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)
        pause_at("capture")  # test-only (layout.pause_at): a kill mid-capture, with a save to resume from


def _read_state(path: Path) -> dict:
    """A rank's save, refusing one of another format."""
    state = read_json_object(path, "it is damaged: start over with --overwrite instead of --resume")
    keys = ("rank", "settings", "model", "world", "data", "device", "dtype", "sequences", "tokens", "saves", "stats")
    if state.get("format") != FORMAT or any(key not in state for key in keys):
        raise ValueError(f"{path} was not written by this kvcal version; start over with --overwrite instead of --resume")
    return state


def _model_files(model: Path) -> dict[str, str]:
    """The model directory's top-level files: sha256 of the small ones (config, tokenizer); of weights and other large
    files, size and mtime (a file rewritten in place with the same names and sizes changes its mtime) and the sha256
    of a safetensors header."""
    files = {}
    for f in sorted(model.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        st = f.stat()
        if f.suffix in _WEIGHT_SUFFIXES or st.st_size > _HASH_LIMIT:
            header = f", header sha256 {_header_sha256(f)}" if f.suffix == ".safetensors" else ""
            files[f.name] = f"{st.st_size} bytes, mtime_ns {st.st_mtime_ns}{header}"
        else:
            files[f.name] = file_sha256(f)
    return files


def _header_sha256(path: Path) -> str:
    """sha256 of a safetensors file's length prefix and JSON header (the weights are checked whole elsewhere)."""
    with path.open("rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        return hashlib.sha256(prefix + f.read(min(length, 100 << 20))).hexdigest()

"""Write a checkpoint vLLM loads with static FP8 KV scales, leaving the weights untouched.

The output is the source checkpoint with:
- every weight file hardlinked (copied only across filesystems) under a shard name
  ``model-0000i-of-0000N.safetensors``, except a shard that held old KV scale tensors, which is rewritten
  without them so that no tensor name is stored twice;
- the scales in a shard of their own, the last one, and every tensor listed once in
  ``model.safetensors.index.json``. There is never a ``model.safetensors``: transformers loads that file
  alone when it exists and ignores the index (so it would miss the scales), while vLLM follows the index;
  with shard names only, every loader reads the same files (docs/vllm-notes.md, "Checkpoint layout");
- ``config.json`` with a compressed-tensors ``quantization_config`` carrying ``kv_cache_scheme``;
  in a ModelOpt checkpoint instead, ModelOpt's scale names and its own config(s) declaring an FP8 KV cache;
  in a ``quant_method: fp8`` release (block FP8 weights), per-tensor ``self_attn.{k,v,q}_scale`` and the
  config left exactly as the release has it (vLLM's fp8 loader reads the scales without any config key);
- ``kvcal/`` with the statistics and provenance.
It is built in a temporary directory beside OUT_DIR and renamed into place, so an interrupted run
leaves no partial OUT_DIR.
"""

import copy
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from ..files import apply_umask, save_tensors
from ..layout import KVCAL_DIR, identity, pause_at, replaceable, sibling, swap_in, sweep
from ..model.description import ModelDescription
from ..model.directory import (
    HF_QUANT_CONFIG,
    INDEX_FILE,
    KV_SCALE_PATTERN,
    check_float_weights,
    tensor_names,
    vllm_files,
)
from ..scales.observers import ScaleSet
from .loaders import STRATEGIES, WRITE_NAMES, check_scalar_scales, loaded_multiplier, source_form
from .space import NoRoom, check_room, no_room, output_room, room_error

SCALES_PRODUCER = "kvcal"  # the "producer" metadata of the scales shard


def scale_tensors(prefixes: list[str], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for the scales of each attention layer.

    Args:
        prefixes: module name of each layer's attention, e.g. ``model.layers.0.self_attn``.
        scales: kind → [L] (per tensor) or [L, H] (per head) dequantization scales.

    Returns:
        name → float32 tensor: shape [1] per tensor, [H, 1, 1] per head (llm-compressor's layout).
    """
    out = {}
    for kind, values in scales.items():
        if values.shape[0] != len(prefixes):
            raise ValueError(f"{kind} scales cover {values.shape[0]} layers but the model has {len(prefixes)}")
        check_scales(kind, values)
        for prefix, value in zip(prefixes, values.float().cpu()):
            out[f"{prefix}.{WRITE_NAMES['compressed-tensors'][kind]}"] = value.reshape(-1, 1, 1).clone() if value.dim() == 1 else value.reshape(1).clone()
    return out


def stored_scales(scale_set: ScaleSet) -> dict[str, torch.Tensor]:
    """kind → the scales as a compressed-tensors checkpoint stores them, so that vLLM's loader uses exactly
    ``scale_set.scales`` on either FP8 format (a ModelOpt or fp8 target converts them: ``modelopt_scales``,
    ``fp8_release_scales``)."""
    factor = loaded_multiplier("compressed-tensors", scale_set.fmt.name)
    return {kind: s / factor for kind, s in scale_set.scales.items()}


def check_scales(kind: str, values: torch.Tensor) -> None:
    """Refuse any scale vLLM would treat as absent (≤ 0) or that breaks it (NaN/Inf)."""
    bad = ~(torch.isfinite(values) & (values > 0))
    if bad.any():
        rows = sorted({int(i[0]) for i in bad.nonzero()})
        raise ValueError(f"{kind} scales of layer rows {rows} are zero, negative or not finite; refusing to write them")


def kv_cache_scheme(strategy: str) -> dict:
    """compressed-tensors' ``QuantizationArgs`` of a static symmetric FP8 KV cache, as JSON.

    Written out rather than built with compressed-tensors, whose import pulls transformers (seconds);
    tests check it equals compressed-tensors' own ``model_dump``.
    """
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": STRATEGIES[strategy], "dynamic": False}


def quantization_config(existing: dict | None, strategy: str) -> dict:
    """A compressed-tensors ``quantization_config`` with a static FP8 ``kv_cache_scheme``.

    An existing compressed-tensors config (e.g. FP8 weights) is kept and only its kv_cache_scheme
    replaced; any other quantization method is refused, since vLLM would not read our scheme there
    (``write_checkpoint`` calls this only for that form: see ``loaders.QUANT_METHODS``).
    """
    if existing is None:
        return {
            "config_groups": {}, "quant_method": "compressed-tensors", "kv_cache_scheme": kv_cache_scheme(strategy),
            "format": "dense", "quantization_status": "compressed", "ignore": [],
        }
    method = existing.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"the source checkpoint is quantized with {method!r}; kvcal can add KV scales to unquantized or "
            "compressed-tensors checkpoints only"
        )
    return dict(existing) | {"kv_cache_scheme": kv_cache_scheme(strategy)}


def modelopt_scales(scales: dict[str, torch.Tensor], fp8_format: str) -> dict[str, torch.Tensor]:
    """kvcal's compressed-tensors scale tensors under ModelOpt's names, in the units ModelOpt's loader expects.

    vLLM's ModelOpt loader doubles loaded scales on e4m3fnuz platforms (it expects e4m3fn units), so the
    values are divided by that factor: after loading, vLLM uses exactly the calibrated scales.
    """
    kind_of = {suffix: kind for kind, suffix in WRITE_NAMES["compressed-tensors"].items()}
    factor = loaded_multiplier("modelopt", fp8_format)
    renamed = {}
    for name, value in scales.items():
        prefix, _, suffix = name.rpartition(".")
        renamed[f"{prefix}.{WRITE_NAMES['modelopt'][kind_of[suffix]]}"] = value / factor
    return renamed


def fp8_release_scales(scales: dict[str, torch.Tensor], fp8_format: str) -> dict[str, torch.Tensor]:
    """kvcal's scale tensors for a ``quant_method: fp8`` checkpoint: the same names (vLLM's fp8 loader maps
    ``self_attn.{k,v,q}_scale`` onto the attention), one value each, in the units its base KV loader expects
    (it doubles loaded scales on e4m3fnuz platforms, so they are divided by that factor here)."""
    factor = loaded_multiplier("fp8", fp8_format)
    return {name: value / factor for name, value in scales.items()}


def modelopt_quant_configs(source: Path, config: dict) -> dict[str, dict]:
    """Declare an FP8 KV cache in a ModelOpt checkpoint's own quantization config(s), keeping the rest.

    Edits ``config["quantization_config"]`` in place when config.json has one (ModelOpt ≥ 0.31: vLLM reads
    ``kv_cache_scheme`` there, or ``quantization.kv_cache_quant_algo`` in the nested form), and returns
    the updated hf_quant_config.json (file name → content) when the source has that file.
    """
    out = {}
    quant = config.get("quantization_config")
    if quant is not None:
        if isinstance(quant.get("quantization"), dict):
            quant["quantization"]["kv_cache_quant_algo"] = "FP8"
        else:
            quant["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "dynamic": False}
    if (source / HF_QUANT_CONFIG).is_file():
        hf_quant = json.loads((source / HF_QUANT_CONFIG).read_text())
        hf_quant.setdefault("quantization", {})["kv_cache_quant_algo"] = "FP8"
        out[HF_QUANT_CONFIG] = hf_quant
    return out


def weight_files(described: ModelDescription) -> list[Path]:
    """The safetensors files vLLM loads from the described checkpoint, headers checked; refuses forms vLLM can't take
    and damaged files."""
    model_dir = described.directory
    files, problems = vllm_files(model_dir)
    if problems:
        raise ValueError(f"{model_dir}: {problems[0]}; the checkpoint is incomplete")
    if not files:
        has_bin = any(model_dir.glob("*.bin"))
        hint = " (it has .bin files: re-save it with save_pretrained(..., safe_serialization=True))" if has_bin else ""
        raise ValueError(f"{model_dir} has no .safetensors weight files{hint}; kvcal writes scales beside safetensors weights")
    if any(p.name.startswith("consolidated") for p in files):
        raise ValueError(f"{model_dir} holds consolidated*.safetensors (Mistral format); pass the Hugging Face format directory")
    for path in files:
        tensor_names(path)  # reads and checks the header
    check_float_weights(files, described.quant)
    return files


def shard_name(i: int, n: int) -> str:
    """The conventional name of shard ``i`` (from 1) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def scales_file(directory: Path) -> Path:
    """The shard of a kvcal output that holds the KV scales (found through the index)."""
    if not (Path(directory) / INDEX_FILE).is_file():
        raise ValueError(f"{directory} has no {INDEX_FILE}, so no kvcal scales shard; is it a kvcal output?")
    index = json.loads((Path(directory) / INDEX_FILE).read_text())["weight_map"]
    shards = {file for name, file in index.items() if KV_SCALE_PATTERN.search(name)}
    if len(shards) != 1:
        raise ValueError(f"{directory} holds KV scales in {len(shards)} shards, not one; is it a kvcal output?")
    return Path(directory) / shards.pop()


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link the file ``src`` names, following symlinks (a Hub cache's snapshot files are relative links
    into its ``blobs/``, which a link of the link itself would leave dangling in OUT)."""
    try:
        os.link(Path(src).resolve(strict=True), dst)
    except OSError:  # another filesystem, or links not allowed: a new file, with the umask's mode
        shutil.copyfile(src, dst)


def _write_weights(tmp: Path, files: list[Path]) -> dict[str, str]:
    """Link each weight file into ``tmp`` under a shard name, the last shard left for the scales.

    A file holding old KV scales is rewritten without them (and dropped when it held nothing else).

    Returns:
        tensor name → shard file name, for the weights.
    """
    kept = []  # (source file, its tensors without KV scales, whether some were dropped)
    for path in files:
        names = tensor_names(path)
        keep = [n for n in names if not KV_SCALE_PATTERN.search(n)]
        if keep:
            kept.append((path, keep, len(keep) < len(names)))
    weight_map = {}
    for i, (path, keep, rewrite) in enumerate(kept, start=1):
        name = shard_name(i, len(kept) + 1)
        if rewrite:
            with safe_open(str(path), "pt") as f:
                metadata = f.metadata()
                save_tensors({n: f.get_tensor(n) for n in keep}, tmp / name, metadata)
        else:
            link_or_copy(path, tmp / name)
            pause_at("weights")  # test-only (layout.pause_at)
        weight_map.update(dict.fromkeys(keep, name))
    return weight_map


def check_index(directory: Path) -> None:
    """Every tensor in the directory's safetensors files is listed exactly once in the index."""
    index = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    seen: dict[str, str] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name in tensor_names(path):
            if name in seen:
                raise RuntimeError(f"tensor {name} is stored in both {seen[name]} and {path.name}")
            seen[name] = path.name
    if seen != index:
        missing = sorted(set(seen.items()) ^ set(index.items()))[:5]
        raise RuntimeError(f"{INDEX_FILE} does not match the files written: {missing}")


def tensor_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file, from its header's data offsets."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    return sum(end - start for name, v in header.items() if name != "__metadata__" for start, end in [v["data_offsets"]])


def copy_other_files(source: Path, dest: Path, *, skip: set[str], weight_suffixes: tuple[str, ...]) -> None:
    """Copy the source's top-level files and folders (tokenizer, chat template, ...) that are not weights.

    Hidden entries, names in ``skip`` and files ending with ``weight_suffixes`` are left out. The copies are new
    files with the modes the umask gives, not the source's (a 0600 tokenizer would be unreadable to a server
    running as another user; a 0755 one is no program).
    """
    for item in sorted(source.iterdir()):
        if item.name in skip or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, dest / item.name, copy_function=shutil.copyfile)
            apply_umask(dest / item.name)  # copytree gives folders the source's modes
        elif not item.name.endswith(weight_suffixes):
            shutil.copyfile(item, dest / item.name)


def check_links(source: Path) -> None:
    """Refuse a link that leads nowhere (dangling, or a loop) or back into a folder that holds it (``loop -> .``) among
    the files ``copy_other_files`` copies from the source into OUT: copying follows links, so either would fail the
    write at the end of a run (or copy forever)."""

    def walk(path: Path, above: tuple[Path, ...]) -> None:
        """Check ``path`` and, following links as copying does, everything under it; ``above``: the real folders
        that hold it."""
        if path.is_symlink() and not path.exists():
            raise ValueError(f"{path} is a link that leads nowhere (dangling, or a loop); remove or fix it")
        if not path.is_dir():
            return
        real = path.resolve()
        if real in above:
            raise ValueError(f"{path} is a link back to {real}, a folder that holds it: copying the model would never "
                             "end; remove the link")
        for child in sorted(path.iterdir()):
            walk(child, (*above, real))

    root = Path(source).resolve()
    for item in sorted(Path(source).iterdir()):
        if not item.name.startswith("."):
            walk(item, (root,))


def prepare_output(out: Path, inputs: list[Path], overwrite: bool) -> tuple[int, int] | None:
    """Cheap checks on OUT_DIR before any expensive work.

    ``--overwrite`` replaces only what kvcal wrote: an earlier kvcal output or an empty directory. No input
    (the source checkpoint, a target, data files) may be OUT, lie inside it, or hold it; nor may the current
    directory. OUT's parent must be writable (OUT is built there, beside it).

    Returns:
        OUT's identity now (``layout.identity``; None: no OUT), for ``write_checkpoint(seen=...)``: only the OUT a
        run started with may be replaced at its end.
    """
    out = Path(out).resolve()
    sweep(out)  # what killed runs left (an empty claimed OUT, an OUT moved aside) is cleared or put back first
    for given in inputs:
        path = Path(given).resolve()
        if out == path or path in out.parents:
            raise ValueError(f"--out {out} is the input {given} or inside it; choose a new directory")
        if out in path.parents:
            raise ValueError(f"--out {out} holds the input {given}; choose a directory that holds none of the inputs")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass --overwrite to replace it, or choose another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.exists() and not replaceable(out) and any(out.iterdir()):
        raise ValueError(f"{out} exists and was not written by kvcal; --overwrite replaces only kvcal's own outputs: "
                         "choose another --out, or remove it yourself")
    cwd = Path.cwd()
    if out == cwd or out in cwd.parents:
        raise ValueError(f"--out {out} is the current directory or holds it: replacing it would leave this shell in a "
                         "removed directory; choose another --out, or run kvcal from another directory")
    if not out.parent.is_dir():
        raise ValueError(f"the parent directory of {out} does not exist; create it first")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out.parent} is not writable, so --out {out} cannot be created there; choose another --out")
    return identity(out)


def write_checkpoint(
    described: ModelDescription,
    out: Path,
    *,
    scales: dict[str, torch.Tensor],
    strategy: str,
    write_extras: Callable[[Path], None],
    fp8_format: str = "e4m3fn",
    overwrite: bool = False,
    inputs: tuple[Path, ...] = (),
    seen: tuple[int, int] | None | str = "now",
    statistics: int = 0,
) -> Path:
    """Build the output checkpoint in a temporary directory and move it into place.

    Args:
        described: the model directory (never modified), its config.json as the command read it.
        out: the directory to create.
        scales: checkpoint tensor name → scale tensor (see ``scale_tensors``).
        strategy: "tensor" or "head".
        write_extras: called with the temporary kvcal/ directory to add statistics and provenance.
        fp8_format: the format the scales are in (a ModelOpt target gets them in its loader's units).
        overwrite: replace an existing ``out`` (only one kvcal wrote, see ``prepare_output``).
        inputs: the run's other inputs (data files, statistics), none of which ``out`` may be or hold.
        seen: what ``prepare_output`` returned when the run started ("now": take it here); OUT is replaced only
            if it is still that one (another run with the same --out may have written it meanwhile).
        statistics: bytes of the statistics ``write_extras`` adds (``space.stats_bytes``), for the room check.

    Raises:
        ValueError: OUT's file system or the file-size limit cannot take the output (checked first; ``space.NoRoom``
            when the disk filled while writing: the partial output is removed).

    Returns:
        ``out``, complete.
    """
    source, out = described.directory, Path(out)
    now = prepare_output(out, [source, *inputs], overwrite)
    seen = now if seen == "now" else seen
    files = weight_files(described)
    check_links(source)
    room = output_room(source, out, files, statistics)
    check_room(room)
    config = copy.deepcopy(described.config)  # edited below into OUT's
    quant_files: dict[str, dict] = {}  # other quantization config files to write (ModelOpt form)
    form = source_form(source, config)  # refuses the quantization methods whose scales vLLM would not read
    check_scalar_scales(source, form, strategy)  # per-head scales only where the loader takes them
    if form == "modelopt":
        scales = modelopt_scales(scales, fp8_format)
        quant_files = modelopt_quant_configs(source, config)
    elif form == "fp8":
        scales = fp8_release_scales(scales, fp8_format)
    else:
        config["quantization_config"] = quantization_config(config.get("quantization_config"), strategy)

    sweep(out)
    tmp = sibling(out, "tmp")
    tmp.mkdir()
    try:
        weight_map = _write_weights(tmp, files)
        clash = sorted(set(scales) & set(weight_map))
        if clash:
            raise ValueError(f"the source already stores {clash[0]} under a name kvcal would write")
        n = len(set(weight_map.values())) + 1
        save_tensors(scales, tmp / shard_name(n, n), metadata={"format": "pt", "producer": SCALES_PRODUCER})
        weight_map.update(dict.fromkeys(scales, shard_name(n, n)))
        total = sum(tensor_bytes(tmp / f) for f in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, content in quant_files.items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        skip = {INDEX_FILE, "config.json", KVCAL_DIR} | set(quant_files)
        copy_other_files(source, tmp, skip=skip, weight_suffixes=(".safetensors",))
        (tmp / KVCAL_DIR).mkdir()
        write_extras(tmp / KVCAL_DIR)
        check_index(tmp)
        move_into_place(tmp, out, seen=seen)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if no_room(e):  # the disk filled (or a file hit ulimit -f) since the check: one line, nothing left
            raise NoRoom(room_error(e, room, out)) from None
        raise
    return out


def move_into_place(tmp: Path, out: Path, *, seen: tuple[int, int] | None) -> None:
    """Rename ``tmp`` to ``out``; an old ``out`` is moved aside first and removed only after.

    ``seen`` is OUT's identity when the run started (None: there was none; else --overwrite allowed replacing it):
    an OUT that appeared, or was replaced, while this run worked belongs to another run, and is never replaced.
    """
    if seen is None:
        try:
            out.mkdir()  # claims the name atomically: fails if another run created it meanwhile
        except FileExistsError:
            raise ValueError(f"{out} appeared while this run was working (another run with the same --out?); "
                             "nothing was written: choose another --out, or pass --overwrite to replace it") from None
        pause_at("rename")  # test-only (layout.pause_at): OUT claimed, still empty
        try:
            os.rename(tmp, out)  # replaces the empty directory just made
        except BaseException:
            out.rmdir()
            raise
        return
    if identity(out) != seen:
        raise ValueError(f"{out} was replaced while this run was working (another run with the same --out?); nothing "
                         "was written: run again to replace the new one, or choose another --out")
    swap_in(tmp, out)

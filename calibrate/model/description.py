"""What the model is, read from its config.json once per command and checked here: the stages take this description
as an argument instead of reading config.json again, so a command sees one config.json however long it runs. Every
refusal of a config.json (not a decoder's, a shape field that is no positive integer, a model type transformers does
not know, modeling code that ships with the model) lives in this module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..files import check_model_dir
from .directory import mla_dims, quant_config, read_config_json, text_part
from .layers import ModelSignature, max_context, signature_of, sliding_layers


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
    """The description of a config.json already read, with ``check_config``'s refusals (``describe``'s)."""
    check_config(directory, config)
    return describe_config(directory, config)


def describe(directory: str | Path) -> ModelDescription:
    """Read ``directory``'s config.json once (refused unless a causal LM's, as ``read_config`` does) and describe it."""
    return describe_checked(directory, read_config_file(directory))


# Encoder families that transformers can also build as causal LMs (BertLMHeadModel...), which a config.json without
# ``architectures`` gets; vLLM serves them for embeddings and classification, without a KV cache.
ENCODER_MODEL_TYPES = (
    "bert", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
)
# config.json fields (of the text model) that shape the model and kvcal's statistics: positive integers where present.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "max_position_embeddings")


def read_config(model_dir: str | Path) -> dict:
    """The checkpoint's config.json, after ``check_config``'s cheap checks that it is a causal LM directory."""
    config = read_config_file(model_dir)
    check_config(model_dir, config)
    return config


def check_config(model_dir: str | Path, config: dict) -> None:
    """Refuse a config.json (as read) that is not a decoder's: an architecture other than a causal LM's, an encoder
    model type, a field that shapes the model that is not a positive integer, a quantization_config not an object."""
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        raise ValueError(
            f"{model_dir} holds a {', '.join(architectures)}; kvcal calibrates the decoders vLLM serves with a KV cache "
            "whose architecture is a ...ForCausalLM or ...ForConditionalGeneration"
        )
    text = text_part(config)
    if text.get("model_type") in ENCODER_MODEL_TYPES:
        raise ValueError(
            f"{model_dir} is a {text['model_type']} model, an encoder that vLLM serves without a KV cache; "
            "kvcal calibrates decoder models that vLLM serves with a KV cache"
        )
    for name in SHAPE_FIELDS:
        value = text.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{model_dir}/config.json has {name} {value!r}, not a positive integer; fix config.json")
    quant_config(Path(model_dir), config)  # refuses a quantization_config that is not an object (transformers crashes)


def check_remote_code(model_dir: str | Path, config: dict, trust: bool) -> None:
    """Refuse a model whose modeling code ships with it (config.json's auto_map, a model type transformers does
    not know) unless trusted, as transformers and vLLM do."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    if "auto_map" in config and model_type not in CONFIG_MAPPING and not trust:
        raise ValueError(f"{model_dir} ({model_type}) ships its own modeling code (auto_map in config.json), which "
                         "transformers runs only when asked: pass --trust-remote-code if you trust it")
    check_known_type(model_dir, config)


def check_known_type(model_dir: str | Path, config: dict) -> None:
    """Refuse a model type that transformers does not know and no code of the model's own (auto_map) defines, before
    transformers prints its paragraphs about it."""
    from transformers import CONFIG_MAPPING, __version__

    model_type = config.get("model_type")
    if "auto_map" not in config and model_type is not None and model_type not in CONFIG_MAPPING:
        raise ValueError(f"{model_dir}/config.json has model_type {model_type!r}, which transformers {__version__} does "
                         "not know (transformers: 'does not recognize this architecture'): fix model_type, or upgrade "
                         "transformers (pip install -U transformers) if the model is newer than it")


def read_config_file(model_dir: str | Path) -> dict:
    """A model directory's config.json as a dict, with a one-line error for each way it can be wrong."""
    check_model_dir(model_dir)
    return read_config_json(model_dir)

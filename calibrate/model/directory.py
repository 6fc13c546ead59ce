"""What a model directory holds, read without loading the model.

Its config.json (read once per file, every field kvcal uses checked for its type), which safetensors files vLLM and
transformers read, the tensors in them that are KV-cache scales (by the names vLLM maps, ``vllm_facts.loaders.SCALE_SOURCES``), and
where the decoder's attention layers are. Only headers and small tensors are read. What vLLM's loaders then do with these is
``checkpoint/loaders.py``; facts are vLLM's (vllm_facts.release.READ_IN) and transformers 5.17–5.24's (docs/vllm-notes.md).
"""

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..files import read_json_object
from ..vllm_facts.loaders import SCALE_SOURCES

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"  # transformers reads this file alone, ignoring any index, when it exists
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt ≤ 0.29 keeps its quantization config here only


# Any tensor some tool stored as a KV-cache (or attention-probability) scale: an output holds exactly one
# scale per layer and kind, so these are dropped from weight shards before kvcal writes its own.
KV_SCALE_PATTERN = re.compile(
    r"\.(" + "|".join(re.escape(s) for s in sorted(SCALE_SOURCES, key=len, reverse=True)) + r"|prob_scale)$"
)


def tensor_names(path: Path) -> list[str]:
    """Names of the tensors in a safetensors file (reads the header only); a damaged file is a ValueError."""
    try:
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is damaged or not a safetensors file ({e}); re-download or re-save it") from None


# safetensors dtypes that hold integers (or booleans).
INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def check_float_weights(files: list[Path], quant: dict | None) -> None:
    """Refuse a ``*.weight`` that the headers of an unquantized checkpoint label as integers: transformers would load
    the integers as the weight's values without a word. ``quant``: the checkpoint's ``quant_config`` (a quantized
    checkpoint packs weights into integers on purpose)."""
    if quant is not None:
        return
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if name.endswith(".weight") and dtype in INTEGER_DTYPES:
                    raise ValueError(f"{path} labels {name} {dtype}, integers, in a checkpoint that is not quantized: its "
                                     "header is damaged; re-download or re-save the checkpoint")


def read_tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor(name).float()


def read_json(path: Path) -> dict:
    return read_json_object(path, "restore it from the original checkpoint")


CONFIG_FILE = "config.json"
# Every config.json field kvcal reads, at the top level or in a multimodal model's text_config, with the JSON type it
# must have where present (null counts as absent). Positivity of the shape fields: model/description.SHAPE_FIELDS.
CONFIG_FIELDS: dict[str, type] = {
    "text_config": dict, "model_type": str, "architectures": list, "auto_map": dict, "quantization_config": dict,
    "dtype": str, "torch_dtype": str, "_name_or_path": str, "layer_types": list,
    "num_hidden_layers": int, "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "hidden_size": int, "max_position_embeddings": int, "vocab_size": int, "kv_lora_rank": int, "qk_rope_head_dim": int,
}
_JSON_NAMES = {dict: "an object", str: "a string", list: "a list", int: "an integer"}


def read_config_json(directory: str | Path) -> dict:
    """A checkpoint's config.json, every field in ``CONFIG_FIELDS`` checked for its type: the one way kvcal reads it,
    so that a field of the wrong shape (``text_config`` a string, a head count in words) is one line naming the file
    and the field, never a crash where it is used."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():  # the one refusal of a directory without config.json, whichever command reads it
        raise ValueError(f"{directory} is not a checkpoint: it has no {CONFIG_FILE}; pass a Hugging Face model directory")
    config = read_json_object(path, "fix or replace it")
    text = config.get("text_config")
    for prefix, part in (("", config), ("text_config.", text if isinstance(text, dict) else {})):
        for name, kind in CONFIG_FIELDS.items():
            value = part.get(name)
            if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
                found = _JSON_NAMES.get(type(value), type(value).__name__)
                raise ValueError(f"{path} has {prefix}{name} {_short(value)}, {found}, "
                                 f"where {_JSON_NAMES[kind]} belongs; fix config.json (or restore it from the original checkpoint)")
    return config


def _short(value) -> str:
    """A JSON value for a one-line message: at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def index_files(directory: Path) -> list[str] | None:
    """File names the index lists, or None when there is no index."""
    index = directory / INDEX_FILE
    if not index.is_file():
        return None
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} is damaged (no weight_map); restore it from the original checkpoint")
    return sorted(set(weight_map.values()))


def vllm_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files vLLM loads (those the index lists, else every top-level one) and what is wrong.

    Returns:
        (files, problems): a listed file that does not exist, or an unlisted one holding KV scales (vLLM
        ignores it without a word, so every scale loads as 1.0).
    """
    present = sorted(directory.glob("*.safetensors"))
    listed = index_files(directory)
    if listed is None:
        return present, []
    problems = [f"{INDEX_FILE} lists {name}, which does not exist; vLLM fails to load"
                for name in listed if not (directory / name).is_file()]
    problems += [f"{path.name} holds KV scales but is not listed in {INDEX_FILE}, so vLLM ignores it; add its tensors to the index"
                 for path in present if path.name not in listed and any(KV_SCALE_PATTERN.search(n) for n in tensor_names(path))]
    return [p for p in present if p.name in listed], problems


def transformers_files(directory: Path) -> list[Path]:
    """The safetensors files transformers loads: model.safetensors alone when it exists (any index is then
    ignored), else those the index lists."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    return [directory / name for name in index_files(directory) or []]


def quant_config(directory: Path, config: dict) -> dict | None:
    """The quantization config vLLM uses: config.json's (or its text model's), else hf_quant_config.json (ModelOpt)."""
    quant = config.get("quantization_config") or text_part(config).get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(f"{directory}/config.json has a quantization_config that is a {type(quant).__name__} ({quant!r}), "
                         "not an object; restore it from the original checkpoint, or remove it if the weights are not quantized")
    if quant is None and (directory / HF_QUANT_CONFIG).is_file():
        quant = read_json(directory / HF_QUANT_CONFIG) | {"quant_method": "modelopt"}
    return quant


# Words in module names of what is not decoder attention: vision and audio towers, multi-token-prediction heads.
_NOT_DECODER = ("vision", "visual", "audio", "mtp.")


def text_part(config: dict) -> dict:
    """The decoder's settings in a config.json: its ``text_config`` for a multimodal model, else the config itself."""
    return config.get("text_config") or config


def is_decoder_module(name: str) -> bool:
    """Whether a module (or tensor) name belongs to the decoder: vision and audio towers and MTP heads do not."""
    return not any(word in name for word in _NOT_DECODER)


def mla_dims(cfg: dict) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a multi-head latent attention model (DeepSeek-V2/V3, Kimi-K2), else None.

    ``cfg`` is a config.json as a dict (a multimodal one's text_config is read), or the text model's own. vLLM caches
    one "head" per token for these: the normalised latent kv_c_normed (kv_lora_rank wide) followed by the RoPE'd key
    part k_pe (qk_rope_head_dim wide), both under the one k scale (docs/vllm-notes.md, "MLA").
    """
    cfg = text_part(cfg)
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if rank is None:
        return None
    if not (isinstance(rank, int) and isinstance(rope, int) and rank > 0 and rope >= 0):
        raise ValueError(f"the {cfg.get('model_type')} config has kv_lora_rank {rank!r} and qk_rope_head_dim {rope!r}; "
                         "an MLA latent needs a positive kv_lora_rank and a qk_rope_head_dim of 0 or more")
    return rank, rope


def model_types(config: dict) -> list[str]:
    """The model types of a config.json: the text model's, then (multimodal checkpoints) the top-level one."""
    types = [text_part(config).get("model_type"), config.get("model_type")]
    return list(dict.fromkeys(t for t in types if t))


# Attention modules of the decoder: "...layers.N.self_attn.<anything>"; towers and MTP heads are not.
_ATTENTION = re.compile(r"^(?P<prefix>(?:[\w.]*\.)?layers\.(?P<idx>\d+)\.self_attn)\.")


def attention_prefixes(names: list[str]) -> dict[int, str]:
    """Layer index → attention module prefix, found in tensor names (towers and MTP heads left out)."""
    found: dict[int, str] = {}
    for name in names:
        m = _ATTENTION.match(name)
        if m and is_decoder_module(m["prefix"]):
            found.setdefault(int(m["idx"]), m["prefix"])
    return dict(sorted(found.items()))


def prefixes_in(files: list[Path]) -> dict[int, str]:
    """Layer index → attention prefix, from the headers of these safetensors files."""
    return attention_prefixes([n for path in files for n in tensor_names(path)])


def checkpoint_prefixes(checkpoint: str | Path) -> dict[int, str]:
    """Layer index → attention prefix of a checkpoint directory, from the headers of the files vLLM loads."""
    return prefixes_in(vllm_files(Path(checkpoint))[0])

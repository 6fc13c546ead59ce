"""What a model is, for kvcal: its attention layers, their checkpoint names, and the signature statistics must match."""

from dataclasses import dataclass, replace

from torch import nn

from .directory import is_decoder_module, mla_dims, text_part


@dataclass(frozen=True)
class AttentionLayer:
    """One attention module: its ``layer_idx`` and the prefix its tensors have in the checkpoint."""

    layer_idx: int
    prefix: str  # e.g. "model.layers.3.self_attn"
    sliding_window: bool


@dataclass
class ModelSignature:
    """What statistics must match to be used with a model: refuses stats from another model."""

    model_type: str
    layers: list[int]  # layer_idx of each observed attention layer, in row order
    num_kv_heads: int
    num_heads: int
    head_dim: int  # of every kind; for MLA the cached latent row's width, kv_lora_rank + qk_rope_head_dim
    latent_dim: int = 0  # MLA: kv_lora_rank, the first latent_dim channels of k (the rest are k_pe); 0 otherwise

    @property
    def heads(self) -> dict[str, int]:
        """Heads per kind: the cached K and V have ``num_kv_heads`` (MLA: the one latent row), Q ``num_heads``."""
        return {"k": self.num_kv_heads, "v": self.num_kv_heads, "q": self.num_heads}

    def check_matches(self, other: "ModelSignature", what: str = "these statistics") -> None:
        """Raise ValueError naming the first difference."""
        for name in ("model_type", "layers", "num_kv_heads", "num_heads", "head_dim", "latent_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise ValueError(
                    f"{what} do not match the model: {name} is {mine!r} in the statistics but {theirs!r} "
                    "in the model; calibrate this model instead of reusing statistics from another one"
                )


def text_config(model: nn.Module):
    """The decoder's config (multimodal models nest it)."""
    return model.config.get_text_config()


def sliding_layers(layer_types: list[str] | None) -> frozenset[int]:
    """Indices of the sliding-window layers in a config's ``layer_types`` (as vLLM's skip-layers option reads them)."""
    return frozenset(i for i, kind in enumerate(layer_types or []) if kind == "sliding_attention")


def attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every self-attention module of the decoder, in layer order.

    Found as the modules that carry a ``layer_idx`` and have q/k projections or a config of their own,
    which is how transformers' attention-interface models are built; the prefix is the module's name,
    which is also the name its parameters have in the checkpoint.
    """
    sliding = sliding_layers(getattr(text_config(model), "layer_types", None))
    mla = mla_dims(text_config(model).to_dict()) is not None
    layers = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
            if not is_decoder_module(name):
                continue
            if mla and not is_latent(module):
                raise ValueError(
                    f"{name} ({type(module).__name__}, model type {text_config(model).model_type}) has an MLA latent "
                    "(kv_lora_rank) but not transformers' expand_kv, so kvcal cannot see the latent vLLM caches; load "
                    "the model with transformers' own deepseek_v3 code (without --trust-remote-code)"
                )
            layers.append(AttentionLayer(module.layer_idx, name, module.layer_idx in sliding))
    if not layers:
        raise ValueError(
            f"found no attention modules with a layer_idx in {type(model).__name__} (model type "
            f"{text_config(model).model_type}); kvcal needs a model built on transformers' attention interface"
        )
    return sorted(layers, key=lambda layer: layer.layer_idx)


def standard_names(cfg: dict) -> dict:
    """``cfg`` with transformers' standard field names added where the family spells them its own way (Bloom's
    ``n_head``, MPT's ``n_heads``, GPT-2's ``n_embd``): the config class's ``attribute_map`` says which is which."""
    if "num_attention_heads" in cfg:  # the usual spelling: export and inspect stay free of transformers' import
        return cfg
    from transformers import CONFIG_MAPPING

    if cfg.get("model_type") not in CONFIG_MAPPING:
        return cfg
    aliases = CONFIG_MAPPING[cfg["model_type"]].attribute_map
    return {**{name: cfg[own] for name, own in aliases.items() if name not in cfg and own in cfg}, **cfg}


def signature_of(cfg: dict, layers: list[int]) -> ModelSignature:
    """The shape facts that statistics and scales must agree with, from the text model's config as a dict.

    For MLA the cached "KV head" is the latent row (one head, kv_lora_rank + qk_rope_head_dim wide) and the query is
    compared with it in the latent space (vLLM's absorbed decode query, as wide): every kind has that width.
    """
    cfg = standard_names(cfg)
    num_heads = cfg["num_attention_heads"]
    mla = mla_dims(cfg)
    if mla is not None:
        return ModelSignature(cfg["model_type"], layers, num_kv_heads=1, num_heads=num_heads, head_dim=sum(mla), latent_dim=mla[0])
    return ModelSignature(
        model_type=cfg["model_type"],
        layers=layers,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        num_heads=num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
    )


def is_latent(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' multi-head latent attention (DeepSeek-V2/V3): its cache holds the latent,
    which it expands into K and V (``expand_kv``) just before the attention function."""
    return isinstance(getattr(module, "kv_lora_rank", None), int) and callable(getattr(type(module), "expand_kv", None))


def checkpoint_named(layers: list[AttentionLayer], prefixes: dict[int, str]) -> list[AttentionLayer]:
    """``layers`` with the prefix their tensors have in the checkpoint's own files, where that differs.

    transformers 5 renames some families' modules on load and back on save (Gemma 3's checkpoint holds
    ``language_model.model.layers.N.self_attn``, its module is ``model.language_model.layers.N.self_attn``); vLLM
    maps the checkpoint's names, so scales are written and read under those. ``prefixes``: layer index → prefix in the
    checkpoint's files (``directory.checkpoint_prefixes``).
    """
    return [replace(layer, prefix=prefixes.get(layer.layer_idx, layer.prefix)) for layer in layers]


def signature(model: nn.Module, layers: list[AttentionLayer]) -> ModelSignature:
    """The shape facts that statistics and scales must agree with (``signature_of``)."""
    return signature_of(text_config(model).to_dict(), [layer.layer_idx for layer in layers])


def max_context(config: dict) -> int | None:
    """The longest sequence the model was built for, if its config.json (as ``read_config`` returns it) says."""
    return text_part(config).get("max_position_embeddings")

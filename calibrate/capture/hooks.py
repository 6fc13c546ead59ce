"""See Q, K and V exactly as vLLM would cache them, by standing in for the model's attention function.

transformers' attention interface hands every attention implementation the query, key and value
after the projections, any q/k norm and RoPE, with K/V per KV head ([batch, kv_heads, seq, head_dim]):
precisely what vLLM writes to its cache. kvcal registers a function there that passes those tensors
to a hook and then runs the model's own attention unchanged.

Latent attention (MLA: DeepSeek, Kimi) caches a compressed latent instead, which the attention function never
sees: kvcal also stands in for those modules' ``expand_kv``, which receives the cache's contents (``latent_inputs``).
"""

import inspect
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

from ..model.layers import AttentionLayer, is_latent
from ..model.load import input_device
from .checks import refuse_nonfinite
from .stats import Stats

# hook(module, query, key, value, attention_mask, base_attention, **kwargs) -> attention output tuple
AttentionHook = Callable[..., tuple]


def _base_attention(module: nn.Module, implementation: str) -> Callable:
    """The attention function the model would have used: a registered one, or its own eager one."""
    if implementation != "eager":
        return ALL_ATTENTION_FUNCTIONS[implementation]
    return sys.modules[type(module).__module__].eager_attention_forward


# The hook in force inside ``hooked_attention``; None outside it.
_active_hook: ContextVar[AttentionHook | None] = ContextVar("kvcal_active_hook", default=None)
# What MLA modules' expand_kv received inside ``hooked_attention`` (``cached_latent``).
_latents: ContextVar[dict] = ContextVar("kvcal_latents")


def _register(base: str) -> str:
    """Register (once) the kvcal attention function that wraps implementation ``base``; return its name.

    transformers only builds masks for implementations in its global registry, so kvcal registers one
    name per base implementation ("kvcal_sdpa", "kvcal_eager", ...), each with the base's mask function,
    and dispatches to whichever hook is active.
    """
    name = f"kvcal_{base}"
    if name not in AttentionInterface._global_mapping:

        def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
            hook = _active_hook.get()
            if hook is None:
                raise RuntimeError(f"{name} attention was called outside kvcal's hooked_attention block")
            return hook(module, query, key, value, attention_mask, _base_attention(module, base), **kwargs)

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


@contextmanager
def hooked_attention(model: nn.Module, hook: AttentionHook) -> Iterator[None]:
    """Route every attention call of ``model`` through ``hook`` for the duration of the block.

    The hook receives the model's own attention function as ``base_attention`` and decides what to
    run. The model's own implementation is restored on exit, whatever happens inside. For MLA modules
    the hook reads the latent with ``cached_latent``; a hook with a ``latent_transform(module, kv_c, k_pe)``
    method replaces the latent before the model decompresses it (``latent_inputs``).

    Raises:
        ValueError: the model computes attention itself, not through transformers' attention interface.
    """
    base = model.config._attn_implementation or "eager"
    if base.startswith("kvcal_"):
        raise RuntimeError("kvcal's attention hooks cannot be nested")
    token = _active_hook.set(hook)
    try:
        _set_implementation(model, _register(base))
        with latent_inputs(model, getattr(hook, "latent_transform", None)) as seen:
            latent_token = _latents.set(seen)
            try:
                yield
            finally:
                _latents.reset(latent_token)
    finally:
        _switch(model, base)
        _active_hook.reset(token)


def _switch(model: nn.Module, name: str) -> None:
    """``model.set_attn_implementation(name)`` without transformers' warnings (a second line beside kvcal's error)."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model.set_attn_implementation(name)
    finally:
        hf_logging.set_verbosity(verbosity)


def _set_implementation(model: nn.Module, name: str) -> None:
    """Make ``name`` the model's attention implementation; a model whose attention bypasses transformers' interface
    keeps its own (transformers only warns), and is refused before any data runs."""
    _switch(model, name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"no attention call reaches kvcal's hook: {type(model).__name__} computes attention itself, not through "
            "transformers' attention interface, so kvcal cannot see its K and V; use transformers' own implementation "
            "of the family if it has one"
        )


def cached_latent(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Inside ``hooked_attention``, for an MLA module: the (kv_c_normed, k_pe) of the call being hooked, past + new
    positions, [B, 1, N, L] and [B, 1, N, R], after the hook's ``latent_transform`` when it has one."""
    return _latents.get()[module]


# Latent attention (MLA): per module, kv_c_normed [B, 1, N, L] and k_pe [B, 1, N, R] of the last expand_kv call.
Latents = dict[nn.Module, tuple[torch.Tensor, torch.Tensor]]
LatentTransform = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@contextmanager
def latent_inputs(model: nn.Module, transform: LatentTransform | None = None) -> Iterator[Latents]:
    """Stand in for every MLA module's ``expand_kv`` for the duration of the block; yield what each call received.

    transformers' MLA caches what vLLM caches, the normalised latent and the RoPE'd k_pe, and hands the cache's
    contents (past + new positions) to ``expand_kv`` just before the attention function, which only sees the
    decompressed K and V. ``transform``, when given, replaces the latent first (verify's quantization: the model
    then decompresses what a quantized cache holds). A model without MLA is left as it is.
    """
    seen: Latents = {}
    modules = [m for m in model.modules() if is_latent(m)]
    for m in modules:
        def expand(kv_c: torch.Tensor, k_pe: torch.Tensor, m: nn.Module = m) -> tuple[torch.Tensor, torch.Tensor]:
            if transform is not None:
                kv_c, k_pe = transform(m, kv_c, k_pe)
            seen[m] = (kv_c, k_pe)
            return type(m).expand_kv(m, kv_c, k_pe)

        m.expand_kv = expand
    try:
        yield seen
    finally:
        for m in modules:
            del m.expand_kv


def latent_view(module: nn.Module, query: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, cached row) of an MLA layer as vLLM's latent attention sees them.

    The row is [kv_c_normed | k_pe], [B, 1, N, L + R], what the cache holds under one k scale. The query is vLLM's
    absorbed decode query, the one its q scale applies to: [q_nope · W_UK | q_pe], [B, H, S, L + R], with W_UK the
    key half of kv_b_proj per head (docs/vllm-notes.md, "MLA").
    """
    from accelerate.utils import align_module_device

    nope, rank, H = module.qk_nope_head_dim, module.kv_lora_rank, query.shape[1]
    with align_module_device(module.kv_b_proj, query.device):  # an offloaded weight is brought in, as for its forward
        w_uk = module.kv_b_proj.weight.view(H, -1, rank)[:, :nope].to(query.dtype)  # [H, nope, L]
    q_latent = torch.einsum("bhsn,hnl->bhsl", query[..., :nope], w_uk)  # [B, H, S, L]
    return torch.cat([q_latent, query[..., nope:]], dim=-1), torch.cat([kv_c, k_pe], dim=-1)


def new_positions(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Absolute position of each new token, [batch, q_len] int64.

    With a KV cache the key holds past + new positions; the new ones are the last q_len. Models pass
    ``position_ids`` through to attention; without them the new tokens follow the cached ones.
    """
    B, _, S, _ = query.shape
    pos = kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.shape[-1] == S:
        pos = pos[0] if pos.dim() == 3 else pos  # multimodal rope passes [3, B, S]
        return pos.to(query.device).long().expand(B, S)
    start = key.shape[2] - S
    return torch.arange(start, start + S, device=query.device).expand(B, S)


# Buffered query elements that trigger a flush: large enough that per-operation overhead is amortised,
# small enough that the statistics' passes stay in cache (memory bandwidth dominates on CPU otherwise).
_FLUSH_ELEMENTS = 1 << 20


class Collector:
    """State of one capture: the statistics being filled and which layers have been seen.

    The tensors of consecutive layers of one forward are buffered and folded into the statistics
    together, as a few large operations instead of thousands of small ones (on CPU the per-operation
    overhead would otherwise cost more than the arithmetic). The buffer holds at most one forward's
    new positions, and about _FLUSH_ELEMENTS query elements; ``flush()`` empties it.

    The statistics live on one device (that of ``stats``). With a device map, layers on other GPUs
    hand their tensors over at the flush: a buffer holds tensors of one device only (stacking needs
    that), and is moved to the statistics' device as one copy per flush.
    """

    def __init__(self, stats: Stats, layers: list[AttentionLayer]):
        self.stats = stats
        self.row_of = {layer.layer_idx: row for row, layer in enumerate(layers)}
        self.layers = layers
        self._start = 0
        self._buffer: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._positions: torch.Tensor | None = None

    def __call__(self, module, query, key, value, attention_mask, base_attention, **kwargs):
        S = query.shape[2]
        row = self.row_of[module.layer_idx]
        q, k, v = query, key, value
        if is_latent(module):  # MLA: what the latent cache holds instead of the decompressed K and V
            q, k = latent_view(module, query, *cached_latent(module))
            v = k
        # Only the new positions: a cached prefix was observed by an earlier call.
        new = (q, k[:, :, -S:], v[:, :, -S:])
        # All layers of one forward share the positions; a new forward starts again at the first row.
        same_shapes = self._buffer and all(a.shape == b.shape for a, b in zip(new, self._buffer[0]))
        same_device = self._buffer and query.device == self._buffer[0][0].device
        if self._buffer and (row != self._start + len(self._buffer) or not same_shapes or not same_device):
            self.flush()
        if not self._buffer:
            self._start, self._positions = row, new_positions(query, key, kwargs)  # [B, S]
        self._buffer.append(new)
        if len(self._buffer) * query.numel() >= _FLUSH_ELEMENTS:
            self.flush()
        return base_attention(module, query, key, value, attention_mask, **kwargs)

    def flush(self) -> None:
        """Fold the buffered layers into the statistics."""
        if not self._buffer:
            return
        # [Lb, B, H, S, D] each; a single layer needs no copy.
        device = self.stats.tokens.device
        q, k, v = ((torch.stack(ts) if len(ts) > 1 else ts[0].unsqueeze(0)).to(device) for ts in zip(*self._buffer))
        self._buffer = []
        self.stats.update_layers(self._start, q, k, v, self._positions.to(device))

    def check_complete(self) -> None:
        """Refuse a capture in which some attention layer saw nothing (it would get a made-up scale)."""
        missing = [layer.prefix for layer, n in zip(self.layers, self.stats.tokens.tolist()) if n == 0]
        if len(missing) == len(self.layers):
            raise ValueError(
                f"no attention call reached kvcal's hook: this model ({self.stats.signature.model_type}) does not use "
                "transformers' attention interface (modeling code shipped with a model often does not), so kvcal cannot "
                "see its K and V; use transformers' own implementation of the family if it has one"
            )
        if missing:
            raise ValueError(f"these attention layers saw no tokens, so no scale can be derived for them: {', '.join(missing)}")


@torch.no_grad()
def check_visible(model: nn.Module, layers: list[AttentionLayer], model_type: str) -> None:
    """Refuse, before any data runs, a model some of whose attention layers never reach kvcal's hook.

    One forward of a few tokens under a hook that only notes which layers called it. Modeling code that ships with
    a model may compute attention itself instead of through transformers' attention interface; kvcal would then see
    nothing of those layers' K and V.
    """
    seen: set[int] = set()

    def note(module, query, key, value, attention_mask, base_attention, **kwargs):
        seen.add(module.layer_idx)
        return base_attention(module, query, key, value, attention_mask, **kwargs)

    with hooked_attention(model, note):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=input_device(model)), use_cache=False, logits_to_keep=1)
    missing = [layer.prefix for layer in layers if layer.layer_idx not in seen]
    if missing:
        raise ValueError(
            f"kvcal cannot see K and V in {len(missing)} of {len(layers)} attention layers of this {model_type} model (e.g. "
            f"{missing[0]}): its modeling code computes attention without transformers' attention interface; calibrate "
            "the family with transformers' own implementation, if it has one"
        )


def cache_kwarg(model: nn.Module) -> str:
    """Name of the forward argument that takes a KV cache (``cache`` in newer transformers)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def prefill_chunks(
    model: nn.Module, input_ids: torch.Tensor, chunk_len: int, *, hook: AttentionHook | None = None, keep_from: int | None = None
) -> Iterator[torch.Tensor]:
    """Run ``input_ids`` [1, N] through the model as chunked prefill, one chunk per step, with its own KV cache.

    The one chunk loop of capture, verify's passes and the needle probe. Position ids are explicit, so
    every position passes through attention once, as a new token, at its absolute position; memory for
    attention scores grows with chunk_len × N, not N². Being a generator, several sequences (each with
    its own cache) can advance chunk by chunk in turn; ``hook``, when given, is in force only while this
    generator's own chunk runs.

    Args:
        keep_from: logits are kept (``logits_to_keep``) for this chunk's positions from ``keep_from`` on;
            a chunk that ends before it, and every chunk when None, keeps only its last position.

    Yields:
        Per chunk, float32 logits [k, V] of its last k kept positions.
    """
    cache = DynamicCache(config=model.config)
    kwarg = cache_kwarg(model)

    def run(chunk: torch.Tensor, start: int, keep: int) -> torch.Tensor:
        # A function of its own so that the suspended generator holds no model output (logits [keep, V] per run).
        positions = torch.arange(start, start + chunk.shape[1], device=chunk.device)[None]  # [1, c]
        with hooked_attention(model, hook) if hook is not None else nullcontext():
            out = model(input_ids=chunk, position_ids=positions, use_cache=True, logits_to_keep=keep, **{kwarg: cache})
        return out.logits[0].float()  # [keep, V]

    for start in range(0, input_ids.shape[1], chunk_len):
        chunk = input_ids[:, start : start + chunk_len]  # [1, c]
        keep = 1 if keep_from is None else min(max(1, start + chunk.shape[1] - keep_from), chunk.shape[1])
        yield run(chunk, start, keep)


@torch.no_grad()
def forward_chunked(model: nn.Module, input_ids: torch.Tensor, chunk_len: int) -> None:
    """Run ``input_ids`` [1, S] through the model for its attention inputs only, as chunked prefill (``prefill_chunks``).

    Without chunking (S <= chunk_len) it is one plain forward, without a cache.
    """
    if input_ids.shape[1] <= chunk_len:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for _ in prefill_chunks(model, input_ids, chunk_len):
            pass


def run_capture(
    model: nn.Module,
    layers: list[AttentionLayer],
    sequences: Iterable[torch.Tensor],
    stats: Stats,
    *,
    chunk_len: int,
    total_tokens: int | None = None,
    done_tokens: int = 0,
    after_sequence: Callable[[int], None] | None = None,
    progress: bool = True,
) -> Stats:
    """Stream ``sequences`` (1-D token tensors) through the model, filling ``stats``.

    Sequences run one at a time (batch 1, no padding), each as chunked prefill when longer than
    ``chunk_len``. Token ids go to the embedding's device (``input_device``: with a device map, where the
    embedding runs). Raises when any layer saw nothing, and at the first sequence whose Q, K or V is not finite.

    Args:
        done_tokens: tokens ``stats`` already holds (a resumed run), where the progress bar starts.
        after_sequence: called with each sequence's token count once its statistics are folded in: between
            sequences, the only moments at which ``stats`` holds whole sequences (``resume.Saver`` saves there).
    """
    device = input_device(model)
    collector = Collector(stats, layers)
    bar = tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc="calibrating", disable=not progress)
    with hooked_attention(model, collector), bar:
        for seq in sequences:
            forward_chunked(model, seq.to(device).unsqueeze(0), chunk_len)  # [1, S]
            collector.flush()
            refuse_nonfinite(stats, layers)  # at the sequence that made it, not after the whole run
            bar.update(seq.numel())
            if after_sequence is not None:
                after_sequence(seq.numel())
    collector.check_complete()
    return stats

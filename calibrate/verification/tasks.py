"""``kvcal tasks``: task accuracy through lm-evaluation-harness, on the user's held-out text, once per cache dtype.

Stock lm-eval tasks download their data, so kvcal builds two tasks from ``--data`` (the records a kvcal output was
calibrated on left out, ``data/passages.py``), writes them as lm-eval task files in ``OUT/tasks``, and runs lm-eval's
vLLM backend on them with the unquantized cache and with each candidate ``--kv-cache-dtype`` (``engine/jobs/lmeval.py``,
started as verify's engine runs are):

- ``kvcal_perplexity`` (``loglikelihood_rolling``): word and byte perplexity and bits per byte over whole passages;
- ``kvcal_cloze`` (``loglikelihood``, LAMBADA's form): the passage up to its last word, that word as the target;
  ``acc`` is whether the word is the model's greedy continuation, item by item.

Beside lm-eval's own tables, each candidate is set against the unquantized cache item by item on the cloze: at a few
hundred items the unpaired standard error of an accuracy is about 2 points, more than an FP8 cache usually moves it,
while the items both caches answer alike carry no evidence. The exact McNemar test on the items that flip
(``significance.mcnemar_exact``) says whether the flips lean one way beyond chance. The perplexity is paired too:
each passage's bits per byte with the candidate minus the unquantized cache's, judged by the t test verify's paired
comparisons use.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..data.passages import MIN_WORDS, cloze_items, held_out_passages
from ..data.stream import read_digests
from ..engine.launch import EngineError, run_job
from ..files import write_atomically
from ..layout import records_path
from ..model.description import describe
from ..model.load import load_tokenizer
from ..vllm_facts.platforms import platform
from ..vllm_facts.serving import unquantized_dtype
from . import engine
from .config import DEFAULT_MAX_MODEL_LEN, TasksConfig
from .significance import LEVEL, RULE, mcnemar_exact, mean_stderr, significant

BOOTSTRAP_ITERS = 1000  # lm-eval's bootstrap of the perplexities' standard errors (its default, 100,000, takes minutes)
PERPLEXITY, CLOZE = "kvcal_perplexity", "kvcal_cloze"
JOB_TIMEOUT_S = 3600.0
INSTALL = ("run scripts/setup-vllm, or install kvcal's lmeval extra into it without lm-eval's own vllm extra "
           "(pip install 'lm-eval>=0.4.13,<0.5')")


@dataclass
class TasksResult:
    """What ``kvcal tasks`` measured: per cache dtype lm-eval's results, table and per-item records; per candidate the
    paired cloze test against the unquantized cache; and where it was all written."""

    baseline: str
    runs: dict[str, dict]
    paired: dict[str, dict]  # candidate → the paired cloze test (``pair``)
    passages: dict[str, dict]  # candidate → the paired perplexity difference (``pair_perplexity``)
    items: int
    documents: int
    notes: list[str]
    out: Path

    def summary(self) -> str:
        lines = []
        for dtype, found in self.runs.items():
            lines += [f"lm-eval, --kv-cache-dtype {dtype} ({found['load_s'] + found['eval_s']:.0f} s):", found["table"]]
        lines += [paired_line(self.baseline, dtype, test) for dtype, test in self.paired.items()]
        lines += [perplexity_line(self.baseline, dtype, test) for dtype, test in self.passages.items()]
        lines += [f"note: {note}" for note in self.notes]
        lines.append(f"written: {self.out / 'results.json'}, {self.out / 'tables.md'}, task files in {self.out / 'tasks'}")
        return "\n".join(lines)


def paired_line(baseline: str, dtype: str, test: dict) -> str:
    """One candidate's cloze against the unquantized cache, in words."""
    verdict = (f"significant at {LEVEL:.0%}: the flips lean towards {dtype if test['only_candidate'] > test['only_baseline'] else baseline}"
               if test["p_value"] < LEVEL else f"no significant difference at {LEVEL:.0%}")
    return (f"{dtype} vs {baseline}, cloze ({test['items']} items): accuracy {test['acc_candidate']:.4f} vs "
            f"{test['acc_baseline']:.4f}; {test['only_baseline']} right only with {baseline}, {test['only_candidate']} "
            f"right only with {dtype}; exact McNemar p = {test['p_value']:.3g}: {verdict}")


def perplexity_line(baseline: str, dtype: str, test: dict) -> str:
    """One candidate's bits per byte against the unquantized cache's, passage by passage, in words."""
    se = f" ± {test['stderr']:.4f} s.e." if test["stderr"] is not None else ""
    verdict = f"significant at {LEVEL:.0%}" if test["significant"] else f"not significant at {LEVEL:.0%}"
    return (f"{dtype} vs {baseline}, perplexity ({test['passages']} passages): {test['mean_diff']:+.4f} bits per byte "
            f"a passage{se}, {verdict} (paired t test)")


def pair_perplexity(baseline: list[dict], candidate: list[dict]) -> dict:
    """A candidate's bits per byte minus the unquantized cache's, passage by passage, from lm-eval's per-passage
    records (``bits_per_byte``: [log-likelihood in nats, bytes]): the mean difference, its standard error and whether
    it is significant by the rule every paired comparison of kvcal's uses (``significance.RULE``)."""
    def bits(rows: list[dict]) -> dict[int, float]:
        return {row["doc_id"]: -row["bits_per_byte"][0] / row["bits_per_byte"][1] / math.log(2) for row in rows}

    base, other = bits(baseline), bits(candidate)
    if base.keys() != other.keys():
        raise ValueError("the perplexity passages of two runs differ; they cannot be paired")
    differences = [other[i] - base[i] for i in sorted(base)]
    mean, stderr = mean_stderr(differences)
    return {"passages": len(differences), "mean_diff": mean, "stderr": stderr,
            "significant": significant(mean, stderr, len(differences)), "rule": RULE}


def pair(baseline: list[dict], candidate: list[dict]) -> dict:
    """The paired cloze test of one candidate against the unquantized cache, from their per-item records (``doc_id``,
    ``acc``): both right, both wrong, right only one way, and the exact McNemar p-value on those flips."""
    base = {row["doc_id"]: row["acc"] for row in baseline}
    other = {row["doc_id"]: row["acc"] for row in candidate}
    if base.keys() != other.keys():
        raise ValueError("the cloze items of two runs differ; they cannot be paired")
    ids = sorted(base)
    counts = {"both_right": sum(1 for i in ids if base[i] and other[i]),
              "both_wrong": sum(1 for i in ids if not base[i] and not other[i]),
              "only_baseline": sum(1 for i in ids if base[i] and not other[i]),
              "only_candidate": sum(1 for i in ids if other[i] and not base[i])}
    return {"items": len(ids), **counts, "acc_baseline": sum(base.values()) / len(ids),
            "acc_candidate": sum(other.values()) / len(ids),
            "p_value": mcnemar_exact(counts["only_baseline"], counts["only_candidate"])}


def task_configs(folder: Path) -> dict[str, dict]:
    """lm-eval task configs reading ``folder``'s JSON-lines files (``write_tasks``): the data columns are named, not
    templated, so a target's leading space reaches the tokenizer as written."""
    def local(name: str) -> dict:
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(folder / name)}}, "test_split": "test"}

    return {
        PERPLEXITY: {"task": PERPLEXITY, **local("perplexity.jsonl"), "output_type": "loglikelihood_rolling",
                     "doc_to_text": "", "doc_to_target": "text",
                     "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
                     "metadata": {"version": 1.0}},
        CLOZE: {"task": CLOZE, **local("cloze.jsonl"), "output_type": "loglikelihood", "doc_to_text": "context",
                "doc_to_target": "target",
                "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                "metadata": {"version": 1.0}},
    }


def write_tasks(folder: Path, passages: list[str], items: list) -> None:
    """The two tasks' data (``perplexity.jsonl``: {"text"}; ``cloze.jsonl``: {"context", "target"}) and their configs
    (``NAME.yaml``, written as JSON, which YAML reads) in ``folder``, so lm-eval's own CLI can rerun them too."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "perplexity.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in passages))
    (folder / "cloze.jsonl").write_text("".join(json.dumps({"context": i.context, "target": i.target}) + "\n" for i in items))
    for name, config in task_configs(folder).items():
        (folder / f"{name}.yaml").write_text(json.dumps(config, indent=2) + "\n")


def has_lm_eval(python: Path) -> bool:
    """Whether vLLM's interpreter can import lm-eval (found by its import machinery, not imported)."""
    probe = subprocess.run([str(python), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('lm_eval') is None)"],
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def tasks(checkpoint: str | Path, data: str | Path | list[str], out: str | Path, **options) -> TasksResult:
    """Run lm-eval's perplexity and last-word cloze tasks, built from ``data``'s held-out records, on ``checkpoint`` in
    the installed vLLM with its unquantized cache and each ``kv_cache_dtypes`` entry; options are ``TasksConfig``'s
    fields. Writes ``out`` (a new folder): the task files, lm-eval's tables and results.json."""
    return run_tasks(TasksConfig(str(checkpoint), data, str(out), **options))


def run_tasks(config: TasksConfig) -> TasksResult:
    """Run ``kvcal tasks``; see ``tasks``."""
    config.validate()
    described = describe(config.checkpoint)
    # 1. vLLM and lm-eval in its interpreter, and what the engine offers, before any text is read.
    host = engine.probe(config.vllm_python)
    if not has_lm_eval(host.python):
        raise ValueError(f"lm-eval is not installed in vLLM's interpreter {host.python}: {INSTALL}")
    missing = [d for d in config.kv_cache_dtypes if d not in host.cache_dtypes]
    if missing:
        raise ValueError(f"vLLM {host.version} has no --kv-cache-dtype {missing[0]} (it has {', '.join(host.cache_dtypes)})")
    # 2. Held-out passages (calibration's records left out) and the cloze items cut from them.
    exclude = frozenset() if config.include_calibration_data else read_digests(records_path(config.checkpoint))
    tokenizer = load_tokenizer(config.checkpoint)
    found = held_out_passages(config.data, tokenizer, exclude, limit=max(config.documents, 4 * config.items),
                              text_field=config.text_field, seed=config.seed)
    items = cloze_items(found.texts, config.items)
    documents = found.texts[: config.documents]
    if not items:
        raise ValueError(f"the data holds no held-out passage of {MIN_WORDS} words or more ending in a word: give "
                         "--data text of whole sentences or paragraphs")
    notes = [f"{what}: {len(got)} of the {asked} asked; the data holds no more held-out passages that fit"
             for what, got, asked in (("cloze items", items, config.items), ("perplexity passages", documents, config.documents))
             if len(got) < asked]
    if found.excluded:
        notes.append(f"{found.excluded} records calibration used were left out")
    # 3. The engine settings verify's engine runs use, sized for this model.
    sig = described.signature(list(range(described.num_layers)))
    block = platform(host.platform).block_size
    max_len = config.max_model_len or min(DEFAULT_MAX_MODEL_LEN, described.context or DEFAULT_MAX_MODEL_LEN)
    max_len = max(block, max_len // block * block)  # whole blocks, as verify's engine runs size it
    settings = {"dtype": "auto", "max_model_len": max_len, "block_size": block, "chunk_len": max_len,
                "kv_cache_bytes": engine.kv_cache_bytes(described.num_layers, sig.num_kv_heads, sig.head_dim, max_len, block)}
    baseline = unquantized_dtype(described.config)
    out = Path(config.out)
    made = not out.exists()
    try:
        # 4. The task files, then one lm-eval run per cache dtype, the unquantized first.
        folder = (out / "tasks").resolve()  # the task files name their data by this path; lm-eval runs elsewhere
        write_tasks(folder, documents, items)
        runs = {dtype: _run(host.python, config.checkpoint, dtype, folder, settings)
                for dtype in [baseline, *config.kv_cache_dtypes]}
        # 5. Each candidate paired with the unquantized cache on the cloze, then the files, results.json last.
        paired = {dtype: pair(runs[baseline]["samples"][CLOZE], runs[dtype]["samples"][CLOZE])
                  for dtype in config.kv_cache_dtypes}
        passages = {dtype: pair_perplexity(runs[baseline]["samples"][PERPLEXITY], runs[dtype]["samples"][PERPLEXITY])
                    for dtype in config.kv_cache_dtypes}
        result = TasksResult(baseline, runs, paired, passages, len(items), len(documents), notes, out)
        _write(result, settings, host)
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for child in out.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    return result


def _run(python: Path, checkpoint: str, dtype: str, folder: Path, settings: dict) -> dict:
    """One lm-eval run (``jobs/lmeval.py``) with cache ``dtype``; ValueError in one line when it could not run."""
    request = {**settings, "checkpoint": str(Path(checkpoint).resolve()), "kv_cache_dtype": dtype,
               "tasks_dir": str(folder.resolve()), "tasks": [PERPLEXITY, CLOZE], "bootstrap_iters": BOOTSTRAP_ITERS}
    began = time.perf_counter()
    try:
        answer = run_job(python, "lmeval", request, timeout_s=JOB_TIMEOUT_S)
    except EngineError as e:
        raise ValueError(f"lm-eval with --kv-cache-dtype {dtype}: {e}") from None
    if answer["error"]:
        raise ValueError(f"lm-eval with --kv-cache-dtype {dtype} failed: {answer['error'][:500]}")
    return {**answer["result"], "wall_s": time.perf_counter() - began}


def _write(result: TasksResult, settings: dict, host: engine.EngineHost) -> None:
    """tables.md (lm-eval's tables and the paired lines) and results.json, each written whole."""
    out = result.out
    tables = "\n\n".join(f"## --kv-cache-dtype {dtype}\n\n{found['table']}" for dtype, found in result.runs.items())
    paired = "\n".join([f"- {paired_line(result.baseline, d, t)}" for d, t in result.paired.items()]
                       + [f"- {perplexity_line(result.baseline, d, t)}" for d, t in result.passages.items()])
    write_atomically(out / "tables.md", lambda p: p.write_text(f"{tables}\n\n## Paired tests\n\n{paired}\n"))
    report = {"baseline": result.baseline, "items": result.items, "documents": result.documents, "notes": result.notes,
              "engine": {**settings, "vllm_version": host.version, "platform": host.platform},
              "runs": result.runs, "paired": result.paired, "paired_perplexity": result.passages}
    write_atomically(out / "results.json", lambda p: p.write_text(json.dumps(report, indent=1)))

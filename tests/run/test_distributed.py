"""Data-parallel calibration under torchrun (gloo, two CPU processes): exact merge, uneven shares, failing ranks."""

import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from runners import SIGINT_DEFAULT, TORCHRUN, free_port

from calibrate import calibrate
from calibrate.api import load_calibration
from calibrate.data.config import DataConfig
from calibrate.data.stream import iter_sequences

OPTIONS = ["--seq-len", "64", "--quiet", "--no-verify", "--dist-timeout", "30"]


def rank_env(rank: int, world: int, port: int) -> dict:
    """torchrun's environment contract for one rank, set by hand so that the test can kill one process."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return env


def test_shards_are_the_single_process_sequences(text_file, smol_tokenizer):
    config = DataConfig(sources=[str(text_file)], seq_len=64, max_tokens=64 * 5)
    stream = iter_sequences(config, smol_tokenizer)
    whole = [s.tolist() for s in stream]
    manifest = stream.manifest()
    shards = [[s.tolist() for s in stream.shard(r, 3)] for r in range(3)]
    assert [len(s) for s in shards] == [2, 2, 1]
    assert [shards[i % 3][i // 3] for i in range(5)] == whole
    assert stream.manifest() == manifest  # the manifest still describes the whole set
    assert list(stream.shard(7, 8)) == []  # more ranks than sequences: an empty share


@pytest.mark.slow
@pytest.mark.parametrize("sequences", [3, 1])  # 3 on 2 ranks: uneven; 1: rank 1 gets none
def test_two_ranks_equal_one_process(tiny_dir, text_file, tmp_path, sequences):
    max_tokens = 64 * sequences
    one = calibrate(str(tiny_dir), [str(text_file)], str(tmp_path / "one"), seq_len=64, max_tokens=max_tokens,
                    progress=False, verify=False, min_tokens=64)
    out = tmp_path / "two"
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "calibrate", "calibrate",
           str(tiny_dir), "--data", str(text_file), "--out", str(out), "--max-tokens", str(max_tokens),
           "--min-tokens", "64", *OPTIONS]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # rank 0 alone prints the summary

    stats, provenance = load_calibration(out)
    assert provenance["ranks"] == 2
    assert provenance["data"] == one.provenance["data"]  # the manifest of the whole set
    assert provenance["scales"]["scales"] == one.provenance["scales"]["scales"]
    torch.testing.assert_close(stats.tokens, one.stats.tokens, rtol=0, atol=0)
    torch.testing.assert_close(stats.pos_tokens, one.stats.pos_tokens, rtol=0, atol=0)
    for kind, s in stats.kinds.items():
        for f in fields(s):
            got, want = getattr(s, f.name), getattr(one.stats.kinds[kind], f.name)
            exact = want.dtype != torch.float64  # counts and maxima exactly; float64 sums up to their order
            torch.testing.assert_close(got, want, rtol=0 if exact else 1e-12, atol=0, msg=f"{kind}.{f.name}")


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_on_every_rank(tiny_dir, text_file, tmp_path):
    """Rank 1 is killed mid-capture (held there by layout.pause_at after its first save, so rank 0 cannot have
    finished: it needs rank 1 to merge); rank 0 fails with one line within the timeout, writing nothing."""
    out, port, marker = tmp_path / "out", free_port(), tmp_path / "rank1-paused"
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out),
           "--max-tokens", "4096", "--checkpoint-every", "64", *OPTIONS]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    pause = {"KVCAL_PAUSE_AT": "capture", "KVCAL_PAUSE_MARKER": str(marker)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logs[r].open("w"),
                              env=rank_env(r, 2, port) | (pause if r == 1 else {}), **SIGINT_DEFAULT) for r in range(2)]
    try:
        deadline = time.monotonic() + 300  # against a hang only: the test goes on as soon as the marker appears
        while not marker.exists():
            assert procs[1].poll() is None, read(logs[1])[-3000:]
            assert time.monotonic() < deadline, f"rank 1 did not reach its first save within 300 s: {read(logs[1])[-3000:]}"
            time.sleep(0.05)
        assert int(marker.read_text()) == procs[1].pid
        procs[1].send_signal(signal.SIGKILL)
        code = procs[0].wait(timeout=120)  # the 30 s --dist-timeout bounds it even if the dead peer went unnoticed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    last = read(logs[0]).strip().splitlines()[-1]
    assert code != 0
    assert last.startswith("kvcal: error: ") and "rank" in last, read(logs[0])[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_a_rank_that_fails_stops_the_others(tiny_dir, text_file, tmp_path):
    """An OUT that exists fails on rank 0 alone (only it writes): rank 1 stops too, naming rank 0's error."""
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out),
           "--max-tokens", "256", *OPTIONS]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=rank_env(r, 2, port))
             for r in range(2)]
    errors = [p.communicate(timeout=120)[1].strip().splitlines()[-1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert errors[0].startswith("kvcal: error: ") and "exists" in errors[0]
    assert errors[1].startswith("kvcal: error: rank 0 of 2 failed during the checks of the inputs"), errors[1]
    assert list(out.iterdir()) == []


def test_a_rendezvous_nobody_answers_is_one_line(tiny_dir, text_file, tmp_path):
    """A rank whose master never comes up (wrong --master-addr/port, node not started) gives up within the timeout."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "calibrate", "calibrate", str(tiny_dir), "--data", str(text_file), "--out", str(out),
           "--seq-len", "64", "--quiet", "--no-verify", "--dist-timeout", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env(1, 2, free_port()), timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("kvcal: error: rank 1 could not join the other 1 ranks at 127.0.0.1:") and "reachable" in lines[0]
    assert not out.exists()  # the 120 s timeout above bounds the 5 s --dist-timeout: no wall-clock check here


LEAVE = """
import os, sys, time
from transformers import AutoTokenizer
from calibrate import calibrate
from calibrate.run.distributed import session

def gloo_threads():
    return [t for t in os.listdir("/proc/self/task") if open(f"/proc/self/task/{t}/comm").read().startswith(("pt_gloo", "gloo"))]

def named_within(seconds):  # a gloo thread names itself once it runs, which a busy machine can delay
    deadline = time.monotonic() + seconds
    while not gloo_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return gloo_threads()

model, data, out = sys.argv[1:]
with session("cpu", 30) as group:
    assert group.active, "no process group"
    assert named_within(30), "no gloo worker thread within 30 s of the join"
    AutoTokenizer.from_pretrained(model)  # imports torch.distributed.nn inside the session
print(len(gloo_threads()))
calibrate(model, [data], out, seq_len=64, max_tokens=256, progress=False, verify=False)  # a whole run, rank 0 of 1
print(len(gloo_threads()))
"""


def test_leaving_the_session_stops_the_process_groups_threads(tiny_dir, text_file, tmp_path):
    """A process group still referenced after the session keeps gloo's worker threads running while Python shuts
    down, which aborts the process (SIGABRT) now and then instead of its exit code 2 or 0: every thread must be gone
    once the session is left, whatever ran inside it (a tokenizer's load, a whole calibration)."""
    run = subprocess.run([sys.executable, "-c", LEAVE, str(tiny_dir), str(text_file), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=rank_env(0, 1, free_port()))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["0", "0"]
    assert (tmp_path / "out" / "kvcal" / "calibration.json").is_file()


def test_a_gpu_rank_sets_its_device_then_joins(monkeypatch):
    """The NCCL path without GPUs: the rank's GPU is made current before the join (NCCL's object collectives use it),
    and a join that fails is one DistributedError. (A function-local `import torch...` once made `torch` unbound here.)"""
    from calibrate.run import distributed

    for name, value in rank_env(1, 2, 1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))

    def init(backend, **kwargs):
        calls.append(("init", backend))
        raise RuntimeError("no NCCL here")

    monkeypatch.setattr(distributed.dist, "init_process_group", init)
    with pytest.raises(distributed.DistributedError, match=r"rank 1 could not join the other 1 ranks .*\(no NCCL here\)"):
        with distributed.session("cuda", timeout_s=1):
            pass
    assert calls == [("set_device", "cuda:1"), ("init", "nccl")]

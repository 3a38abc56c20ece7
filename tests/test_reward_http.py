"""The HTTP reward source: client drills against real servers on loopback, and serve-reward.

Each failure drill runs a real server (ours with a stub scorer, or tests/workers/reward_stub_server.py
misbehaving on purpose) and records how long the client took to stop with RewardSourceError;
`-s` prints the table (failure -> behaviour -> seconds to detect) at the end of the module.
The slow test serves a trained reward model at TP2 through our torchrun and compares its
scores with the in-process reward model's.
"""

import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch

from distributed import REPO, torchrun
from stages import RECIPE, SIZES
from workers.reward_stub_server import stub_app

from megatron_rlhf.data.tokenizers import WordTokenizer
from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError
from megatron_rlhf.rewards.http import SCHEMA, HttpRewardClient, request_body
from megatron_rlhf.rewards.server import BatchQueue, HttpThread, RewardModelScorer, Stopping, serving

FAST = dict(timeout_s=2.0, max_retries=3, backoff_s=0.05, max_backoff_s=0.2)  # drills take well under a second
DRILLS: list[tuple[str, str, float]] = []  # (failure, behaviour, seconds to detect)


@pytest.fixture(scope="module", autouse=True)
def drill_table():
    yield
    if DRILLS:
        print("\n| failure | behaviour | time to detect |\n|---|---|---:|")
        for failure, behaviour, seconds in DRILLS:
            print(f"| {failure} | {behaviour} | {seconds:.2f} s |")


def inputs(n: int, scores=None) -> RewardInputs:
    """n rows; each row's stub score is its index (or scores[i]), carried in extra."""
    scores = range(n) if scores is None else scores
    return RewardInputs([f"prompt {i}" for i in range(n)], [f"response {i}" for i in range(n)],
                        [[3, 4, 5 + i % 7] for i in range(n)], [[6] * (1 + i % 5) for i in range(n)],
                        [i % 2 == 0 for i in range(n)], [{"score": float(s)} for s in scores])


def stub_scorer(seen: list | None = None):
    """Our server's scorer for the drills: each row scores extra["score"]; records batch sizes."""
    def score(batch: RewardInputs) -> list[float]:
        if seen is not None:
            seen.append(len(batch))
        if any(extra.get("boom") for extra in batch.extras):
            raise RuntimeError("stub scorer exploded")
        return [extra["score"] for extra in batch.extras]
    return score


@contextmanager
def stub_server(mode: str, **kwargs):
    http = HttpThread(stub_app(mode, **kwargs)).start()
    try:
        yield http.url
    finally:
        http.stop()


@contextmanager
def stub_subprocess(mode: str = "ok"):
    """The stub as its own process, so a test can kill -9 it."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests/workers/reward_stub_server.py"), "--mode", mode],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield proc, line.split()[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect(failure: str, behaviour: str, call):
    """Run `call`, which must raise RewardSourceError; record the time to detect; return the error."""
    start = time.monotonic()
    with pytest.raises(RewardSourceError) as caught:
        call()
    DRILLS.append((failure, behaviour, time.monotonic() - start))
    return caught.value


# ----------------------------------------------------------------------------- failure drills


def test_server_not_started_raises_after_the_retries_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}/score"
    with HttpRewardClient(url, **FAST) as client:
        err = detect("server not started (connection refused)", "RewardSourceError after 1 + 3 retries",
                     lambda: client.score(inputs(4)))
        assert client.pop_stats()["retries"] == 3
    message = str(err)
    assert f"POST {url}" in message and "after 4 attempts" in message and "ConnectError" in message, message
    assert "serve-reward" in message  # the fix


def test_server_killed_mid_run_raises_on_the_next_call():
    with stub_subprocess("ok") as (proc, url), HttpRewardClient(url, **FAST) as client:
        assert client.score(inputs(8)) == [float(i) for i in range(8)]
        proc.kill()
        proc.wait()
        err = detect("server killed mid-run (kill -9)", "RewardSourceError after the retries",
                     lambda: client.score(inputs(8)))
    assert url in str(err) and "attempts" in str(err)


def test_slow_server_times_out():
    with stub_server("slow", delay_s=0.6) as url, \
            HttpRewardClient(url, **{**FAST, "timeout_s": 0.2, "max_retries": 1}) as client:
        err = detect("answer slower than timeout_s (0.2 s)", "RewardSourceError after 1 + 1 retries",
                     lambda: client.score(inputs(4)))
    assert "ReadTimeout" in str(err) and "timeout_s=0.2" in str(err), str(err)


def test_http_500_then_recovery_within_the_budget():
    with stub_server("http500-then-ok", fail_first=2) as url, HttpRewardClient(url, **FAST) as client:
        state = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
        start = time.monotonic()
        assert client.score(inputs(8)) == [float(i) for i in range(8)]
        DRILLS.append(("HTTP 500 for the first 2 requests", "recovered: scores after 2 retries",
                       time.monotonic() - start))
        stats = client.pop_stats()
        assert stats["retries"] == 2 and stats["requests"] == 3, stats
        # exact resume: the jitter must not draw from the trainer's global RNG streams
        assert random.getstate() == state[0]
        assert (np.random.get_state()[1] == state[1]).all() and torch.equal(torch.get_rng_state(), state[2])


@pytest.mark.parametrize("mode, problem", [
    ("malformed-json", "is not JSON"),
    ("wrong-count", "returned 7 scores for 8 samples"),
    ("nan", "score 3 is nan"),
    ("non-number", "score 3 is '0.5'"),
    ("bad-schema", "'someone.else.v2'"),
])
def test_wrong_answers_stop_at_once(mode, problem):
    with stub_server(mode) as url, HttpRewardClient(url, **FAST) as client:
        err = detect(f"answer: {mode}", "RewardSourceError at once, not retried", lambda: client.score(inputs(8)))
        stats = client.pop_stats()
    assert stats["requests"] == 1 and stats["retries"] == 0, stats
    assert problem in str(err) and url in str(err), str(err)


def test_our_server_refuses_out_of_vocabulary_ids_naming_the_sample():
    tokenizer = WordTokenizer([f"w{i}" for i in range(20)])  # ids 0..22
    scorer = RewardModelScorer(None, tokenizer, max_seq_length=16, micro_batch_size=4)
    bad = inputs(4)
    bad.response_ids[2] = [3, 99]
    with serving(stub_scorer(), prepare=scorer.prepare) as url, HttpRewardClient(url, **FAST) as client:
        err = detect("our server: out-of-vocabulary id (HTTP 400)", "RewardSourceError at once, not retried",
                     lambda: client.score(bad))
        assert client.pop_stats()["retries"] == 0
    assert "HTTP 400" in str(err) and "sample 2: 'response_ids'[1]=99" in str(err), str(err)


def test_our_server_names_the_field_of_a_malformed_request():
    samples = request_body(inputs(3))["samples"]
    samples[1]["prompt_ids"] = [3, True]
    with serving(stub_scorer()) as url:
        answer = httpx.post(url, json={"schema": SCHEMA, "samples": samples})
        assert answer.status_code == 400 and "sample 1: 'prompt_ids'[1]=True" in answer.json()["error"], answer.text
        answer = httpx.post(url, json={"schema": "v0", "samples": []})
        assert answer.status_code == 400 and SCHEMA in answer.json()["error"]
        answer = httpx.post(url, content=b"{not json")
        assert answer.status_code == 400 and "not JSON" in answer.json()["error"]


def test_reward_model_prepare_tokenizes_text_and_checks_the_length():
    tokenizer = WordTokenizer(["good", "bad", "movie"])
    scorer = RewardModelScorer(None, tokenizer, max_seq_length=6, micro_batch_size=4)
    text_only = RewardInputs(["good movie"], ["bad"], [[]], [[]], [True])
    prepared = scorer.prepare(text_only)
    assert (prepared.prompt_ids, prepared.response_ids) == ([[3, 5]], [[4, tokenizer.eos_id]])  # + EOS, as in training
    with pytest.raises(ValueError, match=r"sample 0: 3 prompt \+ 4 response tokens = 7, more than .*max_seq_length=6"):
        scorer.prepare(RewardInputs(["x"], ["y"], [[3, 3, 3]], [[4, 4, 4, 1]], [True]))
    with pytest.raises(ValueError, match="sample 0: empty"):
        scorer.prepare(RewardInputs([""], [""], [[]], [[]], [False]))


def test_scorer_failure_answers_500_and_the_server_keeps_serving():
    boom = inputs(4)
    boom.extras[1]["boom"] = True
    with serving(stub_scorer()) as url, HttpRewardClient(url, **{**FAST, "max_retries": 1}) as client:
        err = detect("scorer raises (HTTP 500 every time)", "RewardSourceError after the retries",
                     lambda: client.score(boom))
        assert "stub scorer exploded" in str(err), str(err)
        assert client.score(inputs(4)) == [0.0, 1.0, 2.0, 3.0]


def test_batches_are_split_sent_concurrently_and_reassembled_in_order():
    seen: list[int] = []
    want = [float(i) for i in range(100)]
    with serving(stub_scorer(seen), max_batch=16, max_wait_ms=20) as url:
        with HttpRewardClient(url, **FAST, batch_size=8, max_concurrency=3) as client:
            assert client.score(inputs(100)) == want
            stats = client.pop_stats()
            assert stats["requests"] == 13 and stats["retries"] == 0 and stats["seconds"] > 0, stats
            assert 0 < stats["latency_mean_seconds"] <= stats["latency_max_seconds"] <= stats["seconds"]
        with HttpRewardClient(url, **FAST, batch_size=50) as client:  # requests larger than the server's batch
            assert client.score(inputs(100)) == want
    assert sum(seen) == 200 and max(seen) <= 16, seen


def test_queue_takes_whole_requests_up_to_max_batch_and_refuses_once_closed():
    q = BatchQueue(max_batch=8, max_wait_s=0)
    for n in (3, 3, 3, 20):
        q.submit(inputs(n))
    assert [len(r) for r, _ in q.take(0.1)] == [3, 3]
    assert [len(r) for r, _ in q.take(0.1)] == [3]
    assert [len(r) for r, _ in q.take(0.1)] == [20]  # alone: the loop scores it in chunks of 8
    assert q.take(0.01) == []
    waiting = q.submit(inputs(1))
    q.close()
    assert isinstance(waiting.exception(), Stopping) and isinstance(q.submit(inputs(1)).exception(), Stopping)


def test_small_answers_do_not_wait_for_delayed_acks():
    # Nagle's algorithm on the server's sockets once cost every answer ~40 ms on loopback
    with serving(stub_scorer(), max_wait_ms=0) as url, HttpRewardClient(url, **FAST) as client:
        client.score(inputs(1))
        seconds = []
        for _ in range(15):
            start = time.monotonic()
            client.score(inputs(1))
            seconds.append(time.monotonic() - start)
    assert sorted(seconds)[len(seconds) // 2] < 0.02, seconds


def test_health():
    with serving(stub_scorer(), max_batch=7, info={"checkpoint": "somewhere"}) as url:
        health = httpx.get(url.replace("/score", "/health")).json()
    assert health == {"status": "ok", "schema": SCHEMA, "max_batch": 7, "checkpoint": "somewhere"}


def test_empty_batch_sends_nothing():
    with HttpRewardClient(f"http://127.0.0.1:{free_port()}/score", **FAST) as client:
        assert client.score(inputs(0)) == []
        assert client.pop_stats()["requests"] == 0


@pytest.mark.parametrize("bad, name", [
    (dict(timeout_s=0), "timeout_s"), (dict(max_retries=-1), "max_retries"), (dict(backoff_s=-1), "backoff_s"),
    (dict(backoff_s=2, max_backoff_s=1), "max_backoff_s"), (dict(batch_size=0), "batch_size"),
    (dict(max_concurrency=0), "max_concurrency"),
])
def test_constructor_names_the_bad_argument(bad, name):
    with pytest.raises(ValueError, match=f"^{name}="):
        HttpRewardClient("http://127.0.0.1:1/score", **bad)
    with pytest.raises(ValueError, match="^url="):
        HttpRewardClient("127.0.0.1:8000/score")


# ----------------------------------------------------------------------------- serve-reward, a real model


def test_serve_reward_runs_one_replica_only():
    from megatron_rlhf.config import ConfigError, load_config
    from megatron_rlhf.trainers.serve_reward import check_one_replica

    cfg = load_config("pipelines/tiny_cpu.yaml", ["parallel.tensor_parallel=2"])
    check_one_replica(cfg, 2)
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel=2 x parallel.pipeline_parallel=1 = 2, but 4 "
                                          r"processes were launched: serve-reward runs one model replica"):
        check_one_replica(cfg, 4)


def test_serve_reward_without_a_checkpoint_is_a_config_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf", "serve-reward", *RECIPE, "--ckpt",
                           str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr
    assert f"config error: --ckpt {tmp_path / 'missing'}: no checkpoint" in proc.stderr, proc.stderr
    assert "give the RM stage directory" in proc.stderr



def start_reward_server(*args: str) -> tuple[subprocess.Popen, str, threading.Thread, list[str]]:
    """`python -m megatron_rlhf.torchrun ... serve-reward --port 0`: (the launcher, its URL, the
    thread reading its output, the output lines so far)."""
    env = {**{k: v for k, v in os.environ.items() if k != "MEGATRON_RLHF_FAULT"}, "PYTHONUNBUFFERED": "1",
           "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.torchrun", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []

    def read():
        for line in proc.stdout:
            output.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if listening := [line for line in list(output) if "[serve-reward] listening on " in line]:
            return proc, listening[0].split("listening on ")[1].split()[0], reader, output
        time.sleep(0.2)
    proc.kill()
    reader.join(timeout=5)
    raise AssertionError("serve-reward did not start:\n" + "".join(output)[-6000:])


def rank0_worker(launcher: subprocess.Popen):
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == "0":
                return child
        except psutil.Error:
            continue
    raise AssertionError("no rank 0 worker under the launcher")


@pytest.mark.slow
def test_serve_reward_at_tp2_matches_the_in_process_reward_model(sft_rm_root, tmp_path):
    rm_dir = sft_rm_root / "main" / "rm"
    g = torch.Generator().manual_seed(0)
    lengths = [3, 17, 9, 30, 5, 12, 24, 2]  # unequal: padding and the last-token read both matter
    sequences = [torch.randint(3, 80, (n,), generator=g).tolist() for n in lengths]
    (tmp_path / "sequences.json").write_text(json.dumps(sequences))
    torchrun(1, "tests/workers/rm_scores.py", *RECIPE, "--ckpt", str(rm_dir), "--sequences",
             str(tmp_path / "sequences.json"), "--out", str(tmp_path / "want.json"), *SIZES)
    want = json.loads((tmp_path / "want.json").read_text())

    proc, url, reader, output = start_reward_server("--nproc-per-node", "2", "serve-reward", *RECIPE, "--ckpt", str(rm_dir),
                                           "--port", "0", "--max-batch", "4", "parallel.tensor_parallel=2")
    try:
        split = [n // 2 for n in lengths]
        rows = RewardInputs([""] * len(sequences), [""] * len(sequences),
                            [s[:k] for s, k in zip(sequences, split)], [s[k:] for s, k in zip(sequences, split)],
                            [True] * len(sequences))
        with HttpRewardClient(url, timeout_s=60, batch_size=3, max_concurrency=2) as client:
            got = client.score(rows)
        health = httpx.get(url.replace("/score", "/health")).json()
        assert health["tensor_parallel"] == 2 and health["checkpoint"].startswith(str(rm_dir)), health
        rank0_worker(proc).send_signal(signal.SIGTERM)  # rank 0 tells rank 1 to stop: both exit 0
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert "[serve-reward] stopped (SIGTERM)" in "".join(output), "".join(output)[-4000:]
    assert len(got) == len(want) and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, want)), (got, want)
    assert len({round(x, 3) for x in want}) == len(want), want  # distinct: a reordering would show

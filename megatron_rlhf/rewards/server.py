"""A reward model as an HTTP service: `python -m megatron_rlhf serve-reward` (schema: rewards/http.py,
docs/reward_service.md).

    python -m megatron_rlhf.torchrun --nproc-per-node N serve-reward --config RECIPE --ckpt <rm stage or iter_*>
        [--host 127.0.0.1] [--port 8000] [--max-batch 64] [--max-wait-ms 5] [parallel.tensor_parallel=N ...]

One model replica at any TP x PP (no data parallelism: world size = TP x PP). Rank 0 runs the
HTTP front (uvicorn in a thread): each request is validated, tokenized when it has no ids,
and queued with a Future. The main thread of every rank loops: rank 0 takes the queued
requests (waiting up to --max-wait-ms for more, up to --max-batch samples), broadcasts the
batch, every rank runs the reward model's forward, rank 0 answers. The scores are the
normalised RM scores, exactly what the RL stage's in-process reward model returns.

The front, the queue and the loop take any scorer (a RewardInputs batch -> one float per
row), so a pure-Python scorer runs in one process with `serving(...)`: tests and benchmarks.
The command itself (the checkpoint, the model, the ranks, signals) is trainers/serve_reward.py.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron_rlhf.resilience.faults import FAULTS
from megatron_rlhf.rewards.base import RewardInputs
from megatron_rlhf.rewards.http import SCHEMA, SchemaError, error_body, parse_request, response_body

Scorer = Callable[[RewardInputs], list[float]]
Prepare = Callable[[RewardInputs], RewardInputs]
# The loop's longest wait for work: ranks > 0 then hear from rank 0 at least this often, so an
# idle server never runs into the process group's collective timeout.
IDLE_TICK_S = 0.5


class Stopping(RuntimeError):
    """The server is shutting down: queued requests are answered 503 (a client retries)."""


# ----------------------------------------------------------------------------- the queue


class BatchQueue:
    """Requests waiting to be scored, taken in arrival order as batches of <= max_batch samples
    (a single larger request is taken alone; the loop scores it in max_batch chunks)."""

    def __init__(self, max_batch: int, max_wait_s: float):
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch={max_batch}, max_wait_s={max_wait_s}: need max_batch >= 1, max_wait_s >= 0")
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._pending: deque[tuple[RewardInputs, Future]] = deque()
        self._ready = threading.Condition()
        self._closed = False

    def submit(self, inputs: RewardInputs) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                future.set_exception(Stopping("the reward server is shutting down"))
                return future
            self._pending.append((inputs, future))
            self._ready.notify()
        return future

    def take(self, idle_s: float) -> list[tuple[RewardInputs, Future]]:
        """Up to max_batch samples of queued requests; waits up to idle_s for the first one
        ([] when none came, or once closed), then up to max_wait_s for more to fill the batch."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._pending or self._closed, timeout=idle_s) or self._closed:
                return []
            deadline = time.monotonic() + self.max_wait_s
            while self._queued_samples() < self.max_batch and (left := deadline - time.monotonic()) > 0:
                self._ready.wait(left)
            taken, samples = [], 0
            while self._pending and (not taken or samples + len(self._pending[0][0]) <= self.max_batch):
                inputs, future = self._pending.popleft()
                if future.set_running_or_notify_cancel():  # False: its client went away
                    taken.append((inputs, future))
                    samples += len(inputs)
            return taken

    def close(self) -> None:
        """Refuse new requests and answer the queued ones 503."""
        with self._ready:
            self._closed = True
            pending, self._pending = list(self._pending), deque()
            self._ready.notify_all()  # a waiting take() returns at once
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(Stopping("the reward server is shutting down"))

    def _queued_samples(self) -> int:
        return sum(len(inputs) for inputs, _ in self._pending)


# ----------------------------------------------------------------------------- scoring


def concat(parts: list[RewardInputs]) -> RewardInputs:
    """The rows of `parts`, in order, as one batch."""
    columns = ("prompts", "responses", "prompt_ids", "response_ids", "finished", "extras")
    return RewardInputs(*([row for part in parts for row in getattr(part, name)] for name in columns))


def run_scorer(scorer: Scorer, batch: RewardInputs, max_batch: int) -> list[float] | Exception:
    """The scores of `batch` in chunks of <= max_batch rows, or the exception that stopped it
    (answered 500: one bad batch must not take the server down)."""
    try:
        scores = [float(s) for start in range(0, len(batch), max_batch)
                  for s in scorer(batch.rows(start, start + max_batch))]
    except Exception as err:  # noqa: BLE001  (reported to the clients of this batch)
        return RuntimeError(f"scoring failed: {type(err).__name__}: {err}")
    if len(scores) != len(batch):
        return RuntimeError(f"scoring failed: the scorer returned {len(scores)} scores for {len(batch)} samples")
    if bad := [i for i, s in enumerate(scores) if not math.isfinite(s)]:
        return RuntimeError(f"scoring failed: non-finite score for batch rows {bad[:10]}")
    return scores


def resolve(requests: list[tuple[RewardInputs, Future]], outcome: list[float] | Exception) -> None:
    """Hand each request its slice of the batch's scores (or the batch's error)."""
    start = 0
    for inputs, future in requests:
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome[start : start + len(inputs)])
        start += len(inputs)


def serve_loop(scorer: Scorer, max_batch: int, stop: threading.Event, queue: BatchQueue | None,
               exchange: Callable[[Any], Any] = lambda message: message) -> None:
    """Every rank's main loop until rank 0 (the one with the queue) says stop. `exchange`
    hands rank 0's message to every rank (a broadcast; the identity in one process), so all
    ranks run each forward together."""
    batches = 0
    while True:
        message, requests = next_message(queue, stop) if queue is not None else (None, [])
        kind, batch = exchange(message)
        if kind == "stop":
            return
        if kind == "score":
            batches += 1
            FAULTS.at("serve", step=batches)  # drills: MEGATRON_RLHF_FAULT=kill@serve:N
            outcome = run_scorer(scorer, batch, max_batch)
            if queue is not None:
                resolve(requests, outcome)


def next_message(queue: BatchQueue, stop: threading.Event) -> tuple[tuple[str, Any], list]:
    """Rank 0: ((what every rank does next, its batch), the requests that batch answers)."""
    if stop.is_set():
        return ("stop", None), []
    requests = queue.take(IDLE_TICK_S)
    if not requests:
        return ("idle", None), []
    return ("score", concat([inputs for inputs, _ in requests])), requests


# ----------------------------------------------------------------------------- HTTP


def build_app(queue: BatchQueue, prepare: Prepare | None = None, info: dict | None = None):
    """POST /score (the schema) and GET /health. `prepare` checks a parsed request against the
    scorer (SchemaError -> 400) and may fill it in (e.g. tokenize); it runs before queueing."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def score(request):
        try:
            inputs = parse_request(await request.json())
            inputs = prepare(inputs) if prepare is not None else inputs
        except SchemaError as err:
            return JSONResponse(error_body(str(err)), status_code=400)
        except ValueError as err:  # the body is not JSON (or not UTF-8)
            return JSONResponse(error_body(f"the body is not JSON: {err}"), status_code=400)
        if not len(inputs):
            return JSONResponse(response_body([]))
        try:
            scores = await asyncio.wrap_future(queue.submit(inputs))
        except Stopping as err:
            return JSONResponse(error_body(str(err)), status_code=503)
        except Exception as err:  # noqa: BLE001  (the scorer's failure, see run_scorer)
            return JSONResponse(error_body(str(err)), status_code=500)
        return JSONResponse(response_body(scores))

    async def health(request):
        return JSONResponse({"status": "ok", "schema": SCHEMA, "max_batch": queue.max_batch, **(info or {})})

    return Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/health", health, methods=["GET"])])


class HttpThread:
    """uvicorn serving `app` on host:port (0: a free port, then `.port`) in a daemon thread.
    uvicorn installs no signal handlers off the main thread: the caller's own decide."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.host = host
        self._socket = _bind(host, port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="reward-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/score"

    def start(self, timeout_s: float = 30.0) -> "HttpThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the reward server's HTTP front on {self.host}:{self.port} did not start "
                                   "(its error is above)")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say TCP, and
    # with Nagle on every small answer waits ~40 ms for a delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        from megatron_rlhf.config import ConfigError

        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({err}); choose another --port "
                          "(0 picks a free one)") from None
    return sock


@contextmanager
def serving(scorer: Scorer, *, host: str = "127.0.0.1", port: int = 0, max_batch: int = 64,
            max_wait_ms: float = 5.0, prepare: Prepare | None = None, info: dict | None = None) -> Iterator[str]:
    """A reward server scoring with `scorer` in this process (HTTP and scoring threads):
    yields its /score URL. For pure-Python scorers, tests and benchmarks."""
    queue, stop = BatchQueue(max_batch, max_wait_ms / 1000), threading.Event()
    http = HttpThread(build_app(queue, prepare, info), host, port).start()
    loop = threading.Thread(target=serve_loop, args=(scorer, max_batch, stop, queue), name="reward-scoring",
                            daemon=True)
    loop.start()
    try:
        yield http.url
    finally:
        stop.set()
        queue.close()
        loop.join(timeout=10)
        http.stop()


# ----------------------------------------------------------------------------- the reward model


class RewardModelScorer:
    """Our reward model behind the schema: `prepare` (rank 0, per request) checks ids and
    lengths against the model and tokenizes text-only samples; calling it (every rank,
    together) scores a batch with the model's forward."""

    def __init__(self, reward_model, tokenizer, max_seq_length: int, micro_batch_size: int):
        self.reward_model, self.tokenizer = reward_model, tokenizer
        self.max_seq_length, self.micro_batch_size = max_seq_length, micro_batch_size

    def prepare(self, inputs: RewardInputs) -> RewardInputs:
        prompt_ids, response_ids = [], []
        for index in range(len(inputs)):
            p, r = self._ids(inputs, index)
            prompt_ids.append(p)
            response_ids.append(r)
        return RewardInputs(inputs.prompts, inputs.responses, prompt_ids, response_ids, inputs.finished, inputs.extras)

    def _ids(self, inputs: RewardInputs, index: int) -> tuple[list[int], list[int]]:
        p, r = inputs.prompt_ids[index], inputs.response_ids[index]
        if not p and not r:  # text only: our sequence convention, prompt + response + EOS (data/encode.py)
            p, r = self.tokenizer.encode(inputs.prompts[index]), self.tokenizer.encode(inputs.responses[index])
            r = [*r, self.tokenizer.eos_id]
            if not p and len(r) == 1:
                raise SchemaError(f"sample {index}: empty: no ids, and 'prompt' and 'response' encode to no tokens")
        vocab = self.tokenizer.vocab_size
        for name, ids in (("prompt_ids", p), ("response_ids", r)):
            if bad := next(((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab), None):
                raise SchemaError(f"sample {index}: '{name}'[{bad[0]}]={bad[1]} is outside the reward model's "
                                  f"vocabulary [0, {vocab}); send ids of the reward model's tokenizer, or only text")
        if len(p) + len(r) > self.max_seq_length:
            raise SchemaError(f"sample {index}: {len(p)} prompt + {len(r)} response tokens = {len(p) + len(r)}, more "
                              f"than the reward model's model.max_seq_length={self.max_seq_length}; shorten it")
        return list(p), list(r)

    def __call__(self, batch: RewardInputs) -> list[float]:
        import torch

        from megatron_rlhf.models.batching import padded_forward

        sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
        lengths = torch.tensor([len(s) for s in sequences])
        tokens = torch.full((len(sequences), int(lengths.max())), self.tokenizer.pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tokens[row, : len(sequence)] = torch.tensor(sequence)
        rewards = padded_forward(self.reward_model, {"tokens": tokens, "lengths": lengths}, self.micro_batch_size)
        return rewards["rewards"].float().cpu().tolist()

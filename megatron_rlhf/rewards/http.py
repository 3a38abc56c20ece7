"""A remote reward service as a reward source: the wire schema and the client.

The RL stage posts each iteration's responses to a scoring endpoint (e.g. our own
`python -m megatron_rlhf serve-reward`, megatron_rlhf/rewards/server.py) and gets one score per
response. The schema, version "megatron_rlhf.reward.v1" (docs/reward_service.md):

    POST <url>   {"schema": "megatron_rlhf.reward.v1",
                  "samples": [{"prompt": str, "response": str, "prompt_ids": [int], "response_ids": [int],
                               "finished": bool, "extra": {...}}, ...]}
    200          {"schema": "megatron_rlhf.reward.v1", "scores": [float, ...]}   one finite number per
                                                                                sample, in order
    4xx          {"error": "..."}   the request is wrong (retrying cannot help)
    5xx / 429    server trouble or overload (retried)

Client and server share the builders and validators here, so both read the schema the same way.

The client splits a batch into requests of at most `batch_size` samples, keeps at most
`max_concurrency` in flight on one pooled connection set, and retries transport failures,
timeouts, 429 and 5xx with exponential backoff. A request's whole answer must arrive within
timeout_s of its start (rewards/deadline.py: a server trickling it byte by byte times out too). An answer that is wrong (not the schema, the
wrong count, a NaN) is never retried or patched: a server that answers wrongly must not feed
the policy, so it stops the stage with a RewardSourceError at once.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import httpx

from megatron_rlhf.rewards.base import RewardInputs, RewardSourceError, finite_scores
from megatron_rlhf.rewards.deadline import deadline, deadline_client

SCHEMA = "megatron_rlhf.reward.v1"
# A sample's required fields; the others default to empty: without ids a server tokenizes the text.
REQUIRED = ("prompt", "response", "finished")


class SchemaError(ValueError):
    """A request or an answer that does not follow the schema; the message names the place
    (sample index and field, or score index) and the problem."""


# ----------------------------------------------------------------------------- requests


def request_body(inputs: RewardInputs) -> dict[str, Any]:
    """The JSON body scoring `inputs`, one sample per row in order."""
    return {"schema": SCHEMA, "samples": [
        {"prompt": prompt, "response": response, "prompt_ids": [int(t) for t in p_ids],
         "response_ids": [int(t) for t in r_ids], "finished": bool(finished), "extra": extra}
        for prompt, response, p_ids, r_ids, finished, extra in zip(
            inputs.prompts, inputs.responses, inputs.prompt_ids, inputs.response_ids, inputs.finished, inputs.extras)
    ]}


def parse_request(body: Any) -> RewardInputs:
    """A request body -> RewardInputs; SchemaError naming the sample index and field."""
    if not isinstance(body, dict):
        raise SchemaError(f"the body is a JSON {_json_type(body)}; expected an object with 'schema' and 'samples'")
    _check_schema_tag(body)
    samples = body.get("samples")
    if not isinstance(samples, list):
        raise SchemaError(f"'samples': expected a list of sample objects, got {_json_type(samples)}")
    rows = [_parse_sample(sample, index) for index, sample in enumerate(samples)]
    return RewardInputs(*(list(column) for column in zip(*rows))) if rows else RewardInputs([], [], [], [], [])


def _parse_sample(sample: Any, index: int) -> tuple:
    where = f"sample {index}"
    if not isinstance(sample, dict):
        raise SchemaError(f"{where}: expected an object, got {_json_type(sample)}")
    if missing := [name for name in REQUIRED if name not in sample]:
        raise SchemaError(f"{where}: missing {', '.join(repr(m) for m in missing)}")
    fields = {"prompt_ids": [], "response_ids": [], "extra": {}, **sample}
    for name in ("prompt", "response"):
        if not isinstance(fields[name], str):
            raise SchemaError(f"{where}: '{name}' must be a string, got {_json_type(fields[name])}")
    for name in ("prompt_ids", "response_ids"):
        _check_ids(fields[name], f"{where}: '{name}'")
    if not isinstance(fields["finished"], bool):
        raise SchemaError(f"{where}: 'finished' must be true or false, got {_json_type(fields['finished'])}")
    if not isinstance(fields["extra"], dict):
        raise SchemaError(f"{where}: 'extra' must be an object, got {_json_type(fields['extra'])}")
    return (fields["prompt"], fields["response"], fields["prompt_ids"], fields["response_ids"],
            fields["finished"], fields["extra"])


def _check_ids(ids: Any, where: str) -> None:
    if not isinstance(ids, list):
        raise SchemaError(f"{where} must be a list of token ids, got {_json_type(ids)}")
    for position, token in enumerate(ids):
        if type(token) is not int:  # bool is an int subclass, and 3.0 is not a token id
            raise SchemaError(f"{where}[{position}]={token!r}: a token id must be an integer, got {_json_type(token)}")


# ----------------------------------------------------------------------------- answers


def response_body(scores: list[float]) -> dict[str, Any]:
    return {"schema": SCHEMA, "scores": [float(s) for s in scores]}


def error_body(message: str) -> dict[str, str]:
    return {"error": message}


def parse_scores(body: Any, expected: int) -> list[float]:
    """An answer body -> `expected` finite floats; SchemaError naming the problem."""
    if not isinstance(body, dict):
        raise SchemaError(f"the answer is a JSON {_json_type(body)}, not an object with 'schema' and 'scores'")
    _check_schema_tag(body)
    scores = body.get("scores")
    if not isinstance(scores, list):
        raise SchemaError(f"the answer has no 'scores' list (got {_json_type(scores)})")
    try:
        return finite_scores(scores, expected)
    except ValueError as err:
        raise SchemaError(str(err)) from None


def _check_schema_tag(body: dict) -> None:
    if body.get("schema") != SCHEMA:
        raise SchemaError(f"'schema' is {body.get('schema')!r}; expected {SCHEMA!r} (docs/reward_service.md)")


def _json_type(value: Any) -> str:
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object",
             type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ----------------------------------------------------------------------------- the client

# Failures another attempt may fix: the service is restarting, overloaded or slow.
RETRIED_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)


class _Aborted(Exception):
    """Another request of the same batch failed; this one stops retrying."""


class HttpRewardClient:
    """Scores RewardInputs with a remote reward service (schema above). One client per
    data-parallel replica; `score` is called from one thread at a time."""

    def __init__(self, url: str, *, name: str = "http", timeout_s: float = 30.0, max_retries: int = 4,
                 backoff_s: float = 0.5, max_backoff_s: float = 8.0, batch_size: int = 64, max_concurrency: int = 4):
        _check_args(url, timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                    max_backoff_s=max_backoff_s, batch_size=batch_size, max_concurrency=max_concurrency)
        self.url, self.name = url, name
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.batch_size, self.max_concurrency = batch_size, max_concurrency
        self.where = f"reward source {name!r} (POST {url})"
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = deadline_client(timeout_s, limits)  # a request's whole answer within timeout_s
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix=f"reward-{name}")
        # Private: the trainer's global RNG streams (random, numpy, torch) must not move, or a
        # resumed run would sample differently from an uninterrupted one.
        self._jitter = random.Random()
        self._lock = threading.Lock()
        self._stats = _fresh_stats()

    # --- public
    def score(self, inputs: RewardInputs) -> list[float]:
        """One finite score per row of `inputs`, in order; RewardSourceError on any failure."""
        started = time.monotonic()
        try:
            return self._score_all(inputs)
        except RewardSourceError:
            raise
        except Exception as err:  # the trainer stops cleanly on RewardSourceError only (every rank)
            raise RewardSourceError(f"{self.where}: {type(err).__name__}: {err}") from err
        finally:
            with self._lock:
                self._stats["seconds"] += time.monotonic() - started

    def pop_stats(self) -> dict[str, float]:
        """Since the last call: HTTP requests sent (every attempt), retries, their latency mean
        and max (seconds), and the wall time spent in `score`."""
        with self._lock:
            stats, self._stats = self._stats, _fresh_stats()
        latencies = stats.pop("latencies")
        return {**stats, "latency_mean_seconds": sum(latencies) / len(latencies) if latencies else 0.0,
                "latency_max_seconds": max(latencies, default=0.0)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> "HttpRewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- one batch
    def _score_all(self, inputs: RewardInputs) -> list[float]:
        chunks = [inputs.rows(start, start + self.batch_size) for start in range(0, len(inputs), self.batch_size)]
        abort = threading.Event()
        futures = [self._pool.submit(self._score_chunk, chunk, abort) for chunk in chunks]
        try:  # a signal's StageInterrupted ends the wait at once (resilience/preemption.py)
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:
            abort.set()  # the requests in flight stop retrying; those not started never start
            for future in futures:
                future.cancel()
            raise
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            abort.set()  # the batch is lost: stop the others' retries instead of waiting them out
            for future in futures:
                future.cancel()
            raise _first_real(failed)
        return [score for future in futures for score in future.result()]

    def _score_chunk(self, chunk: RewardInputs, abort: threading.Event) -> list[float]:
        body = json.dumps(request_body(chunk)).encode()
        started, last = time.monotonic(), None
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._count(retries=1)
                if abort.wait(self._backoff(attempt - 1)):
                    raise _Aborted()
            try:
                response = self._post(body)
            except RETRIED_ERRORS as err:
                last = _describe_transport_error(err, self.timeout_s)
                continue
            except httpx.HTTPError as err:  # e.g. an unsupported URL: no attempt can succeed
                raise RewardSourceError(f"{self.where}: {type(err).__name__}: {err}; check the url") from None
            if response.status_code == 429 or response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_error_text(response)}"
                continue
            return self._scores_from(response, len(chunk))
        raise RewardSourceError(
            f"{self.where}: no valid answer after {self.max_retries + 1} attempts in "
            f"{time.monotonic() - started:.1f} s; last failure: {last}. Is the service running and reachable "
            "from this host (python -m megatron_rlhf serve-reward, docs/reward_service.md)? If it is only slow "
            "or restarting, raise the source's timeout_s or max_retries")

    def _post(self, body: bytes) -> httpx.Response:
        sent = time.monotonic()
        try:
            with deadline(self.timeout_s):
                return self._http.post(self.url, content=body, headers={"content-type": "application/json"})
        finally:
            self._count(requests=1, latency=time.monotonic() - sent)

    def _scores_from(self, response: httpx.Response, expected: int) -> list[float]:
        if response.status_code != 200:  # a refusal (4xx): the same request would be refused again
            raise RewardSourceError(f"{self.where}: HTTP {response.status_code}: {_error_text(response)}; the service "
                                    "refused the request (not retried): fix what it names")
        try:
            return parse_scores(response.json(), expected)
        except ValueError as err:  # JSONDecodeError is a ValueError too
            problem = err if isinstance(err, SchemaError) else f"the answer is not JSON ({err}): {response.text[:200]!r}"
            raise RewardSourceError(f"{self.where}: {problem}; the service does not answer with schema {SCHEMA} "
                                    "(docs/reward_service.md); not retried: fix the service") from None

    def _backoff(self, retry: int) -> float:
        """Exponential, capped; jittered to 50-100% so replicas that failed together do not
        retry together."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** retry) * (0.5 + 0.5 * self._jitter.random())

    def _count(self, requests: int = 0, retries: int = 0, latency: float | None = None) -> None:
        with self._lock:
            self._stats["requests"] += requests
            self._stats["retries"] += retries
            if latency is not None:
                self._stats["latencies"].append(latency)


def _fresh_stats() -> dict:
    return {"requests": 0, "retries": 0, "seconds": 0.0, "latencies": []}


def _first_real(failed: list) -> BaseException:
    """The failure to report: a request's own error, not another's abort."""
    errors = [f.exception() for f in failed]
    return next((e for e in errors if not isinstance(e, _Aborted)), errors[0])


def _check_args(url: str, **values: float) -> None:
    try:
        parsed = httpx.URL(url)
    except (TypeError, httpx.InvalidURL):
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"url={url!r}: give the scoring endpoint, e.g. http://127.0.0.1:8000/score")
    rules = {"timeout_s": (lambda v: v > 0, "> 0"), "max_retries": (lambda v: v >= 0, ">= 0"),
             "backoff_s": (lambda v: v >= 0, ">= 0"), "max_backoff_s": (lambda v: v >= values["backoff_s"], ">= backoff_s"),
             "batch_size": (lambda v: v >= 1, ">= 1"), "max_concurrency": (lambda v: v >= 1, ">= 1")}
    for name, (ok, rule) in rules.items():
        if not ok(values[name]):
            raise ValueError(f"{name}={values[name]!r}: must be {rule}")


def _describe_transport_error(err: Exception, timeout_s: float) -> str:
    text = f"{type(err).__name__}: {err}"
    if isinstance(err, httpx.TimeoutException):
        text += f" (no answer within timeout_s={timeout_s} s)"
    return text


def _error_text(response: httpx.Response) -> str:
    """The server's own words: its {"error": ...} when it sent one, else the start of the body."""
    try:
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), str):
            return body["error"]
    except ValueError:
        pass
    return response.text[:200] or "(empty body)"

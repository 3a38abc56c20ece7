"""An environment service over HTTP: the wire schema and the client (rl.environment.type=http).

Schema "megatron_rlhf.env.v1" (docs/environments.md), three POST endpoints under the base URL:

    POST <url>/reset  {"schema": ..., "record": {"prompt": str, ...the prompt record's other fields}}
    200               {"schema": ..., "episode_id": str, "observation": str | [int] | null}

    POST <url>/step   {"schema": ..., "episode_id": str, "action": str, "action_ids": [int]}
    200               {"schema": ..., "observation": str | [int] | null, "done": bool,
                       "reward": float | null, "info": {...}, "tool_calls": [{"name": str, "arguments": {...}}],
                       "tool_errors": [str]}        (info, tool_calls, tool_errors optional)

    POST <url>/close  {"schema": ..., "episode_id": str}     (best effort; a server also drops an
    200               {"schema": ...}                          episode once it is done or failed)

    200 {"schema": ..., "failure": {"reason": "raised" | "timed_out" | "invalid_output", "detail": str}}
        to /reset or /step: the environment failed this episode (a tool raised, ...).
    429 / 503  the server did not act on the request (overloaded, starting, stopping): retried.
    other 4xx / 5xx  the episode fails (a step is not idempotent, so it is never sent twice).

Client and server (envs/server.py) share the builders and validators here, and reuse the reward
service's (rewards/http.py): SchemaError, the JSON type names, the server's error text.

Failures, and what each does: a refused connection or a 429 / 503 is retried max_retries times
with exponential backoff, then raises EnvironmentServiceDown (the stage stops cleanly, as for a
reward service that is down); no whole answer within step_timeout_s of the request's start (a
deadline per request, however slowly the server trickles it: rewards/deadline.py) ends the
episode TIMED_OUT; an answer that is not the schema ends it INVALID_OUTPUT; an in-band failure
or any other HTTP error ends it with the failure's reason (RAISED for an HTTP error). Episode
failures count toward rl.max_failed_episodes.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx

from megatron_rlhf.envs.base import (
    FAILURE_REASONS, INVALID_OUTPUT, RAISED, TIMED_OUT, Environment, EnvironmentServiceDown, EnvStart, EpisodeFailed,
    StepResult,
)
from megatron_rlhf.envs.tools import ToolCall
from megatron_rlhf.rewards.deadline import deadline, deadline_client
from megatron_rlhf.rewards.http import SchemaError, _check_ids, _error_text, _json_type

SCHEMA = "megatron_rlhf.env.v1"
ENDPOINTS = ("reset", "step", "close")
# The request never reached the server: sending it again cannot run a step twice.
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# The server says it did not act on the request.
NOT_ACTED_STATUSES = (429, 503)


# ----------------------------------------------------------------------------- requests


def reset_request(record: dict[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "record": record}


def step_request(episode_id: str, action: str, action_ids: list[int]) -> dict[str, Any]:
    return {"schema": SCHEMA, "episode_id": episode_id, "action": action, "action_ids": [int(t) for t in action_ids]}


def close_request(episode_id: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "episode_id": episode_id}


def parse_reset_request(body: Any) -> dict[str, Any]:
    """A /reset body -> the prompt record; SchemaError naming the problem."""
    _check_object(body, "schema', 'record")
    record = body.get("record")
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise SchemaError(f"'record': expected an object with a 'prompt' string, got {_json_type(record)}")
    return record


def parse_step_request(body: Any) -> tuple[str, str, list[int]]:
    """A /step body -> (episode_id, action, action_ids)."""
    episode_id = _episode_id(body)
    if not isinstance(body.get("action"), str):
        raise SchemaError(f"'action' must be a string, got {_json_type(body.get('action'))}")
    _check_ids(body.get("action_ids"), "'action_ids'")
    return episode_id, body["action"], body["action_ids"]


def parse_close_request(body: Any) -> str:
    return _episode_id(body)


def _episode_id(body: Any) -> str:
    _check_object(body, "schema', 'episode_id")
    if not isinstance(body.get("episode_id"), str) or not body["episode_id"]:
        raise SchemaError(f"'episode_id' must be a non-empty string, got {_json_type(body.get('episode_id'))}")
    return body["episode_id"]


# ----------------------------------------------------------------------------- answers


def reset_answer(episode_id: str, start: EnvStart) -> dict[str, Any]:
    return {"schema": SCHEMA, "episode_id": episode_id, "observation": start.observation}


def step_answer(result: StepResult) -> dict[str, Any]:
    return {"schema": SCHEMA, "observation": result.observation, "done": result.done,
            "reward": None if result.reward is None else float(result.reward), "info": result.info,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in result.tool_calls],
            "tool_errors": list(result.tool_errors)}


def failure_answer(reason: str, detail: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "failure": {"reason": reason, "detail": detail}}


def parse_reset_answer(body: Any) -> tuple[str, EnvStart]:
    """A /reset answer -> (episode_id, EnvStart); EpisodeFailed for an in-band failure."""
    _check_answer(body)
    return _episode_id(body), EnvStart(_observation(body))


def parse_step_answer(body: Any) -> StepResult:
    """A /step answer -> StepResult (its values are checked by the episode runner)."""
    _check_answer(body)
    if not isinstance(body.get("done"), bool):
        raise SchemaError(f"'done' must be true or false, got {_json_type(body.get('done'))}")
    info, calls, errors = body.get("info", {}), body.get("tool_calls", []), body.get("tool_errors", [])
    if not isinstance(info, dict):
        raise SchemaError(f"'info' must be an object, got {_json_type(info)}")
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                              and isinstance(c.get("arguments", {}), dict) for c in calls):
        raise SchemaError("'tool_calls' must be a list of {\"name\": str, \"arguments\": {...}}")
    if not isinstance(errors, list) or not all(isinstance(e, str) for e in errors):
        raise SchemaError("'tool_errors' must be a list of strings")
    return StepResult(_observation(body), body["done"], body.get("reward"), info,
                      [ToolCall(c["name"], c.get("arguments", {})) for c in calls], errors)


def _check_answer(body: Any) -> None:
    _check_object(body, "schema', ...")
    failure = body.get("failure")
    if failure is not None:
        if not isinstance(failure, dict) or failure.get("reason") not in FAILURE_REASONS:
            raise SchemaError(f"'failure' must be {{\"reason\": one of {FAILURE_REASONS}, \"detail\": str}}, "
                              f"got {failure!r:.200}")
        raise EpisodeFailed(failure["reason"], f"the service: {failure.get('detail', '')}")


def _observation(body: dict) -> Any:
    observation = body.get("observation")
    if observation is not None and not isinstance(observation, (str, list)):
        raise SchemaError(f"'observation' must be a string, a list of token ids or null, got {_json_type(observation)}")
    return observation


def _check_object(body: Any, expected: str) -> None:
    if not isinstance(body, dict):
        raise SchemaError(f"the body is a JSON {_json_type(body)}; expected an object with '{expected}'")
    if body.get("schema") != SCHEMA:
        raise SchemaError(f"'schema' is {body.get('schema')!r}; expected {SCHEMA!r} (docs/environments.md)")


# ----------------------------------------------------------------------------- the client


class HttpEnvironmentService:
    """The client side of an environment service: an EnvironmentFactory (calling it gives one
    episode's HttpEnvironment), all episodes sharing one pooled connection set. The episode
    runner steps up to `max_connections` episodes at once (thread_safe, concurrency); each
    request ends within step_timeout_s of its start, however slowly the server trickles its
    answer (rewards/deadline.py), so the runner does not time the calls itself (self_timed)."""

    thread_safe, self_timed = True, True

    def __init__(self, url: str, *, step_timeout_s: float = 30.0, max_retries: int = 4, backoff_s: float = 0.5,
                 max_backoff_s: float = 8.0, max_connections: int = 16):
        parsed = httpx.URL(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"url={url!r}: give the environment service's base URL, e.g. http://127.0.0.1:8100")
        if step_timeout_s <= 0 or max_retries < 0 or not 0 <= backoff_s <= max_backoff_s:
            raise ValueError(f"step_timeout_s={step_timeout_s}, max_retries={max_retries}, backoff_s={backoff_s}, "
                             f"max_backoff_s={max_backoff_s}: need > 0, >= 0 and 0 <= backoff_s <= max_backoff_s")
        self.url = url.rstrip("/")
        self.step_timeout_s, self.max_retries = step_timeout_s, max_retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = deadline_client(step_timeout_s, limits)  # a request's whole answer within step_timeout_s
        self.concurrency = max_connections  # the episode runner's pool: one call per connection
        # Private: the trainer's global RNG streams must not move (exact resume).
        self._jitter = random.Random()
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0}

    def __call__(self) -> "HttpEnvironment":
        return HttpEnvironment(self)

    def post(self, endpoint: str, body: dict[str, Any], retries: bool = True) -> Any:
        """The JSON answer of POST <url>/<endpoint>; EpisodeFailed or EnvironmentServiceDown as
        the module docstring says (`retries` False: one attempt)."""
        where = f"environment service POST {self.url}/{endpoint}"
        content, started, last = json.dumps(body).encode(), time.monotonic(), ""
        attempts = self.max_retries + 1 if retries else 1
        for attempt in range(attempts):
            if attempt:
                self._count(retries=1)
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * (0.5 + 0.5 * self._jitter.random()))
            self._count(requests=1)
            try:
                with deadline(self.step_timeout_s):
                    response = self._http.post(f"{self.url}/{endpoint}", content=content,
                                               headers={"content-type": "application/json"})
            except NOT_SENT_ERRORS as err:
                last = f"{type(err).__name__}: {err}"
                continue
            except httpx.TimeoutException:
                raise EpisodeFailed(TIMED_OUT, f"{where}: no answer within rl.environment.step_timeout_s="
                                    f"{self.step_timeout_s} s") from None
            except httpx.HTTPError as err:  # e.g. the server closed the connection mid-step
                raise EpisodeFailed(RAISED, f"{where}: {type(err).__name__}: {err}") from None
            if response.status_code in NOT_ACTED_STATUSES:
                last = f"HTTP {response.status_code}: {_error_text(response)}"
                continue
            if response.status_code != 200:
                raise EpisodeFailed(RAISED, f"{where}: HTTP {response.status_code}: {_error_text(response)}")
            try:
                return response.json()
            except ValueError as err:
                raise EpisodeFailed(INVALID_OUTPUT, f"{where}: the answer is not JSON ({err}): "
                                    f"{response.text[:200]!r}") from None
        raise EnvironmentServiceDown(
            f"{where}: no answer after {attempts} attempts in {time.monotonic() - started:.1f} s; last "
            f"failure: {last}. Is the service running and reachable from this host (rl.environment.url)? If it is "
            "only restarting, raise rl.environment.max_retries or rl.environment.backoff_s")

    def pop_stats(self) -> dict[str, float]:
        """Requests sent (every attempt) and retries since the last call."""
        with self._lock:
            stats, self._stats = self._stats, {"requests": 0, "retries": 0}
        return stats

    def close(self) -> None:
        self._http.close()

    def _count(self, requests: int = 0, retries: int = 0) -> None:
        with self._lock:
            self._stats["requests"] += requests
            self._stats["retries"] += retries


class HttpEnvironment(Environment):
    """One episode on an environment service."""

    self_timed = True  # each request has its deadline (step_timeout_s); a service down must not look like a timeout

    def __init__(self, service: HttpEnvironmentService):
        self.service = service
        self.episode_id: str | None = None

    def reset(self, record: dict[str, Any]) -> EnvStart:
        self.episode_id, start = _parsed(parse_reset_answer, self.service.post("reset", reset_request(record)))
        return start

    def step(self, action_text: str, action_ids: list[int]) -> StepResult:
        result = _parsed(parse_step_answer, self.service.post("step", step_request(self.episode_id, action_text,
                                                                                    action_ids)))
        if result.done:  # the server has forgotten it: nothing to close
            self.episode_id = None
        return result

    def close(self) -> None:
        if self.episode_id is not None:
            try:  # one attempt: the server forgets ended episodes itself
                self.service.post("close", close_request(self.episode_id), retries=False)
            except (EpisodeFailed, EnvironmentServiceDown):
                pass


def _parsed(parse, body: Any) -> Any:
    try:
        return parse(body)
    except SchemaError as err:
        raise EpisodeFailed(INVALID_OUTPUT, f"the service does not answer with schema {SCHEMA}: {err}") from None

"""Any Environment class behind the HTTP schema (envs/http.py): for tests, demos, and as a
starting point for a real service.

    with serving_environment(CalculatorEnv) as url:     # url: http://127.0.0.1:<free port>
        ...rl.environment.type=http rl.environment.url=<url>

Each /reset makes a fresh environment with `factory()` under a new episode id; /step runs the
episode's environment in a worker thread (so a slow step does not hold up other episodes);
the server forgets an episode once it is done, failed or closed. What the environment raises
is answered in-band as a failure (RAISED, or the EpisodeFailed's own reason), never as a crash.
The HTTP front is the reward server's (rewards/server.py HttpThread: uvicorn in a thread).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron_rlhf.envs.base import INVALID_OUTPUT, RAISED, EnvironmentFactory, EnvStart, EpisodeFailed, check_step_result
from megatron_rlhf.envs.http import (
    SCHEMA, SchemaError, failure_answer, parse_close_request, parse_reset_request, parse_step_request, reset_answer,
    step_answer,
)
from megatron_rlhf.rewards.http import error_body
from megatron_rlhf.rewards.server import HttpThread


class UnknownEpisode(LookupError):
    """An episode id the server does not run (answered 404)."""


class Episodes:
    """The running episodes' environments by id (the HTTP front's threads share it)."""

    def __init__(self, factory: EnvironmentFactory):
        self.factory = factory
        self._running: dict[str, Any] = {}
        self._lock = threading.Lock()

    def reset(self, record: dict[str, Any]) -> dict[str, Any]:
        environment = self.factory()
        start = environment.reset(record)
        if not isinstance(start, EnvStart):
            raise EpisodeFailed(INVALID_OUTPUT, f"reset returned {type(start).__name__}, not an EnvStart")
        episode_id = uuid.uuid4().hex
        with self._lock:
            self._running[episode_id] = environment
        return reset_answer(episode_id, start)

    def step(self, episode_id: str, action: str, action_ids: list[int]) -> dict[str, Any]:
        environment = self.get(episode_id)
        try:
            result = check_step_result(environment.step(action, action_ids), None)
        except BaseException:  # re-raised: the episode is over, whatever ended it
            self.close(episode_id)
            raise
        if result.done:
            self.close(episode_id)
        return step_answer(result)

    def get(self, episode_id: str):
        with self._lock:
            environment = self._running.get(episode_id)
        if environment is None:
            raise UnknownEpisode(f"no running episode {episode_id!r} (it ended, or the server restarted)")
        return environment

    def close(self, episode_id: str) -> None:
        with self._lock:
            environment = self._running.pop(episode_id, None)
        if environment is not None:
            environment.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._running)


def _user_code(act: Callable[..., dict], *args) -> dict:
    """act(*args) in the request's worker thread: a BaseException the environment's code raises
    (SystemExit from an argparse-based tool, KeyboardInterrupt) fails the episode, as an
    Exception does; it must not reach the server's event loop."""
    try:
        return act(*args)
    except Exception:
        raise
    except BaseException as err:  # noqa: BLE001  (the environment's code, in this worker thread)
        return failure_answer(RAISED, f"{type(err).__name__}: {err}")


def build_app(episodes: Episodes):
    """POST /reset, /step, /close (the schema) and GET /health."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def endpoint(parse: Callable[[Any], Any], act: Callable[..., dict]):
        async def handle(request):
            try:
                body = await request.json()
            except ValueError as err:  # not JSON (or not UTF-8)
                return JSONResponse(error_body(f"the body is not JSON: {err}"), status_code=400)
            try:
                parsed = parse(body)
            except SchemaError as err:
                return JSONResponse(error_body(str(err)), status_code=400)
            args = parsed if isinstance(parsed, tuple) else (parsed,)
            try:
                return JSONResponse(await asyncio.to_thread(_user_code, act, *args))
            except UnknownEpisode as err:
                return JSONResponse(error_body(err.args[0]), status_code=404)
            except EpisodeFailed as failed:
                return JSONResponse(failure_answer(failed.reason, failed.detail))
            except Exception as err:  # noqa: BLE001  (the environment's code: this episode fails, not the server)
                return JSONResponse(failure_answer(RAISED, f"{type(err).__name__}: {err}"))
        return handle

    def close(episode_id: str) -> dict[str, Any]:
        episodes.close(episode_id)
        return {"schema": SCHEMA}

    async def health(request):
        return JSONResponse({"status": "ok", "schema": SCHEMA, "episodes": len(episodes)})

    return Starlette(routes=[
        Route("/reset", endpoint(parse_reset_request, episodes.reset), methods=["POST"]),
        Route("/step", endpoint(parse_step_request, episodes.step), methods=["POST"]),
        Route("/close", endpoint(parse_close_request, close), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ])


@contextmanager
def serving_environment(factory: EnvironmentFactory, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """An environment service for `factory`'s environments in this process; yields its base URL."""
    http = HttpThread(build_app(Episodes(factory)), host, port).start()
    try:
        yield f"http://{host}:{http.port}"
    finally:
        http.stop()

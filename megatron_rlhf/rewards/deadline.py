"""An overall deadline per HTTP request, for the reward service client and the environment
service client: httpx's timeouts bound each socket operation (a connect, one read), so a server
that trickles its answer one byte a second never trips them.

    client = deadline_client(timeout_s, limits)
    with deadline(timeout_s):
        response = client.post(...)      # every socket operation ends by timeout_s after `with`

Within `deadline(seconds)`, each operation of the client's connections in this thread (connect,
TLS handshake, read, write) waits at most until the deadline: past it, httpx raises its usual
timeout errors (httpx.ConnectTimeout, ReadTimeout, WriteTimeout: httpx.TimeoutException). The
wait for a pooled connection is bounded by the client's pool timeout (timeout_s too), so a
request ends within timeout_s of its start, plus one scheduling slice (tests/test_envs.py and
tests/test_reward_http.py drill it against a server that trickles its answer).

How: the client's connection pools get a network backend whose streams cap every operation's
timeout at the deadline left (httpcore's NetworkBackend interface; the deadline is per thread,
so concurrent requests on one client each keep their own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpcore
import httpx

_local = threading.local()


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Requests in this thread end within `seconds` from here (see the module docstring)."""
    outer = getattr(_local, "deadline", None)
    _local.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        _local.deadline = outer


def deadline_client(timeout_s: float, limits: httpx.Limits) -> httpx.Client:
    """An httpx.Client (per-operation timeout `timeout_s`, `limits`; proxies from the environment
    as httpx reads them) whose requests honour `deadline`."""
    client = httpx.Client(timeout=timeout_s, limits=limits)
    transports = [client._transport, *(t for t in client._mounts.values() if t is not None)]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        if pool is None or not hasattr(pool, "_network_backend"):  # httpx's internals moved: say so, never
            # run without the deadline
            raise RuntimeError(f"httpx {httpx.__version__} / httpcore {httpcore.__version__}: no connection pool "
                               "to give a request deadline to (megatron_rlhf/rewards/deadline.py); pin httpx<0.29")
        pool._network_backend = _DeadlineBackend(pool._network_backend)
    return client


def _bounded(timeout: float | None, error: type[Exception]) -> float | None:
    """`timeout` capped at what is left of this thread's deadline; `error` once it has passed."""
    end = getattr(_local, "deadline", None)
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the request's deadline passed (the server answered too slowly)")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname,
                                                      _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str):
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, backend: httpcore.NetworkBackend):
        self._backend = backend

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                                         local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None) -> httpcore.NetworkStream:
        return _DeadlineStream(self._backend.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                                 socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)

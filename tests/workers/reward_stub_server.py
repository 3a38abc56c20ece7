"""A reward service that misbehaves on purpose, for the HTTP reward client's failure drills.

    python tests/workers/reward_stub_server.py --mode MODE [--fail-first K] [--delay-s S] [--port 0]

prints `listening on http://127.0.0.1:PORT/score` once ready, then serves until killed;
`stub_app(mode, ...)` is the same app for an in-process server (server.HttpThread).

Modes: ok (each sample scores extra["score"], else len(response_ids)); http500-then-ok (the
first K requests answer 500); slow (answers after delay-s); malformed-json; wrong-count (one
score short); nan; non-number (a score is a string); bad-schema (another schema tag).
GET /stats: {"requests": n, "batch_sizes": [...]}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path

from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

MODES = ("ok", "http500-then-ok", "slow", "malformed-json", "wrong-count", "nan", "non-number", "bad-schema")


def ok_scores(samples: list[dict]) -> list[float]:
    return [float(s.get("extra", {}).get("score", len(s.get("response_ids", [])))) for s in samples]


def stub_app(mode: str, fail_first: int = 0, delay_s: float = 0.0) -> Starlette:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: choose one of {MODES}")
    seen = {"requests": 0, "batch_sizes": []}
    lock = threading.Lock()

    async def score(request):
        samples = (await request.json())["samples"]
        with lock:
            seen["requests"] += 1
            seen["batch_sizes"].append(len(samples))
            number = seen["requests"]
        scores = ok_scores(samples)
        if mode == "http500-then-ok" and number <= fail_first:
            return JSONResponse({"error": f"stub: failing request {number} of the first {fail_first}"}, status_code=500)
        if mode == "slow":
            await asyncio.sleep(delay_s)
        if mode == "malformed-json":
            return Response('{"schema": "megatron_rlhf.reward.v1", "scores": [1.0,', media_type="application/json")
        if mode == "wrong-count":
            scores = scores[:-1]
        if mode == "nan":  # JSONResponse refuses NaN: write it as Python's json module would
            return Response('{"schema": "megatron_rlhf.reward.v1", "scores": [' +
                            ", ".join(["NaN" if i == 3 else str(s) for i, s in enumerate(scores)]) + "]}",
                            media_type="application/json")
        if mode == "non-number":
            scores = [*scores[:3], "0.5", *scores[4:]]
        schema = "someone.else.v2" if mode == "bad-schema" else "megatron_rlhf.reward.v1"
        return JSONResponse({"schema": schema, "scores": scores})

    async def stats(request):
        with lock:
            return JSONResponse(dict(seen))

    return Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/stats", stats, methods=["GET"])])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: megatron_rlhf without installing
    from megatron_rlhf.rewards.server import HttpThread

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default="ok")
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    http = HttpThread(stub_app(args.mode, args.fail_first, args.delay_s), "127.0.0.1", args.port).start()
    print(f"listening on {http.url}", flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()

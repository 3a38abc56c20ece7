"""The serve-reward command (rewards/server.py has the server): load the reward model of an
RM checkpoint at TP x PP as one replica, put rewards/server.py's HTTP front on rank 0, and run
its loop on every rank until SIGTERM or SIGINT.

    python -m megatron_rlhf.torchrun --nproc-per-node N serve-reward --config RECIPE --ckpt <rm stage or iter_*>
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from megatron_rlhf.rewards.server import BatchQueue, HttpThread, Prepare, RewardModelScorer, build_app, serve_loop


def find_reward_checkpoint(ckpt: str | None) -> Path:
    """--ckpt (an RM stage or iter_* directory, or STAGE_DIR@iter_N) -> the complete iter_* directory
    holding a reward role."""
    from megatron_rlhf.checkpoint.validate import find_checkpoint
    from megatron_rlhf.config import ConfigError

    if not ckpt:
        raise ConfigError("serve-reward: missing --ckpt: give the RM stage directory (e.g. checkpoints/tiny_cpu/rm) "
                          "or one of its iter_* directories")
    try:  # a damaged newest checkpoint is refused (DamagedNewestCheckpoint): an older one only when named
        iter_dir, warnings = find_checkpoint(ckpt, allow_fallback=False)
    except FileNotFoundError as err:
        if type(err) is not FileNotFoundError:  # CheckpointError: damaged checkpoints, reported as such
            raise
        raise ConfigError(f"--ckpt {ckpt}: {err}; give the RM stage directory (e.g. checkpoints/tiny_cpu/rm) "
                          "or one of its iter_* directories") from None
    if _rank() == 0:
        for line in warnings:
            print(f"[serve-reward] warning: {line}", file=sys.stderr, flush=True)
    if not (iter_dir / "reward").is_dir():
        raise ConfigError(f"--ckpt {ckpt}: {iter_dir} holds no reward model (no 'reward' role); give the RM "
                          "stage's checkpoint (python -m megatron_rlhf rm writes <run>/rm)")
    return iter_dir


def use_checkpoint_model_config(cfg, iter_dir: Path, typed_keys: set[str]):
    """(the config with the model section the checkpoint recorded (the recipe's, for checkpoints
    that record none), a note for the console). Architecture fields given as overrides must
    agree with it; other model.* overrides (e.g. params_dtype) apply."""
    from megatron_rlhf.checkpoint.validate import recorded_model_config
    from megatron_rlhf.config import ARCHITECTURE_FIELDS, ConfigError

    recorded = recorded_model_config(iter_dir)
    if recorded is None:
        return cfg, "model config: the recipe's (the checkpoint records none)"
    typed = {key.split(".")[1] for key in typed_keys if key.startswith("model.")}
    if wrong := [f"model.{f}={getattr(cfg.model, f)!r}: the checkpoint recorded {getattr(recorded, f)!r}"
                 for f in ARCHITECTURE_FIELDS if f in typed and getattr(cfg.model, f) != getattr(recorded, f)]:
        raise ConfigError(f"{iter_dir}: the overrides differ from the model the checkpoint recorded:\n  "
                          + "\n  ".join(wrong) + "\nremove them: serve-reward reads the architecture from the checkpoint")
    model = dataclasses.replace(recorded, **{name: getattr(cfg.model, name) for name in typed - set(ARCHITECTURE_FIELDS)})
    return dataclasses.replace(cfg, model=model), f"model config: recorded by {iter_dir}"


def check_one_replica(cfg, world_size: int) -> None:
    from megatron_rlhf.config import ConfigError

    tp, pp = cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel
    if world_size != tp * pp:
        raise ConfigError(
            f"parallel.tensor_parallel={tp} x parallel.pipeline_parallel={pp} = {tp * pp}, but {world_size} processes "
            "were launched: serve-reward runs one model replica (data-parallel size 1); set "
            f"parallel.tensor_parallel / parallel.pipeline_parallel so their product is {world_size}, or launch "
            f"{tp * pp} process(es) (several replicas: one server each, on different ports)")


class StopRequest(threading.Event):
    """Set by SIGTERM or SIGINT; remembers which, for the last line."""

    signal_name = "stopped"


def stop_on_signals() -> StopRequest:
    """A StopRequest set by SIGTERM or SIGINT (main thread only). Rank 0 then tells every rank to stop."""
    stop = StopRequest()

    def on_signal(signum, _frame):
        stop.signal_name = signal.Signals(signum).name
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop


def broadcast_from_rank0(message: Any) -> Any:
    """Rank 0's message on every rank (the world group: TP x PP is the whole world)."""
    import torch.distributed as dist

    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve_reward(cfg, *, ckpt: str | None, host: str, port: int, max_batch: int, max_wait_ms: float,
                 typed_keys: set[str]) -> None:
    """The serve-reward command: load the reward model at TP x PP, serve until SIGTERM/SIGINT."""
    from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
    from megatron_rlhf.checkpoint.dist import load_role
    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.trainers.runner import start_distributed
    from megatron_rlhf.trainers.stage_data import resolve_vocab_size, tokenizer_for

    if max_batch < 1 or max_wait_ms < 0:
        raise ConfigError(f"--max-batch {max_batch} --max-wait-ms {max_wait_ms}: need --max-batch >= 1 and "
                          "--max-wait-ms >= 0")
    iter_dir = find_reward_checkpoint(ckpt)
    cfg, note = use_checkpoint_model_config(cfg, iter_dir, typed_keys)
    tokenizer = tokenizer_for(cfg)
    cfg, _ = resolve_vocab_size(cfg, tokenizer)
    check_one_replica(cfg, parallel.read_dist_env().world_size)
    stop = stop_on_signals()  # before the slow part: a signal while loading still stops cleanly
    env = start_distributed(cfg)

    from megatron_rlhf.models.roles import RewardModel

    reward_model = RewardModel(cfg.model)
    load_role(reward_model, iter_dir / "reward", with_optimizer=False)
    scorer = RewardModelScorer(reward_model, tokenizer, cfg.model.max_seq_length, cfg.rl.micro_batch_size)
    exchange = broadcast_from_rank0 if env.world_size > 1 else (lambda message: message)
    queue = BatchQueue(max_batch, max_wait_ms / 1000) if env.rank == 0 else None
    info = {"checkpoint": str(iter_dir), "tensor_parallel": cfg.parallel.tensor_parallel,
            "pipeline_parallel": cfg.parallel.pipeline_parallel, "max_seq_length": cfg.model.max_seq_length,
            "vocab_size": tokenizer.vocab_size}  # what a client sending ids must stay within
    http = start_front(queue, scorer.prepare, info, host, port)
    if http is not None:
        print(f"[serve-reward] listening on {http.url} (reward model of {iter_dir}, TP{cfg.parallel.tensor_parallel} "
              f"PP{cfg.parallel.pipeline_parallel}, --max-batch {max_batch}, --max-wait-ms {max_wait_ms:g}; {note}; "
              "GET /health; stop: SIGTERM or Ctrl-C)", flush=True)
    try:
        serve_loop(scorer, max_batch, stop, queue, exchange)
    finally:
        if http is not None:
            queue.close()
            http.stop()
    if http is not None:
        print(f"[serve-reward] stopped ({stop.signal_name})", flush=True)


def start_front(queue: BatchQueue | None, prepare: Prepare, info: dict, host: str, port: int) -> HttpThread | None:
    """Collective. The HTTP front on rank 0 (None elsewhere). Its failure (e.g. the port is
    taken) is raised on every rank: the others must not wait for batches that will never come."""
    from megatron_rlhf.parallel.collectives import errors_agreed

    http = None
    with errors_agreed(lambda: RuntimeError("the reward server's HTTP front did not start on rank 0 (see its error)")):
        if queue is not None:
            http = HttpThread(build_app(queue, prepare, info), host, port).start()
    return http


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))

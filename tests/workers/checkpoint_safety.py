"""torchrun worker for tests/test_checkpoint_safety.py: a tiny trainable Actor saved and loaded
through CheckpointManager. Every run trains the same way (seeded init, batch k for step k), so
runs are comparable step by step. --mode:

  train     steps 1..4 with a sync save after each (keep_last=2) into <root>/sync; an async save
            of step 3 into <root>/async followed at once by training step 4 (in place, before
            the save is committed), then wait(); an async save of step 4 committed by poll();
            the actor at step 4 saved by megatron's own code into <root>/megatron_own;
            a load at the same layout (RNG streams restored); async vs sync save with a plain
            (non-distributed) optimizer into <root>/plain_{sync,async}; a NaN weight on rank 1
            -> save() must raise on every rank (sync and async); errors_agreed with an error on
            rank 1 only, plain, wrapped (raise_as) and absent. Results are written, then:
            save step 4 into <root>/kill_sync, train steps 5..6 and save step 6 there (run with
            MEGATRON_RLHF_FAULT=kill@save:6:1: rank 1 dies in that save).
  kill      steps 1..6 with async saves at 4 and 6 into <root>/kill_async (rank 1 dies in the
            commit of 6, under the same fault).
  relayout  (at another layout) load <root>/sync, damaged copies the test prepared and an
            explicit damaged iter dir: record what was chosen, the warnings and the outputs.
            Then resume the killed stages: load, re-save the loaded actor to <root>/<stage>_loaded,
            train steps 5..6 and save step 6 again.
  payloads  (one process, tests/test_safe_loading.py) save a checkpoint into <root>/good and
            load it (RNG streams restored exactly); copies of it with an object whose unpickling
            creates <root>/payload_ran in the trainer state, in the role's .metadata, and in the
            role's common state (inside the .distcp file) must each be refused without running it.
            Then saves into <root>/links with symlinks to <root>/outside planted at the tmp, iter
            and file (latest.tmp) level and as retention debris, and commits of a tmp directory
            holding a symlinked role directory or file: nothing may be written outside.
Results go to <root>/results_<mode>.pt (global rank 0).
"""

import argparse
import json
import os
import pickle
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import save_role
from megatron_rlhf.checkpoint.manager import CheckpointManager
from megatron_rlhf.checkpoint.validate import validate
from megatron_rlhf.config import load_config
from megatron_rlhf.models.roles import Actor, summed
from megatron_rlhf.parallel.collectives import errors_agreed
from megatron_rlhf.trainers.runner import start_distributed
from workers import training_of

BATCH, SEQ, MBS, VOCAB = 4, 16, 2, 100


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(2, VOCAB, (BATCH, SEQ), generator=g),
            "advantages": torch.randn(BATCH, SEQ, generator=g)}


def loss(out, mb):
    return (*summed(-out["logprobs"] * mb["advantages"]), {})


def train(actor, step: int) -> None:
    actor.train_step(batch(step), MBS, loss)  # every DP rank the same batch: DP is 1 here


def params(actor) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in actor.module.named_parameters()}


def save_as_megatron_does(role, path: Path) -> None:
    """The role as megatron-core's own save writes it, without streaming_writer.py and
    live_param_state_at_dp1: its DistributedOptimizer's gathered copies, its writer's up-front
    copies of views. tests/test_checkpoint_safety.py compares the bytes with ours."""
    from megatron.core import dist_checkpointing

    from megatron_rlhf.models.optimizer import OPTIMIZER_CKPT_METADATA

    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    model = role.module.sharded_state_dict()
    optimizer = role.optimizer.sharded_state_dict(model, is_loading=False, metadata=OPTIMIZER_CKPT_METADATA)
    state = {"model": model, "extra": role.extra_state(), "optimizer": optimizer,
             "scheduler": role.scheduler.state_dict()}
    dist_checkpointing.save(state, str(path))


def state(step: int) -> dict:
    return {"step": step}


def tracker_rand():
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        return torch.rand(4)


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def catch(fn):
    """(None, result) or (message, None) on this rank."""
    try:
        return None, fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", None


def mode_train(cfg, overrides: list[str], root: Path, write) -> None:
    actor = Actor(cfg.model, **training_of(cfg))
    roles, res = {"actor": actor}, {}
    sync = CheckpointManager(root / "sync", keep_last=2)
    asy = CheckpointManager(root / "async", keep_last=2, async_save=True)
    for step in (1, 2, 3):
        train(actor, step)
        sync.save(step, roles, state(step))
    asy.save(3, roles, state(3))
    before = params(actor)
    train(actor, 4)  # in place, while checkpoint 3 is being written
    res["moved_while_pending"] = max((p - before[n]).abs().max().item() for n, p in params(actor).items())
    res["committed_before_wait"] = gather((root / "async" / "iter_0000003").exists())
    asy.wait()
    sync.save(4, roles, state(4))
    after_save = torch.rand(4), tracker_rand()  # what the RNG streams give next
    save_as_megatron_does(actor, root / "megatron_own")  # the same state, for the bytes it writes
    asy.save(4, roles, state(4))
    polls = 0
    while asy.latest() is None or asy.latest().name != "iter_0000004":
        polls += 1
        if polls > 1000:
            raise RuntimeError("poll() never committed the async save")
        asy.poll()
        time.sleep(0.02)
    res["polls_to_commit"] = polls
    res["outputs"] = actor.forward(batch(100), MBS)

    # Same layout: the RNG streams continue from where they were at save time.
    loaded = sync.load({"actor": Actor(cfg.model, **training_of(cfg))})
    res["same_layout"] = {"warnings": loaded["checkpoint_warnings"], "checkpoint": loaded["checkpoint"],
                          "rng_restored": gather(all(map(torch.equal, after_save, (torch.rand(4), tracker_rand()))))}

    # A plain (non-distributed) optimizer's state, like everything on CPU, relies on the
    # snapshot the forked writer takes when save() returns.
    plain_cfg = load_config(None, [*overrides, "optimizer.use_distributed_optimizer=false"])
    plain = Actor(plain_cfg.model, **training_of(plain_cfg))
    train(plain, 1)
    CheckpointManager(root / "plain_sync").save(1, {"actor": plain}, state(1))
    plain_async = CheckpointManager(root / "plain_async", async_save=True)
    plain_async.save(1, {"actor": plain}, state(1))
    train(plain, 2)
    plain_async.wait()

    weight = next(actor.module.parameters())
    kept = weight.detach().clone()
    with torch.no_grad():
        if dist.get_rank() == 1:
            weight[0] = float("nan")
    for name, mgr in (("nan_sync", CheckpointManager(root / "nan_sync")),
                      ("nan_async", CheckpointManager(root / "nan_async", async_save=True))):
        res[name] = gather(catch(lambda: mgr.save(5, roles, state(5)))[0])
        mgr.wait()
    with torch.no_grad():
        weight.copy_(kept)

    def fail_on_rank_1(fails=True, raise_as=None):  # the helper every "error on one rank" site uses
        with errors_agreed(lambda: RuntimeError("failed on another rank"), catch=ValueError, raise_as=raise_as):
            if fails and dist.get_rank() == 1:
                raise ValueError("rank 1's own error")
        return "went on"

    res["agreed"] = gather(catch(fail_on_rank_1))
    res["agreed_as"] = gather(catch(lambda: fail_on_rank_1(raise_as=lambda e: LookupError(f"wrapped: {e}"))))
    res["agreed_none"] = gather(catch(lambda: fail_on_rank_1(fails=False)))
    write(res)

    kill = CheckpointManager(root / "kill_sync", keep_last=2)
    kill.save(4, roles, state(4))
    for step in (5, 6):
        train(actor, step)
    kill.save(6, roles, state(6))
    raise AssertionError("the fault did not fire")


def mode_kill(cfg, root: Path) -> None:
    actor = Actor(cfg.model, **training_of(cfg))
    mgr = CheckpointManager(root / "kill_async", keep_last=2, async_save=True)
    for step in range(1, 7):
        train(actor, step)
        if step in (4, 6):
            mgr.save(step, {"actor": actor}, state(step))
        mgr.poll()
    mgr.wait()
    raise AssertionError("the fault did not fire")


def mode_relayout(cfg, root: Path, write) -> None:
    actor = Actor(cfg.model, **training_of(cfg))
    res = {}
    mgr = CheckpointManager(root / "sync")
    loaded = mgr.load({"actor": actor})
    res["sync"] = {"checkpoint": loaded["checkpoint"], "warnings": loaded["checkpoint_warnings"],
                   "step": loaded["step"], "outputs": actor.forward(batch(100), MBS)}
    for name in ("damaged", "bad_latest"):
        loaded = CheckpointManager(root / name).load({"actor": actor})
        res[name] = {"checkpoint": loaded["checkpoint"], "warnings": loaded["checkpoint_warnings"]}
    for name, where in (("explicit_damaged", root / "damaged" / "iter_0000004"), ("all_damaged", root / "all_damaged")):
        res[name] = gather(catch(lambda: mgr.load({"actor": actor}, where))[0])

    for stage in ("kill_sync", "kill_async"):
        actor = Actor(cfg.model, **training_of(cfg))
        mgr = CheckpointManager(root / stage, keep_last=2, async_save=stage == "kill_async")
        loaded = mgr.load({"actor": actor})
        save_role(actor, root / f"{stage}_loaded" / "actor")
        for step in range(loaded["step"] + 1, 7):
            train(actor, step)
        mgr.save(6, {"actor": actor}, state(6))
        mgr.wait()
        res[stage] = {"checkpoint": loaded["checkpoint"], "warnings": loaded["checkpoint_warnings"],
                      "step": loaded["step"]}
    write(res)


class Payload:
    """Unpickling it creates the file `marker`: a stand-in for running any code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def recommit(iter_dir: Path) -> None:
    """Record the files' current sizes in commit.json, as someone tampering with them would."""
    record = json.loads((iter_dir / "commit.json").read_text())
    record["files"] = {rel: (iter_dir / rel).stat().st_size for rel in record["files"]}
    (iter_dir / "commit.json").write_text(json.dumps(record))


def tampered_copy(root: Path, name: str, marker: Path) -> None:
    """<root>/good copied to <root>/<name>, with a Payload in its trainer state or .metadata."""
    shutil.copytree(root / "good", root / name)
    iter_dir = root / name / "iter_0000001"
    if name == "trainer_state":
        path = iter_dir / "trainer_state" / "rank_00000.pt"
        torch.save({**torch.load(path, weights_only=True), "note": Payload(marker)}, path)
    else:
        path = iter_dir / "actor" / ".metadata"
        md = pickle.loads(path.read_bytes())
        md.planner_data = Payload(marker)
        path.write_bytes(pickle.dumps(md))
    recommit(iter_dir)


def planted_symlinks(actor, root: Path) -> dict:
    """Saves and commits into <root>/links past symlinks to <root>/outside (see the docstring)."""
    stage, outside = root / "links", root / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the checkpoint's")
    mgr, roles, res = CheckpointManager(stage, keep_last=1), {"actor": actor}, {}
    stage.mkdir()
    os.symlink(outside, stage / "iter_0000001.tmp")  # a save's tmp dir: written through before
    os.symlink(outside, stage / "iter_0000000.tmp")  # debris retention removes after the commit
    res["save_1"] = catch(lambda: mgr.save(1, roles, state(1)))[0]
    os.symlink(outside, stage / "iter_0000002")  # the step saved next: replaced by the commit
    os.symlink(outside / "keep.txt", stage / "latest.tmp")  # the `latest` update writes it first
    res["save_2"] = catch(lambda: mgr.save(2, roles, state(2)))[0]

    # role and file level: a tmp dir made to hold a symlink when it is committed
    record = {"step": 3, "roles": ["actor"], "world_size": 1, "layout": {"tp": 1, "pp": 1, "dp": 1}}
    shutil.copytree(stage / "iter_0000002", outside / "actor_copy")
    for name, rel in (("role", "actor"), ("file", "trainer_state/rank_00000.pt")):
        tmp = stage / "iter_0000003.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(stage / "iter_0000002", tmp)
        (tmp / "commit.json").unlink()
        if (tmp / rel).is_dir():
            shutil.rmtree(tmp / rel)
        else:
            (tmp / rel).unlink()
        os.symlink(outside / "actor_copy" / rel, tmp / rel)
        res[f"commit_{name}"] = catch(lambda: mgr._commit(tmp, stage / "iter_0000003", record))[0]
        res[f"committed_{name}"] = os.path.lexists(stage / "iter_0000003")
    res["save_3"] = catch(lambda: mgr.save(3, roles, state(3)))[0]  # over the refused tmp dir
    res["stage"] = sorted(p.name + ("@" if p.is_symlink() else "") for p in stage.iterdir())
    res["latest"] = (stage / "latest").read_text().strip()
    res["complete"] = [p.name for p in sorted(stage.glob("iter_*")) if not validate(p)]
    res["outside"] = sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*")
                            if not p.is_relative_to(outside / "actor_copy"))
    res["keep.txt"] = (outside / "keep.txt").read_text()
    return res


def next_random() -> list:
    return [random.random(), float(np.random.rand()), torch.rand(2), tracker_rand()]


def mode_payloads(cfg, root: Path, write) -> None:
    actor = Actor(cfg.model, **training_of(cfg))
    train(actor, 1)
    CheckpointManager(root / "good").save(1, {"actor": actor}, state(1))
    expected = next_random()
    marker = root / "payload_ran"
    for name in ("trainer_state", "metadata"):
        tampered_copy(root, name, marker)
    extra_state = actor.extra_state  # megatron stores the role's extra state in its common state
    actor.extra_state = lambda: {**extra_state(), "note": Payload(marker)}
    CheckpointManager(root / "common_state").save(1, {"actor": actor}, state(1))

    res = {}
    loaded = CheckpointManager(root / "good").load({"actor": Actor(cfg.model, **training_of(cfg))})
    res["good"] = {"step": loaded["step"], "warnings": loaded["checkpoint_warnings"],
                   "rng_restored": all(a == b if isinstance(a, float) else torch.equal(a, b)
                                       for a, b in zip(expected, next_random()))}
    for name in ("trainer_state", "metadata", "common_state"):
        res[name] = {"error": catch(lambda: CheckpointManager(root / name).load({"actor": Actor(cfg.model, **training_of(cfg))}))[0],
                     "payload_ran": marker.exists()}
    actor.extra_state = extra_state
    res["symlinks"] = planted_symlinks(actor, root)
    write(res)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--mode", required=True, choices=["train", "kill", "relayout", "payloads"])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    start_distributed(cfg)

    def write(res):
        if dist.get_rank() == 0:
            torch.save(res, args.root / f"results_{args.mode}.pt")

    if args.mode == "train":
        mode_train(cfg, args.overrides, args.root, write)
    elif args.mode == "kill":
        mode_kill(cfg, args.root)
    elif args.mode == "payloads":
        mode_payloads(cfg, args.root, write)
    else:
        mode_relayout(cfg, args.root, write)
    parallel.destroy()


if __name__ == "__main__":
    sys.exit(main())

"""rollout.placement / rollout.engine_devices / rollout.refit_transport (docs/rollout_placement.md):
the config rules, which devices the engine process sees, and the broadcast transport's wire
format: on fake CUDA tensors (FakeTensorMode: a host copy or host read anywhere in the sender's
preparation fails or shows as a CPU tensor) and through a real private gloo group between two
processes (the receiver is the engine worker's code, vllm_worker.receive_bucket). The transport
through a real vLLM engine: tests/test_refit_broadcast.py.
"""

import multiprocessing
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from test_gpu_check_reuse import load_gpu_check

from megatron_rlhf.config import ConfigError, RolloutConfig, load_config, validate
from megatron_rlhf.rollout.placement import cuda_visible_devices, engine_device_ids, engine_slot, refit_transport
from megatron_rlhf.rollout.refit_broadcast import HOST, wire_tensors
from megatron_rlhf.rollout.vllm_worker import (broadcast, checksums, join_refit_group, receive_bucket, refit_group,
                                               verify_bucket)

VLLM = ("rollout.engine=vllm",)
SEPARATE = (*VLLM, "rollout.placement=separate", "rollout.sleep_level=0")


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, list(overrides)), world_size=1)
    return str(err.value)


@pytest.mark.parametrize("overrides, fields", [
    (("rollout.placement=remote",), ["rollout.placement"]),
    (("rollout.refit_transport=ftp",), ["rollout.refit_transport"]),
    (("rollout.placement=separate", "rollout.sleep_level=0"), ["rollout.placement", "rollout.engine"]),
    ((*VLLM, "rollout.placement=separate"), ["rollout.placement", "rollout.sleep_level=0"]),
    (("rollout.refit_transport=broadcast",), ["rollout.refit_transport", "rollout.engine"]),
    ((*VLLM, "rollout.refit_transport=broadcast"), ["rollout.refit_transport", "rollout.placement=separate"]),
    ((*SEPARATE, "rollout.engine_devices=[2,3]"), ["rollout.engine_devices", "rollout.tensor_parallel=1"]),
    ((*SEPARATE, "rollout.engine_devices=[2,2]", "rollout.tensor_parallel=2"), ["rollout.engine_devices", "distinct"]),
    ((*SEPARATE, "rollout.engine_devices=[-1]"), ["rollout.engine_devices"]),
    ((*VLLM, "rollout.engine_devices=[2]"), ["rollout.engine_devices", "rollout.placement=separate"]),
    # colocated: the engine uses its replica's devices, so at most TP x PP of them
    ((*VLLM, "rollout.tensor_parallel=2"), ["rollout.tensor_parallel", "rollout.placement=separate"]),
])
def test_placement_rules_name_the_fields(overrides, fields):
    message = error_of(*overrides)
    for field in fields:
        assert field in message, message


def test_separate_placement_parses_and_validates():
    cfg = validate(load_config(None, [*SEPARATE, "rollout.engine_devices=[4,5]", "rollout.tensor_parallel=2"]),
                   world_size=1)
    r = cfg.rollout
    assert list(r.engine_devices) == [4, 5] and r.tensor_parallel == 2  # beyond TP x PP = 1: separate devices
    assert refit_transport(r) == "broadcast"
    assert refit_transport(RolloutConfig(engine="vllm")) == "shm"  # auto: colocated keeps shared memory
    assert refit_transport(RolloutConfig(engine="vllm", placement="separate", sleep_level=0,
                                         refit_transport="shm")) == "shm"


def ids(local_rank=0, local_world_size=4, slot=0, count=8, **rollout):
    r = RolloutConfig(engine="vllm", **rollout)
    return engine_device_ids(r, local_rank=local_rank, local_world_size=local_world_size, engine_slot=slot,
                             device_count=count)


def test_engine_devices_colocated_and_separate():
    assert ids(local_rank=2, tensor_parallel=2) == [2, 3]  # colocated: the replica's own, from the engine rank on
    sep = {"placement": "separate", "sleep_level": 0}
    assert ids(**sep) == [4]  # the first device after the trainer's four
    assert ids(local_rank=2, slot=1, tensor_parallel=2, **sep) == [6, 7]  # the node's second engine: the next block
    assert ids(engine_devices=[7], **sep) == [7]
    assert engine_slot(local_rank=4, engine_group_stride=2) == 2


@pytest.mark.parametrize("kwargs, words", [
    ({"engine_devices": [3]}, ["rollout.engine_devices", "[3]", "trainer"]),   # a trainer device
    ({"slot": 4}, ["rollout.engine_devices", "8"]),                            # device 8 of 8 does not exist
    ({"engine_devices": [6], "slot": 1}, ["rollout.engine_devices", "leave"]),  # one list, two engines on the node
])
def test_engine_devices_that_cannot_work_are_refused(kwargs, words):
    with pytest.raises(ConfigError) as err:
        ids(placement="separate", sleep_level=0, **kwargs)
    for word in words:
        assert word in str(err.value), err.value


def test_cuda_visible_devices_follow_the_trainers_own():
    assert cuda_visible_devices([4, 5], None) == "4,5"
    assert cuda_visible_devices([1, 2], "3,5,6,7") == "5,6"  # device i of the trainer is its i-th visible one
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        cuda_visible_devices([4], "0,1")


def bucket(device):
    return {"model.layers.0.mlp.down_proj.weight": torch.randn(6, 4, device=device).to(torch.bfloat16).t(),
            "model.norm.weight": torch.ones(4, device=device)}


def test_the_broadcast_sender_keeps_every_tensor_on_the_device():
    """Under FakeTensorMode a host read (.item(), .tolist(): a device sync) raises, and a host
    copy would show as a CPU tensor: the sender's wire tensors, checksums included, stay on CUDA."""
    with FakeTensorMode():
        cuda = torch.device("cuda", 0)
        header, tensors = wire_tensors(bucket(cuda))
        assert all(t.device == cuda for t in tensors), [t.device for t in tensors]
        assert all(t.is_contiguous() for t in tensors)  # the transposed one was made contiguous on the device
        assert tensors[-1].dtype == torch.int64 and list(tensors[-1].shape) == [2]
    assert header == {"names": ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"],
                      "shapes": [[4, 6], [4]], "dtypes": ["bfloat16", "float32"]}


def _receiver(port: int, expected: dict, corrupt: bool, inbox, out) -> None:
    try:
        timeout = timedelta(seconds=120)
        group = join_refit_group(HOST, port, 1, 2, "gloo", 120, torch.device("cpu"))
        header = inbox.get(timeout=120)
        tensors, checks = receive_bucket(group, header["names"], header["shapes"], header["dtypes"],
                                         torch.device("cpu"), timeout)
        if corrupt:
            first = next(iter(tensors.values()))
            first.view(torch.int16).view(-1)[0] += 1  # one changed word
        verify_bucket(tensors, checks, expected, set())
        out.put(("ok", checksums(tensors)))
    except Exception as e:  # noqa: BLE001  (reported to the test)
        out.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_bucket_crosses_a_private_gloo_group_intact(corrupt):
    """Rank 0 (this process, which runs no default group) broadcasts a bucket's wire tensors to
    an engine-worker stand-in process running the worker's receive code; a changed word is caught
    by the checksums."""
    assert not dist.is_initialized()  # the group needs no default one
    sent = bucket("cpu")
    expected = {name: tuple(t.shape) for name, t in sent.items()}
    store = dist.TCPStore(HOST, 0, None, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    headers, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(store.port, expected, corrupt, headers, results))
    child.start()
    try:
        group = refit_group(store, HOST, 0, 2, "gloo", timedelta(seconds=120), torch.device("cpu"))
        header, tensors = wire_tensors(sent)
        headers.put(header)  # (the header goes by vLLM's collective_rpc in the real transport)
        for t in tensors:
            broadcast(group, t, timedelta(seconds=120))
        status, detail = results.get(timeout=180)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    if corrupt:
        assert status == "error" and "arrived corrupted" in detail, detail
    else:
        assert status == "ok", detail
        assert detail == checksums(sent)


def test_gpu_check_skips_the_separate_placement_below_two_gpus(tmp_path):
    gc = load_gpu_check()
    run = gc.run_vllm_separate(Path(sys.executable), [], tmp_path, tmp_path, 10)  # this machine: no CUDA device
    assert run["skipped"].startswith("needs 2 GPUs"), run
    assert "skipped: needs 2 GPUs" in gc.vllm_separate_lines(run)[-1]
    line = gc.vllm_separate_lines({"exit_code": 0, "seconds": 61.0, "refit_seconds": 0.012, "refit_gb_per_s": 3.5})
    assert "refit 0.012 s, 3.50 GB/s" in line[-1]

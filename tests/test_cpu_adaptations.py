"""The CPU adaptation module changes nothing when CUDA is available, and on CPU it installs
exactly the device plumbing megatron-core needs. Runs in a subprocess so the process-wide
patches never leak into other tests."""

import subprocess
import sys
import textwrap

INERT = textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True   # simulate a GPU machine
    from megatron_rlhf.parallel import cpu
    before = {n: getattr(torch.cuda, n) for n in ("synchronize", "current_device", "Stream",
              "Event", "get_rng_state", "set_rng_state", "manual_seed", "current_stream")}
    from megatron.core.tensor_parallel import random as mpu_random
    rng = (mpu_random._get_cuda_rng_state, mpu_random._set_cuda_rng_state)
    from megatron.core.distributed import param_and_grad_buffer as buffers
    collectives = (buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func)
    assert cpu.apply() is False and not cpu.is_applied()
    assert (buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func) == collectives
    assert all(getattr(torch.cuda, n) is f for n, f in before.items()), "torch.cuda was patched"
    assert (mpu_random._get_cuda_rng_state, mpu_random._set_cuda_rng_state) == rng
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was pushed"
    print("INERT-OK")
""")

ACTIVE = textwrap.dedent("""
    import torch
    from megatron_rlhf.parallel import cpu
    assert cpu.apply() is True and cpu.apply() is True  # idempotent
    assert torch._C._len_torch_function_stack() == 1
    x = torch.zeros(3, device="cuda")                  # literal device strings run on CPU
    assert x.device.type == "cpu" and x.cuda() is x
    assert x.type() == "torch.cuda.FloatTensor"        # megatron's type-string checks pass
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    torch.cuda.synchronize()
    # the model-parallel RNG tracker forks and restores the CPU generator
    from megatron.core.tensor_parallel import random as mpu_random
    tracker = mpu_random.get_cuda_rng_tracker()
    torch.manual_seed(0)
    tracker.add("model-parallel-rng", 123)
    with tracker.fork():
        a = torch.rand(2)
    b = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(b, torch.rand(2)), "fork did not restore the default generator"
    torch.manual_seed(123)
    assert torch.equal(a, torch.rand(2)), "tracker state was not seeded on the CPU generator"
    # DP=1: the DistributedOptimizer's reduce-scatter and all-gather over one rank return at once
    # when the output is the input (megatron's case) and copy otherwise; with 2+ ranks they are
    # gloo's (the DP2 layout and resume tests reduce real gradients through them).
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    one_rank = dist.new_group([0])
    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        installed = getattr(buffers, name)
        calls = []
        def counted(*args, gloo=installed.__wrapped__, **kwargs):
            calls.append(args)
            return gloo(*args, **kwargs)
        collective = cpu._one_rank_is_identity(counted)
        buffer = torch.arange(6.0)
        assert collective(buffer[:6], buffer, group=one_rank) is None
        assert collective(buffer, buffer, group=one_rank, async_op=True).wait()
        out = torch.zeros(6)
        collective(out, buffer, group=one_rank)
        assert torch.equal(out, buffer) and calls == [], name
        assert installed.__wrapped__ is getattr(dist, installed.__wrapped__.__name__), name
    dist.destroy_process_group()
    print("ACTIVE-OK")
""")


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_inert_when_cuda_is_available():
    assert "INERT-OK" in run(INERT)


def test_active_on_cpu():
    assert "ACTIVE-OK" in run(ACTIVE)


def test_smoke_command_runs_all_roles_at_tp2():
    """The main command path (docs/getting_started.md): `python -m megatron_rlhf smoke` under torchrun."""
    from distributed import torchrun

    proc = torchrun(2, "-m", "megatron_rlhf", "smoke", "--config", "pipelines/tiny_cpu.yaml",
                    "parallel.tensor_parallel=2")
    assert "TP2 PP1 world 2" in proc.stdout
    for role in ("Actor", "Reference", "Critic", "RewardModel"):
        assert role in proc.stdout


def test_cli_reports_config_errors_with_the_field():
    proc = subprocess.run([sys.executable, "-m", "megatron_rlhf", "smoke", "model.hiden_size=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.hiden_size: unknown key; did you mean 'model.hidden_size'" in proc.stderr

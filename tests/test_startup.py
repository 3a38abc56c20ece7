"""Process start-up: importing our trainers (and so megatron-core) does not import torch's
compiler stack, while megatron's torch.compile-decorated functions still compile on their
first call. In a subprocess: what a fresh worker imports is the point."""

import subprocess
import sys
import textwrap

DEFERRED = textwrap.dedent("""
    import sys
    import torch
    compile_before = torch.compile
    import megatron_rlhf.trainers.rl, megatron_rlhf.trainers.sft, megatron_rlhf.trainers.rm, megatron_rlhf.trainers.dpo
    assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "compiler imported at start-up"
    assert "wandb" not in sys.modules and "mlflow" not in sys.modules, "a tracker client imported while not enabled"
    assert torch.compile is compile_before, "torch.compile was not restored after megatron.core imported"

    # megatron's jit_fuser (torch.compile) functions: a plain function and a method
    from megatron.core.transformer.utils import gelu_impl
    from megatron.core.transformer.torch_norm import L2Norm
    x = torch.linspace(-3, 3, 11)
    want = 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))
    assert torch.allclose(gelu_impl(x), want), "deferred compile changed the result"
    assert "torch._dynamo" in sys.modules, "the first call did not go through torch.compile"
    norm = L2Norm(hidden_size=11, eps=1e-6)
    assert torch.allclose(norm(x[None]), x[None] * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    print("DEFERRED-OK")
""")


def test_megatron_import_defers_torch_compile_to_the_first_call():
    # TORCHDYNAMO_DISABLE: the first call imports dynamo (what is checked) and runs eagerly
    # instead of spending 10-30 s compiling on a 2-core CPU.
    env = {"TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DEFERRED-OK" in proc.stdout

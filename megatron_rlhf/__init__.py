"""megatron_rlhf: PPO-RLHF (SFT -> reward model -> PPO) on megatron-core."""

__version__ = "0.1.0"


def _hide_old_nvrx_async_checkpointing() -> None:
    # megatron-core 0.19.2 asserts nvidia-resiliency-ext >= 0.6 as soon as nvrx's async
    # checkpoint modules import (and reads a __version__ that 0.4.1 lacks), so importing
    # megatron.core fails next to 0.4.1, the newest release that installs on glibc 2.36.
    # Hiding those modules makes megatron use its own async checkpointing; ft_launcher and
    # the rank-monitor client (what we use 0.4.1 for) are untouched. nvrx >= 0.6: no-op.
    import sys
    from importlib import metadata

    try:
        major, minor = (int(x) for x in metadata.version("nvidia-resiliency-ext").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return
    if (major, minor) < (0, 6):
        sys.modules.setdefault("nvidia_resiliency_ext.checkpointing.async_ckpt.core", None)


class _DeferTorchCompileInMegatron:
    """Import hook: while megatron.core's package imports, `torch.compile` used as a decorator
    defers its work to the decorated function's first call.

    megatron-core decorates ~40 functions at import (megatron/core/jit.py sets its `jit_fuser`
    to torch.compile; transformer/moe/router.py uses @torch.compile directly), and the first
    torch.compile call imports torch._dynamo and torch._inductor: ~2.5 s of CPU in every process
    (a third of a worker's start-up on our 2-core machines, ~1.5 s on a GPU node), although
    most of those functions are never called (none is in our CPU runs, where the fusions are
    off). torch.compile(fn) compiles on the first call anyway, so deferring the import changes
    only when it happens: a fused kernel a GPU run calls is compiled exactly as before.
    torch.compile itself is restored once megatron.core has imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        import importlib.machinery
        import sys

        sys.meta_path.remove(self)  # once: megatron.core imports once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: _with_deferred_compile(run, module)
        return spec


def _with_deferred_compile(exec_module, module) -> None:
    import functools

    import torch

    compile_now = torch.compile

    def compile_on_first_call(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return functools.partial(compile_on_first_call, **options)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    torch.compile = compile_on_first_call
    try:
        exec_module(module)
    finally:
        torch.compile = compile_now



class _MegatronWithoutWandb:
    """Import hook: megatron-core's modules see W&B as not installed.

    megatron-core's own optional W&B writers (core/timers.py; the dynamic inference engine)
    `import wandb` when their module imports, if it is installed: ~0.7 s of CPU in every process
    that imports megatron.core (every rank, every test worker). We never log through them: our
    tracker (megatron_rlhf/logging/trackers.py) imports wandb itself, only when logging.wandb is
    enabled, and gets the real module. Only an import of `wandb` made from a megatron.core module
    is refused (as ImportError, which those modules catch)."""

    def find_spec(self, name, path=None, target=None):
        if name != "wandb":
            return None
        import sys

        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
            frame = frame.f_back
        if frame is not None and frame.f_globals.get("__name__", "").startswith("megatron.core"):
            raise ImportError("wandb is not offered to megatron-core's own writers (megatron_rlhf/__init__.py)")
        return None


_hide_old_nvrx_async_checkpointing()
for _hook in (_DeferTorchCompileInMegatron, _MegatronWithoutWandb):
    if not any(isinstance(f, _hook) for f in __import__("sys").meta_path):
        __import__("sys").meta_path.insert(0, _hook())

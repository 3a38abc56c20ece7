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


_hide_old_nvrx_async_checkpointing()

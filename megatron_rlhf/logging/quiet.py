"""A quiet start: the known, harmless third-party warnings are hidden unless --verbose
(or logging.verbose) asks for everything. Each entry below says why it is harmless here;
anything not listed still shows, and so do our own warnings.

`install` must run before torch or megatron-core is imported: most of these are raised at
import time. It matches by category, message and the module the warning is attributed to;
`install_cpu` adds hints that only matter on a GPU, once torch has found none.
On CPU every torch call passes through megatron_rlhf.parallel.cpu (a TorchFunctionMode), so
warnings that torch raises from C++ name that module; those entries list it too.
"""

from __future__ import annotations

import logging
import re
import warnings

_CPU_MODE = r"|megatron_rlhf\.parallel\.cpu"  # see the docstring

# warnings.warn: (category, message regex, module regex, why it is harmless here)
WARNINGS = [
    (FutureWarning, r"The pynvml package is deprecated", r"torch\.cuda",
     "torch.cuda imports pynvml (a dependency of nvidia-resiliency-ext) to query GPUs; it still works"),
    (UserWarning, r"(Transformer Engine and Apex are|Apex is) not installed", r"megatron\b|megatron_fsdp\b",
     "without TE we build megatron-core's local spec, unfused, on purpose (models/gpt.py): the fallback is our path"),
    (UserWarning, r"full scope is deprecated", r"megatron\.core\.transformer\.transformer_config",
     "megatron-core's own default cuda_graph_modules='full' triggers it; we use no CUDA graphs"),
    (UserWarning, r"MimoModelConfig is experimental", r"megatron\.core\.models\.mimo",
     "megatron-core imports its MIMO configs itself; we build no MIMO model"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf", r"megatron\.core\.optimizer" + _CPU_MODE,
     "the distributed optimizer's zero_grad reads .grad of its fp32 shard views (megatron marks the line); None, skipped"),
    (FutureWarning, r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     r"torch\.distributed",
     "megatron-core calls the old names of these collectives; torch runs the same collective"),
    (UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized", r"torch\.distributed\.checkpoint",
     "megatron-core's checkpoint load passes no_dist=True on purpose: each rank reads its own shards"),
    (UserWarning, r"The argument order of load has been changed", r"torch\.distributed\.checkpoint",
     "megatron-core passes the storage reader positionally; torch maps it to the keyword"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor", r"torch\.distributed" + _CPU_MODE,
     "megatron-core's torch_dist checkpoints are built on ShardedTensor, which the pinned torch supports"),
]

# Only on CPU (install_cpu, once torch has found no GPU): hints that matter on a GPU.
CPU_WARNINGS = [
    (UserWarning, r"When using (async grad allreduce|sequence parallelism) it is recommended to set the "
     r"environment variable CUDA_DEVICE_MAX_CONNECTIONS", r"megatron\.core\.tensor_parallel\.layers",
     "a CUDA stream-ordering hint for tensor parallelism on GPUs; there are no CUDA streams on CPU"),
]

# logging: (logger, message regex, why it is harmless here); only that logger's matching records
LOGS = [
    ("torch.utils.cpp_extension", r"No CUDA runtime is found, using CUDA_HOME",
     "we compile no C++/CUDA extension; torch only says where CUDA would be"),
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
     "GPTModel is maintained (critical fixes) in the megatron-core we pin; HybridModel is a later change"),
    ("megatron.core.distributed.distributed_data_parallel", r"DistributedDataParallel: full_param_layout not provided",
     "DDP computes the same parameter layout itself (megatron-core's backward-compatible path)"),
    ("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
     "async_strategy='mcore' is chosen on purpose (checkpoint/dist.py: 'nvrx' needs nvidia-resiliency-ext >= 0.6)"),
]

# Our launcher (megatron_rlhf/torchrun.py) only: loggers below CRITICAL are hidden.
LAUNCHER_LOGGERS = {
    "torch.distributed.elastic": "start-up and per-worker failure logs; the launcher reports a failure itself "
                                 "(the worker's message and exit code)",
}

_installed = False


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def install(verbose: bool) -> None:
    """Hide the warnings and log records listed above (nothing when verbose)."""
    global _installed
    if verbose or _installed:
        return
    _installed = True
    for category, message, module, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, message, _why in LOGS:
        logging.getLogger(name).addFilter(_Drop(message))


def install_cpu(verbose: bool) -> None:
    """Hide CPU_WARNINGS too (nothing when verbose); call when there is no GPU."""
    for category, message, module, _why in [] if verbose else CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def quiet_launcher(verbose: bool) -> None:
    """After torch.distributed.run is imported: raise LAUNCHER_LOGGERS (and their children
    that exist, some of which set their own level) to CRITICAL."""
    if verbose:
        return
    for prefix in LAUNCHER_LOGGERS:
        names = [n for n in list(logging.root.manager.loggerDict) if n.startswith(prefix + ".")]
        for name in (prefix, *names):
            logging.getLogger(name).setLevel(logging.CRITICAL)

"""Which engine generates the RL stage's responses, and its rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import ModelConfig
from megatron_rlhf.config.training import ParallelConfig

ROLLOUT_ENGINES = ("megatron", "vllm")
ROLLOUT_PLACEMENTS = ("colocated", "separate")
REFIT_TRANSPORTS = ("auto", "shm", "broadcast")
# Head sizes vLLM's CPU attention backend supports (its GPU backends take more).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


@dataclass(frozen=True)
class RolloutConfig:
    """Which engine generates the RL stage's responses (rollout/)."""

    # megatron: in place, with the actor's own weights (no copy, no refit). vllm: a vLLM
    # engine per data-parallel replica, in its own process next to the trainer, refit with the
    # actor's weights before every generation (docs/rollout_engines.md).
    engine: str = "megatron"
    # vllm only. The engine's own tensor parallelism (independent of the training layout).
    tensor_parallel: int = 1
    # KV cache budget on CPU (bytes); on GPU the engine takes gpu_memory_utilization of the
    # device (weights + KV cache) and, with sleep_level > 0, frees it while training runs.
    kv_cache_bytes: int = 64 * 2**20
    gpu_memory_utilization: float = 0.3
    sleep_level: int = 1             # GPU: 0 keep, 1 offload weights + drop KV, 2 drop both
    refit_bucket_bytes: int = 256 * 2**20  # largest bucket of HF tensors sent to the engine at once
    enforce_eager: bool = True       # no CUDA graphs / torch.compile in the engine
    # vllm only. CPUs the engine process and its threads run on (os.sched_setaffinity ids); the
    # trainer is then pinned to the other CPUs it may use, so that with rl.max_staleness >= 1
    # generation and training do not take turns on the same cores. Empty: no pinning.
    engine_cpus: list[int] = field(default_factory=list)
    # vllm only. A generation, refit or engine call that takes longer stops the stage with an
    # error naming the engine (a hung engine process), instead of waiting forever.
    engine_timeout_seconds: float = 1800.0
    # vllm only (docs/rollout_placement.md). colocated: on GPU the engine shares its replica's
    # devices and sleeps while the trainer works. separate: the engine has devices of its own
    # (engine_devices; sleep_level must be 0: nothing else is on them), refit by broadcast. On
    # CPU both are the engine process next to the trainer.
    placement: str = "colocated"
    # separate on GPU: the CUDA device ids (as this node numbers them) the engine runs on, one per
    # rollout.tensor_parallel rank, none a trainer device. Empty: the devices after the trainer's
    # local ones (local_world_size + replica-on-node * tensor_parallel + i).
    engine_devices: list[int] = field(default_factory=list)
    # How refit buckets reach the engine. shm: written to /dev/shm, loaded by the engine (through
    # host memory). broadcast: a torch.distributed broadcast from the trainer's device to the
    # engine's (NCCL on GPU, gloo on CPU), over a private group. auto: broadcast when separate.
    refit_transport: str = "auto"

    def check(self, m: ModelConfig, p: ParallelConfig) -> None:
        r = self
        if r.engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"rollout.engine={r.engine!r}: choose one of {ROLLOUT_ENGINES}")
        if r.tensor_parallel < 1 or r.kv_cache_bytes < 1 or r.refit_bucket_bytes < 1:
            raise ConfigError("rollout.tensor_parallel, rollout.kv_cache_bytes and rollout.refit_bucket_bytes must be >= 1")
        if not 0 < r.gpu_memory_utilization < 1 or r.sleep_level not in (0, 1, 2):
            raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1) and "
                              f"rollout.sleep_level={r.sleep_level} one of 0, 1, 2")
        if r.engine_timeout_seconds <= 0:
            raise ConfigError(f"rollout.engine_timeout_seconds={r.engine_timeout_seconds}: must be > 0 (seconds a "
                              "generation or refit may take before the stage stops)")
        cpus = list(r.engine_cpus)
        if any(not isinstance(c, int) or c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
            raise ConfigError(f"rollout.engine_cpus={cpus}: distinct CPU ids >= 0 (e.g. [1]), or [] for no pinning")
        self._check_placement()
        if r.engine != "vllm":
            return
        tp = r.tensor_parallel
        if m.num_attention_heads % tp or (m.kv_heads % tp and tp % m.kv_heads):
            raise ConfigError(f"rollout.tensor_parallel={r.tensor_parallel}: vLLM splits attention heads "
                              f"({m.num_attention_heads}, {m.kv_heads} key/value) over it; choose a divisor of "
                              f"model.num_attention_heads")
        if r.placement == "colocated" and r.tensor_parallel > p.tensor_parallel * p.pipeline_parallel:
            raise ConfigError(f"rollout.tensor_parallel={r.tensor_parallel}: the engine of a data-parallel replica "
                              f"uses that replica's devices (parallel.tensor_parallel x pipeline_parallel = "
                              f"{p.tensor_parallel * p.pipeline_parallel}); choose at most that, or "
                              "rollout.placement=separate (the engine on devices of its own)")

    def _check_placement(self) -> None:
        r = self
        if r.placement not in ROLLOUT_PLACEMENTS:
            raise ConfigError(f"rollout.placement={r.placement!r}: choose one of {ROLLOUT_PLACEMENTS}")
        if r.refit_transport not in REFIT_TRANSPORTS:
            raise ConfigError(f"rollout.refit_transport={r.refit_transport!r}: choose one of {REFIT_TRANSPORTS}")
        if r.placement == "separate" and r.engine != "vllm":
            raise ConfigError(f"rollout.placement=separate with rollout.engine={r.engine}: only the vLLM engine runs "
                              "apart from the trainer; set rollout.engine=vllm or rollout.placement=colocated")
        if r.refit_transport == "broadcast" and r.engine != "vllm":
            raise ConfigError(f"rollout.refit_transport=broadcast with rollout.engine={r.engine}: the in-place engine "
                              "uses the actor's own weights (no refit); set rollout.engine=vllm or "
                              "rollout.refit_transport=auto")
        if r.refit_transport == "broadcast" and r.placement != "separate":
            raise ConfigError("rollout.refit_transport=broadcast with rollout.placement=colocated: on GPU the engine "
                              "and its trainer rank share a device, where NCCL refuses two ranks; set "
                              "rollout.placement=separate or rollout.refit_transport=shm")
        if r.placement == "separate" and r.sleep_level != 0:
            raise ConfigError(f"rollout.placement=separate with rollout.sleep_level={r.sleep_level}: the engine's "
                              "devices hold nothing else, so sleeping frees nothing and costs a reload per "
                              "generation; set rollout.sleep_level=0")
        devices = list(r.engine_devices)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devices) or \
                len(set(devices)) != len(devices):
            raise ConfigError(f"rollout.engine_devices={devices}: distinct CUDA device ids >= 0 (e.g. [4]), or [] "
                              "for the devices after the trainer's")
        if devices and r.placement != "separate":
            raise ConfigError(f"rollout.engine_devices={devices} with rollout.placement={r.placement}: a colocated "
                              "engine uses its replica's devices; set rollout.placement=separate or "
                              "rollout.engine_devices=[]")
        if devices and len(devices) != r.tensor_parallel:
            raise ConfigError(f"rollout.engine_devices={devices}: one device per engine tensor-parallel rank "
                              f"(rollout.tensor_parallel={r.tensor_parallel}); list that many")


def check_vllm_cpu_model(m: ModelConfig) -> None:
    """vLLM's CPU attention supports only some head sizes: refuse others before any engine starts."""
    if m.kv_channels not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(
            f"rollout.engine=vllm on CPU: the model's head size is {m.kv_channels} (model.hidden_size / "
            f"model.num_attention_heads, or model.head_dim) and vLLM's CPU backend supports only {VLLM_CPU_HEAD_DIMS}; "
            "use a recipe with such a head size (pipelines/tiny_cpu_vllm.yaml) or rollout.engine=megatron")

"""The sections of trained roles and supervised stages: the parallel layout, optimizers, LoRA,
and the sft, rm and dpo stages, each with its rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import ModelConfig

LR_DECAY_STYLES = ("constant", "linear", "cosine")
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "output")
LORA_STAGES = ("sft", "dpo", "rl")
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel: int = 1         # TP: each layer's weight matrices split over this many ranks
    pipeline_parallel: int = 1       # PP: the layers split into this many consecutive stages, one per rank
    # "auto": NCCL when CUDA is available, gloo otherwise.
    backend: str = "auto"
    # megatron's sequence parallelism: with TP > 1 the activations outside attention and the MLP
    # (norms, residuals, dropout) are split along the sequence over the TP ranks instead of
    # replicated (~(10 + 24/TP)*s*h bytes per layer become ~34*s*h/TP). auto: on when TP > 1
    # (megatron refuses MoE layers with TP > 1 without it). Decoding runs without it, as
    # megatron's own engines do.
    sequence_parallel: bool | str = "auto"
    # Mixture-of-experts models (model.num_experts): experts split over `expert_parallel` ranks
    # (tokens go to their experts by all-to-all), each expert's matrices over
    # `expert_tensor_parallel` ranks (null: the TP size, megatron's default; 1 is the usual
    # choice with EP). The expert layers' data parallelism is what remains of the world
    # (megatron's expert groups: world / (ETP x EP x PP)).
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    # CP: each sequence split over this many ranks for sequences too long for one GPU's
    # activations (megatron-core's context parallelism, load-balanced: 2 x CP chunks, rank r
    # holds chunks r and 2 x CP - 1 - r; docs/long_context.md). Needs Transformer Engine's
    # attention on GPUs: megatron's local attention has none, so a CPU run refuses it. Weights
    # are replicated over the CP ranks and their gradients reduce over data x context ranks;
    # the data-parallel size is world / (TP x PP x CP).
    context_parallel: int = 1

    @property
    def sequence_parallel_on(self) -> bool:
        """Whether the roles train and score with sequence parallelism."""
        if self.sequence_parallel == "auto":
            return self.tensor_parallel > 1
        return bool(self.sequence_parallel)

    def check(self, m: ModelConfig, world_size: int | None) -> int:
        """The layout against the model's shape and the world size; returns the data-parallel size."""
        p = self
        for name, value in {"parallel.tensor_parallel": p.tensor_parallel,
                            "parallel.pipeline_parallel": p.pipeline_parallel,
                            "parallel.context_parallel": p.context_parallel}.items():
            if value < 1:
                raise ConfigError(f"{name}={value}: must be >= 1")
        if p.backend not in ("auto", "nccl", "gloo"):
            raise ConfigError(f"parallel.backend={p.backend!r}: choose auto, nccl or gloo")
        tp = p.tensor_parallel
        if p.sequence_parallel not in ("auto", True, False):
            raise ConfigError(f"parallel.sequence_parallel={p.sequence_parallel!r}: choose auto, true or false")
        if p.sequence_parallel is True and tp == 1:
            raise ConfigError("parallel.sequence_parallel=true: sequence parallelism splits activations over the "
                              "tensor-parallel ranks and needs parallel.tensor_parallel > 1; set it to auto or false")
        if m.num_attention_heads % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp}: does not divide model.num_attention_heads="
                f"{m.num_attention_heads}; choose a TP size that divides the head count"
            )
        if m.kv_heads % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp}: does not divide the key/value heads "
                f"(model.num_query_groups={m.kv_heads}); lower TP or raise num_query_groups"
            )
        if m.ffn_hidden_size % tp:
            raise ConfigError(f"parallel.tensor_parallel={tp}: does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
        if m.make_vocab_size_divisible_by % tp:
            raise ConfigError(
                f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}: must be a "
                f"multiple of parallel.tensor_parallel={tp} so the padded vocabulary splits evenly; "
                f"set model.make_vocab_size_divisible_by={math.lcm(m.make_vocab_size_divisible_by, tp)}"
            )
        pp = p.pipeline_parallel
        if pp > m.num_layers:
            raise ConfigError(
                f"parallel.pipeline_parallel={pp}: larger than model.num_layers={m.num_layers}; "
                f"each pipeline stage needs at least one layer"
            )
        if m.num_layers % pp:
            raise ConfigError(
                f"parallel.pipeline_parallel={pp}: does not divide model.num_layers={m.num_layers}"
            )
        cp = p.context_parallel
        if cp > 1 and m.num_experts:
            raise ConfigError(f"parallel.context_parallel={cp} with model.num_experts={m.num_experts}: context "
                              "parallelism with expert layers (routing replay, the routers' load-balancing counts "
                              "over split sequences) is not built yet; set parallel.context_parallel=1")
        if world_size is not None and world_size % (tp * pp * cp):
            raise ConfigError(
                f"parallel.tensor_parallel={tp} x parallel.pipeline_parallel={pp} x parallel.context_parallel={cp} "
                f"= {tp * pp * cp} does not divide the world size {world_size}; launch a multiple of TP*PP*CP processes"
            )
        self._check_experts(m, world_size)
        return (world_size or tp * pp * cp) // (tp * pp * cp)

    @property
    def expert_tensor_parallel_size(self) -> int:
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def _check_experts(self, m: ModelConfig, world_size: int | None) -> None:
        ep, etp, tp, pp = self.expert_parallel, self.expert_tensor_parallel_size, self.tensor_parallel, self.pipeline_parallel
        for name, value in {"parallel.expert_parallel": ep, "parallel.expert_tensor_parallel": etp}.items():
            if value < 1:
                raise ConfigError(f"{name}={value}: must be >= 1")
        experts = m.num_experts
        if not experts:
            if ep > 1 or self.expert_tensor_parallel not in (None, tp):
                raise ConfigError(f"parallel.expert_parallel={ep}, parallel.expert_tensor_parallel="
                                  f"{self.expert_tensor_parallel}: the model has no experts (model.num_experts is "
                                  "null); remove them")
            return
        if experts % ep:
            raise ConfigError(f"parallel.expert_parallel={ep}: does not divide model.num_experts={experts}; "
                              "each expert-parallel rank holds the same number of experts")
        if m.expert_ffn_hidden_size % etp:
            raise ConfigError(f"parallel.expert_tensor_parallel={etp}: does not divide the experts' intermediate size "
                              f"{m.expert_ffn_hidden_size} (model.moe_ffn_hidden_size)")
        if tp > 1 and not self.sequence_parallel_on:
            raise ConfigError(f"parallel.sequence_parallel=false with parallel.tensor_parallel={tp}: megatron's MoE "
                              "layers need sequence parallelism when TP > 1; set parallel.sequence_parallel=auto")
        if world_size is not None and world_size % (etp * ep * pp):
            raise ConfigError(
                f"parallel.expert_tensor_parallel={etp} x parallel.expert_parallel={ep} x "
                f"parallel.pipeline_parallel={pp} = {etp * ep * pp} does not divide the world size {world_size}; "
                "launch a multiple of it")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4                 # peak learning rate (Adam)
    min_lr: float = 0.0              # where lr_decay_style decays to, at the last step
    weight_decay: float = 0.0        # decoupled weight decay (AdamW)
    adam_beta1: float = 0.9          # Adam's first-moment decay
    adam_beta2: float = 0.95         # Adam's second-moment decay
    adam_eps: float = 1e-8           # Adam's epsilon
    clip_grad: float = 1.0           # clip the global gradient norm to this
    # megatron-core's DistributedOptimizer (ZeRO-1 over data-parallel ranks), also at DP=1: it and
    # the non-distributed one (false) cannot load each other's checkpoints, so true keeps the
    # optimizer state loadable at any DP (models/optimizer.py).
    use_distributed_optimizer: bool = True
    # megatron-core's OptimizerParamScheduler: linear warmup, then decay to min_lr.
    warmup_steps: int = 0
    lr_decay_style: str = "constant"  # after the warmup: constant | linear | cosine, from lr to min_lr

    def check(self, name: str) -> None:
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"{name}.lr_decay_style={self.lr_decay_style!r}: choose one of {LR_DECAY_STYLES}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"{name}.lr={self.lr}, {name}.min_lr={self.min_lr}: need 0 <= min_lr <= lr and lr > 0")
        if self.warmup_steps < 0:
            raise ConfigError(f"{name}.warmup_steps={self.warmup_steps}: must be >= 0")


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (models/lora.py) on the trained policy and critic of the stages listed;
    their base weights stay frozen. rank 0: off (full fine-tuning)."""

    rank: int = 0                    # the adapters' rank (0: off, full fine-tuning; typical 8-64)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training only; sft and dpo only (rl refuses it)
    # which linear layers of every decoder layer: qkv, proj (attention output), fc1, fc2; and
    # output: the policy's LM head (untied embeddings only; a critic's value head trains in full)
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])
    # sft, dpo, rl: the stages that train adapters (a later stage starting from a LoRA
    # checkpoint starts from its base with the adapters merged)
    stages: list[str] = field(default_factory=lambda: ["rl"])
    critic: bool = True  # the critic gets adapters of its own (value head trained in full); false: full critic

    def applies_to(self, stage: str) -> bool:
        return self.rank > 0 and stage in self.stages

    def check(self) -> None:
        lo = self
        if lo.rank < 0:
            raise ConfigError(f"lora.rank={lo.rank}: must be >= 0 (0: no adapters, full fine-tuning; typical 8-64)")
        if lo.rank == 0:
            return
        if not lo.alpha > 0:
            raise ConfigError(f"lora.alpha={lo.alpha}: must be > 0 (the adapter output is scaled by alpha / rank; e.g. 2 x rank)")
        if not 0 <= lo.dropout < 1:
            raise ConfigError(f"lora.dropout={lo.dropout}: must be in [0, 1)")
        bad = [t for t in lo.targets if t not in LORA_TARGETS]
        if bad or not lo.targets or len(set(lo.targets)) != len(lo.targets):
            raise ConfigError(f"lora.targets={lo.targets}: choose distinct layers from {LORA_TARGETS} (at least one)")
        bad = [s for s in lo.stages if s not in LORA_STAGES]
        if bad:
            raise ConfigError(f"lora.stages={lo.stages}: LoRA trains the policy of {LORA_STAGES} (and the rl critic); "
                              f"remove {bad}")
        if lo.dropout > 0 and "rl" in lo.stages:
            raise ConfigError(f"lora.dropout={lo.dropout} with rl in lora.stages={lo.stages}: the RL stage's old "
                              "log-probs and values come from eval-mode forwards, so adapter dropout in its training "
                              "forwards makes the first minibatch's ratios differ from 1 and shifts the value clipping; "
                              "set lora.dropout=0 or remove rl from lora.stages (sft and dpo keep adapter dropout)")


@dataclass(frozen=True)
class StageConfig:
    steps: int = 100                 # optimizer steps of the stage
    # In sequences (SFT) or preference pairs (RM), summed over data-parallel ranks.
    global_batch_size: int = 32
    # Sequences (pairs: rm, dpo) per forward/backward on one rank; global_batch_size accumulates them.
    micro_batch_size: int = 8
    seq_length: int = 64             # tokens per sequence (<= model.max_seq_length; longer ones: data.overflow)
    eval_interval: int = 50          # evaluate every this many steps and at the last step
    log_interval: int = 10           # log the metrics every this many steps and at the last step
    # 0: save only at the end of the stage.
    save_interval: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def check(self, name: str, m: ModelConfig, dp: int) -> None:
        st = self
        for key in ("steps", "global_batch_size", "micro_batch_size", "seq_length", "eval_interval", "log_interval"):
            if getattr(st, key) < 1:
                raise ConfigError(f"{name}.{key}={getattr(st, key)}: must be >= 1")
        if st.save_interval < 0:
            raise ConfigError(f"{name}.save_interval={st.save_interval}: must be >= 0 (0 = only at the end)")
        if st.seq_length < 2:
            raise ConfigError(f"{name}.seq_length={st.seq_length}: must be >= 2 (a prompt token and one to learn)")
        if st.seq_length > m.max_seq_length:
            raise ConfigError(
                f"{name}.seq_length={st.seq_length}: longer than model.max_seq_length={m.max_seq_length}"
            )
        if st.global_batch_size % (st.micro_batch_size * dp):
            raise ConfigError(
                f"{name}.global_batch_size={st.global_batch_size}: must be a multiple of "
                f"{name}.micro_batch_size={st.micro_batch_size} x data-parallel size {dp}"
            )
        if st.optimizer.warmup_steps > st.steps:
            raise ConfigError(f"{name}.optimizer.warmup_steps={st.optimizer.warmup_steps}: more than {name}.steps={st.steps}")


@dataclass(frozen=True)
class SFTConfig(StageConfig):
    # Stage (or iter_*) directory of a checkpoint with an actor to start from (an earlier
    # stage, import-hf's output); default: model.init_from_hf, else a fresh initialisation.
    init_from: str | None = None


@dataclass(frozen=True)
class RMConfig(StageConfig):
    # Normalise rewards to mean 0, std 1 over SFT-data responses; stored with the checkpoint.
    normalize: bool = True
    # Stage (or iter_*) directory of the SFT checkpoint; default: <run>/sft.
    init_from: str | None = None
    # > 0: hold out this fraction of the training pairs (chosen from `seed`) and train a
    # second, independent reward model on them (<run>/rm_holdout). The RL stage scores with
    # it too: a proxy reward that rises while the holdout score falls is reward hacking.
    holdout_fraction: float = 0.0

    def check(self, name: str, m: ModelConfig, dp: int) -> None:
        if not 0 <= self.holdout_fraction < 1:
            raise ConfigError(f"rm.holdout_fraction={self.holdout_fraction}: must be in [0, 1) (e.g. 0.5; 0: no "
                              "holdout RM)")
        super().check(name, m, dp)


@dataclass(frozen=True)
class DPOConfig(StageConfig):
    """Direct preference optimisation (python -m megatron_rlhf dpo; algorithms/dpo.py): batch
    sizes in preference pairs, like rm. Writes <run>/dpo/ (an actor role, like sft)."""

    # sigmoid: DPO's -log sigmoid(beta x (log-ratio chosen - log-ratio rejected)), log-ratios
    # summed over the response tokens; ipo: (h - 1/(2 beta))^2 with log-ratios averaged over them.
    loss: str = "sigmoid"
    beta: float = 0.1
    # sigmoid only: conservative DPO, the preference label is wrong with this probability (< 0.5).
    label_smoothing: float = 0.0
    # Weight of an extra NLL term on the chosen response (mean over its tokens; 0: none).
    sft_weight: float = 0.0
    # false: a reference role resident at the actor's TP x PP computes each batch's reference
    # log-probs; true: computed once for every pair at the start, the reference freed, and the
    # table kept in the stage's checkpoints (no reference forward or weights during training).
    precompute_reference: bool = False
    # Stage (or iter_*) directory of the starting checkpoint (actor and reference); default:
    # <run>/sft, or, when that has no checkpoint, model.init_from_hf.
    init_from: str | None = None

    def check_loss(self) -> None:
        """The loss's own rules (StageConfig.check has the batch ones)."""
        d = self
        if d.loss not in DPO_LOSSES:
            raise ConfigError(f"dpo.loss={d.loss!r}: choose one of {DPO_LOSSES}")
        if not (math.isfinite(d.beta) and d.beta > 0):
            raise ConfigError(f"dpo.beta={d.beta}: must be > 0 (typical 0.1; smaller lets the policy move further "
                              "from the reference)")
        if not 0 <= d.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={d.label_smoothing}: must be in [0, 0.5) (the probability that a "
                              "preference label is wrong; 0: plain DPO)")
        if d.label_smoothing and d.loss != "sigmoid":
            raise ConfigError(f"dpo.label_smoothing={d.label_smoothing} with dpo.loss={d.loss}: conservative DPO's label "
                              "smoothing belongs to the sigmoid loss; set dpo.loss=sigmoid or dpo.label_smoothing=0")
        if not (math.isfinite(d.sft_weight) and d.sft_weight >= 0):
            raise ConfigError(f"dpo.sft_weight={d.sft_weight}: must be >= 0 (0: no NLL term on the chosen response)")

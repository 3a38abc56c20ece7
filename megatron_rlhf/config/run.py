"""The sections of a whole run (data, pipeline, checkpoints, resilience, logging) and the root
`Config` that holds every section."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import ModelConfig
from megatron_rlhf.config.rl import RLConfig
from megatron_rlhf.config.rollout import RolloutConfig
from megatron_rlhf.config.sampling import SamplingConfig
from megatron_rlhf.config.training import DPOConfig, LoRAConfig, OptimizerConfig, ParallelConfig, RMConfig, SFTConfig
from megatron_rlhf.data.chat import CHAT_LOSS_TURNS
from megatron_rlhf.data.jsonl import RecordFields
from megatron_rlhf.data.tasks.base import TaskSizes

STAGES = ("sft", "rm", "dpo", "rl")
DEFAULT_STAGES = ("sft", "rm", "rl")
# What each stage starts from: an earlier stage in pipeline.stages, or the field naming its checkpoint.
STAGE_INPUTS = {"rm": {"sft": "rm.init_from"}, "dpo": {"sft": "dpo.init_from"},
                "rl": {"sft": "rl.sft_from", "rm": "rl.rm_from"}}
# ... unless the stage does not need that input (rules.py: check_pipeline)
OVERFLOW_POLICIES = ("truncate", "drop")


@dataclass(frozen=True)
class DataConfig:
    # A built-in task (megatron_rlhf/data/tasks) generates every split from `seed`; a data
    # path given below (a .jsonl or .parquet file, or a directory `datasets`' save_to_disk wrote)
    # replaces that split. task: null means all needed paths must be given. docs/data.md: formats.
    task: str | None = "sentiment"
    task_sizes: TaskSizes = field(default_factory=TaskSizes)
    # "auto": model.init_from_hf's directory when set, else the tokenizer this run (or the
    # checkpoint the stage starts from) recorded, else "builtin". "builtin": the task's
    # word-level tokenizer. Otherwise the path of a local Hugging Face tokenizer directory.
    tokenizer: str = "auto"
    # How `messages` records (conversations) become text: "auto" the tokenizer directory's
    # template (tokenizer_config.json "chat_template" or chat_template.jinja), none if it has
    # none; "none": no template (conversations are refused); or the path of a Jinja file.
    # Flat prompt/response records are never templated.
    chat_template: str = "auto"
    # The assistant turns of an SFT conversation the loss trains on: "all_assistant" (every
    # one, as TRL's assistant_only_loss and NeMo-RL do) or "last_assistant".
    chat_loss: str = "all_assistant"
    # The column each record field is read from, e.g. fields.prompt=question fields.response=answer.
    fields: RecordFields = field(default_factory=RecordFields)
    sft_train: str | None = None  # SFT records: prompt + response, or a conversation (messages)
    sft_eval: str | None = None  # held-out SFT records (none: data.eval_fraction of sft_train)
    preference_train: str | None = None  # RM and DPO pairs: prompt, chosen, rejected
    preference_eval: str | None = None  # held-out pairs (none: data.eval_fraction of preference_train)
    prompts_train: str | None = None  # RL prompts (extra fields are passed to rule rewards)
    prompts_eval: str | None = None  # held-out RL and DPO evaluation prompts (none: data.eval_fraction)
    # Sequences longer than the stage's seq_length: "truncate" or "drop" (always counted).
    overflow: str = "truncate"
    # A *_train file without its *_eval file: this fraction of its records (chosen from
    # `seed`) is held out for evaluation and the rest trains; recorded in the stage summary.
    eval_fraction: float = 0.05

    def check(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction={self.eval_fraction}: must be in [0, 1) (e.g. 0.05); 0 needs "
                              "an *_eval file (or data.task) for every *_train file")
        if self.overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"data.overflow={self.overflow!r}: choose one of {OVERFLOW_POLICIES}")
        if self.chat_loss not in CHAT_LOSS_TURNS:
            raise ConfigError(f"data.chat_loss={self.chat_loss!r}: choose one of {CHAT_LOSS_TURNS}")
        if not self.tokenizer or not self.chat_template:
            raise ConfigError("data.tokenizer and data.chat_template: must not be empty (auto picks one for you)")
        for name, column in dataclasses.asdict(self.fields).items():
            if not isinstance(column, str) or not column:
                raise ConfigError(f"data.fields.{name}={column!r}: must be a column name (default {name!r})")


@dataclass(frozen=True)
class PipelineConfig:
    # Stages `pipeline` (and slurm/submit_pipeline.sh, megatron_rlhf.launch) run in order,
    # from sft, rm, dpo, rl: e.g. [sft, rm, rl] (default), [sft, dpo], [sft, rm, dpo, rl].
    # Each starts from an earlier stage's checkpoint or its *_from field.
    stages: list[str] = field(default_factory=lambda: list(DEFAULT_STAGES))
    # A finished stage is reused only on the inputs its summary.json recorded (data, tokenizer,
    # settings, start checkpoint; trainers/stage_inputs.py); one whose inputs changed stops the
    # run, unless listed here: then it trains again from scratch, its old directory renamed
    # <stage>.replaced-<time> (as are later stages that start from it: list them too).
    # Unchanged stages are still reused, so a repeated or requeued command trains nothing twice.
    rerun: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointConfig:
    # Stages write to <root>/<run_name>/<stage>/.
    root: str = "checkpoints"
    run_name: str = "default"
    keep_last: int = 2               # complete checkpoints kept per stage directory (older ones are deleted)
    # Resume from the stage's own latest complete checkpoint when there is one.
    resume: bool = True
    # Resume from this stage or iter_* directory instead (e.g. a copy of another run).
    load: str | None = None
    # Write checkpoints in background processes (megatron-core async dist-checkpointing):
    # training continues while the files are written; the checkpoint is committed (renamed,
    # named in `latest`) only once every rank has finished writing.
    async_save: bool = False

    def check(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last}: must be >= 1")


@dataclass(frozen=True)
class ResilienceConfig:
    # A step whose loss or gradients are NaN/Inf on any rank is skipped (no optimizer update);
    # this many skipped steps in a row stop the run with an error (0: stop at the first).
    max_consecutive_nonfinite: int = 3

    def check(self) -> None:
        if self.max_consecutive_nonfinite < 0:
            raise ConfigError(f"resilience.max_consecutive_nonfinite={self.max_consecutive_nonfinite}: "
                              "must be >= 0 (0 stops at the first non-finite step)")


WANDB_MODES = ("online", "offline")


def _missing_package(section: str, module: str, extra: str) -> None:
    """A tracker enabled without its client: refused when the config is validated (a login node
    too), not when the stage reaches its first step. find_spec looks, it does not import."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"logging.{section}.enabled=true but the {module} package is not installed: "
                          f"pip install -e '.[{extra}]' (or set logging.{section}.enabled=false)")


@dataclass(frozen=True)
class WandbConfig:
    # Send every metrics.jsonl row, the resolved config and the stage summary to Weights & Biases
    # (rank 0; docs/logging.md). A resumed stage continues the same W&B run.
    enabled: bool = False
    project: str = "megatron_rlhf"  # the W&B project the runs go to
    entity: str | None = None  # null: the logged-in user's default entity
    # null: <checkpoint.run_name>/<stage>; the stages of one run share the W&B group checkpoint.run_name.
    run_name: str | None = None
    tags: list[str] = field(default_factory=list)  # the W&B run's tags
    # online | offline (sync later with `wandb sync`); null: W&B's own WANDB_MODE, else online.
    mode: str | None = None
    # Where W&B keeps its local files (a wandb/ folder is made there); null: the stage directory.
    dir: str | None = None

    def check(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ConfigError(f"logging.wandb.mode={self.mode!r}: choose one of {WANDB_MODES}, or null to "
                              "follow WANDB_MODE")
        if self.enabled:
            _missing_package("wandb", "wandb", "wandb")


@dataclass(frozen=True)
class MlflowConfig:
    # Send every metrics.jsonl row, the resolved config (as params) and the stage summary to
    # MLflow (rank 0; docs/logging.md). A resumed stage continues the same MLflow run.
    enabled: bool = False
    # null: MLFLOW_TRACKING_URI, else sqlite:///<checkpoint.root>/<checkpoint.run_name>/mlflow.db.
    tracking_uri: str | None = None
    experiment: str = "megatron_rlhf"  # the MLflow experiment the runs go to (made if missing)
    run_name: str | None = None  # null: <checkpoint.run_name>/<stage>
    # Run tags as "key=value" (a bare "name" is the tag name with an empty value).
    tags: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.enabled:
            _missing_package("mlflow", "mlflow", "mlflow")
            uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
            if uri.startswith("sqlite:"):  # the store is a database file, read with sqlalchemy
                _missing_package("mlflow", "sqlalchemy", "mlflow")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True  # write <stage dir>/tensorboard/ event files (rank 0)
    # Show every third-party warning at start-up (the CLI flag --verbose does the same);
    # false hides the known harmless ones (megatron_rlhf/logging/quiet.py lists them).
    verbose: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def check(self) -> None:
        self.wandb.check()
        self.mlflow.check()


@dataclass(frozen=True)
class Config:
    seed: int = 1234                 # random seed: the built-in task's data, fresh weights, data order, sampling
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Used by roles built outside a stage (smoke run, tests); each stage has its own.
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    # How the policy samples, in the RL stage and in the evaluations of RL and DPO.
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # What load_config found in the recipe besides the values (not a recipe key; see RecipeFacts).
    recipe: RecipeFacts = field(default_factory=lambda: RecipeFacts(), repr=False, compare=False,
                                metadata={"recipe_key": False})

    def to_dict(self) -> dict[str, Any]:
        """The settings, as a recipe would give them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "recipe"}

    @property
    def notes(self) -> tuple[str, ...]:
        return self.recipe.notes

    @property
    def given(self) -> frozenset[str]:
        return self.recipe.given

    @property
    def override_keys(self) -> frozenset[str]:
        return self.recipe.override_keys

    @property
    def hf_notes(self) -> tuple[str, ...]:
        return self.recipe.hf_notes


@dataclass(frozen=True)
class RecipeFacts:
    """What loading a recipe learned besides the values, fixed when it is loaded."""

    notes: tuple[str, ...] = ()  # on renamed (legacy) keys
    # The dotted keys the recipe itself (not a base recipe) and the overrides set: a rule may
    # depend on whether a value was chosen (e.g. a critic field with a critic-free algorithm).
    given: frozenset[str] = frozenset()
    # The dotted keys the command-line overrides set (a subset of `given`): a later stage refuses
    # these when they contradict what its run recorded, and replaces a recipe's (stage_data.py).
    override_keys: frozenset[str] = frozenset()
    # Architecture fields a recipe set that model.from_hf_config / init_from_hf replaced, and
    # the training values taken from its config.json (model.moe_aux_loss_coef) (printed by the
    # pre-flight check).
    hf_notes: tuple[str, ...] = ()
    # Where each dotted leaf the recipe chain, the overrides or config.json set came from: "recipe",
    # "base <file>", "override" or "config.json"; a leaf not here is its default (print-config).
    sources: dict[str, str] = field(default_factory=dict)

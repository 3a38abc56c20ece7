"""Time-shared colocation: which roles live on the device in which RL phase.

The schedule is data: PHASES below, narrowed by `phases_for` to the roles an algorithm builds. Entering a phase onloads what it needs and offloads
the rest: frozen roles move their parameters to (pinned) host memory; trained roles keep
their parameters but move optimizer states and gradient buffers off the device outside
`train`. Every phase records wall time and peak memory (device memory on GPU; on CPU the
moves are no-ops and the peak is the process's peak RSS so far).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from megatron_rlhf.resilience.preemption import interruptible
# phase -> roles whose parameters must be on the device; "+optimizer" marks roles that train.
PHASES: dict[str, dict[str, str]] = {
    "generate": {"actor": "params"},
    "score": {"actor": "params", "reference": "params", "reward": "params", "critic": "params",
              "holdout_reward": "params"},
    "train": {"actor": "params+optimizer", "critic": "params+optimizer"},
    "eval": {"actor": "params", "reward": "params", "holdout_reward": "params"},
    # a separate rollout engine (rollout.engine=vllm) reads the actor's weights here (refit)
    "sync": {"actor": "params"},
}
# Phases that change no weights and may wait long on environments, tools, reward services or
# the asynchronous engine's batch in flight: interruptible (resilience/preemption.py).
INTERRUPTIBLE_PHASES = ("generate", "score", "eval", "wait")


def phases_for(roles, reward_in_generate: bool = False, engine: str = "megatron",
               asynchronous: bool = False) -> dict[str, dict[str, str]]:
    """PHASES for the roles that exist (a critic-free algorithm has no critic); with dynamic
    sampling the reward model scores candidate groups during generate, so it is on the device.
    A separate engine generates from its own copy of the weights: generate needs no actor, eval
    only the judges, and there is a sync phase; the in-place engine has none. `asynchronous`
    (rl.max_staleness >= 1): between train and score the trainer only waits for the engine
    (`wait`), refits it and takes a buffered batch, so those phases keep score's roles in place
    instead of moving memory back and forth."""
    table = {phase: {r: need for r, need in needs.items() if r in roles} for phase, needs in PHASES.items()}
    if engine == "megatron":
        del table["sync"]
    else:
        del table["generate"]["actor"], table["eval"]["actor"]
    if reward_in_generate and "reward" in roles:
        table["generate"]["reward"] = "params"
    if asynchronous:
        for phase in ("wait", "sync", "generate"):
            table[phase] = dict(table["score"])
    return table


@dataclass
class PhaseStats:
    seconds: float = 0.0
    calls: int = 0
    peak_memory_bytes: int = 0
    tokens: int = 0


@dataclass
class ColocationScheduler:
    roles: dict  # name -> Role
    phases: dict[str, dict[str, str]] | None = None  # default: phases_for(roles)
    stats: dict[str, PhaseStats] = field(default_factory=dict)
    on_device: dict[str, str] = field(default_factory=dict)  # name -> "params" | "params+optimizer" | "host"

    def __post_init__(self):
        self.phases = phases_for(self.roles) if self.phases is None else self.phases
        unknown = {r for needs in self.phases.values() for r in needs} - set(self.roles)
        if unknown:
            raise ValueError(f"phase table names roles that do not exist: {sorted(unknown)}")
        self.on_device = {name: "params+optimizer" if role.trainable else "params"
                          for name, role in self.roles.items()}
        self._current, self._start = None, 0.0
        self._reported: dict[str, PhaseStats] = {}  # step_metrics: the totals at its last call

    def enter(self, phase: str) -> None:
        """Close the current phase (if any), move memory for `phase`, start its clock."""
        if self._current is not None:
            self.exit()
        for name, role in self.roles.items():
            self._place(name, role, self.phases[phase].get(name, "host"))
        reset_peak_memory()
        self._current, self._start = phase, time.perf_counter()

    def exit(self, tokens: int = 0) -> None:
        st = self.stats.setdefault(self._current, PhaseStats())
        st.seconds += time.perf_counter() - self._start
        st.calls += 1
        st.tokens += tokens
        st.peak_memory_bytes = max(st.peak_memory_bytes, peak_memory_bytes())
        self._current = None

    @contextmanager
    def phase(self, name: str):
        """`with sched.phase("score") as p: ...; p.tokens = n`: enter, run, exit with the tokens.
        Generating, scoring and eval change no weights and wait on environments, tools and
        reward services: SIGTERM ends them at once (resilience/preemption.py)."""
        with interruptible(f"the {name} phase") if name in INTERRUPTIBLE_PHASES else nullcontext():
            self.enter(name)
            counter = SimpleNamespace(tokens=0)
            yield counter
            self.exit(tokens=counter.tokens)

    def step_metrics(self) -> dict[str, float]:
        """The phases run since the last call (a step's): their seconds and tokens/s in that
        time, and each one's peak memory so far. A phase that did not run is left out, so a
        step without evaluation logs no eval numbers."""
        last = {p: self._reported.get(p, PhaseStats()) for p in self.stats}
        since = {p: (s.seconds - last[p].seconds, s.tokens - last[p].tokens)
                 for p, s in self.stats.items() if s.calls > last[p].calls}
        self._reported = {p: dataclasses.replace(s) for p, s in self.stats.items()}
        return {**{f"{p}_seconds": sec for p, (sec, _) in since.items()},
                **{f"{p}_tokens_per_s": tok / sec if sec else 0.0 for p, (sec, tok) in since.items()},
                **{f"{p}_peak_memory_bytes": self.stats[p].peak_memory_bytes for p in since}}

    def state_dict(self) -> dict:
        """The per-phase totals so far: a resumed run's summary then covers the whole run."""
        return {p: dataclasses.asdict(s) for p, s in self.stats.items()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {p: PhaseStats(**s) for p, s in state.items()}
        self._reported = {p: dataclasses.replace(s) for p, s in self.stats.items()}

    def _place(self, name: str, role, want: str) -> None:
        have = self.on_device[name]
        if have == want or getattr(role, "shares_weights_of", None):  # its weights move with their owner
            return
        if torch.cuda.is_available():  # on CPU everything already lives in host memory
            _move(role, have, want)
        self.on_device[name] = want

    def summary(self) -> dict[str, dict[str, float]]:
        return {p: {"seconds": s.seconds, "calls": s.calls, "peak_memory_bytes": s.peak_memory_bytes,
                    "tokens_per_s": s.tokens / s.seconds if s.seconds else 0.0}
                for p, s in self.stats.items()}


def reset_peak_memory() -> None:
    """Start a new device-memory peak (a process's peak RSS cannot be reset: on CPU the
    peak is the process's so far)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def current_memory_bytes() -> int:
    """Allocated device memory on GPU; the process's resident set on CPU (unlike its peak,
    ru_maxrss cannot give the current one)."""
    if torch.cuda.is_available():
        return int(torch.cuda.memory_allocated())
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _move(role, have: str, want: str) -> None:
    """GPU only (marked for GPU checks): megatron-core's RL offload helpers for trained roles,
    whole-module moves for frozen ones."""
    if role.trainable:
        if "optimizer" in have and "optimizer" not in want:
            role.optimizer.offload_to_cpu()
            role.model.offload_grad_buffers()
        elif "optimizer" in want and "optimizer" not in have:
            role.model.restore_grad_buffers()
            role.optimizer.restore_from_cpu()
        return
    role.module.to("cpu" if want == "host" else torch.cuda.current_device())

"""Reward-hacking alarm: the proxy reward (the combined reward of rl.rewards the policy is
trained on) rises while an independent judge of the same responses falls.

The independent signal is the built-in task's gold scorer when there is one, else the
holdout reward model (rm.holdout_fraction: trained on pairs the proxy never saw). Both
trends are least-squares slopes over the last rl.reward_hacking_window iterations; the
alarm is on while the proxy's slope is significantly positive and the independent one's
significantly negative (|t| of each slope >= T_MIN), so per-iteration noise does not trip it.
"""

from __future__ import annotations

import math

PROXY = "reward"
INDEPENDENT = ("gold_score", "holdout_rm_score")  # the first one a run measures
# |t| of each slope; ~2% one-sided at 8 dof. Over six healthy 40-iteration runs on the built-in
# task (PPO, GRPO, RLOO, REINFORCE++) it never fired; against a label-swapped RM it did by step 10.
T_MIN = 2.5


def slope_and_t(ys: list[float]) -> tuple[float, float]:
    """Least-squares slope of ys against 0..n-1 (per iteration) and its t-statistic
    (inf for a noiseless trend, 0 for a flat one)."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in range(n))
    slope = sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sxx
    residual = sum((y - ym - slope * (x - xm)) ** 2 for x, y in enumerate(ys))
    stderr = math.sqrt(residual / (n - 2) / sxx) if n > 2 else 0.0
    if stderr == 0.0:
        return slope, (0.0 if slope == 0 else math.copysign(math.inf, slope))
    return slope, slope / stderr


class RewardHackingAlarm:
    def __init__(self, window: int):
        self.window = window
        self.history: list[tuple[int, float, float]] = []  # (step, proxy, independent)
        self.independent: str | None = None
        self.active = False
        self.alarms: list[dict] = []

    def update(self, step: int, metrics: dict) -> str | None:
        """Add an iteration's metrics; sets metrics["reward_hacking"] (1.0 while the alarm
        is on, 0.0 otherwise) once a window is full. Returns a warning when the alarm turns on."""
        if self.independent is None:
            self.independent = next((k for k in INDEPENDENT if k in metrics), None)
        if not self.window or self.independent is None or PROXY not in metrics:
            return None
        self.history = [*self.history, (step, float(metrics[PROXY]), float(metrics[self.independent]))][-self.window:]
        if len(self.history) < self.window:
            return None
        proxy_slope, proxy_t = slope_and_t([h[1] for h in self.history])
        indep_slope, indep_t = slope_and_t([h[2] for h in self.history])
        hacking = proxy_t >= T_MIN and indep_t <= -T_MIN
        metrics["reward_hacking"] = float(hacking)
        warning = None
        if hacking and not self.active:
            alarm = {"step": step, "proxy": PROXY, "proxy_slope": proxy_slope, "independent": self.independent,
                     "independent_slope": indep_slope}
            self.alarms.append(alarm)
            warning = (f"warning: possible reward hacking at step {step}: {PROXY} rising {proxy_slope:+.4f}/iteration "
                       f"while {self.independent} falls {indep_slope:+.4f}/iteration over the last {self.window} "
                       f"iterations; read the samples, and consider a larger rl.kl_coef, a smaller "
                       f"rl.actor_optimizer.lr, or a better reward (rl.rewards)")
        self.active = hacking
        return warning

    def state_dict(self) -> dict:
        return {"history": list(self.history), "independent": self.independent, "active": self.active,
                "alarms": list(self.alarms)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [tuple(h) for h in state["history"]]
        self.independent, self.active, self.alarms = state["independent"], state["active"], list(state["alarms"])

"""Rank heartbeats for nvidia-resiliency-ext's ft_launcher: in-job restart of hung ranks.

Launch a stage under ft_launcher instead of torchrun (same arguments, `-m` works):

    ft_launcher --standalone --nproc-per-node=8 --max-restarts=3 \\
        --ft-initial-rank-heartbeat-timeout=1800 --ft-rank-heartbeat-timeout=900 \\
        -m megatron_rlhf sft --config pipelines/llama3_70b.yaml

(slurm/stage.sh does this per node with LAUNCHER=ft_launcher.) ft_launcher gives every
worker a rank monitor, reachable through the socket in $FT_RANK_MONITOR_IPC_SOCKET; the
trainers call `beat()` once per step (PPO also between phases). The launcher's timeouts
decide when a silent rank counts as hung and is killed, which restarts the worker group
(up to --max-restarts); the restarted stage resumes from its latest checkpoint:
  --ft-initial-rank-heartbeat-timeout  connect -> first beat: checkpoint load, first eval
                                       and first step
  --ft-rank-heartbeat-timeout          between beats: the longest step (PPO: phase),
                                       including a checkpoint save and an eval
Set both (0.4.1 defaults to 3600 s and 2700 s, newer releases to no timeout). A rank that
dies is noticed by the launcher at once, without any timeout. Outside ft_launcher the
heartbeat is inactive and its methods do nothing.
"""

from __future__ import annotations

import os
import time

SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for each worker
MIN_INTERVAL_S = 1.0  # beats closer together than this are not sent (one IPC round trip each)


class Heartbeat:
    def __init__(self, client=None):
        self._client = client
        self._last = float("-inf")

    @classmethod
    def from_env(cls) -> "Heartbeat":
        if not os.environ.get(SOCKET_ENV):
            return cls()
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()  # the initial-heartbeat timeout starts now
        return cls(client)

    @property
    def active(self) -> bool:
        return self._client is not None

    def beat(self) -> None:
        if self._client is None:
            return
        now = time.monotonic()
        if now - self._last >= MIN_INTERVAL_S:
            self._client.send_heartbeat()
            self._last = now

    def close(self) -> None:
        if self._client is not None:
            self._client.shutdown_workload_monitoring()
            self._client = None

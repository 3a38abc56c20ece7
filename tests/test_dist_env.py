"""Where the process's rank, world size and rendezvous come from under each launcher."""

import pytest

from megatron_rlhf.config import ConfigError
from megatron_rlhf.parallel import first_slurm_host, read_dist_env


def test_torchrun_environment():
    env = read_dist_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                         "MASTER_ADDR": "node7", "MASTER_PORT": "29500"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 4, 1, "node7", 29500)


def test_srun_one_task_per_device():
    env = read_dist_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_ID": "123", "MASTER_ADDR": "n1"})
    assert (env.rank, env.world_size, env.local_rank) == (9, 16, 1)
    assert env.master_port == 20123  # slurm/stage.sh's rule: 20000 + job id % 20000


def test_srun_without_master_addr_takes_the_first_node():
    env = read_dist_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5",
                         "SLURM_JOB_NODELIST": "gpu[017-018]"})
    assert env.master_addr == "gpu017"


@pytest.mark.parametrize("nodelist, first", [
    ("n1", "n1"), ("n[1-2]", "n1"), ("gpu[017-018,020],cpu1", "gpu017"), ("a1,b[2-3]", "a1"),
    ("rack[3-4]-node[09-12]", "rack3-node09"), ("node[5,7]", "node5"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_single_process_and_missing_port():
    env = read_dist_env({})
    assert (env.rank, env.world_size) == (0, 1) and env.master_port > 0
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        read_dist_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x"})

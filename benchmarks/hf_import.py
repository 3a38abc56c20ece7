"""Time and peak memory of a Hugging Face import and export, one process (TP1 PP1), CPU.

    python benchmarks/hf_import.py [--quick] [--hidden 1024 --layers 12 --vocab 32000] [--shard-mb 200]
        [--out benchmarks/results/hf_import.json]

Builds a random LlamaForCausalLM with transformers (GQA 16/4 heads, SwiGLU, untied, fp32),
saves it in ~--shard-mb MB safetensors shards (in a child process, so that its memory does not
count), then measures import_hf (build our actor + stream
the HF slices + save a dist checkpoint) and export_hf (per-layer read -> HF shards). Peak
RSS is the process maximum after each step (ru_maxrss: it only grows). Prints a table,
writes JSON. --quick: hidden 128, 2 layers, vocab 1000 (0.6M parameters) in 1 MB shards, so
import and export still read and write several shards (tests/test_benchmarks.py runs it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FULL = dict(hidden=1024, layers=12, vocab=32000, shard_mb=200)
QUICK = dict(hidden=128, layers=2, vocab=1000, shard_mb=1)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_hf_model(hf_dir: Path, hidden: int, layers: int, vocab: int, shard_mb: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 64, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 4, 1), max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(hf_dir, max_shard_size=f"{shard_mb}MB")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help=f"a 0.6M-parameter model ({QUICK}): does it run")
    ap.add_argument("--hidden", type=int, help=f"default {FULL['hidden']}")
    ap.add_argument("--layers", type=int, help=f"default {FULL['layers']}")
    ap.add_argument("--vocab", type=int, help=f"default {FULL['vocab']}")
    ap.add_argument("--shard-mb", type=int, help=f"shard size of the HF checkpoints, default {FULL['shard_mb']}")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/hf_import.json")
    ap.add_argument("--make-hf", type=Path, help=argparse.SUPPRESS)  # the child process's job
    args = ap.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.make_hf:
        print(make_hf_model(args.make_hf, args.hidden, args.layers, args.vocab, args.shard_mb))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = tmp / "hf"
        # the child builds the HF model while this process imports megatron
        child = subprocess.Popen([sys.executable, __file__, "--make-hf", str(hf_dir), f"--hidden={args.hidden}",
                                  f"--layers={args.layers}", f"--vocab={args.vocab}", f"--shard-mb={args.shard_mb}"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        from megatron_rlhf import parallel
        from megatron_rlhf.trainers.runner import start_distributed
        from megatron_rlhf.config import load_config
        from megatron_rlhf.convert import export_hf, hf_overrides, import_hf

        stdout, stderr = child.communicate()
        if child.returncode:
            raise SystemExit(f"building the HF model: exit {child.returncode}\n{stderr[-4000:]}")
        hf_shards = len(list(hf_dir.glob("*.safetensors")))
        params = int(stdout.split()[-1])
        rows.append({"step": "start (imports)", "seconds": None, "peak_rss_mib": peak_rss_mib()})
        cfg = load_config(None, hf_overrides(hf_dir))
        start_distributed(cfg)
        t0 = time.perf_counter()
        import_hf(cfg, hf_dir, tmp / "imported")
        rows.append({"step": "import_hf", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()})
        parallel.destroy()
        t0 = time.perf_counter()
        export_hf(tmp / "imported", "actor", tmp / "exported", model_cfg=cfg.model,
                  max_shard_bytes=args.shard_mb * 2**20)
        rows.append({"step": "export_hf", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()})
        exported_shards = len(list((tmp / "exported").glob("*.safetensors")))

    print(f"random Llama: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}), fp32, one process; {hf_shards} HF shards in, {exported_shards} out")
    print(f"{'step':<26} {'seconds':>8} {'peak RSS MiB':>12}")
    for r in rows:
        seconds = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        print(f"{r['step']:<26} {seconds:>8} {r['peak_rss_mib']:>12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "HF import/export, TP1 PP1, CPU", "quick": args.quick,
                                    "parameters": params, "hidden": args.hidden, "layers": args.layers,
                                    "vocab": args.vocab, "shard_mb": args.shard_mb, "hf_shards": hf_shards,
                                    "exported_shards": exported_shards, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

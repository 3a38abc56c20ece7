"""Time and peak memory of a Hugging Face import and export, one process (TP1 PP1), CPU.

    python benchmarks/hf_import.py [--hidden 1024 --layers 12 --vocab 32000] [--out benchmarks/results/hf_import.json]

Builds a random LlamaForCausalLM with transformers (GQA 16/4 heads, SwiGLU, untied, fp32),
saves it in ~200 MB safetensors shards (in a child process, so that its memory does not
count), then measures import_hf (build our actor + stream
the HF slices + save a dist checkpoint) and export_hf (per-layer read -> HF shards). Peak
RSS is the process maximum after each step (ru_maxrss: it only grows). Prints a table,
writes JSON.
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


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_hf_model(hf_dir: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 64, 1)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(heads // 4, 1), max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(hf_dir, max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/hf_import.json")
    ap.add_argument("--make-hf", type=Path, help=argparse.SUPPRESS)  # the child process's job
    args = ap.parse_args()
    if args.make_hf:
        print(make_hf_model(args.make_hf, args.hidden, args.layers, args.vocab))
        return
    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config
    from megatron_rlhf.convert import export_hf, hf_overrides, import_hf

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hf_dir = tmp / "hf"
        child = subprocess.run([sys.executable, __file__, "--make-hf", str(hf_dir), f"--hidden={args.hidden}",
                                f"--layers={args.layers}", f"--vocab={args.vocab}"],
                               check=True, capture_output=True, text=True)
        params = int(child.stdout.split()[-1])
        rows.append({"step": "start (imports)", "seconds": None, "peak_rss_mib": peak_rss_mib()})
        cfg = load_config(None, hf_overrides(hf_dir))
        parallel.initialize(cfg)
        t0 = time.perf_counter()
        import_hf(cfg, hf_dir, tmp / "imported")
        rows.append({"step": "import_hf", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()})
        parallel.destroy()
        t0 = time.perf_counter()
        export_hf(tmp / "imported", "actor", tmp / "exported", model_cfg=cfg.model, max_shard_bytes=200 * 2**20)
        rows.append({"step": "export_hf", "seconds": time.perf_counter() - t0, "peak_rss_mib": peak_rss_mib()})

    print(f"random Llama: {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}), fp32, one process")
    print(f"{'step':<26} {'seconds':>8} {'peak RSS MiB':>12}")
    for r in rows:
        seconds = f"{r['seconds']:.1f}" if r["seconds"] is not None else "-"
        print(f"{r['step']:<26} {seconds:>8} {r['peak_rss_mib']:>12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "HF import/export, TP1 PP1, CPU", "parameters": params,
                                    "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

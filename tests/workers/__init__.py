"""torchrun workers launched by the multi-process tests."""

import argparse
from pathlib import Path


def start_layout_worker():
    """Parse `--root DIR --layout NAME [--init] key=value...`, start distributed + megatron.
    Returns (args, config)."""
    from megatron_rlhf import parallel
    from megatron_rlhf.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--init", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(None, args.overrides)
    parallel.initialize(cfg)
    return args, cfg

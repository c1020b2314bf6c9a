"""The `cacheflow` command. Each pod of a deployment runs one subcommand of it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from cacheflow_common.errors import CacheFlowError


def default_cache_dir() -> Path:
    import os

    return Path(os.environ.get("CACHEFLOW_CACHE", Path.home() / ".cache" / "cacheflow"))


def _profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cacheflow_common.model.sources import load_model, parse_dtype
    from cacheflow_common.restore.profiler import ProfileSettings, profile_model
    from cacheflow_common.store.base import open_store

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=parse_dtype(args.dtype))
    settings = ProfileSettings(chunk_size=args.chunk_size, max_tokens=args.max_tokens)
    steps = 3 + len(settings.crossover_ratios)
    with tqdm(total=steps, disable=not sys.stderr.isatty(), desc="profiling") as bar:

        def progress(msg: str) -> None:
            bar.set_postfix_str(msg)
            bar.update(1)

        profile = profile_model(model, store=open_store(args.store), settings=settings,
                                model_name=args.model, progress=progress)
    out = Path(args.out) if args.out else default_cache_dir() / f"profile-{args.model.replace('/', '_')}.json"
    profile.save(out)
    print(f"profile written to {out}")
    for c in profile.crossovers:
        print(f"  link {c.link_bytes_per_s * 8 / 1e9:.3f} Gbit/s: L_delta = {c.l_delta} tokens")
    return 0


def _bench_restore(args: argparse.Namespace, rest: Sequence[str]) -> int:
    from cacheflow_bench import restore_single

    return restore_single.main(list(rest))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheflow", description="CacheFlow KV-cache restoration")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    prof = sub.add_parser("profile", help="measure this machine's compute/load costs and L_delta")
    prof.add_argument("--model", default="smollm2", help="tiny | smollm2 | a model directory (default: smollm2)")
    prof.add_argument("--dtype", default="auto", help="compute dtype; auto: bfloat16 where the CPU/GPU runs it fast")
    prof.add_argument("--chunk-size", type=int, default=256, help="restore chunk size in tokens")
    prof.add_argument("--max-tokens", type=int, default=4096, help="longest prefix timed for the fits")
    prof.add_argument("--store", default="memory", help="store to time reads from: memory | filesystem:DIR")
    prof.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    prof.add_argument("--out", default="", help="profile file (default: the cache directory)")

    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", choices=["restore"], help="restore: single-request restore vs the bound")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "profile":
            if rest:
                build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
            return _profile(args)
        return _bench_restore(args, rest)
    except CacheFlowError as exc:
        print(f"cacheflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

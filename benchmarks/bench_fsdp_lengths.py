"""An FSDP2 step over lengths: ``mbs="auto"``'s modelled peak against the live bytes per rank.

    OMP_NUM_THREADS=1 python benchmarks/bench_fsdp_lengths.py [--lengths 8 16 32 48]

The per-token MLP of ``tests/fsdp_memory_workers.py`` (4 blocks of width 256, each an FSDP2
unit, then the root), gbs 16 on 2 gloo ranks, Adam, compiled at 16 tokens with the length
symbolic (``dynamic=``) and ``mbs="auto"`` under a budget that binds nothing, then stepped
at each length: the modelled peak is the sharded step's length model at the call's length
(``length_plans.py``; ``cm.estimate``), the measured one the rank's live bytes (parameter
shards, optimizer state and batch share before the step, plus the allocator's peak above
them in a profiled step: ``fsdp_memory_workers.measure``). Once per FSDP2 setting
(``reshard_after_forward``, ``gradient_sync``). The test of the same figure:
``tests/test_fsdp_memory.py::test_the_length_model_of_a_sharded_step_matches_live_bytes``
(within 20%, as issue 18's model of a sharded step at the example's length).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import on_two_ranks  # noqa: E402

GBS = 16
SETTINGS = ((True, "step"), (False, "microbatch"))


def _rank(rank: int, world: int, out: str, lengths: list[int]) -> None:
    import fsdp_memory_workers as workers

    torch.set_num_threads(1)  # two ranks share the cores
    rows = [workers.measure(rank, world, GBS, 0, reshard, sync, length=length)
            for reshard, sync in SETTINGS for length in lengths]
    if rank == 0:
        with open(out, "w") as f:
            json.dump([{k: row[k] for k in ("length", "mbs", "k", "reshard_after_forward",
                                            "gradient_sync", "measured")}
                       | {"modelled": row["model"]["peak"]} for row in rows], f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 32, 48])
    rows = on_two_ranks(_rank, parser.parse_args().lengths)
    print(f"2 gloo ranks, gbs {GBS}, compiled at 16 tokens, rank 0's figures (MiB)")
    print(f"{'reshard':>8s} {'sync':>10s} {'length':>6s} {'mbs':>4s} {'modelled':>9s} "
          f"{'measured':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['reshard_after_forward']!s:>8s} {r['gradient_sync']:>10s} {r['length']:6d} "
              f"{r['mbs']:4d} {r['modelled'] / 2**20:9.2f} {r['measured'] / 2**20:9.2f} "
              f"{r['modelled'] / r['measured']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

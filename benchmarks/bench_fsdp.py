"""A model sharded with FSDP2 on 2 gloo ranks: mbcompile against a hand-written FSDP2 loop.

    python benchmarks/bench_fsdp.py                 # 20 rounds
    python benchmarks/bench_fsdp.py --rounds 40

Five contenders train the same small GPT, sharded the usual way (``fully_shard`` on
each block, then on the root), on the same global batch with the same MBS:

- the hand-written loop, the FSDP2 idiom for gradient accumulation:
  ``set_requires_gradient_sync(False)`` before every microbatch but the last, each
  microbatch's mean weighted by its share of the global token count (one all-reduce
  of the count per step, which an exact loop needs as the compiled step does; times
  the world size, since FSDP averages), units resharded after forward (FSDP2's
  default);
- mbcompile with ``reshard_after_forward=True``: like for like with the hand loop;
- mbcompile with ``reshard_after_forward="auto"``: as a user gets it (the cost model
  chooses the settings with the MBS; the output says which);
- the hand loop that syncs in every microbatch (FSDP2's default, torchtitan's: the
  gradients accumulate sharded), and mbcompile with ``gradient_sync="microbatch"``
  (units resharded after forward): like for like for models whose full gradients do
  not fit one device.

They alternate round by round (the order rotates), each step starts from a barrier,
and the ratio is the median of the per-round ratios of rank 0's wall time.
Collectives are counted per step from the c10d calls FSDP2 makes (reduce-scatter,
all-gather) and from all-reduce; the gradients (``full_tensor()``) of one more step of
each are compared.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import IGNORE_INDEX, make_tiny_gpt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, on_two_ranks  # noqa: E402

CONFIG = dict(vocab=1000, width=256, depth=4, heads=4, seq=128)
GBS, MBS, WARMUP = 16, 4, 2
ROUNDS = 20
KINDS = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
         "all_gather": ("all_gather_single", "all_gather_into_tensor"),
         "all_reduce": ("all_reduce",)}


class _Counted:
    """Counts the c10d calls by kind while active (FSDP2 calls them through ``dist``)."""

    def __enter__(self) -> dict[str, int]:
        self.counts = dict.fromkeys(KINDS, 0)
        self.saved = []
        for kind, names in KINDS.items():
            for name in names:
                real = getattr(dist, name, None)
                if real is not None:
                    self.saved.append((name, real))

                    def counted(*a, _real=real, _kind=kind, **k):
                        self.counts[_kind] += 1
                        return _real(*a, **k)

                    setattr(dist, name, counted)
        return self.counts

    def __exit__(self, *exc: object) -> None:
        for name, real in self.saved:
            setattr(dist, name, real)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _hand_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               sizes: tuple[int, ...], world: int, every: bool = False) -> torch.Tensor:
    """An FSDP2 user's exact step: gradient sync on the last microbatch only (``every``:
    in each microbatch)."""
    ids, labels = batch
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    slices = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
    total = torch.stack(counts).sum()
    dist.all_reduce(total)  # the global count, as the compiled step's packed sums
    loss = torch.zeros(())
    for k, ((a, b), count) in enumerate(zip(slices, counts)):
        model.set_requires_gradient_sync(every or k == len(slices) - 1)
        mean, _ = model(ids[a:b], labels[a:b])
        part = mean * (count * world / total)
        part.backward()
        loss += part.detach() / world
    return loss


PINNED = "mbcompile, reshard_after_forward=True"
AUTO = "mbcompile, reshard_after_forward='auto'"
HAND = "FSDP2 + set_requires_gradient_sync"
EVERY = "mbcompile, gradient_sync='microbatch'"
HAND_EVERY = "FSDP2, gradient sync in every microbatch"


def _rank(rank: int, world: int, out: str, rounds: int) -> None:
    torch.set_num_threads(1)
    model, batch = make_tiny_gpt(GBS, **CONFIG)
    twin = _shard(copy.deepcopy(model))  # the hand loop's, resharded after forward (default)
    twin_every = _shard(copy.deepcopy(model))
    auto_model = _shard(copy.deepcopy(model))
    every_model = _shard(copy.deepcopy(model))
    model = _shard(model)

    def compiled_step(module: torch.nn.Module, reshard: bool | str, sync: str = "step"
                      ) -> tuple[object, object]:
        cm = mbcompile.compile(module, GBS, world, MBS, example_inputs=batch,
                               backend="torch.distributed", outputs="loss",
                               reshard_after_forward=reshard,
                               gradient_sync=sync if reshard != "auto" else "auto")

        def step() -> object:
            loss, _ = cm(*local)
            loss.backward()
            return loss
        return cm, step

    cm, pinned = compiled_step(model, True)  # like for like: the hand loop's setting
    auto_cm, auto = compiled_step(auto_model, "auto")  # as a user gets it
    _, every = compiled_step(every_model, True, "microbatch")
    local = mbdist.shard(batch, cm.plan, rank)  # the steps read it when they run
    sizes = cm.plan.microbatch_sizes[rank]

    def hand() -> object:
        return _hand_step(twin, local, sizes, world)

    def hand_every() -> object:
        return _hand_step(twin_every, local, sizes, world, every=True)

    contenders = {PINNED: (model, pinned), AUTO: (auto_model, auto), HAND: (twin, hand),
                  EVERY: (every_model, every), HAND_EVERY: (twin_every, hand_every)}
    names = list(contenders)

    def before() -> None:  # untimed: all start from no gradients and from a barrier
        for module, _ in contenders.values():
            module.zero_grad(set_to_none=True)
        dist.barrier()

    timed = alternate({n: step for n, (_, step) in contenders.items()}, rounds, WARMUP, before)
    times, cpu = timed.wall, timed.cpu
    grads, counts = {}, {}
    for name in names:  # one more step of each from zero gradients: collectives, gradients
        module, step = contenders[name]
        module.zero_grad(set_to_none=True)
        with _Counted() as counts[name]:
            step()
        grads[name] = [p.grad.full_tensor() for p in module.parameters()]
    ref = grads[HAND]
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for name in (PINNED, AUTO, EVERY, HAND_EVERY) for a, b in zip(grads[name], ref))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "grad_diff": diff, "counts": counts,
                       "microbatches": len([s for s in sizes if s]),
                       "auto_chose": auto_cm.plan.reshard_after_forward,
                       "auto_sync": auto_cm.plan.gradient_sync}, f)


def versus_hand(rounds: int) -> None:
    got = on_two_ranks(_rank, rounds)
    times, cpu = got["times"], got["cpu"]
    hand = HAND
    print(f"2 gloo ranks, small GPT {CONFIG} sharded per block and at the root (5 FSDP "
          f"units), gbs {GBS}, mbs {MBS} ({got['microbatches']} microbatches per rank); "
          f"{rounds} rounds, contenders in turn, one torch thread per rank; rank 0's wall "
          "time per step, medians; '/ hand' is the median of the per-round ratios")
    print(f"{'contender':40s} {'median ms':>9s} {'/ hand':>6s} {'quartiles':>13s} "
          f"{'CPU ms':>7s} {'CPU / hand':>10s} {'RS':>3s} {'AG':>3s} {'AR':>3s}")
    for name, ts in times.items():
        base = HAND_EVERY if name == EVERY else hand  # like for like
        ratios = sorted(t / h for t, h in zip(ts, times[base]))
        q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
        cpu_ratio = statistics.median(c / h for c, h in zip(cpu[name], cpu[base]))
        c = got["counts"][name]
        print(f"{name:40s} {statistics.median(ts) * 1e3:9.1f} {statistics.median(ratios):6.3f} "
              f"{q1:6.3f}-{q3:.3f} {statistics.median(cpu[name]) * 1e3:7.1f} {cpu_ratio:10.3f} "
              f"{c['reduce_scatter']:3d} {c['all_gather']:3d} {c['all_reduce']:3d}")
    print(f"collectives per step per rank: RS reduce-scatter, AG all-gather, AR all-reduce. "
          f"Gradients (full_tensor()): mbcompile against the hand loop, largest difference "
          f"relative to the tensor's largest element {got['grad_diff']:.1e} (float32). "
          f"The hand loop reshards after forward (FSDP2's default), as the pinned mbcompile "
          f"does; 'auto' chose reshard_after_forward={got['auto_chose']}, gradient_sync="
          f"{got['auto_sync']!r}. The gradient_sync='microbatch' row's ratios are against "
          f"the hand loop that syncs in every microbatch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of the side-by-side")
    versus_hand(parser.parse_args().rounds)


if __name__ == "__main__":
    sys.exit(main())

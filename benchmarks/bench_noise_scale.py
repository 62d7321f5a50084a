"""What measuring the gradient noise scale costs: a training step with and without it.

    python benchmarks/bench_noise_scale.py

The small GPT of the overhead benchmark, gbs 32 over 2 systems at MBS 2, 4 and 16,
the two variants compiled from the same model and timed in turn (CPU time, one
torch thread, medians of per-round ratios). Measuring adds one squared-norm
reduction per parameter per microbatch and one over the step's gradient.
"""

from __future__ import annotations

import torch
from common import GBS, SYSTEMS, alternate, make_gpt, median, paired_ratio

import mbcompile

ROUNDS = 8


def main() -> None:
    torch.set_num_threads(1)
    model, batch = make_gpt()
    print(f"noise-scale measurement overhead, small GPT, gbs {GBS} over {SYSTEMS} systems, "
          f"{ROUNDS} rounds (CPU time)")
    for mbs in (2, 4, 16):
        plain = mbcompile.compile(model, GBS, SYSTEMS, mbs, example_inputs=batch)
        measured = mbcompile.compile(model, GBS, SYSTEMS, mbs, example_inputs=batch,
                                     measure_noise_scale=True)

        def step(cm: mbcompile.CompiledModule) -> None:
            loss, _ = cm(*batch)
            loss.backward()

        times = alternate({"plain": lambda cm=plain: step(cm),
                           "measured": lambda cm=measured: step(cm)},
                          ROUNDS, before=lambda: model.zero_grad(set_to_none=True))
        ratio = paired_ratio(times.cpu["measured"], times.cpu["plain"])
        print(f"  mbs {mbs:2d}: plain {median(times.cpu['plain']) * 1e3:7.1f} ms, measured "
              f"{median(times.cpu['measured']) * 1e3:7.1f} ms, ratio {ratio:.3f}; "
              f"B_simple {measured.noise_scale.b_simple:.4g}")


if __name__ == "__main__":
    main()

"""``mbcompile demo``: compile a tiny GPT, show its plan and graph, check one step
against an eager full-batch step, and train a few steps; no files needed."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from typing import Any

import torch
from rich.console import Console

import mbcompile.compiler as compiler
from mbcompile.check import relative_error
from mbcompile.models import make_tiny_gpt, token_batch
from mbcompile.planning.plan import make_plan, parse_mbs
from mbcompile.planning.systems import TEXT_FIELDS, SystemSpec, get_system
from mbcompile.training.cli.messages import EXIT_OK, CommandError, echo
from mbcompile.training.flags import GlobalFlags
from mbcompile.training.trainer import Trainer

__all__ = ["DEMO_OUTPUTS", "DEMO_TOLERANCE", "next_config", "run_demo"]

#: The demo's max relative difference above which it fails (float32 rounding is ~1e-7).
DEMO_TOLERANCE = 1e-4
#: What the demo's compiled step returns: the loss only, as the Trainer's step in part 4
#: does, so that both compiles see the same memory and make the same plan.
DEMO_OUTPUTS = "loss"


def next_config(gbs: int, num_csx: int, mbs: Any, system: SystemSpec | None = None) -> str:
    """The config the demo ends with: its own run as YAML, for ``mbcompile fit`` (printed,
    not a file of the repository, so the hint works wherever mbcompile is installed).

    ``system`` is the demo's made-up small system: its figures are written out (those
    that differ from ``SystemSpec``'s defaults, which the config's mapping fills in), so
    that the config plans what the demo ran instead of planning on the host.
    """
    lines = [f"model: tiny_gpt\nbatch_size: {gbs}\nnum_csx: {num_csx}\n"]
    if system is not None:
        lines.append("system:  # the demo's simulated systems: this host with less memory\n")
        lines.append(f"  name: {system.name}\n")
        for f in dataclasses.fields(SystemSpec):
            value = getattr(system, f.name)
            if f.name not in TEXT_FIELDS and value != f.default:
                lines.append(f"  {f.name}: {_number(value)}\n")
    # on the demo's systems the validation step would not fit (a forward-only step is
    # planned with the memory of a training step): the config trains only, as the demo does
    validate = ", val_steps: 0}  # as the demo: no validation" if system is not None else "}"
    lines.append("optimizer: {name: AdamW, lr: 3.0e-3}\n"
                 f"callbacks: [{{GlobalFlags: {{micro_batch_size: {mbs}}}}}]\n"
                 f"fit: {{max_steps: 20, checkpoint_every: 10{validate}\n")
    return "".join(lines)


def _number(value: float) -> str:
    """``value`` as YAML reads it back exactly: an integral figure without ``.0``."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclasses.dataclass(frozen=True)
class DemoSystem:
    """Simulated systems too small for a whole per-system batch, and the figures why."""

    spec: SystemSpec
    pbs: int  # the per-system batch
    whole: float  # the least modelled peak of a whole per-system batch, checkpointed or not


def _demo_system(model: Any, batch: Any, gbs: int, num_csx: int) -> DemoSystem | None:
    """The host with memory halfway between the least any split needs (MBS 1 with
    activation checkpointing) and the least a whole per-system batch needs (with or
    without it), or None when a system holds one sample and there is nothing to split.

    On the real host a tiny GPT fits whole, and auto rightly keeps it whole; the demo is
    about microbatching, so it runs on systems where no plan without a split fits, and
    auto's choice between the splits that do (with checkpointing or without) is its own.
    """
    pbs = make_plan(gbs, num_csx, "none").pbs
    if pbs < 2:
        return None

    def peak(mbs: int, recompute: bool) -> float:
        return compiler.compile(model, gbs, num_csx, mbs, example_inputs=batch,
                                compile_only=True, recompute=recompute, outputs=DEMO_OUTPUTS
                                ).estimate.memory.peak

    least = peak(1, True)
    whole = min(peak(pbs, True), peak(pbs, False))
    spec = dataclasses.replace(get_system("host"), name="demo", memory_bytes=(least + whole) / 2)
    return DemoSystem(spec, pbs, whole)


def _split_line(plan: Any) -> str:
    """What the plan does with each system's share, in words."""
    how = ", with activation checkpointing per block" if plan.recompute else ""
    if plan.num_microbatches == 1:
        return f"=> one microbatch per system: each system's whole share at once{how}"
    least, most = min(plan.per_system_batch_sizes), plan.pbs
    share = f"{most}" if least == most else f"{least} to {most}"
    return (f"=> each system's {share} samples run as {plan.num_microbatches} microbatches "
            f"of at most {plan.mbs}, one after the other{how}")


def run_demo(args: argparse.Namespace) -> int:
    gbs, num_csx = args.gbs, args.num_csx
    if parse_mbs(args.mbs).mode == "explore":
        raise CommandError(f"--mbs {args.mbs} plans only, and the demo trains: explore a "
                           "config's MBS with `mbcompile compile CONFIG.yaml --mbs explore "
                           "--compile-only`")
    if gbs < num_csx:
        raise CommandError(f"--gbs {gbs} is smaller than --num-csx {num_csx}: each system "
                           "needs at least one sample")
    model, batch = make_tiny_gpt(gbs, seed=0)
    reference = copy.deepcopy(model)  # the eager full-batch step runs on this copy
    params = sum(p.numel() for p in model.parameters())
    echo(f"mbcompile demo: TinyGPT ({params:,} parameters), {gbs} padded token sequences "
         f"(gbs {gbs}) over {num_csx} simulated systems, mbs={args.mbs}")
    echo()

    demo = _demo_system(model, batch, gbs, num_csx) if args.mbs == "auto" else None
    if demo is not None:
        echo(f"the simulated systems have {demo.spec.memory_bytes / 1e3:.0f} kB of memory each: "
             f"a whole per-system batch of {demo.pbs} needs {demo.whole / 1e3:.0f} kB even with "
             "activation checkpointing, so mbs=auto has to split it")
    elif args.mbs == "auto":
        echo(f"each system holds one sample, so there is nothing to split: try --gbs "
             f"{4 * num_csx} to see a split")
    system = None if demo is None else demo.spec
    started = time.perf_counter()
    cm = compiler.compile(model, gbs, num_csx, args.mbs, example_inputs=batch, system=system,
                          outputs=DEMO_OUTPUTS)
    echo(f"1. compiled in {time.perf_counter() - started:.2f} s")
    echo(str(cm.plan))
    echo(_split_line(cm.plan))
    echo()
    echo("2. the rewritten graph (the body submodule runs once per microbatch):")
    echo(cm.graph_module.code.strip())
    echo()

    echo("3. one training step, compiled against an eager full-batch step on a copy:")
    loss, _ = cm(*batch)
    loss.backward()
    ref_loss, _ = reference(*batch)
    ref_loss.backward()
    grads = [(n, p.grad, dict(reference.named_parameters())[n].grad)
             for n, p in model.named_parameters()]
    missing = [n for n, g, r in grads if g is None or r is None]
    if missing:
        raise CommandError(f"the compiled step left no gradient in {missing[0]!r}")
    loss_diff = relative_error(loss, ref_loss)
    grad_diff = max(relative_error(g, r) for _, g, r in grads)
    echo(f"   loss       compiled {loss.item():.6f}   full batch {ref_loss.item():.6f}   "
         f"max rel diff {loss_diff:.1e}")
    echo(f"   gradients  {len(grads)} tensors, max rel diff {grad_diff:.1e} "
         "(max |compiled - eager| / max |eager|, per tensor)")
    if not (loss_diff <= DEMO_TOLERANCE and grad_diff <= DEMO_TOLERANCE):
        raise CommandError(f"the compiled step differs from the full-batch step by more than "
                           f"{DEMO_TOLERANCE:g} (loss {loss_diff:.1e}, gradients "
                           f"{grad_diff:.1e}); please report this")
    echo(f"   equal to a full-batch step, to float32 rounding (tolerance {DEMO_TOLERANCE:g})")
    echo()

    echo(f"4. training {args.steps} steps (AdamW, a fresh compile inside the Trainer):")
    model.zero_grad(set_to_none=True)
    batches = [token_batch(gbs, seed=1 + i) for i in range(4)]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gbs=gbs,
                      num_csx=num_csx, callbacks=[GlobalFlags(micro_batch_size=args.mbs)],
                      console=Console(soft_wrap=True), system=system,
                      compile_options={"outputs": DEMO_OUTPUTS})
    rows = trainer.fit(batches, max_steps=args.steps)
    echo()
    echo(f"done: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} steps.")
    echo()
    echo("Next, train from a config: save these lines as run.yaml and run `mbcompile fit "
         "run.yaml` (`mbcompile --help` says where it writes metrics and checkpoints):")
    config = next_config(gbs, num_csx, args.mbs, system)
    echo("".join(f"  {line}\n" for line in config.splitlines()).rstrip())
    return EXIT_OK

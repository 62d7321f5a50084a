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
from mbcompile.planning.systems import get_system
from mbcompile.training.cli_messages import EXIT_OK, CommandError, echo
from mbcompile.training.flags import GlobalFlags
from mbcompile.training.trainer import Trainer

__all__ = ["DEMO_TOLERANCE", "run_demo"]

#: The demo's max relative difference above which it fails (float32 rounding is ~1e-7).
DEMO_TOLERANCE = 1e-4


def _demo_system(model: Any, batch: Any, gbs: int, num_csx: int) -> Any:
    """The host with memory halfway between the needs of MBS 1 and of no split.

    On the real host a tiny GPT fits whole, and auto rightly keeps it whole; the
    demo is about microbatching, so it runs on systems that need it.
    """
    peak = [compiler.compile(model, gbs, num_csx, mbs, example_inputs=batch, compile_only=True
                             ).estimate.memory.peak for mbs in (1, "none")]
    return dataclasses.replace(get_system("host"), name="demo", memory_bytes=sum(peak) / 2)


def run_demo(args: argparse.Namespace) -> int:
    gbs, num_csx = args.gbs, args.num_csx
    if gbs < num_csx:
        raise CommandError(f"--gbs {gbs} is smaller than --num-csx {num_csx}: each system "
                           "needs at least one sample")
    model, batch = make_tiny_gpt(gbs, seed=0)
    reference = copy.deepcopy(model)  # the eager full-batch step runs on this copy
    params = sum(p.numel() for p in model.parameters())
    echo(f"mbcompile demo: TinyGPT ({params:,} parameters), {gbs} padded token sequences "
         f"(gbs {gbs}) over {num_csx} simulated systems, mbs={args.mbs}")
    echo()

    system = _demo_system(model, batch, gbs, num_csx) if args.mbs == "auto" else None
    if system is not None:
        echo(f"the simulated systems have {system.memory_bytes / 1e3:.0f} kB of memory each: "
             "too little for a whole per-system batch, so mbs=auto has to split it")
    started = time.perf_counter()
    cm = compiler.compile(model, gbs, num_csx, args.mbs, example_inputs=batch, system=system)
    echo(f"1. compiled in {time.perf_counter() - started:.2f} s")
    echo(str(cm.plan))
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
                      console=Console(soft_wrap=True), system=system)
    rows = trainer.fit(batches, max_steps=args.steps)
    echo()
    echo(f"done: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} steps. "
         "Next: mbcompile fit examples/tiny_gpt.yaml")
    return EXIT_OK

"""``mbcompile compile``: compile a config's model and write its artifacts folder.

``plan.txt`` and ``plan.json``, the rewritten graph's code (``graph.py``) and the
original's (``original_graph.py``), the graph as ``graph.dot`` and ``graph.svg``, and
``explore.png`` when exploring MBS values; a rejected model gets ``rejected.dot`` and
``rejected.svg`` with the mixing op highlighted.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import mbcompile.compiler as compiler
from mbcompile.errors import MbcompileError, MixingError
from mbcompile.planning.plan import parse_mbs
from mbcompile.reports.exploration import plot
from mbcompile.training.batches import batch_args
from mbcompile.training.cli.messages import EXIT_OK, CommandError, echo
from mbcompile.training.config import (
    Config,
    build_data,
    build_model,
    build_optimizer,
    compile_options,
    load_config,
)

__all__ = ["compile_config", "run_compile", "write_artifacts"]


def _report(cm: Any) -> tuple[str, Any]:
    """``cm.report()`` of a compiled module or a ``Validation`` as (text, JSON-able): a
    ``Report`` is the text, and its ``to_dict()`` the data."""
    report = cm.report()
    return str(report), report.to_dict()


def _explore_plot(cm: Any, out: Path) -> Path | None:
    """``explore.png``: the plot of the module's exploration, when it explored."""
    if cm.exploration is None:
        return None
    return plot(cm.exploration, out / "explore.png")


def _write(path: Path, text: str, written: list[Path]) -> None:
    path.write_text(text)
    written.append(path)


def write_artifacts(cm: Any, out: Path, cfg: Config | None = None, mbs: Any = None
                    ) -> list[Path]:
    """The artifacts folder of a compiled module; returns the files written."""
    from mbcompile.reports.draw import draw

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    plan = getattr(cm, "plan", None)
    report_text, report_json = _report(cm)
    if plan is not None or report_text:
        text = "\n\n".join(t for t in (str(plan) if plan is not None else None, report_text)
                           if t)
        _write(out / "plan.txt", text + "\n", written)
        data = {"plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
                "report": report_json,
                "config": cfg.to_dict() if cfg is not None else None}
        _write(out / "plan.json", json.dumps(data, indent=2, default=str) + "\n", written)
    for attr, name in (("graph_module", "graph.py"), ("original_graph_module",
                                                      "original_graph.py")):
        try:
            gm = getattr(cm, attr, None)
        except MbcompileError:  # a validate-only result may have no rewritten graph
            gm = None
        if gm is not None:
            _write(out / name, gm.print_readable(print_output=False) + "\n", written)
    try:
        written += draw(cm, out / "graph.svg")  # graph.dot and graph.svg
    except (MbcompileError, AttributeError):  # a validate-only result has no rewritten graph
        pass
    if mbs is not None and parse_mbs(mbs).mode == "explore":
        picture = _explore_plot(cm, out)
        if picture is not None:
            written.append(picture)
    return written


def _first_batch(cfg: Config, phase: str) -> Any:
    for batch in build_data(cfg, phase):
        return batch
    raise CommandError(f"the {phase} data of {cfg.file} yielded no batches")


def compile_config(cfg: Config, out: Path, *, mbs: Any = None, phase: str = "train",
                   compile_only: bool = False, validate_only: bool = False) -> int:
    from mbcompile.reports.draw import draw

    mbs = cfg.flags(phase)["micro_batch_size"] if mbs is None else mbs
    if parse_mbs(mbs).mode == "explore" and not (compile_only or validate_only):
        # exploring compares MBS values and pins none: it plans, and builds nothing to run
        echo(f"mbs={mbs} explores MBS values and builds no module to run: compiling with "
             "--compile-only")
        compile_only = True
    planning_only = compile_only or validate_only
    if cfg.shard != "none" and not planning_only:
        raise CommandError(f"{cfg.file} shards the model (shard: {cfg.shard}), which happens on "
                           f"its ranks only: plan it here with --compile-only (FSDP2 over "
                           f"{cfg.num_csx} ranks, costed in this process), or train it with "
                           f"mbcompile fit {cfg.file} --nproc {cfg.num_csx}")
    if cfg.model_init == "meta" and not planning_only:
        raise CommandError(f"{cfg.file} builds the model on the meta device (model.init: meta), "
                           "without values to run: add --compile-only (or --validate-only) to "
                           "plan it")
    options = compile_options(cfg, compile_only=compile_only, validate_only=validate_only)
    if planning_only:  # a plan needs no ranks: the same systems, costed in this process
        options.pop("backend", None)
        if cfg.shard != "none":
            options["shard"] = cfg.shard
    model = build_model(cfg)
    model.train(phase == "train")
    # the plan holds the state of the optimizer fit would train with, as fit's Trainer does
    # (a name in compile_options, e.g. adamw-mixed, says what the instance cannot)
    if "optimizer" not in options:
        options["optimizer"] = build_optimizer(cfg, model)
    args, kwargs = batch_args(_first_batch(cfg, phase))
    if cfg.model_init == "meta":  # the example's shapes and dtypes, on the model's device
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    what = "validate-only" if validate_only else "compile-only" if compile_only else "compile"
    echo(f"{what}: {cfg.model} ({phase} phase), gbs {cfg.batch_size} over {cfg.num_csx} "
         f"system{'s' if cfg.num_csx != 1 else ''}, mbs={mbs}, outputs={options['outputs']}")
    started = time.perf_counter()
    try:
        cm = compiler.compile(model, cfg.batch_size, cfg.num_csx, mbs,
                              example_inputs=args or None, example_kwargs=kwargs or None,
                              **options)
    except MixingError as exc:
        try:
            files = draw(model, out / "rejected.svg", error=exc)
        except MbcompileError:
            files = []
        where = f"\n  the graph with the mixing op highlighted: {files[-1]}" if files else ""
        raise MixingError(f"{exc}{where}") from exc
    echo(f"done in {time.perf_counter() - started:.2f} s")
    plan = getattr(cm, "plan", None)
    if plan is not None:
        echo(str(plan))
    written = write_artifacts(cm, out, cfg, mbs)
    echo(f"artifacts in {out}/: " + ", ".join(p.name for p in written))
    return EXIT_OK


def run_compile(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    compile_only = args.compile_only or (cfg.compile_only and not args.validate_only)
    validate_only = args.validate_only or (cfg.validate_only and not args.compile_only)
    return compile_config(cfg, Path(args.out or cfg.output_dir), mbs=args.mbs, phase=args.phase,
                          compile_only=compile_only, validate_only=validate_only)

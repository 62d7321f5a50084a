"""Reports: ``cm.report()`` as text for people, ``cm.report("json")`` for tools.

Both come from one dict (:func:`report_dict`), so they never disagree::

    >>> cm = mbcompile.compile(model, 512, 4, "auto", system="a100-80gb",
    ...                        compile_only=True, example_inputs=batch)
    >>> print(cm.report())                       # plan, why, memory, time, candidates
    >>> json.loads(cm.report("json"))["plan"]["mbs"]

A ``validate_only=True`` compile returns a :class:`Validation`, which has the
same ``report()``.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from mbcompile.errors import MbcompileError
from mbcompile.passes.facts import FACT
from mbcompile.planning.cost import format_bytes, format_seconds
from mbcompile.planning.plan_text import describe_fsdp, describe_precision
from mbcompile.reports.exploration import table
from mbcompile.version import __version__

__all__ = ["Report", "Validation", "render", "report_dict", "validation_of"]

_FORMATS = ("text", "json")


def _check_format(fmt: str) -> None:
    if fmt not in _FORMATS:
        raise MbcompileError(f"unknown report format {fmt!r}; use 'text' or 'json'")


class Report(str):
    """The text report, which also hands out its data: ``to_dict()`` and ``to_json()``.

    A ``str`` subclass so that ``print(cm.report())`` and ``str(...)`` are the text.
    """

    _data: dict[str, Any]

    def __new__(cls, text: str, data: dict[str, Any]) -> Report:
        self = super().__new__(cls, text)
        self._data = data
        return self

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.to_json())  # a deep copy, JSON types only

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self._data, indent=indent, default=str)


# --------------------------------------------------------------------------- #
# Validation (validate_only=True)
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Validation:
    """The result of ``compile(..., validate_only=True)``: the model can be microbatched.

    Capture and batch analysis ran and raised nothing; no plan, no cost model, no
    rewrite.  ``graph_module`` is the captured graph with a batch fact on every
    node (``node.meta['mbcompile.fact']``).
    """

    model: str
    gbs: int
    num_csx: int
    graph_module: fx.GraphModule = field(repr=False)
    facts: tuple[tuple[str, int], ...]  # fact kind -> node count
    seconds: float
    note: str = ""  # set when the analysis rejected a split that this request never makes
    two_phase: bool = False  # the loss couples samples: a two-phase step runs it exactly

    def to_dict(self) -> dict[str, Any]:
        return {"status": "validated", "model": self.model, "gbs": self.gbs,
                "num_csx": self.num_csx, "nodes": len(self.graph_module.graph.nodes),
                "facts": dict(self.facts), "seconds": self.seconds, "note": self.note,
                "two_phase": self.two_phase}

    def report(self, fmt: str = "text") -> str:
        """Text (a :class:`Report`, which also has ``to_dict()``) or ``"json"``."""
        _check_format(fmt)
        if fmt == "json":
            return json.dumps(self.to_dict(), indent=2)
        facts = ", ".join(f"{n} {k}" for k, n in self.facts)
        what = ("can be microbatched as a two-phase step" if self.two_phase
                else "runs unsplit" if self.note else "can be microbatched")
        systems = "system" if self.num_csx == 1 else "systems"
        text = (f"mbcompile validation: {self.model} {what} "
                f"(gbs {self.gbs} over {self.num_csx} {systems})\n"
                f"  captured {len(self.graph_module.graph.nodes)} nodes: {facts}\n"
                f"  capture and batch analysis took {self.seconds:.2f} s; no plan was made "
                "(validate_only=True)")
        if self.note:
            text += f"\n  note: {self.note}"
        return Report(text, self.to_dict())

    def __str__(self) -> str:
        return self.report()


def validation_of(model_name: str, gbs: int, num_csx: int, gm: fx.GraphModule,
                  seconds: float, rejected: Exception | None = None,
                  two_phase: bool = False) -> Validation:
    """Summarise an analysed graph as a :class:`Validation`.

    ``rejected``: the analysis's error for a request that never splits the batch
    (one system, one microbatch), which therefore still runs; or, with ``two_phase``
    (the analysis's mode, decided there), for a graph that runs exactly as a two-phase step.
    """
    kinds = Counter(type(n.meta.get(FACT)).__name__ for n in gm.graph.nodes
                    if n.op not in ("output",) and FACT in n.meta)
    note = ""
    if rejected is not None and two_phase:
        first = str(rejected).splitlines()[0]
        note = (f"the loss couples samples ({first}); it runs exactly as a two-phase step: "
                "the per-sample part per microbatch, the coupled part once on the whole batch")
    elif rejected is not None:
        first = str(rejected).splitlines()[0]
        note = (f"the batch cannot be split ({first}); it runs because one system runs "
                "one microbatch")
    return Validation(model_name, gbs, num_csx, gm, tuple(sorted(kinds.items())), seconds,
                      note, two_phase=two_phase)


# --------------------------------------------------------------------------- #
# Compiled modules
# --------------------------------------------------------------------------- #


def report_dict(cm: Any) -> dict[str, Any]:
    """Everything the report says, as JSON-ready data.

    Reads ``cm.plan``, ``cm.selection`` (a :class:`~mbcompile.selection.Selection`,
    may be None), ``cm.compile_only`` and ``cm.module``.
    """
    plan = cm.plan
    selection = getattr(cm, "selection", None)
    compile_only = bool(getattr(cm, "compile_only", False))
    module = getattr(cm, "module", None)
    d: dict[str, Any] = {
        "mbcompile": __version__,
        "status": "compile_only" if compile_only else "compiled",
        "model": type(module).__name__ if module is not None else None,
        "plan": plan.to_dict(),
        "system": None, "estimate": None, "cost_model": None, "exploration": None,
        "pin": None, "cost_error": None,
    }
    if selection is None:
        return d
    d["system"] = selection.system.to_dict()
    d["cost_error"] = selection.cost_error
    if selection.estimate is not None:
        d["estimate"] = selection.estimate.to_dict()
    cost = selection.cost
    if cost is not None:
        f1 = cost.figures(1)
        d["cost_model"] = {
            **cost.static.__dict__, "fit": cost.fit_note, "probes": cost.probes_run,
            "per_sample": {"flops_forward": f1.flops_forward,
                           "flops_backward": f1.flops_backward,
                           "saved_bytes": cost.figures(2).saved_bytes - f1.saved_bytes
                           if cost.fitted else f1.saved_bytes},
        }
    if selection.exploration is not None:
        d["exploration"] = selection.exploration.to_dict()
        if selection.exploration.mode == "explore":
            d["pin"] = selection.exploration.best
    return d


def _provenance(spec: Any, exploration: Any) -> list[str]:
    """Where each kind of figure of the plan came from: the system, the optimizer, a clock."""
    from mbcompile.planning.fixes import describe_capacity, optimizer_source

    measured = ("microbatch loops timed on this host (measure=True), beside the model"
                if exploration is not None and exploration.measured
                else "nothing: every figure is modelled (measure=True times the candidates)")
    return [f"  memory: {describe_capacity(spec)}",
            f"  optimizer state: {optimizer_source(spec)}",
            f"  measured: {measured}"]


def _text(d: dict[str, Any], cm: Any) -> str:
    plan = cm.plan
    selection = getattr(cm, "selection", None)
    systems = "system" if plan.num_csx == 1 else "systems"
    name = d["system"]["name"] if d["system"] else "no cost model"
    tag = " [compile-only: reports, does not run]" if d["status"] == "compile_only" else ""
    lines = [f"mbcompile report: {d['model']}, gbs {plan.gbs} over {plan.num_csx} {systems} "
             f"({name}){tag}",
             f"plan: mbs {plan.mbs} (requested {plan.requested_mbs!r}), "
             f"{plan.num_microbatches} microbatch{'es' if plan.num_microbatches != 1 else ''} "
             f"per system, per-system batch {plan.pbs} "
             f"(sizes {', '.join(map(str, plan.per_system_batch_sizes[:8]))}"
             f"{', ...' if plan.num_csx > 8 else ''})",
             f"  why: {plan.reason}"]
    if plan.precision is not None:
        lines.append(f"  precision: {describe_precision(plan.precision)}")
    if plan.reshard_after_forward is not None:
        lines.append(f"  fsdp: {describe_fsdp(plan)}")
    lines += [f"  warning: {w}" for w in plan.warnings]
    if selection is None:
        return "\n".join(lines)
    spec = selection.system
    lines.append(f"system: {spec.describe()}")
    lines.append(f"  source: {spec.source}")
    lines += _provenance(spec, selection.exploration)
    if d["cost_error"]:
        lines.append(f"cost model: unavailable ({d['cost_error']})")
    e = selection.estimate
    if e is not None:
        m, t = e.memory, e.time
        from mbcompile.planning.fixes import describe_memory

        state = (f"fits, {format_bytes(m.headroom)} free" if m.fits
                 else f"DOES NOT FIT by {format_bytes(-m.headroom)}")
        lines.append(f"memory (modelled, per system): {format_bytes(m.peak)} of "
                     f"{format_bytes(m.capacity)} ({state})")
        lines.append(f"  {describe_memory(m)}")
        lines.append(
            f"time (modelled step): {format_seconds(t.step)} = microbatches "
            f"{format_seconds(t.compute + t.overhead)} (roofline {format_seconds(t.compute)}"
            f" + overheads {format_seconds(t.overhead)}) + gradient accumulation "
            f"{format_seconds(t.accumulate)} + all-reduce {format_seconds(t.allreduce)}"
            + (f" ({format_seconds(t.allreduce_hidden)} of it behind the last backward)"
               if t.allreduce_hidden else "") + " + "
            f"optimizer {format_seconds(t.optimizer)}"
            + (f" + FSDP2 all-gathers {format_seconds(t.allgather)}" if t.allgather else "")
            + (f" + joining outputs {format_seconds(t.join)}" if t.join else "")
            + (f" + two-phase extra forward {format_seconds(t.extra_forward)} + coupled part "
               f"{format_seconds(t.coupled)}" if t.extra_forward or t.coupled else "")
            + f"; {t.samples_per_second:.4g} samples/s; {t.bound}-bound")
    c = d["cost_model"]
    if c is not None:
        ps = c["per_sample"]
        lines.append(
            f"cost model: {c['num_params']:,} parameters ({format_bytes(c['param_bytes'])}); "
            f"per sample {ps['flops_forward']:.3g} FLOPs forward + "
            f"{ps['flops_backward']:.3g} backward, {format_bytes(ps['saved_bytes'])} saved for "
            f"backward, {format_bytes(c['output_bytes_per_sample'])} of outputs")
        lines.append(f"  {c['fit']}; {c['probes']} fake-tensor probes")
    x = selection.exploration
    if x is not None and (x.mode in ("auto", "explore") or x.measured):
        label = "candidates auto evaluated" if x.mode == "auto" else "exploration"
        lines.append(f"{label}:")
        lines += ["  " + row for row in table(x).splitlines()]
        if x.measured and x.measured_best is not None:
            lines.append(f"  measured fastest on this host: mbs={x.measured_best}")
    if d["pin"] is not None:
        lines.append(f"pin: compile again with mbs={d['pin']}")
    return "\n".join(lines)


def render(cm: Any, split: Any = None, last: int | None = None, fmt: str = "text") -> str:
    """The report of compiled module ``cm``: text (a :class:`Report`) or ``"json"``;
    ``split``: how its calls' split follows their length (``length_plans.CallSplit``),
    ``last`` the last call's length."""
    _check_format(fmt)
    d = report_dict(cm)
    extra = _batch_guidance(cm, d) + _lengths(cm, split, last, d)
    if fmt == "json":
        return json.dumps(d, indent=2, default=str)
    return Report("\n".join([_text(d, cm), *extra]), d)


def _batch_guidance(cm: Any, d: dict[str, Any]) -> list[str]:
    """Tokens per batch and the noise-scale advice (issue 9), into ``d`` and as text lines."""
    from mbcompile.execution.noise import advice

    lines = []
    plan = cm.plan
    counts = cm.token_counts() if hasattr(cm, "token_counts") and not getattr(
        cm, "compile_only", False) else None
    if plan.tokens_per_sample is not None:
        tokens = plan.to_dict()["tokens"]
        d["tokens"] = {**tokens, "counted_last_step": counts}
        lines.append(f"tokens: {plan.tokens_per_sample} per sample, {tokens['global']} per global "
                     f"batch, per system {', '.join(map(str, tokens['per_system']))}"
                     + (f"; the loss counted {counts['global']:.0f} (non-padding) in the last "
                        f"step, per system {', '.join(f'{c:.0f}' for c in counts['per_system'])}"
                        if counts else ""))
    noise = getattr(cm, "noise_scale", None)
    if noise is not None:
        low, high = noise.spread()
        d["noise_scale"] = {"b_simple": noise.b_simple, "trace_sigma": noise.trace_sigma,
                            "grad_norm_sq": noise.grad_norm_sq, "steps": noise.steps,
                            "spread": [low, high],
                            "advice": advice(noise, "tokens" if plan.tokens_per_sample
                                             else "samples")}
        lines.append("batch size: " + d["noise_scale"]["advice"])
    return lines


def _lengths(cm: Any, split: Any, last: int | None, d: dict[str, Any]) -> list[str]:
    """How the split follows the length (issue 34), into ``d`` and as text lines."""
    if split is None:
        return []
    rule = split.split
    d["lengths"] = {"mode": rule.mode, "note": rule.note or None, "last_length": last,
                    "rows": [{"shortest": low, "longest": high, "mbs": mbs,
                              "num_microbatches": k} for low, high, mbs, k in rule.rows()]}
    lines = rule.describe()
    if last is not None:
        plan = cm.plan
        lines.append(f"  last call: length {last}, mbs {plan.mbs}, {plan.num_microbatches} "
                     f"microbatch{'es' if plan.num_microbatches != 1 else ''} per system")
    return lines

"""Forward-modes pass: grad-mode regions inside forward become ``detach`` on what they read.

A forward may switch grad mode around part of its work (a distillation teacher
under ``torch.no_grad()``, ``torch.set_grad_enabled(False)``, ``torch.inference_mode()``,
a ``@torch.no_grad()`` helper, an EMA update of frozen parameters). Values computed
under no-grad are the same numbers; autograd only records nothing for them. So the
region is kept exactly by detaching every tensor it reads from outside it: nothing
inside then requires grad, its results come back with eager's ``requires_grad=False``,
parameters used only there keep ``.grad`` None, and no global grad mode is switched
while a graph runs (a failing microbatch cannot leave grad mode off). Every later pass
(the rewrite, two-phase steps, ``recompute``, the joint graph of ``torch_compile``)
sees plain ``detach`` nodes. A tensor that requires grad written in place inside a region
(``h.clamp_(-0.1, 0.1)``) keeps eager's gradient after it: its later uses read the written
value with ``h``'s gradient (``no_grad_writes.py``, run first).

Before (traced under ``with torch.no_grad(): t = self.teacher(x)``)::

    teacher = self.teacher(x)                 # meta[GRAD_ENABLED] = False
    student = self.student(x)

After (``detach_grad_free_inputs``)::

    detach = aten.detach(x)
    teacher = self.teacher(detach)            # reads no tensor that requires grad
    student = self.student(x)

How each capture records the regions:

- ``torch.fx``: the tracer stamps every node with the grad mode it was created under
  (``GRAD_ENABLED``; the context managers really switch grad mode while tracing).
  Autocast regions change what each op computes, which a symbolic trace cannot see:
  such a forward is refused under fx (``capture="auto"`` then uses ``torch.export``).
- ``torch.export``: grad-mode regions are ``wrap_with_set_grad_enabled`` higher-order
  ops; their tensor arguments are detached before the program is lowered (lowering
  would otherwise inline the region and forget it was no-grad). Autocast regions
  (``wrap_with_autocast``) are lowered to the explicit casts autocast makes.
  ``torch.inference_mode()``, which export drops without a trace, is traced as
  ``torch.no_grad()`` (the same values; eager's inference tensors differ only in which
  later uses raise).
"""

from __future__ import annotations

import contextlib
import operator
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from .errors import CaptureError
from .facts import GRAD_ENABLED, SHAPES
from .hook_sandbox import call_sandboxed, hooks_sandboxed, runs_per_microbatch
from .no_grad_writes import straight_through_region, straight_through_writes
from .ops import TensorHook
from .python_state import MODULE_INTERNALS
from .sources import source_line

__all__ = ["GRAD_ENABLED", "autocast_nodes", "autocast_state", "detach_grad_free_inputs",
           "detach_no_grad_regions", "differentiation_error", "differentiation_refused",
           "check_layer_hooks", "check_tensor_hooks", "inference_mode_as_no_grad",
           "stamp_modes"]

_AUTOCAST = "mbcompile.autocast"
_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[Any, ...]:
    """What autocast does right now, per device type: off, or on with its dtype."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES
                 if torch.is_autocast_enabled(d))


def stamp_modes(node: fx.Node, ambient_autocast: tuple[Any, ...]) -> None:
    """Record on a node just traced the grad mode and autocast state it was created under."""
    node.meta[GRAD_ENABLED] = torch.is_grad_enabled()
    state = autocast_state()
    if state != ambient_autocast:
        node.meta[_AUTOCAST] = state


def autocast_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes a trace stamped as created inside an autocast region of forward."""
    return [n for n in graph.nodes if n.meta.get(_AUTOCAST)]


def _outside(node: fx.Node) -> bool:
    """Whether a value is made outside every no-grad region: inputs and attributes always are
    (fx creates a parameter's ``get_attr`` where it is first used, maybe inside a region)."""
    return node.op in ("placeholder", "get_attr") or node.meta.get(GRAD_ENABLED, True)


def detach_grad_free_inputs(graph: fx.Graph, is_tensor: Callable[[fx.Node], bool]) -> int:
    """Detach every tensor that a node traced under no-grad reads from outside its region.

    A node traced with grad on (``torch.enable_grad()`` nested in a no-grad region) reads
    its inputs as they are. Returns how many ``detach`` nodes were inserted.
    """
    kept = straight_through_writes(graph)  # a write into h keeps h's gradient after it
    made: dict[fx.Node, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output") or node.meta.get(GRAD_ENABLED, True):
            continue
        for arg in node.all_input_nodes:
            if not _outside(arg) or not is_tensor(arg):
                continue
            if arg not in made:
                with graph.inserting_after(arg):
                    made[arg] = graph.call_function(torch.ops.aten.detach.default, (arg,))
                made[arg].meta = {**arg.meta, GRAD_ENABLED: False,
                                  "stack_trace": node.meta.get("stack_trace")}
            node.replace_input_with(arg, made[arg])
    return len(made) + kept


def _is_region(node: fx.Node) -> bool:
    return (node.op == "call_function"
            and node.target is torch.ops.higher_order.wrap_with_set_grad_enabled)


def detach_no_grad_regions(gm: fx.GraphModule) -> None:
    """Detach the tensor arguments of each of export's no-grad regions, in ``gm`` and in the
    graphs its regions call (a no-grad region inside an autocast region). Export ends a
    no-grad region where ``torch.enable_grad()`` starts inside it, so no region holds a part
    that needs gradients."""
    for module in list(gm.modules()):
        if not isinstance(module, fx.GraphModule):
            continue
        graph = module.graph
        for node in list(graph.nodes):
            if not _is_region(node) or node.args[0]:
                continue
            straight_through_region(module, node)  # what it writes keeps its gradient
            args = list(node.args)
            for i, arg in enumerate(args[2:], start=2):
                if isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor):
                    with graph.inserting_before(node):
                        detached = graph.call_function(torch.ops.aten.detach.default, (arg,))
                    detached.meta = dict(arg.meta)
                    args[i] = detached
            node.args = tuple(args)
        module.recompile()


@contextlib.contextmanager
def inference_mode_as_no_grad() -> Iterator[None]:
    """While export traces: ``torch.inference_mode()`` regions behave as ``torch.no_grad()``
    (export records no-grad regions, and drops inference-mode ones without a trace)."""
    cls = torch.autograd.grad_mode.inference_mode
    enter, exit_ = cls.__enter__, cls.__exit__

    def __enter__(self: Any) -> None:
        self._mbcompile_no_grad = torch.no_grad() if self.mode else contextlib.nullcontext()
        self._mbcompile_no_grad.__enter__()

    def __exit__(self: Any, *exc: Any) -> None:
        self._mbcompile_no_grad.__exit__(*exc)

    cls.__enter__, cls.__exit__ = __enter__, __exit__
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, exit_


class differentiation_refused(TorchFunctionMode):  # noqa: N801 (used as a context manager)
    """While torch.export traces: ``torch.autograd.grad`` (a gradient penalty) or a backward
    inside forward is an error at its line.

    Export cannot keep a differentiation nested in forward (it would trace the inner
    backward's ops as constants of a fake run); the fx capture keeps ``torch.autograd.grad``
    as a node the body calls per microbatch (``penalties.py``). ``fx_error`` says why fx did
    not capture the model first. A torch-function mode sees the call whatever name the model
    imported it under, and patches nothing of torch's.
    """

    def __init__(self, model_name: str, fx_error: BaseException | None = None) -> None:
        super().__init__()
        self.model_name = model_name
        self.fx_error = fx_error

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func in _DIFFERENTIATIONS:
            raise differentiation_error(self.model_name, func is torch.autograd.grad,
                                        self.fx_error)
        if func is torch._make_dual:  # forward_ad.make_dual; torch.func.jvp, jacfwd, hessian
            from .sources import user_frame

            tried = (f" torch.fx failed first: {str(self.fx_error).rstrip('.')}."
                     if self.fx_error else "")
            raise CaptureError(
                f"{self.model_name}.forward runs forward-mode AD at "
                f"{user_frame(traceback.extract_stack()[:-1])} (torch.func.jvp, jacfwd, "
                "hessian or torch.autograd.forward_ad.make_dual), which neither torch.export "
                f"nor torch.fx captures.{tried} Fix: compute it outside the compiled module, "
                "or take the derivative with torch.autograd.grad(..., create_graph=True) "
                "under capture='fx'")
        return func(*args, **(kwargs or {}))


_DIFFERENTIATIONS = (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward)


def differentiation_error(model_name: str, penalty: bool = False,
                          fx_error: BaseException | None = None) -> CaptureError:
    """The error for a differentiation inside forward, at the user's line: a backward
    (``penalty=False``: it writes ``.grad`` in the middle of the step), or a
    ``torch.autograd.grad`` that torch.export met (only the fx capture keeps it)."""
    from .sources import user_frame

    where = user_frame(traceback.extract_stack()[:-1])
    if not penalty:
        return CaptureError(
            f"{model_name}.forward runs a backward inside forward at {where} "
            "(torch.autograd.backward or Tensor.backward): it accumulates into .grad in the "
            "middle of the step, which the compiled step's own backward per microbatch would "
            "mix with. Fix: take the gradient with torch.autograd.grad(..., "
            "create_graph=True) and put it into the loss, or run that backward outside the "
            "compiled module")
    tried = f" torch.fx failed first: {fx_error}." if fx_error is not None else ""
    return CaptureError(
        f"{model_name}.forward differentiates inside forward at {where} (a gradient "
        "penalty: torch.autograd.grad), which torch.export cannot capture; the torch.fx "
        f"capture keeps it, per microbatch, when the differentiated function is per sample."
        f"{tried} Fix: make forward traceable by torch.fx (capture='fx'; draw noise with "
        "torch.rand_like(x) rather than torch.rand(x.size(0), ...)), or compute the penalty "
        "outside the compiled module")


def check_tensor_hooks(graph: fx.Graph, model_name: str) -> None:
    """Refuse a tensor hook forward registers unless it is linear in the gradient and keeps
    samples apart: it runs on each microbatch's gradient (``ops.TensorHook``), which equals
    the full batch's only for such a hook. Checked on random gradients of the value's shape
    at the full batch (``SHAPES``, from the shape pass): ``hook(2a + 3b) = 2 hook(a) +
    3 hook(b)``, and the hook of the batch equals the hooks of its two halves, joined."""
    for node in graph.nodes:
        if not isinstance(node.target, TensorHook):
            continue
        info = node.meta.get(SHAPES)
        if not getattr(info, "is_tensor", False) or not (info.dtype.is_floating_point):
            continue
        wrote: list[str] = []
        why = _hook_misbehaves(node.target.fn, info, wrote)
        if wrote and not runs_per_microbatch(node.target.fn):
            raise CaptureError(
                f"{model_name}.forward registers a tensor hook at {source_line(node)} that "
                f"writes Python state ({wrote[0]}); the compiled step runs it on each "
                "microbatch's gradient, where eager runs it once on the whole batch's. Fix: "
                "read the gradient after backward (h.retain_grad(), then h.grad), or mark "
                "the hook mbcompile.per_microbatch(hook) to run it on each microbatch as "
                "written (it was called on made-up gradients here, with what it wrote put "
                "back)")
        if why is not None:
            raise CaptureError(
                f"{model_name}.forward registers a tensor hook at {source_line(node)} that "
                f"{why}; the compiled step runs it on each microbatch's gradient, which "
                "equals the full batch's only for a hook linear in the gradient that keeps "
                "samples apart (a scale, a mask, a sign flip). Fix: apply the transformation "
                "to the gradients after backward (e.g. clip in the optimizer step), or "
                "compile without the hook")


def _hook_misbehaves(fn: Any, info: Any, wrote: list[str]) -> str | None:
    """Why ``fn`` cannot run per microbatch, or None; called sandboxed (it changes
    nothing), what it would have written put in ``wrote``."""
    dtype = torch.float64  # the check's own precision, whatever the model's
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(info.shape_a, generator=generator, dtype=dtype) for _ in range(2))

    def hooked(g: torch.Tensor) -> torch.Tensor:
        out, what = call_sandboxed(fn, None, (g.clone(),), module_first=False)
        if what is not None:
            wrote.append(what)
        return g if out is None else out

    def close(x: torch.Tensor, y: torch.Tensor) -> bool:
        return bool(torch.allclose(x, y, rtol=1e-9, atol=1e-12 * float(y.abs().max()) + 1e-300))

    if not close(hooked(2 * a + 3 * b), 2 * hooked(a) + 3 * hooked(b)):
        return "is not linear in the gradient"
    dim = next((i for i, (x, y) in enumerate(zip(info.shape_a, info.shape_b)) if x != y), None)
    if dim is not None and info.shape_a[dim] >= 2:
        half = info.shape_a[dim] // 2
        parts = torch.cat([hooked(a.narrow(dim, 0, half)),
                           hooked(a.narrow(dim, half, info.shape_a[dim] - half))], dim)
        if not close(parts, hooked(a)):
            return "mixes the samples of the batch"
    return None


def check_layer_hooks(gm: fx.GraphModule, model_name: str) -> None:
    """Refuse a layer's hook that a microbatch would change: a layer the graph calls as one
    node runs its hooks at each call, on each microbatch, and the batch rule of the layer
    knows nothing of them. Checked on a copy of the layer, on a random batch of the input's
    full-batch shape (``SHAPES``): the batch's output must equal its two halves' outputs,
    joined (``out - out.mean(0)`` does not), and with backward hooks, so must the gradient
    that reaches the input (``grad - grad.mean(0)`` does not).

    Forward hooks added to such a layer after compile are not called on made-up data
    (tests and users inject counting or failing hooks): they run as written, and one that
    changes what the layer returns is refused at its first call inside a step
    (``mbcompile.execution.live_hooks``). Backward hooks added later recompile."""
    for node in gm.graph.nodes:
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        layer = gm.get_submodule(str(node.target))
        if not (layer._forward_pre_hooks or layer._forward_hooks or layer._backward_hooks
                or layer._backward_pre_hooks):
            continue
        info = getattr(node.args[0], "meta", {}).get(SHAPES)
        if not getattr(info, "is_tensor", False) or not info.dtype.is_floating_point:
            continue
        dim = next((i for i, (x, y) in enumerate(zip(info.shape_a, info.shape_b)) if x != y),
                   None)
        if dim is None or info.shape_a[dim] < 2:
            continue
        what = _mixed_by_hooks(layer, info, dim)
        if what is None:
            continue
        raise CaptureError(
            f"{model_name}: a hook of {type(layer).__name__} {node.target!r} changes {what} "
            f"depending on the whole batch ({source_line(node)}); the layer runs with its "
            "hooks once per microbatch, so the step would differ from eager. Fix: register "
            "the hook on a module of your own that wraps the layer (its hooks are traced and "
            "judged with the model), or remove it while training")


def _mixed_by_hooks(layer: torch.nn.Module, info: Any, dim: int) -> str | None:
    """What the layer's hooks make depend on the whole batch (None: nothing found): the
    layer is run on a random batch and on its two halves, and with backward hooks the
    gradient of a random seed is taken back to the input too."""
    probe = _copy_of(layer)  # its running statistics and buffers stay the user's
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(info.shape_a, generator=generator, dtype=info.dtype)
    n = info.shape_a[dim]
    backward = bool(layer._backward_hooks or layer._backward_pre_hooks)
    seed: torch.Tensor | None = None
    outs, grads = [], []
    with hooks_sandboxed(probe, layer):  # the user's hooks, on made-up data: they change nothing
        wiring = [(d, dict(d)) for k, d in vars(probe).items()
                  if k in MODULE_INTERNALS and isinstance(d, dict)]
        for start, size in ((0, n), (0, n // 2), (n // 2, n - n // 2)):
            _rewired_back(wiring)
            piece = x.narrow(dim, start, size).detach().requires_grad_(backward)
            with torch.enable_grad():  # a hook may register a tensor hook on the output
                out = probe(piece)
            if not isinstance(out, torch.Tensor) or out.dim() <= dim:
                return None  # not a tensor-to-tensor layer: nothing this check can compare
            outs.append(out.detach())
            if backward and out.requires_grad and (start, size) == (0, n):
                seed = torch.randn(out.shape, generator=generator, dtype=out.dtype)
            if (seed is not None and out.requires_grad and seed.shape[dim] == n
                    and out.shape[dim] == size):
                grads.append(torch.autograd.grad(out, piece, seed.narrow(dim, start, size),
                                                 allow_unused=True)[0])
    if not _joined_equal(outs, dim):
        return "what the layer returns"
    if len(grads) == 3 and all(g is not None for g in grads) and not _joined_equal(grads, dim):
        return "the gradient it passes back"
    return None


def _rewired_back(wiring: list[tuple[dict[Any, Any], dict[Any, Any]]]) -> None:
    """The probe's slots and hook tables as they were before its first call: a hook that
    rebinds a parameter or registers a hook (refused in a step, or run there as written
    where marked ``per_microbatch``) must not make each call of the check run another
    layer (``del m.weight`` would fail the next, ``m.bias = None`` change its output)."""
    for live, before in wiring:
        if list(live) != list(before) or any(map(operator.is_not, live.values(),
                                                 before.values())):
            live.clear()
            live.update(before)


def _copy_of(layer: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``layer`` for the check; a hook object that cannot be copied (one holding
    a tqdm bar, a file) is shared by the copy instead (its calls are sandboxed)."""
    import copy

    # a weight a pre-hook computes (``torch.nn.utils.prune``: ``weight_orig * weight_mask``)
    # is a plain attribute outside autograd's leaves, which deepcopy refuses: its value
    computed = {id(v): v.detach().clone() for m in layer.modules() for v in vars(m).values()
                if isinstance(v, torch.Tensor) and not v.is_leaf}
    try:
        return copy.deepcopy(layer, dict(computed))
    except Exception:  # noqa: BLE001 - any failure of a user object's copy: share it instead
        hooks = (layer._forward_hooks, layer._forward_pre_hooks, layer._backward_hooks,
                 layer._backward_pre_hooks)
        return copy.deepcopy(layer, {**computed, **{id(h): h for d in hooks
                                                     for h in d.values()}})


def _joined_equal(pieces: list[torch.Tensor], dim: int) -> bool:
    """Whether ``pieces[0]`` (the whole batch's) equals the other pieces joined on ``dim``
    (True where the shapes cannot be compared)."""
    whole, parts = pieces[0], torch.cat(pieces[1:], dim)
    if whole.shape != parts.shape:
        return True
    scale = float(whole.abs().max()) if whole.numel() else 0.0
    return bool(torch.allclose(whole, parts, rtol=1e-5, atol=1e-6 * scale + 1e-30))

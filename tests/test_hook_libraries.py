"""A torch layer's hook that calls into an installed package (``wandb.log``, a
``SummaryWriter``'s ``add_scalar``), refused before the call runs (issue 35). What a
library writes is out of the hook sandbox's reach (its code is not walked, and a file,
a socket or its own buffers cannot be put back), and the layer runs its hooks once per
microbatch: so, where the hook's code names a library's module, function or object, a
call from it into an installed package's Python code is refused with
``UncheckedHookError`` in a step, nothing changed, and never made by compile's probes.
A hook marked ``mbcompile.per_microbatch`` makes it once per microbatch. The libraries
are real installed pure-Python packages of the venv: ``yaml.safe_dump`` into a stream,
a ``tqdm`` bar's ``update``. Plan: 7 rows over 2 systems, MBS 2, float64."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import tanh_pair

import mbcompile
from mbcompile.errors import UncheckedHookError

yaml = pytest.importorskip("yaml")
tqdm = pytest.importorskip("tqdm")
np = pytest.importorskip("numpy")

STREAM = io.StringIO()


def _dump_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    yaml.safe_dump({"rows": out.shape[0]}, STREAM)


def _numpy_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    np.empty(out.shape[0])  # a C extension's built-in function


def _dump_through_layer(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    module.dump({"rows": out.shape[0]}, STREAM)  # the library's function, held by the layer


def _progress() -> tuple[Any, Any]:
    """A hook holding a library's object in its closure: ``bar.update`` is its write."""
    bar = tqdm.tqdm(total=100, file=io.StringIO(), mininterval=0)

    def update(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        bar.update(out.shape[0])

    return bar, update


def _compile(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    return mbcompile.compile(model, 7, 2, 2, example_inputs=batch)


@pytest.mark.parametrize("kind", ["yaml on the layer", "tqdm on the layer", "tqdm global",
                                  "yaml held by the layer", "numpy on the layer"])
def test_a_hook_calling_an_installed_package_is_refused_with_nothing_changed(kind):
    """Compile's probes make no call into the library; the step is refused at the call,
    naming it and the fixes, with the parameters, gradients and the library's object
    (the stream's text, the bar's count) as they were."""
    model, batch = tanh_pair()
    params = [p.detach().clone() for p in model.parameters()]
    STREAM.seek(0)
    STREAM.truncate()
    bar, update = _progress()
    hook = update if kind.startswith("tqdm") else _dump_rows
    if kind.startswith("numpy"):
        hook = _numpy_rows
    if kind.endswith("held by the layer"):
        model.b.dump, hook = yaml.safe_dump, _dump_through_layer
    handle = torch.nn.modules.module.register_module_forward_hook(hook) \
        if kind.endswith("global") else model.b.register_forward_hook(hook)
    try:
        cm = _compile(model, batch)
        assert STREAM.getvalue() == "" and bar.n == 0
        with pytest.raises(UncheckedHookError, match="per_microbatch") as refusal:
            cm(*batch)
    finally:
        handle.remove()
    message = str(refusal.value)
    package = kind.split()[0]
    assert f"installed package {package!r}" in message and "training loop" in message
    assert "of your own" not in message  # a traced hook would make the call at compile
    assert "test_hook_libraries.py" in message  # the hook's line that makes the call
    assert STREAM.getvalue() == "" and bar.n == 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_a_marked_hook_calls_the_library_once_per_microbatch_and_not_at_compile():
    """Marked ``per_microbatch``: never watched, so the step makes the call on each
    microbatch (2, 2, 2, 1 rows); compile's probes made none."""
    model, batch = tanh_pair()
    STREAM.seek(0)
    STREAM.truncate()
    handle = model.b.register_forward_hook(mbcompile.per_microbatch(_dump_rows))
    try:
        cm = _compile(model, batch)
        assert STREAM.getvalue() == ""
        cm(*batch).backward()
    finally:
        handle.remove()
    rows = [d["rows"] for d in yaml.safe_load_all(STREAM.getvalue().replace("rows", "---\nrows"))]
    assert sorted(rows) == [1, 2, 2, 2]


def test_torchs_summary_writer_counts_as_an_installed_package():
    """``torch.utils.tensorboard``'s ``SummaryWriter`` writes an event file: a call into it
    is a library's (``tensorboard`` itself is not installed here to call)."""
    from mbcompile.passes.library_calls import installed

    torch_dir = os.path.dirname(torch.__file__)
    assert installed(os.path.join(torch_dir, "utils", "tensorboard", "writer.py"))
    assert installed(yaml.__file__)
    assert not installed(torch.nn.functional.__file__) and not installed(__file__)

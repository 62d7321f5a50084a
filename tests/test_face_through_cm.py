"""What code that was handed ``cm`` does to it reaches the model as ``model.f(...)`` would
(a hunt: the compiled module used as an ordinary nn.Module). Each change is made through
``cm`` and on an eager deep copy of the model taken before compile; both then train two
SGD steps on the same batches, float64, and every loss, gradient and parameter agrees."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL

import mbcompile
from mbcompile.errors import InputError, RecompileWarning
from mbcompile.mode_key import kinds_changed

GBS, SYSTEMS, MBS = 7, 2, 2
CAPTURES = ["fx", "export"]


pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


class Net(nn.Module):
    """Reads optional state the way schedules and surgery leave it: ``getattr`` defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        if getattr(self, "extra", None) is not None:
            h = h + self.extra(h)
        if getattr(self, "shift", None) is not None:
            h = h + self.shift
        logits = self.head(h) / getattr(self, "temperature", 1.0)
        return F.cross_entropy(logits, y)

    def init_head(self) -> None:
        with torch.no_grad():
            self.head.weight.mul_(0.5)


def _batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g))
            for _ in range(steps)]


def _pair(capture: str, cls: type[nn.Module] = Net) -> tuple[nn.Module, Any, nn.Module]:
    torch.manual_seed(0)
    model = cls()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batches(1)[0],
                           cost_model=False, capture=capture)
    return model, cm, eager


def _train_alike(model: nn.Module, cm: Any, eager: nn.Module,
                 params: Callable[[Any], Any] = lambda m: m.parameters()) -> None:
    """Two SGD steps of ``cm`` and of ``eager`` (optimizers over ``params`` of each): the
    losses, every ``.grad`` (None included), every parameter and buffer agree."""
    opt_c = torch.optim.SGD(params(cm), lr=0.5)
    opt_e = torch.optim.SGD(params(eager), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecompileWarning)
        for x, y in _batches():
            opt_c.zero_grad()
            opt_e.zero_grad()
            got, want = cm(x, y), eager(x, y)
            got.backward()
            want.backward()
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
            for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(),
                                         strict=True):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=TOL)
            opt_c.step()
            opt_e.step()
    torch.testing.assert_close(model.state_dict(), eager.state_dict(), rtol=TOL, atol=TOL)


# ------------------------------------------------------- 1. writes and deletes reach the model
@pytest.mark.parametrize("capture", CAPTURES)
def test_a_new_attribute_set_through_cm_is_the_models(capture):
    """``cm.temperature = 4.0`` stayed on the compiled module: forward's ``getattr(self,
    "temperature", 1.0)`` kept 1.0 (loss 1.41 against eager's 1.16), while ``cm.temperature``
    read back 4.0."""
    model, cm, eager = _pair(capture)
    cm.temperature = eager.temperature = 4.0
    assert model.temperature == 4.0 and "temperature" not in vars(cm)
    _train_alike(model, cm, eager)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_new_parameter_layer_and_buffer_through_cm_are_the_models(capture):
    """They were registered on the compiled module (in its state_dict as ``extra.weight``),
    where the model's forward never saw them."""
    model, cm, eager = _pair(capture)
    torch.manual_seed(1)
    layer = nn.Linear(8, 8)
    cm.extra, eager.extra = layer, copy.deepcopy(layer)
    cm.shift = nn.Parameter(torch.full((8,), 0.1))
    eager.shift = nn.Parameter(torch.full((8,), 0.1))
    assert model.extra is layer and isinstance(model._parameters["shift"], nn.Parameter)
    assert list(cm.state_dict()) == list(eager.state_dict())
    _train_alike(model, cm, eager)

    model, cm, eager = _pair(capture)
    cm.register_buffer("shift", torch.full((8,), 0.2))
    eager.register_buffer("shift", torch.full((8,), 0.2))
    assert "shift" in model._buffers and list(cm.state_dict()) == list(eager.state_dict())
    _train_alike(model, cm, eager)


@pytest.mark.parametrize("capture", CAPTURES)
def test_deleting_through_cm_deletes_from_the_model(capture):
    """``del cm.extra`` was torch's AttributeError on the compiled module, though
    ``cm.extra`` read the model's layer."""
    model, cm, eager = _pair(capture)
    torch.manual_seed(1)
    model.extra = nn.Linear(8, 8)
    eager.extra = copy.deepcopy(model.extra)
    _train_alike(model, cm, eager)
    del cm.extra
    del eager.extra
    assert not hasattr(model, "extra")
    _train_alike(model, cm, eager)
    cm.temperature = 2.0
    del cm.temperature
    assert not hasattr(model, "temperature")
    with pytest.raises(AttributeError):
        del cm.not_an_attribute


def test_a_private_plain_value_the_model_lacks_stays_on_cm():
    """A library's bookkeeping on the object it was handed: accelerate stores
    ``_original_forward`` and reads it back from ``cm.__dict__``; the compiled module's own
    state (``compile_only``, its hooks) is never the model's."""
    model, cm, _ = _pair("fx")
    cm._original_forward = cm.forward
    assert "_original_forward" in vars(cm) and not hasattr(model, "_original_forward")
    cm.compile_only = False
    assert "compile_only" not in vars(model)
    model._seen = 0
    cm._seen = 3  # the model has it: the model's
    assert model._seen == 3 and "_seen" not in vars(cm)


# ------------------------------------------------- 2. apply and modules() see the model once
@pytest.mark.parametrize("capture", CAPTURES)
def test_apply_runs_on_each_of_the_models_modules_once(capture):
    """``cm.apply(fn)`` visited the model and then ``cm``, which passes ``isinstance(m, Net)``
    and has ``init_head``: the head was halved twice (0.25 of eager's)."""
    model, cm, eager = _pair(capture)
    seen: list[str] = []

    def init(m: nn.Module) -> None:
        seen.append(type(m).__name__)
        if isinstance(m, Net):
            m.init_head()

    assert cm.apply(init) is cm
    eager.apply(lambda m: m.init_head() if isinstance(m, Net) else None)
    assert seen == ["Linear", "Linear", "Net"]
    _train_alike(model, cm, eager)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_loop_over_modules_meets_the_model_once(capture):
    """``cm.modules()`` listed ``cm`` and the model, both ``isinstance(m, Net)`` and with
    ``reset_parameters`` through the face: a seeded re-init ran twice."""
    model, cm, eager = _pair(capture)
    assert [m for m in cm.modules() if isinstance(m, Net)] == [model]
    assert [n for n, _ in cm.named_modules()] == ["module", "module.inp", "module.head"]
    assert [n for n, _ in cm.named_modules(prefix="cm")][0] == "cm.module"
    for module, root in ((cm, model), (eager, eager)):
        torch.manual_seed(3)
        for m in module.modules():
            if hasattr(m, "init_head"):
                m.init_head()
        for m in root.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
    _train_alike(model, cm, eager)


def test_names_and_the_train_flag_stay_as_they_were():
    """The names the Trainer matches (``named_children``, ``named_parameters``) keep the
    ``module.`` prefix; a parent still lists ``cm``; ``cm.training`` is the model's."""
    model, cm, _ = _pair("fx")
    assert [n for n, _ in cm.named_children()] == ["module"]
    assert [n for n, _ in cm.named_parameters()] == [
        "module." + n for n, _ in model.named_parameters()]
    assert list(cm.state_dict()) == list(model.state_dict())
    parent = nn.ModuleDict({"cm": cm})
    assert [n for n, _ in parent.named_modules()][:3] == ["", "cm", "cm.module"]
    model.eval()
    assert cm.training is False
    cm.train()
    assert cm.training and model.training and model.head.training
    for m in cm.modules():
        m.training = False
    assert not cm.training


# ------------------------------------------- 3. a load pre-hook on cm sees the model's keys
def _legacy_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "classifier.")]:
        state_dict[key.replace("classifier.", "head.", 1)] = state_dict.pop(key)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_load_pre_hook_on_cm_sees_the_models_keys(capture):
    """It saw ``module.classifier.weight`` (mbcompile's own pre-hook ran first), so a hook
    renaming legacy keys renamed none: strict loads failed, ``strict=False`` left the head."""
    model, cm, eager = _pair(capture)
    torch.manual_seed(5)
    saved = {k.replace("head.", "classifier."): torch.randn_like(v)
             for k, v in eager.state_dict().items()}
    keys: list[list[str]] = []
    for module in (cm, eager):
        module.register_load_state_dict_pre_hook(
            lambda m, sd, prefix, *a: keys.append(sorted(sd)))
        module.register_load_state_dict_pre_hook(_legacy_keys)
        result = module.load_state_dict(saved)
        assert not result.missing_keys and not result.unexpected_keys
    assert keys[0] == keys[1]
    _train_alike(model, cm, eager)


# --------------------------------------------- 4. the model's overrides of nn.Module methods
class HeadOnly(Net):
    """Trains its head only, names a legacy layout in its checkpoints, and has a counter
    of its train() calls."""

    def parameters(self, recurse: bool = True):
        return self.head.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        return self.head.named_parameters("head", recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = super().state_dict(*args, **kwargs)
        return {k.replace("head.", "classifier."): v for k, v in out.items()}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        state_dict = {k.replace("classifier.", "head."): v for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict, assign)

    def train(self, mode: bool = True):
        self.trained = getattr(self, "trained", 0) + 1
        return super().train(mode)


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_models_overrides_run_through_cm(capture):
    """``cm.parameters()`` was nn.Module's (4 tensors, where the model gives its head's 2):
    an optimizer built from it trained ``inp`` too (0.157 off eager after two steps); the
    model's ``load_state_dict`` remapping was skipped (missing/unexpected keys)."""
    model, cm, eager = _pair(capture, HeadOnly)
    assert len(list(cm.parameters())) == len(list(eager.parameters())) == 2
    assert [n for n, _ in cm.named_parameters()] == ["module.head.weight", "module.head.bias"]
    assert list(cm.state_dict()) == list(eager.state_dict())
    assert "classifier.weight" in cm.state_dict()
    assert cm.train() is cm and model.trained == 1
    assert cm.eval() is cm and model.trained == 2 and not model.training
    cm.train()
    eager.train()
    torch.manual_seed(5)
    saved = {k: torch.randn_like(v) for k, v in eager.state_dict().items()}
    assert cm.load_state_dict(saved) == eager.load_state_dict(saved)
    _train_alike(model, cm, eager)


def test_an_override_and_a_hook_on_cm_for_the_same_call_are_refused():
    """The override runs on the model; a hook registered on ``cm`` would be skipped."""
    model, cm, _ = _pair("fx", HeadOnly)
    cm.register_load_state_dict_pre_hook(_legacy_keys)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match=r"overrides load_state_dict\(\).*cm\.module"):
        cm.load_state_dict({k: v + 1 for k, v in before.items()})
    torch.testing.assert_close(model.state_dict(), before, rtol=0, atol=0)
    cm.register_state_dict_post_hook(lambda *a: None)
    with pytest.raises(InputError, match=r"overrides state_dict\(\)"):
        cm.state_dict()


def test_the_default_methods_keep_the_compiled_modules_behaviour():
    """A model that overrides nothing: the same tensors and names as before."""
    model, cm, _ = _pair("fx")
    assert [p for p in cm.parameters()] == [p for p in model.parameters()]
    assert [n for n, _ in cm.named_buffers()] == []
    assert cm.to(torch.float64) is cm and cm.requires_grad_(True) is cm
    assert cm.load_state_dict(model.state_dict()).missing_keys == []


# ------------------------------------------- 5. registering a name the model has replaces it
@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("how", ["add_module", "register_module", "register_buffer"])
def test_registering_a_name_the_model_has_replaces_it(capture, how):
    """torch's ``KeyError: attribute 'head' already exists``: its check ``hasattr(cm, name)``
    is true through the face."""
    model, cm, eager = _pair(capture)
    torch.manual_seed(2)
    if how == "register_buffer":
        model.register_buffer("shift", torch.zeros(8))
        eager.register_buffer("shift", torch.zeros(8))
        cm.register_buffer("shift", torch.full((8,), 0.3))
        eager.register_buffer("shift", torch.full((8,), 0.3))
    else:
        head = nn.Linear(8, 3)
        getattr(cm, how)("head", head)
        getattr(eager, how)("head", copy.deepcopy(head))
        assert model.head is head
    _train_alike(model, cm, eager)


# ------------------------------------------------------- 6. what a recompile says changed
def test_a_recompile_after_weight_norm_says_there_are_more_parameters():
    """It said 'were as now, now fewer' for 4 -> 5 (the kinds are the same)."""
    model, cm, eager = _pair("fx")
    with pytest.warns(RecompileWarning, match="the model had 4 parameters and buffers, now 5"):
        nn.utils.parametrizations.weight_norm(cm.head)
        nn.utils.parametrizations.weight_norm(eager.head)
        cm(*_batches(1)[0])
    _train_alike(model, cm, eager)


@pytest.mark.parametrize(("before", "now", "said"), [
    ((torch.float64, torch.float64), (torch.float32, torch.float32),
     "were float64 on cpu, now float32 on cpu"),
    ((torch.float64,), (torch.float64, torch.float64), "had 1 parameters and buffers, now 2"),
    ((torch.float64, torch.float64), (torch.float64,), "had 2 parameters and buffers, now 1"),
    ((torch.float64, torch.float64), (torch.float64, torch.float32),
     "some of the model's parameters or buffers are now float32 on cpu"),
    ((torch.float64, torch.float32), (torch.float32, torch.float64),
     "changed dtype or device"),
])
def test_kinds_changed_names_what_changed(before, now, said):
    key = lambda dtypes: (torch.float64, *((d, torch.device("cpu")) for d in dtypes))  # noqa: E731
    text = kinds_changed(key(before), key(now))
    assert said in text and "fewer" not in text and "as now" not in text

"""The compiled module looks like the model (issue 27): its attributes, its forward's
signature, its state_dict keys; and it takes batches of any size, planned on first sight."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, step_errors

import mbcompile
from mbcompile.models import make_tiny_gpt

GBS, SYSTEMS, MBS = 6, 2, 2


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _compiled(**kw):
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    return model, batch, mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch,
                                           cost_model=False, **kw)


def test_attributes_the_compiled_module_lacks_are_the_models():
    model, _, cm = _compiled()
    model.loss_type = "ForCausalLM"
    assert cm.loss_type == "ForCausalLM" and cm.blocks is model.blocks
    assert cm.plan.gbs == GBS  # its own come first
    with pytest.raises(AttributeError, match="neither has the TinyGPT it compiled"):
        cm.not_an_attribute  # noqa: B018


def test_writes_to_the_models_attributes_reach_the_model():
    model, _, cm = _compiled()
    model.temperature = 1.0
    cm.temperature = 0.5  # an attribute of the model: written there
    cm.note = "mine"  # neither's: written to the model, as eager's model.note = "mine"
    assert model.temperature == 0.5 and "temperature" not in vars(cm)
    assert cm.note == "mine" and model.note == "mine" and "note" not in vars(cm)
    cm._mine = 1  # a private plain value the model lacks: the compiled module's
    assert "_mine" in vars(cm) and not hasattr(model, "_mine")


def test_the_signature_and_state_dict_are_the_models():
    model, _, cm = _compiled()
    assert inspect.signature(cm.forward) == inspect.signature(model.forward)
    assert list(cm.state_dict()) == list(model.state_dict())


@pytest.mark.parametrize("size", [4, 5, 1])
def test_a_batch_of_another_size_is_planned_once_and_exact(size):
    model, _, cm = _compiled()
    _, batch = make_tiny_gpt(size, seed=3, dtype=torch.float64)
    with pytest.warns(mbcompile.BatchSizeWarning, match=f"a batch of {size} sample"):
        cm(*batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.BatchSizeWarning)  # once per size
        assert_close_errors(step_errors(model, cm, batch), TOL)
    variant = cm._variants[(size, False)]  # (batch, forward only)
    assert variant.plan.gbs == size and variant.plan.mbs <= MBS
    assert max(variant.plan.per_system_batch_sizes) - min(
        variant.plan.per_system_batch_sizes) <= 1


def test_batch_sizes_fixed_keeps_the_error():
    _, _, cm = _compiled(batch_sizes="fixed")
    _, batch = make_tiny_gpt(4, seed=3, dtype=torch.float64)
    with pytest.raises(mbcompile.InputError, match="batch_sizes='fixed'"):
        cm(*batch)
    with pytest.raises(mbcompile.InputError, match="batch_sizes must be one of"):
        _compiled(batch_sizes="sometimes")


def test_an_evaluation_batch_of_another_size_runs_in_eval_mode():
    model, _, cm = _compiled()
    ref = copy.deepcopy(model).eval()
    cm.eval()
    _, batch = make_tiny_gpt(3, seed=5, dtype=torch.float64)
    with torch.no_grad(), pytest.warns(mbcompile.BatchSizeWarning):
        got = cm(*batch)
    want = ref(*batch)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-12) for g, w in zip(got, want))


class Tempered(nn.Module):
    """A scalar tensor argument (a temperature): it has no batch dim to split."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y, temperature):
        return F.mse_loss(self.lin(x) / temperature, y)


def test_a_transformers_model_keeps_its_face(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(0, 64, (GBS, 8), generator=torch.Generator().manual_seed(1))
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_kwargs={"input_ids": ids},
                           cost_model=False)
    assert cm.config is model.config and cm.device == model.device and cm.dtype == model.dtype
    cm.save_pretrained(tmp_path)  # the model's method: tied weights saved as the model saves
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).double()
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                  model.state_dict().values()))
    prompt = ids[:1, :4]
    assert torch.equal(cm.generate(prompt, max_new_tokens=3, do_sample=False),
                       model.generate(prompt, max_new_tokens=3, do_sample=False))


class Kw(nn.Module):
    """A forward that takes extra keywords through **kwargs, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y, **kwargs):
        err = ((self.lin(x) - y) ** 2).sum(1)
        if "weight" in kwargs:  # per sample: split with the batch
            err = err * kwargs["weight"]
        if "num_items_in_batch" in kwargs:  # a 0-dim tensor: passed whole to every microbatch
            return err.sum() / kwargs["num_items_in_batch"]
        return err.mean()


def test_keywords_through_var_kwargs_are_inputs_split_or_passed_whole():
    torch.manual_seed(0)
    model = Kw()
    ref = copy.deepcopy(model)
    x, y, weight = torch.randn(GBS, 4), torch.randn(GBS, 3), torch.rand(GBS)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=(x, y), cost_model=False,
                           example_kwargs={"num_items_in_batch": torch.tensor(7.0)})
    assert "kwargs" in inspect.signature(cm.forward).parameters  # the model's face
    calls = [{"num_items_in_batch": torch.tensor(9.0)},  # the example's keywords: no compile
             {"num_items_in_batch": torch.tensor(5.0), "weight": weight},  # a variant, once
             {}]  # none at all: another variant
    for i, kwargs in enumerate(calls):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cm(x, y, **kwargs).backward()
        recompiled = [w for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]
        assert len(recompiled) == (i > 0)
        assert not recompiled or "**kwargs" in str(recompiled[0].message)
        ref(x, y, **kwargs).backward()
        assert all(torch.allclose(p.grad, q.grad, rtol=0, atol=1e-14)
                   for p, q in zip(model.parameters(), ref.parameters()))
    assert set(cm._variants) == {frozenset({"num_items_in_batch", "weight"}), frozenset()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        cm(x, y, **calls[1])  # kept: compiled once


def test_the_keyword_view_names_the_keywords_and_holds_the_models_own_state():
    from mbcompile.passes.keyword_view import keyword_view

    model = Kw()
    assert keyword_view(model, ["x", "y"]) is model  # nothing reaches **kwargs
    view = keyword_view(model, ["x", "y", "num_items_in_batch"])
    assert list(inspect.signature(view.forward).parameters) == ["x", "y", "num_items_in_batch"]
    assert dict(view.named_parameters()) == dict(model.named_parameters())  # the same tensors
    x, y, n = torch.randn(GBS, 4), torch.randn(GBS, 3), torch.tensor(7.0)
    assert torch.equal(view(x=x, y=y, num_items_in_batch=n), model(x, y, num_items_in_batch=n))


def test_the_compiled_module_is_an_instance_of_the_models_class_and_still_itself():
    import pickle

    model, batch, cm = _compiled()
    assert isinstance(cm, type(model)) and isinstance(cm, mbcompile.CompiledModule)
    assert type(cm) is mbcompile.CompiledModule and repr(cm).startswith("CompiledModule(")
    assert {"plan", "report", "blocks"} <= set(dir(cm))
    twin = pickle.loads(pickle.dumps(cm))
    assert type(twin) is mbcompile.CompiledModule and isinstance(twin, type(model))
    assert torch.equal(twin(*batch)[0], cm(*batch)[0])


@pytest.mark.parametrize("temperature, expected", [
    (torch.tensor([0.5]), r"'temperature' is a tensor of shape \(1,\) where the example passed "
                          r"a scalar \(a 0-dim tensor\)"),
    (0.5, r"'temperature' is a Python float where the example passed a tensor of shape \(\)"),
])
def test_a_scalar_input_of_another_kind_says_what_differs(temperature, expected):
    batch = (torch.randn(GBS, 4), torch.randn(GBS, 3), torch.tensor(2.0))
    cm = mbcompile.compile(Tempered(), GBS, SYSTEMS, MBS, example_inputs=batch, cost_model=False)
    with pytest.raises(mbcompile.InputError, match=expected) as info:
        cm(*batch[:2], temperature)
    assert "has shape () but the example had ()" not in str(info.value)


def test_a_tensor_input_left_out_says_so():
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch, cost_model=False)
    with pytest.raises(mbcompile.InputError, match=r"is None where the example passed a tensor"):
        cm(batch[0], None)


def test_compiled_in_eval_mode_training_compiles_the_training_graph_only_and_says_so():
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model.eval(), GBS, SYSTEMS, MBS, example_inputs=batch,
                           cost_model=False)
    assert sum("compiled in eval mode" in note for note in cm.plan.warnings) == 1
    cm.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.MbcompileWarning)  # a mode switch: silent
        assert_close_errors(step_errors(model, cm, batch), TOL)
    assert len(cm._cache) == 2 and not cm._variants  # the eval graph and the training one
    _, small = make_tiny_gpt(4, seed=3, dtype=torch.float64)
    with pytest.warns(mbcompile.BatchSizeWarning):
        cm.eval()(*small)  # another batch size: its variant compiles, this module nothing
    assert len(cm._cache) == 2 and len(cm._variants[(4, True)]._cache) == 1
    trained = mbcompile.compile(model.train(), GBS, SYSTEMS, MBS, example_inputs=batch,
                                cost_model=False)
    assert not any("eval mode" in note for note in trained.plan.warnings)


class _Counted(nn.Module):
    """A model that checkpoints a Python counter the documented way (extra state)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.steps = nn.Linear(4, 2), 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x), y)

    def get_extra_state(self) -> dict[str, int]:
        return {"steps": self.steps}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


def test_extra_state_saves_and_loads_through_the_compiled_module():
    """``cm.state_dict()`` raised torch's "should never be called" error (torch asks the
    model's class whether there is extra state, then asked the compiled module), and
    ``cm.load_state_dict`` refused the model's own state; so did every parent holding cm."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _Counted()
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    cm = mbcompile.compile(model, 6, 2, 1, example_inputs=(x, y), cost_model=False)
    model.steps = 5
    saved = cm.state_dict()
    assert saved.keys() == model.state_dict().keys() and saved["_extra_state"] == {"steps": 5}
    assert get_model_state_dict(cm).keys() == saved.keys()
    parent = nn.ModuleDict({"cm": cm})
    assert list(parent.state_dict()) == [f"cm.{k}" for k in saved]
    fresh = _Counted()
    fresh_cm = mbcompile.compile(fresh, 6, 2, 1, example_inputs=(x, y), cost_model=False)
    assert not fresh_cm.load_state_dict(saved).missing_keys and fresh.steps == 5
    model.steps = 0
    parent.load_state_dict(parent.state_dict() | {"cm._extra_state": {"steps": 9}})
    assert model.steps == 9


def test_the_keys_a_load_reports_are_the_state_dicts():
    """A load reported keys that exist nowhere (``module.ln.weight``), in its result and in
    the strict error, where ``state_dict()`` says ``ln.weight``."""
    _, batch, cm = _compiled()
    name = next(iter(cm.state_dict()))
    partial = {k: v for k, v in cm.state_dict().items() if k != name} | {"extra": torch.ones(1)}
    keys = cm.load_state_dict(partial, strict=False)
    assert keys.missing_keys == [name] and keys.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match=f'Missing key\\(s\\) in state_dict: "{name}"'):
        cm.load_state_dict(partial)


def test_named_parameters_keep_the_prefix_the_children_have():
    """transformers' Trainer chooses the parameters it decays by names it makes from
    ``named_children()`` and matches against ``named_parameters()``: the two must agree
    (named_parameters without the prefix gave an empty decay group, silently: no weight
    decay at all)."""
    from transformers.trainer_pt_utils import get_parameter_names

    model, _, cm = _compiled()

    def decayed(m: nn.Module) -> list[torch.Tensor]:  # as Trainer.create_optimizer does
        names = set(get_parameter_names(m, [nn.LayerNorm]))
        return [p for n, p in m.named_parameters() if n in names and "bias" not in n]

    assert len(decayed(cm)) == len(decayed(model)) > 0
    assert all(p is q for p, q in zip(decayed(cm), decayed(model)))

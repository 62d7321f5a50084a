"""Training loops as a demanding user writes them, each against eager on the full batch.

Every journey runs one compiled module and an eager deep copy of the model side by side
through the same steps: sequence lengths that change every step (the example's own length
coming back, lengths 1 and 2, short last batches, a batch of one sample, a batch larger
than gbs), ``eval()`` and ``torch.no_grad()`` calls at new lengths, Python state and
parameters changed between steps, gradient clipping and an optimizer. After every step
it compares what eager gives: the loss and every output (values, dtype, shape,
``requires_grad``), every ``.grad`` (``None`` too), the parameters after the optimizer's
step, buffers and the models' Python attributes (``_errors``). Tiny models in float64
on gbs 7 over 2 systems (4 and 3 samples: uneven microbatches).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    TOL,
    assert_close_errors,
    buffer_errors,
    grad_errors,
    grads_of,
    rel_err,
    step_errors,
)
from models import tensor_leaves as leaves
from test_token_split import BUDGET

import mbcompile
from mbcompile.errors import MicrobatchError
from mbcompile.models import TinyGPT, make_tiny_gpt, token_batch

DTYPE = torch.float64
GBS, NUM_CSX, EXAMPLE = 7, 2, 12
Step = tuple[Any, Any]  # (kind or a function of the model, the batch: a tuple or a dict)
Optimizer = Callable[[Any], torch.optim.Optimizer]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _batch(length: int, batch: int = GBS, seed: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_batch`` with every row's first label kept: at length 1 next-token labels
    are all -100, a step whose loss is NaN in eager (see the tests of a batch with nothing
    to count below)."""
    ids, labels = token_batch(batch, length, seed=length * 31 + batch if seed is None else seed)
    labels[:, 0] = ids[:, 0]
    return ids, labels


def train(length: int, batch: int = GBS) -> Step:
    return "train", _batch(length, batch)


def evaluate(length: int, batch: int = GBS) -> Step:
    """A call in ``eval()`` under ``torch.no_grad()``, then back to ``train()``."""
    return "eval", _batch(length, batch, seed=100 + length)


def no_grad(length: int, batch: int = GBS) -> Step:
    """A call in training mode under ``torch.no_grad()`` (a validation loss)."""
    return "no_grad", _batch(length, batch, seed=200 + length)


def _errors(got: Any, want: Any, model: nn.Module, ref: nn.Module, floor: float
            ) -> dict[str, float]:
    """Everything eager gives, compared: outputs, ``.grad``s, parameters, buffers and
    the numbers, strings and flags the modules hold (a counter forward keeps)."""
    a, b = leaves(got), leaves(want)
    assert [p for p, _ in a] == [p for p, _ in b], "output structure differs"
    errors = {p: (rel_err(x.detach(), y.detach()) if y.is_floating_point()
                  else 0.0 if torch.equal(x, y) else math.inf) for (p, x), (_, y) in zip(a, b)}
    errors.update({f"{p}.requires_grad": float(x.requires_grad != y.requires_grad)
                   for (p, x), (_, y) in zip(a, b)})
    errors.update({f"grad {n}": e for n, e in grad_errors(grads_of(model), grads_of(ref),
                                                          floor).items()})
    # a parameter whose gradient is rounding noise (BERT's key bias) is judged at a floor
    largest = max(p.detach().abs().max().item() for p in ref.parameters())
    errors.update({f"param {n}": rel_err(p.detach(), q.detach(), floor * largest)
                   for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())})
    errors.update(buffer_errors(model, ref))
    for (name, m), r in zip(model.named_modules(), ref.modules()):
        errors.update({f"attr {name}.{k}": float(vars(r).get(k) != v) for k, v in vars(m).items()
                       if not k.startswith("_") and isinstance(v, (bool, int, float, str))})
    return errors


def journey(model: nn.Module, cm: Any, steps: list[Step], optimizer: Optimizer | None = None,
            clip: float | None = None, floor: float = 0.0, tol: float = TOL,
            loss: Callable[[Any], torch.Tensor] = lambda out: leaves(out)[0][1]) -> list[str]:
    """Run ``steps`` on ``cm`` (sharing ``model``'s parameters) and on an eager deep copy
    taken first, asserting after every step that they agree (``_errors``); a step whose
    kind is a function is applied to both models (a change between steps). Returns the
    warnings the steps gave."""
    model.zero_grad(set_to_none=True)  # a deep copy does not copy ``.grad``
    ref = copy.deepcopy(model)
    opts = [optimizer(m.parameters()) if optimizer else None for m in (model, ref)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (kind, batch) in enumerate(steps):
            if callable(kind):
                kind(model)
                kind(ref)
                continue
            args, kwargs = ((), batch) if isinstance(batch, dict) else (batch, {})
            outs = []
            for m, call, opt in zip((model, ref), (cm, ref), opts):
                m.train(kind != "eval")
                if kind != "train":
                    with torch.no_grad():
                        outs.append(call(*args, **kwargs))
                    m.train()
                    continue
                m.zero_grad(set_to_none=True)
                torch.manual_seed(i)
                outs.append(call(*args, **kwargs))
                loss(outs[-1]).backward()
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                if opt is not None:
                    opt.step()
            errors = _errors(*outs, model, ref, floor)
            assert not {k: e for k, e in errors.items() if not e <= tol}, (i, kind, errors)
    return [f"{type(w.message).__name__}: {w.message}" for w in caught]


def _gpt(mbs: Any, freeze_qkv_bias: bool = False, **options: Any) -> tuple[nn.Module, Any]:
    model, (ids, labels) = make_tiny_gpt(GBS, dtype=DTYPE, seq=64)
    for block in model.blocks if freeze_qkv_bias else ():
        block.qkv.bias.requires_grad_(False)
    if isinstance(mbs, int):
        options.setdefault("cost_model", False)  # an int MBS: no probes needed
    cm = mbcompile.compile(model, GBS, NUM_CSX, mbs, example_inputs=(
        ids[:, :EXAMPLE], labels[:, :EXAMPLE]), **options)
    return model, cm


#: lengths that change every step: the example's own coming back, 1 and 2, no-grad and
#: eval calls at new lengths, short last batches at new lengths, one sample, more than gbs
LENGTHS = [train(12), train(8), train(20), train(12), train(1), train(2), no_grad(5),
           train(9), evaluate(30), train(12), train(3, 3), train(17, 5), train(4, 1),
           train(6, 9), train(12)]
#: the same with the first new length met in eval and under no_grad, before any training
EVAL_FIRST = [evaluate(20), no_grad(9), train(12), evaluate(12), train(30), train(1, 1),
              train(12, 1), train(5, 9), evaluate(7, 1), train(12)]


# --------------------------------------------------------------------------- #
# Lengths that change every step
# --------------------------------------------------------------------------- #


def test_lengths_change_every_step_sgd_with_clipping():
    """dynamic="auto" (the default): the first new length makes it symbolic, once; a length
    of 1 compiles its own step, once (a symbolic size is 2 or more: ``for_size_one``)."""
    model, cm = _gpt(2)
    caught = journey(model, cm, LENGTHS, sgd, clip=0.5)
    recompiles = [w for w in caught if w.startswith("RecompileWarning")]
    assert len(recompiles) == 2 and sum("has size 1" in w for w in recompiles) == 1, caught


def test_dynamic_true_with_adam_and_the_first_new_length_in_eval():
    model, cm = _gpt(2, dynamic=True)
    caught = journey(model, cm, EVAL_FIRST, adam, clip=1.0)
    recompiles = [w for w in caught if w.startswith("RecompileWarning")]
    assert [("has size 1" in w) for w in recompiles] == [True], caught  # (train(1, 1))


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    pytest.param(dict(mbs="auto", system=BUDGET), id="auto-budget"),
    pytest.param(dict(mbs="auto", system=BUDGET, recompute=True, dynamic=True),
                 id="auto-budget-recompute"),
    pytest.param(dict(mbs={"tokens": 40}, outputs="all"), id="tokens"),
    pytest.param(dict(mbs=1, outputs="all", recompute=True), id="mbs1-recompute"),
])
def test_split_options_over_changing_lengths_with_adam(options):
    """The key third of ``qkv.bias`` gets a gradient that is rounding alone (softmax cancels
    a key bias), which Adam turns into steps that differ by more than rounding (1.1e-10 at
    mbs 1 with recompute on one CPU, within 1e-10 on another; the query and value thirds
    agree to 1e-16): the biases are frozen here, as bench_dynamic freezes BERT's."""
    model, cm = _gpt(options.pop("mbs"), freeze_qkv_bias=True, **options)
    journey(model, cm, [*LENGTHS[:3], train(40), *LENGTHS[3:]], adam, clip=0.3)
    journey(model, cm, EVAL_FIRST, adam)


# --------------------------------------------------------------------------- #
# Python state and parameters changed between steps
# --------------------------------------------------------------------------- #


class TemperedGPT(TinyGPT):
    """Reads a Python attribute (``temp``), counts its calls, and branches on
    ``self.training``: what users' research code does."""

    def __init__(self) -> None:
        super().__init__(seq=64)
        self.temp, self.calls = 1.0, 0

    def forward(self, ids: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x)) / self.temp
        if not self.training:
            logits = logits * 2
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1)), logits


def _set(**values: Any) -> Step:
    return (lambda m: [setattr(m, k, v) for k, v in values.items()]), None


def _replace_head(m: nn.Module) -> None:
    torch.manual_seed(5)
    m.head.weight = nn.Parameter(torch.randn_like(m.head.weight) * 0.1)


def _copy_into_head(m: nn.Module) -> None:
    torch.manual_seed(6)
    with torch.no_grad():
        m.head.weight.copy_(torch.randn_like(m.head.weight) * 0.1)


def _load_state(m: nn.Module) -> None:
    torch.manual_seed(7)
    m.load_state_dict(TemperedGPT().to(DTYPE).state_dict())


def _freeze(m: nn.Module) -> None:
    m.tok.weight.requires_grad_(False)
    m.blocks[0].qkv.bias.requires_grad_(False)


STATE = [train(12), _set(temp=2.0), train(9), train(12), evaluate(20), _set(temp=0.5),
         train(20), no_grad(7), (_replace_head, None), train(5), (_load_state, None),
         train(16), (_copy_into_head, None), train(12), evaluate(12), (_freeze, None),
         train(3, 3), _set(temp=3.0), train(4, 3), train(12)]


@pytest.mark.parametrize("mbs", [2, pytest.param("auto", marks=pytest.mark.slow)])
def test_python_state_and_parameters_changed_between_steps_at_changing_lengths(mbs):
    torch.manual_seed(0)
    model = TemperedGPT().to(DTYPE)
    ids, labels = _batch(EXAMPLE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, mbs, example_inputs=(ids, labels),
                           **({"system": BUDGET} if mbs == "auto" else {"cost_model": False}))
    journey(model, cm, STATE, clip=0.5)  # no optimizer: a replaced parameter is not in it
    assert model.calls == 13  # the counter as eager counts it (also compared every step)


class KeepsActivations(TinyGPT):
    """Stores what it computed for logging: a loss, the last hidden states (their shape
    follows the length) and a max in a dict."""

    def __init__(self) -> None:
        super().__init__(seq=64)
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        self.last_loss, self.last_hidden = loss.detach(), x.detach()
        self.stats["max_logit"] = logits.detach().amax()
        return loss


def test_activations_forward_stores_are_the_full_batchs_at_every_length():
    torch.manual_seed(0)
    model = KeepsActivations().to(DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_inputs=_batch(EXAMPLE),
                           cost_model=False)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the length made symbolic
        for length, batch in ((EXAMPLE, GBS), (9, GBS), (20, GBS), (5, 3), (EXAMPLE, GBS)):
            ids, labels = _batch(length, batch)
            assert_close_errors(step_errors(model, cm, (ids, labels)), TOL)
            ref(ids, labels)
            assert_close_errors({k: rel_err(getattr(model, k), getattr(ref, k)) for k in (
                "last_loss", "last_hidden")} | {"max": rel_err(model.stats["max_logit"],
                                                               ref.stats["max_logit"])}, TOL)


class WritesSizes(nn.Module):
    """Keeps the sizes it saw for logging: the batch size in an attribute, the length in
    a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 8), nn.Linear(8, 64)
        self.batch_size, self.seen = 0, {}

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.batch_size, self.seen["length"] = ids.size(0), ids.size(1)
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_sizes_forward_writes_are_eagers_or_refused(capture):
    """torch.fx replays the full batch's sizes. Under torch.export they are symbolic: the
    attribute's write was dropped (0, where eager wrote 7) and the dict got export's symbol
    (``s23``); refused instead, at compile, naming capture='fx'."""
    torch.manual_seed(0)
    model = WritesSizes().to(DTYPE)
    batch = _batch(EXAMPLE)
    if capture == "export":
        with pytest.raises(mbcompile.CaptureError, match=r"writes a size.*capture='fx'"):
            mbcompile.compile(model, GBS, NUM_CSX, 2, example_inputs=batch, capture=capture,
                              cost_model=False)
        assert model.batch_size == 0 and model.seen == {}
        return
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_inputs=batch, capture=capture,
                           cost_model=False)
    cm(*batch)
    assert (model.batch_size, model.seen) == (GBS, {"length": EXAMPLE})


# --------------------------------------------------------------------------- #
# Loops around the call
# --------------------------------------------------------------------------- #


def test_gradient_accumulation_with_weights_and_lengths_that_change():
    """Three calls per optimizer step, each loss weighted by its own factor (the seed's
    guess of the weight is wrong at every call), a validation call in training mode
    without backward between steps, and two calls backpropagated together."""
    model, cm = _gpt(2)
    ref = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the length made symbolic
        for step in range(3):
            for call, opt in zip((cm, ref), opts):
                opt.zero_grad()
                for k, (n, w) in enumerate([(12, 0.3), (8, 0.5), (20, 0.2 + step)]):
                    (call(*_batch(n, seed=10 * step + k))[0] * w).backward()
                call(*_batch(9, seed=99))[0].item()  # a loss read, never backpropagated
                a, b = call(*_batch(6, seed=step))[0], call(*_batch(14, seed=step))[0]
                (a + 2 * b).backward()
                opt.step()
            errors = {f"grad {n}": rel_err(p.grad, q.grad) for (n, p), (_, q) in zip(
                model.named_parameters(), ref.named_parameters())}
            errors.update({n: rel_err(p.detach(), q.detach()) for (n, p), (_, q) in zip(
                model.named_parameters(), ref.named_parameters())})
            assert_close_errors(errors, TOL)


def test_backward_through_another_output_is_refused_and_changes_no_gradient():
    """A penalty on the logits added outside the model: the step's backward already ran
    for the loss only, so the gradient flowing into the logits is refused at backward,
    with every ``.grad`` as it was."""
    model, cm = _gpt(2)
    ids, labels = _batch(EXAMPLE)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    for backprop in (lambda out: out[0] + 0.01 * out[1].pow(2).mean(),
                     lambda out: out[1].sum()):
        out = cm(ids, labels)
        with pytest.raises(MicrobatchError, match="other than its loss.*no_grad"):
            backprop(out).backward()
        assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())


class HooksOnFirstUse(nn.Module):
    """Registers a forward hook the first time a flag asks for it, as transformers'
    output capturing does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)
        self.record, self.installed = False, False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.record and not self.installed:
            self.a.register_forward_hook(lambda m, i, out: out * 2)
            self.installed = True
        return ((self.b(torch.tanh(self.a(x))) - y) ** 2).mean()


def test_a_forward_that_registers_a_hook_is_refused_and_changes_nothing():
    """Under torch.fx too: tracing put the hook back and replayed ``installed = True``, so
    every later step ran without the hook that eager's steps run with."""
    torch.manual_seed(0)
    model = HooksOnFirstUse().to(DTYPE)
    x, y = torch.randn(GBS, 4, dtype=DTYPE), torch.randn(GBS, 1, dtype=DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_inputs=(x, y), cost_model=False)
    model.record = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the flag read: compiled again
        with pytest.raises(mbcompile.CaptureError, match=r"a\._forward_hooks \(registers"):
            cm(x, y)
    assert not model.installed and not model.a._forward_hooks
    model(x, y)  # the fix the error names: one eager call
    assert_close_errors(step_errors(model, cm, (x, y)), TOL)


# --------------------------------------------------------------------------- #
# A batch with nothing to count
# --------------------------------------------------------------------------- #


class _MaskedMean(nn.Module):
    """A per-token loss averaged by hand over a mask: ``sum(l * m) / sum(m)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1, dtype=DTYPE)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_token = self.lin(x).squeeze(-1) ** 2
        return (per_token * mask).sum() / mask.sum()


@pytest.mark.parametrize("length", [1, EXAMPLE])
def test_a_batch_with_every_label_ignored_keeps_eagers_zero_gradients(length):
    """A causal LM's batch of one-token rows (its shifted labels all -100), or a batch
    whose completions were all cut off: eager's loss is NaN and every gradient zero
    (``nll_loss`` writes 0 where a label is ignored, whatever its seed), so an optimizer
    step leaves the parameters finite; NaN gradients would poison every later step. The
    count is 0, so ``dL/dS`` is infinite: the microbatches are seeded with it, as eager's
    backward is, and the step after it is exact again."""
    model, cm = _gpt(2)
    ids, labels = token_batch(GBS, length, seed=3)
    labels[:] = -100
    outs = []
    for m, call in ((model, cm), (copy.deepcopy(model), None)):
        m.zero_grad(set_to_none=True)
        out = (call or m)(ids, labels)
        out[0].backward()
        outs.append((out[0], grads_of(m)))
    (loss, got), (want_loss, want) = outs
    assert loss.isnan() and want_loss.isnan()
    assert all(w is not None and torch.equal(w, torch.zeros_like(w)) for w in want.values())
    assert_close_errors(grad_errors(got, want), TOL)
    assert_close_errors(step_errors(model, cm, token_batch(GBS, length + 3, seed=4)), TOL)


def test_a_mask_with_nothing_in_it_gives_eagers_nan_gradients():
    """The same count of 0 in a loss written by hand: eager's infinite ``dL/dS`` meets the
    mask's zeros and makes NaN gradients; so does the compiled step (not zeros: they
    would hide the empty batch), and the next step is exact."""
    model = _MaskedMean()
    x, empty = torch.randn(GBS, 5, 4, dtype=DTYPE), torch.zeros(GBS, 5, dtype=DTYPE)
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_inputs=(x, empty + 1))
    grads = []
    for m, call in ((model, cm), (copy.deepcopy(model), None)):
        m.zero_grad(set_to_none=True)
        (call or m)(x, empty).backward()
        grads.append(grads_of(m))
    assert all(g.isnan().all() for got in grads for g in got.values())
    assert_close_errors(step_errors(model, cm, (x, (x[..., 0] > 0).to(DTYPE))), TOL)


# --------------------------------------------------------------------------- #
# HuggingFace models with attention masks and padding
# --------------------------------------------------------------------------- #


def _hf_batch(length: int, batch: int = GBS, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ids, mask and -100 labels; the first row full (its length is the
    batch's), so even at length 2 a causal LM has one label to train on."""
    g = torch.Generator().manual_seed(seed * 7 + length)
    ids = torch.randint(1, 64, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def _hf(kind: str, length: int, batch: int = GBS) -> Step:
    return kind, _hf_batch(length, batch, seed={"train": 0, "eval": 1, "no_grad": 2}[kind])


HF = [_hf("eval", 6), _hf("train", 8), _hf("train", 2, 1), _hf("train", 7, 1),
      _hf("train", 8), _hf("train", 5), _hf("train", 12), _hf("train", 8), _hf("train", 2),
      _hf("no_grad", 16), _hf("train", 3), _hf("eval", 10), _hf("train", 9),
      _hf("train", 4, 3), _hf("train", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("name, options, optimizer", [
    pytest.param("gpt2", dict(mbs=2, cost_model=False), adam, id="gpt2-mbs2"),
    pytest.param("llama", dict(mbs={"tokens": 24}, outputs=["logits"]), adam,
                 id="llama-tokens", marks=pytest.mark.zoo),
    pytest.param("bert", dict(mbs="auto", system=BUDGET), sgd, id="bert-auto-budget"),
    pytest.param("gpt2", dict(mbs=2, cost_model=False, dynamic=True, recompute=True), adam,
                 id="gpt2-dynamic-recompute", marks=pytest.mark.zoo),
])
def test_hf_model_trains_over_changing_lengths_with_masks(name, options, optimizer,
                                                          monkeypatch):
    """Five optimizer steps and more, lengths 2-16 with eval and no-grad calls between,
    a batch of one sample and short batches; float32 regions kept in float64
    (``test_hf_models``: the loss without its upcast, Llama's RMSNorm in its dtype).
    BERT trains with SGD: its key biases' gradients are rounding noise (softmax cancels
    them), which Adam would scale up to whole steps in both, differently."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from test_hf_models import GRAD_FLOOR, build, rms_norm_in_input_dtype

    if name == "llama":
        from transformers.models.llama import modeling_llama

        monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_in_input_dtype)
    model = build(tf, name)
    cm = mbcompile.compile(model, GBS, NUM_CSX, options.pop("mbs"),
                           example_kwargs=_hf_batch(8, seed=9), **options)
    journey(model, cm, HF, optimizer, clip=0.5, floor=GRAD_FLOOR, loss=lambda out: out.loss)


@pytest.mark.slow
def test_hidden_states_asked_for_the_first_time_are_eagers():
    """transformers 5 registers its output-capturing hooks on the first call that asks for
    ``output_hidden_states`` and sets ``_output_capturing_hooks_installed``. A capture that
    made that call put the hooks back but kept the flag: every later call, eager ones on
    the user's model too, returned ``hidden_states=()``. The variant compiled for that
    call installs them first, for real, as eager's first call does: the user's model then
    returns them, and the hidden states are exact at every length."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    from test_hf_models import GRAD_FLOOR, build

    model = build(tf, "gpt2")
    cm = mbcompile.compile(model, GBS, NUM_CSX, 2, example_kwargs=_hf_batch(8, seed=9),
                           cost_model=False)
    assert not model.transformer.h[0]._forward_hooks  # nothing asked for them yet
    asks = {**_hf_batch(8), "output_hidden_states": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the keyword compiles a variant: its own warning
        assert len(cm(**asks).hidden_states) == 3
    assert vars(model.transformer)["_output_capturing_hooks_installed"]
    assert model.transformer.h[0]._forward_hooks  # installed for good, as eager's call would
    with torch.no_grad():  # the user's own model returns them afterwards
        assert len(model(**asks).hidden_states) == 3
    hf = [("train", {**batch, "output_hidden_states": True}) if kind == "train" and i % 2
          else (kind, batch) for i, (kind, batch) in enumerate(HF[1:7])]
    journey(model, cm, hf, sgd, floor=GRAD_FLOOR, loss=lambda out: out.loss)

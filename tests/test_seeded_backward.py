"""Each microbatch's backward is seeded as eager's full-batch backward seeds it (issue 36).

The step backpropagates every microbatch's partial sum with ``g / N``: ``N`` from the
count pre-pass (``passes/loss_counts.py``), ``g`` the gradient the caller sent into the
loss at the previous step (``execution/seeding.py``). So in float32 the gradients are,
bit for bit, those of a hand loop that backpropagates each microbatch's summed loss with
eager's seed, whatever ``g`` is (``loss * w``, a loss scale), from the step after ``g``
is first seen; a wrong guess only rounds as before. Also here: a non-finite loss is
returned as eager returns it (``nonfinite="raise"`` keeps the roll-back), and
post-accumulate-grad hooks fire once per step on the full gradient.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import seeding
from mbcompile.execution.seeding import Seed
from mbcompile.models import IGNORE_INDEX, make_mlp, make_tiny_gpt
from mbcompile.passes.loss_counts import count_graph

GBS, MBS = 7, 2  # microbatches of 2, 2, 2, 1


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _seeded_hand_loop(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                      g: float) -> list[torch.Tensor]:
    """Each microbatch's summed token loss backpropagated with eager's seed ``g / N``."""
    seed = torch.tensor(g) / (labels != IGNORE_INDEX).sum()
    for start in range(0, GBS, MBS):
        _, logits = model(ids[start:start + MBS], labels[start:start + MBS])
        total = F.cross_entropy(logits.view(-1, logits.size(-1)),
                                labels[start:start + MBS].reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
        total.backward(seed)
    return _grads(model)


@pytest.mark.parametrize("weight", [3.0, 1.0])
def test_every_backward_is_seeded_with_eagers_gradient_bit_for_bit(weight, monkeypatch):
    model, (ids, labels) = make_tiny_gpt(GBS)  # float32
    hand = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=(ids, labels))
    replays, replay = [], Seed._replay
    monkeypatch.setattr(Seed, "_replay", lambda self, *args: replays.append(1) or replay(
        self, *args))
    monkeypatch.setattr(seeding, "TRACE_AFTER", 1)  # traced at its first replay
    for step in range(3):
        before = len(replays)
        (cm(ids, labels)[0] * weight).backward()
        # the seed's replay (autograd on the loss's tail) is traced at the first two steps
        # (no guess, then the gradient seen), then the traced aten ops run: no replay
        assert (len(replays) > before) == (step < 2), step
        got = _grads(model)
        want = _seeded_hand_loop(hand, ids, labels, weight)
        if step or weight == 1.0:  # the first step guesses 1: right for weight 1 only
            assert all(torch.equal(a, b) for a, b in zip(got, want)), step
        else:  # a wrong guess rounds as a backward of the sums scaled once: close, not equal
            assert all(float((a - b).norm() / b.norm()) < 1e-6 for a, b in zip(got, want))


def test_a_loss_scale_that_changes_is_followed_one_step_late_and_exactly_when_halved():
    model, (ids, labels) = make_tiny_gpt(GBS)
    hand = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=(ids, labels))
    for scale in (1024.0, 1024.0, 512.0, 512.0):  # a halved scale: exact (powers of two)
        (cm(ids, labels)[0] * torch.tensor(scale)).backward()
        got = _grads(model)
        want = _seeded_hand_loop(hand, ids, labels, scale)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), scale


def test_the_count_pre_pass_reads_only_the_labels():
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=batch)
    counts = count_graph(cm.graph_module.body, 1)
    assert counts is not None
    assert not any(n.op == "call_module" for n in counts.graph.nodes)  # no model in it
    ids, labels = batch
    assert torch.equal(counts(ids[:2], labels[:2]), (labels[:2] != IGNORE_INDEX).sum())


class _Weighted(torch.nn.Module):
    """A token loss whose count is a float: the class weights of the targets."""

    def __init__(self, weight: torch.Tensor | None) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 5)
        self.register_buffer("weight", weight)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.view(-1, 5), labels.view(-1), weight=self.weight,
                               ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("weighted", [False, True])
def test_an_integer_count_is_counted_once_a_step_a_weighted_one_per_microbatch(weighted):
    """The pre-pass counts the whole batch at once when the count is an integer (the same
    number in any order) and per microbatch, summed as the tail sums it, when it is a float
    (class weights); the gradients are the seeded hand loop's, bit for bit, either way."""
    torch.manual_seed(0)
    weight = torch.tensor([0.3, 1.7, 0.9, 2.1, 0.1]) if weighted else None
    model = _Weighted(weight)
    hand = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 16, (GBS, 6), generator=g), torch.randint(0, 5, (GBS, 6),
                                                                              generator=g)
    labels[0, :3] = IGNORE_INDEX
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=(ids, labels), cost_model=False)
    seed = cm._compiled().channels.config.seed
    calls, counts = [], seed.counts.forward
    seed.counts.forward = lambda *args: calls.append(args[1].shape[0]) or counts(*args)
    valid = labels != IGNORE_INDEX
    if weight is None:
        n = valid.sum()
    else:  # per microbatch, added within each system (4 rows, 3 rows), then over them
        w = weight[labels.masked_fill(~valid, 0)].masked_fill(~valid, 0)
        c = [w[a:a + MBS].sum() for a in range(0, GBS, MBS)]
        n = (c[0] + c[1]) + (c[2] + c[3])
    for step in range(3):
        calls.clear()
        cm(ids, labels).backward()
        got = _grads(model)
        for start in range(0, GBS, MBS):
            out = hand.head(hand.emb(ids[start:start + MBS]))
            F.cross_entropy(out.view(-1, 5), labels[start:start + MBS].reshape(-1),
                            weight=weight, ignore_index=IGNORE_INDEX, reduction="sum"
                            ).backward(torch.tensor(1.0) / n)
        want = _grads(hand)
        # the first weighted step tries the whole batch once, then counts per microbatch
        per_microbatch = [GBS] * (step == 0) + [2, 2, 2, 1]
        assert calls == (per_microbatch if weighted else [GBS]), calls
        assert all(torch.equal(a, b) for a, b in zip(got, want)), step


def test_float64_steps_with_a_weight_stay_exact():
    model, batch = make_mlp(GBS, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch)
    for weight in (1.0, 0.3, 0.3, 5.0):
        (cm(*batch)[0] * weight).backward()
        (ref(*batch)[0] * weight).backward()
        for a, b in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- non-finite
def _nan_batch(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x, y = (t.clone() for t in batch)
    y[3] = float("nan")
    return x, y


def test_a_non_finite_loss_is_returned_with_its_gradients_as_eager_does():
    model, batch = make_mlp(GBS, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch)
    bad = _nan_batch(batch)
    loss, _ = cm(*bad)
    want, _ = ref(*bad)
    assert loss.isnan() and want.isnan()
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad.isfinite(), q.grad.isfinite())


def test_nonfinite_raise_keeps_the_roll_back():
    model, batch = make_mlp(GBS, dtype=torch.float64)
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch, nonfinite="raise")
    with pytest.raises(mbcompile.MicrobatchError, match="not finite"):
        cm(*_nan_batch(batch))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(mbcompile.InputError, match="nonfinite must be"):
        mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch, nonfinite="skip")


def test_a_grad_scaler_skips_the_step_whose_loss_is_not_finite():
    model, batch = make_mlp(GBS)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch)
    runs = []
    for call, m in ((cm, model), (ref, ref)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        scales = []
        for step in range(4):
            x, y = batch
            if step == 1:
                x = x * float("inf")
            scaler.scale(call(x, y)[0]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        runs.append(scales)
    assert runs[0] == runs[1] == [1024.0, 512.0, 512.0, 512.0]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- post-accumulate-grad hooks
def _optimizer_in_backward(model: torch.nn.Module) -> list[int]:
    """torchtune's recipe: one SGD per parameter, stepped in its post-accumulate-grad hook,
    which then drops the gradient. Returns the per-step count of hook calls."""
    calls = [0]
    optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}

    def step(p: torch.Tensor) -> None:
        calls[0] += 1
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return calls


@pytest.mark.parametrize("torch_compile", [False, True], ids=["autograd", "joint"])
def test_post_accumulate_grad_hooks_fire_once_per_step_on_the_full_gradient(torch_compile):
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch,
                               torch_compile={"backend": "aot_eager"} if torch_compile
                               else False)
    calls, ref_calls = _optimizer_in_backward(model), _optimizer_in_backward(ref)
    n = len(list(model.parameters()))
    for step in range(3):
        cm(*batch)[0].backward()
        ref(*batch)[0].backward()
        assert calls[0] == ref_calls[0] == n * (step + 1)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is None and q.grad is None
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_post_accumulate_grad_hooks_of_a_two_phase_step_fire_once():
    class Centered(torch.nn.Module):  # the batch mean couples samples: a two-phase step
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.l(x)
            return ((h - h.mean(0)) ** 2).mean()

    torch.manual_seed(0)
    model = Centered().double()
    ref = copy.deepcopy(model)
    x = torch.randn(GBS, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=(x,))
    calls, ref_calls = _optimizer_in_backward(model), _optimizer_in_backward(ref)
    for _ in range(3):
        cm(x).backward()
        ref(x).backward()
    assert calls[0] == ref_calls[0] == 3 * len(list(model.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ HF Trainer, 40 steps
@pytest.mark.slow  # 80 Trainer steps
def test_the_hf_trainer_trains_a_float64_gpt2_as_its_own_loop_for_40_steps(tmp_path):
    """transformers computes the causal-LM loss in float32 and divides it by the
    Trainer's ``num_items_in_batch``: each microbatch's backward gets that float32 seed,
    so 40 AdamW steps stay where ``Trainer(model=model)`` goes (issue 36: 1e-9)."""
    transformers = pytest.importorskip("transformers")
    from integration_workers import example

    script = example("hf_trainer")
    plain = script.make_model("gpt2")
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = script.compile_for_trainer(model, cost_model=False)
    steps = 40
    for m, out in ((plain, "plain"), (cm, "compiled")):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=script.GBS,
            num_train_epochs=1, learning_rate=1e-2, seed=0, use_cpu=True, report_to=[],
            save_strategy="no", disable_tqdm=True, logging_strategy="no")
        trainer = transformers.Trainer(model=m, args=args,
                                       train_dataset=script.Tokens(steps * script.GBS, 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
        assert trainer.state.global_step == steps
    errors = {k: float((v - plain.state_dict()[k]).abs().max())
              for k, v in model.state_dict().items()}
    assert max(errors.values()) <= 1e-9, errors


class _Squares(torch.nn.Module):
    """A mean of squares, in float16 under fp16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.l2(torch.tanh(self.l1(x)))
        return ((out - y.to(out.dtype)) ** 2).mean()


@pytest.mark.parametrize("case", ["fp16-scale-overflows", "float64-loss-times-inf"])
def test_an_infinite_gradient_into_the_loss_leaves_the_next_steps_seed_finite(case: str) -> None:
    """The last step's gradient is the next step's guess: an infinite one (the default
    GradScaler's 65536 cast into a float16 loss; ``loss * inf``) seeded the next step with
    inf, so its gradients were NaN and the scaler skipped a step eager takes."""
    fp16 = case.startswith("fp16")
    dtype = torch.float32 if fp16 else torch.float64

    def run(compiled: bool) -> tuple[list[float], torch.Tensor]:
        torch.manual_seed(0)
        model = _Squares().to(dtype)
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(8, 6, generator=g, dtype=dtype),
                 torch.randn(8, 3, generator=g, dtype=dtype)) for _ in range(5)]
        call = mbcompile.compile(model, 8, 2, 2, example_inputs=data[0], cost_model=False) \
            if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=65536.0 if fp16 else 1024.0)
        scales = []
        for step, (x, y) in enumerate(data):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    loss = call(x, y)
            if not fp16 and step == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        return scales, torch.cat([p.detach().double().flatten() for p in model.parameters()])

    (want_scales, want), (got_scales, got) = run(False), run(True)
    assert got_scales == want_scales  # the same steps skipped: one, where eager skips it
    assert float((got - want).norm() / want.norm()) < (1e-3 if fp16 else 1e-12)


class _DrawnScale(torch.nn.Module):
    """A loss scaled by a number drawn in forward from the model's own generator (mixup's
    ``lam``, a random loss weight): drawn once a step, before the loop, as eager draws it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lam = torch.rand((), generator=self.g, dtype=x.dtype)
        return F.cross_entropy(self.lin(x), y) * (0.5 + lam)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_loss_times_a_draw_is_seeded_with_the_drawn_value_from_the_first_step(capture):
    """The tail ``mean * (0.5 + lam)`` is replayed with this step's ``lam`` (the loop is
    handed the draw): before, a draw in the tail left it unreplayed, so the first step of
    any compiled module (a resumed run's too) seeded with 1 and every later one with the
    last step's ``dL/dS``; the gradients of one state then differed in the last bit between
    the first call and the next, and a resumed Trainer ended 1.7e-18 off the run it resumed."""
    torch.manual_seed(0)
    model = _DrawnScale()  # float32: a seed that is not eager's rounds differently
    hand = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=(x, y), capture=capture,
                           cost_model=False)
    state = model.g.get_state()
    lam = torch.rand((), generator=torch.Generator().set_state(state))
    for start in range(0, GBS, MBS):  # eager's seed: (0.5 + lam) / N, N = GBS samples
        F.cross_entropy(hand.lin(x[start:start + MBS]), y[start:start + MBS],
                        reduction="sum").backward((0.5 + lam) / GBS)
    want = _grads(hand)
    for step in range(3):  # the same state each time: the same gradients, the hand loop's
        model.g.set_state(state)
        cm(x, y).backward()
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), want)), step


class _HandMean(torch.nn.Module):
    """A token mean written by hand, as SFT code writes it: ``tok.sum() / mask.sum()``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.emb, self.head, self.kind = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11), kind
        self.blocks = torch.nn.Sequential(*(torch.nn.Sequential(  # what recompute checkpoints
            torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.emb(ids))).flatten(0, 1)
        tok = F.cross_entropy(logits, labels.flatten(), reduction="none")
        mask = labels.flatten() != IGNORE_INDEX
        if self.kind == "where":
            return torch.where(mask, tok, 0).sum() / mask.sum()
        if self.kind == "float_mask":
            m = mask.float()
            return (tok * m).sum() / m.sum()
        if self.kind == "masked_in_place":  # a mask made in forward, written in place
            lab = labels.clone()
            lab.masked_fill_(ids == 0, IGNORE_INDEX)
            return tok.sum() / (lab != IGNORE_INDEX).sum()
        return tok.sum() / mask.sum()


@pytest.mark.parametrize("capture", ["fx", "export", "fx-recompute"])
@pytest.mark.parametrize("kind", ["count", "where", "float_mask", "masked_in_place"])
def test_a_hand_written_token_mean_of_a_batch_with_every_label_masked_is_eagers(kind, capture):
    """``tok.sum() / mask.sum()`` where every label of the batch is masked: eager's loss is
    NaN and its gradients exactly 0 (the cross entropy writes 0 at ignored labels whatever
    it receives). The denominator, a sum of the data alone, was a second partial sum the
    seed could not replay: the backwards were seeded with a guess and then multiplied by
    ``dL/dS / seed = inf``, every gradient NaN (found by a hunt). It is now the loop's count,
    counted before the backwards, so the seed is this step's ``1 / N`` (inf, as eager's)."""
    torch.manual_seed(0)
    model = _HandMean(kind).double()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (GBS, 5), generator=g),
                torch.randint(0, 11, (GBS, 5), generator=g)) for _ in range(3)]
    batches[1][1][:] = IGNORE_INDEX
    # (with ``recompute`` the body is cut into blocks; the count is read off its ops; a
    # mask written in place into a tensor forward made is counted too: both found by a hunt)
    cm = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batches[0],
                           capture=capture.split("-")[0], recompute="recompute" in capture,
                           cost_model=False)
    for step, batch in enumerate(batches):
        got, want = cm(*batch), eager(*batch)
        got.backward()
        want.backward()
        assert torch.equal(got.isnan(), want.isnan()), step
        for p, q in zip(_grads(model), _grads(eager)):
            if step == 1:
                assert torch.equal(q, torch.zeros_like(q)) and torch.equal(p, q)
            else:
                assert float((p - q).abs().max() / q.abs().max()) < 1e-12, step

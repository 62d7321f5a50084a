"""Worker functions for tests/test_fsdp.py (spawned ranks import them by name), and the
sharded model both the ranks and the single-process reference build."""

from __future__ import annotations

import copy
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import distributed as mbdist

WIDTH, CLASSES, DEPTH, SEQ = 8, 7, 3, 4


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.ff(self.norm(x)))


class TokenNet(nn.Module):
    """Per-token classifier: input projection (root), 3 blocks (one FSDP unit each), head
    (root), token cross-entropy with padded targets (-100)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), ignore_index=-100)


def make_net() -> TokenNet:
    torch.manual_seed(0)
    return TokenNet().double()


def make_batch(gbs: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and targets; every third sample's last two tokens are padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, SEQ, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (gbs, SEQ), generator=g)
    y[::3, -2:] = -100
    return x, y


def shard(net: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2 the usual way: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(net)
    return net


class Comms:
    """Counts c10d collectives by kind while active (FSDP2 calls them through ``dist``)."""

    KINDS = {"reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
             "all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "all_reduce": ("all_reduce",)}

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.KINDS, 0)
        self._saved: list[tuple[str, object]] = []

    def __enter__(self) -> Comms:
        for kind, names in self.KINDS.items():
            for name in names:
                real = getattr(dist, name, None)
                if real is None:
                    continue
                self._saved.append((name, real))

                def counted(*args, _real=real, _kind=kind, **kwargs):
                    self.counts[_kind] += 1
                    return _real(*args, **kwargs)

                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved:
            setattr(dist, name, real)


def train_steps(rank: int, world: int, out_dir: str, gbs: int, mbs: int,
                reshard_after_forward: bool | str = "auto", sync: str = "auto",
                steps: int = 2, cost_model: bool = True, recompute: bool | str = "auto"
                ) -> None:
    """``steps`` compiled steps (SGD between them) of the sharded model on this rank's
    share, with ``compile(reshard_after_forward=...)`` (the model is sharded with the
    opposite of a pinned setting, so the step must apply it); saves each step's loss, full
    gradients (``full_tensor()``), collectives and the units' setting after the step."""
    net = shard(make_net(), reshard_after_forward is not True)
    batch = make_batch(gbs)
    cm = mbcompile.compile(net, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed",
                           reshard_after_forward=reshard_after_forward, gradient_sync=sync,
                           cost_model=cost_model, recompute=recompute)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        batch = make_batch(gbs, seed=1 + step)
        with Comms() as comms:
            loss = cm(*mbdist.shard(batch, cm.plan, rank))
            loss.backward()
        record.append({"loss": loss.detach(), "counts": comms.counts,
                       "grads": {n: p.grad.full_tensor() for n, p in net.named_parameters()},
                       "resharded": [_resharded(b) for b in net.blocks],
                       "sharded": all(not g.is_unsharded for m in (net, *net.blocks)
                                      for g in m._get_fsdp_state()._fsdp_param_groups)})
        opt.step()
        opt.zero_grad()
    torch.save({"steps": record, "plan": cm.plan.to_dict(), "report": str(cm.report())},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _resharded(unit: nn.Module) -> bool:
    """The unit's ``reshard_after_forward`` as FSDP holds it now."""
    return all(g.post_forward_mesh_info is not None
               for g in unit._get_fsdp_state()._fsdp_param_groups)


def _failed_step_and_next(rank: int, out_dir: str, net: nn.Module, cm: Any, gbs: int,
                          step: Callable[[], Any]) -> None:
    """Run ``step`` (a step that fails on rank 1) with the user's gradients set to 7.0;
    record its outcome, whether gradients and parameters stayed as given, then a good
    step: the job goes on, exactly."""
    for p in net.parameters():  # the user's gradients, which a failed step leaves alone
        p.grad = torch.full_like(p, 7.0)
    before = {n: p.detach().full_tensor().clone() for n, p in net.named_parameters()}
    try:
        step()
        outcome = "no error"
    except Exception as exc:  # what each rank saw is the test's result
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=1)}"
    untouched = all(torch.equal(p.grad.to_local(), torch.full_like(p.to_local(), 7.0))
                    for p in net.parameters())
    same = all(torch.equal(p.detach().full_tensor(), before[n])
               for n, p in net.named_parameters())
    for p in net.parameters():
        p.grad = None
    loss = cm(*mbdist.shard(make_batch(gbs, seed=5), cm.plan, rank))
    loss.backward()
    torch.save({"untouched": untouched, "same": same, "outcome": outcome,
                "next_loss": loss.detach(),
                "next_grads": {n: p.grad.full_tensor() for n, p in net.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


def failing_step(rank: int, world: int, out_dir: str, gbs: int, where: str) -> None:
    """Rank 1 fails: ``"nan"`` a NaN feature in its last sample (its last microbatch's loss
    is NaN), ``"target"`` a target out of range there (cross_entropy raises after every
    block ran)."""
    net = shard(make_net())
    x, y = make_batch(gbs)
    cm = mbcompile.compile(net, gbs, world, 1, example_inputs=(x, y),
                           backend="torch.distributed", nonfinite="raise")
    x, y = (t.clone() for t in mbdist.shard((x, y), cm.plan, rank))
    if rank == 1 and where == "nan":
        x[-1, 0, 0] = float("nan")
    if rank == 1 and where == "target":
        y[-1, 0] = CLASSES + 5
    _failed_step_and_next(rank, out_dir, net, cm, gbs, lambda: cm(x, y).backward())


def failing_backward(rank: int, world: int, out_dir: str, gbs: int, which: int,
                     reshard: bool, sync: str = "auto") -> None:
    """Rank 1's backward of its ``which``-th microbatch (1-based) raises halfway, at the
    middle block's weight gradient (a hook on FSDP's gathered parameter), after one good
    step."""
    net = shard(make_net())
    x, y = make_batch(gbs)
    cm = mbcompile.compile(net, gbs, world, 1, example_inputs=(x, y),
                           backend="torch.distributed", reshard_after_forward=reshard,
                           gradient_sync=sync)
    share = mbdist.shard((x, y), cm.plan, rank)
    cm(*share).backward()  # a good step: FSDP's gathered parameters exist from now on
    seen = {"n": 0}

    def explode(grad: torch.Tensor) -> torch.Tensor:
        seen["n"] += 1
        if rank == 1 and seen["n"] == which:
            raise RuntimeError(f"injected failure in backward {which} on rank 1")
        return grad

    block = net.blocks[DEPTH // 2]
    weight = next(f for f in block._get_fsdp_state()._fsdp_param_groups[0].fsdp_params
                  if f._module_info.module is block.ff and f._module_info.param_name == "weight")
    hook = weight._unsharded_param.register_hook(explode)
    try:
        _failed_step_and_next(rank, out_dir, net, cm, gbs, lambda: cm(*share).backward())
    finally:
        hook.remove()


def capture_view(rank: int, world: int, out_dir: str) -> None:
    """What capture makes of a sharded model, and the simulated backend's refusal."""
    from mbcompile.passes.capture import FSDP_PARAM, capture

    net = shard(make_net())
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in net.modules()]
    gm = capture(net).graph_module
    markers = [(n.target.__name__, n.args[0]) for n in gm.graph.nodes
               if n.op == "call_function" and n.target.__name__.startswith("fsdp_unit_")]
    stand_ins = {n: (tuple(p.shape), p.untyped_storage().nbytes(), getattr(p, FSDP_PARAM)[1])
                 for n, p in gm.named_parameters()}
    batch = make_batch(4)
    try:
        mbcompile.compile(net, 4, 1, 2, example_inputs=batch)(*batch)
        refusal = "none"
    except Exception as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    torch.save({"markers": markers, "stand_ins": stand_ins, "refusal": refusal,
                "hooks_kept": hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks))
                                        for m in net.modules()]},
               os.path.join(out_dir, f"rank{rank}.pt"))


def cost_view(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """The cost model of a sharded model on this rank: the modelled memory and time."""
    net = shard(make_net())
    batch = make_batch(gbs)
    cm = mbcompile.compile(net, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed", compile_only=True,
                           reshard_after_forward=True)
    m, t = cm.estimate.memory, cm.estimate.time
    figures = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
               "gathered": m.gathered, "peak": m.peak, "allgather": t.allgather,
               "allreduce": t.allreduce, "saved": m.saved, "transient": m.transient,
               "inputs": m.inputs}
    torch.save({**{k: float(v) for k, v in figures.items()}, "reason": cm.plan.reason,
                "report": str(cm.report())},
               os.path.join(out_dir, f"rank{rank}.pt"))


def reshard_view(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """How ``reshard_after_forward='auto'`` chooses: the modelled peak and step with each
    setting pinned, then auto on a system with room for either, and on one whose memory
    lies between the two peaks."""
    import dataclasses

    from mbcompile.planning.systems import get_system

    net = shard(make_net())
    batch = make_batch(gbs)

    def plan(reshard: bool | str, system=None, sync: str = "step") -> dict:
        cm = mbcompile.compile(net, gbs, world, mbs, example_inputs=batch, system=system,
                               backend="torch.distributed", compile_only=True,
                               reshard_after_forward=reshard, gradient_sync=sync)
        e = cm.estimate
        return {"value": cm.plan.reshard_after_forward, "sync": cm.plan.gradient_sync,
                "peak": e.memory.peak, "grads": e.memory.grads,
                "gathered": e.memory.gathered, "step": e.time.step,
                "allgather": e.time.allgather, "allreduce": e.time.allreduce,
                "reason": cm.plan.reason, "report": str(cm.report()), "plan": str(cm.plan)}

    def between(a: float, b: float) -> Any:
        return dataclasses.replace(get_system("host"), name="between",
                                   memory_bytes=(a + b) / 2)

    pinned = {value: plan(value) for value in (True, False)}
    synced = {when: plan(True, sync=when) for when in ("step", "microbatch")}
    torch.save({"pinned": pinned, "roomy": plan("auto"),
                "tight": plan("auto", between(pinned[True]["peak"], pinned[False]["peak"])),
                "synced": synced, "auto_sync": plan(True, sync="auto"),
                "tight_sync": plan(True, between(synced["step"]["peak"],
                                                 synced["microbatch"]["peak"]), sync="auto")},
               os.path.join(out_dir, f"rank{rank}.pt"))


def make_llama(layers: int = 2) -> nn.Module:
    """A tiny transformers Llama in float64 throughout: its RMSNorm and causal-LM loss
    without their float32 round trips (``test_hf_models``), so sums of partial sums
    agree to float64 rounding; its embeddings tied to its head, as Llama 3.2's are."""
    from test_hf_models import causal_lm_loss_float64, rms_norm_in_input_dtype
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaRMSNorm.forward = rms_norm_in_input_dtype  # this process only
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).double()
    model.loss_function = causal_lm_loss_float64
    return model


def llama_batch(gbs: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids and labels; every third sample's last three labels are padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (gbs, 8), generator=g)
    labels = ids.clone()
    labels[::3, -3:] = -100
    return {"input_ids": ids, "labels": labels}


def hf_train_steps(rank: int, world: int, out_dir: str, gbs: int, mbs: int,
                   steps: int = 2, recompute: bool | str = "auto") -> None:
    """``steps`` compiled steps (SGD between them) of a transformers Llama sharded with
    fully_shard (each decoder layer, then the model) on this rank's share; saves each
    step's loss, full gradients and collectives, and the captured graph's markers."""
    from torch.distributed.fsdp import fully_shard

    from mbcompile.passes.ops import fsdp_unit_enter

    model = make_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    cm = mbcompile.compile(model, gbs, world, mbs, example_kwargs=llama_batch(gbs),
                           backend="torch.distributed", recompute=recompute)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        batch = mbdist.shard(llama_batch(gbs, seed=1 + step), cm.plan, rank)
        with Comms() as comms:
            loss = cm(**batch).loss
            loss.backward()
        record.append({"loss": loss.detach(), "counts": comms.counts,
                       "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
                       "sharded": all(not g.is_unsharded for m in (model, *model.model.layers)
                                      for g in m._get_fsdp_state()._fsdp_param_groups)})
        opt.step()
        opt.zero_grad()
    graph = cm.original_graph_module.graph
    m, t = cm.estimate.memory, cm.estimate.time
    figures = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer,
               "gathered": m.gathered, "peak": m.peak, "allgather": t.allgather,
               "allreduce": t.allreduce, "saved": m.saved, "inputs": m.inputs,
               "transient": m.transient}
    torch.save({"steps": record, "plan": cm.plan.to_dict(), "figures": figures,
                "entered": [n.args[0] for n in graph.nodes if n.target is fsdp_unit_enter],
                "targets": {str(n.target) for n in graph.nodes if n.op == "call_function"}},
               os.path.join(out_dir, f"rank{rank}.pt"))


class _Positions(nn.Module):
    """A learned table, called with no argument (``self.pos()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(SEQ, WIDTH, dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        return self.table * 1.0


class _KeywordNet(TokenNet):
    """TokenNet with a position table sharded on its own, and a forward that takes
    ``**kwargs`` (only torch.export captures it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = _Positions()

    def forward(self, x: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return super().forward(x + self.pos(), y)


def unit_without_tensors(rank: int, world: int, out_dir: str) -> None:
    """A unit called with no tensor, in a model only export captures: compile's error,
    and whether the shards are as they were."""
    from torch.distributed.fsdp import fully_shard

    from mbcompile.errors import CaptureError

    torch.manual_seed(0)
    net = _KeywordNet().double()
    fully_shard(net.pos)
    shard(net)
    before = {n: p.to_local().clone() for n, p in net.named_parameters()}
    hooks = [list(m._forward_pre_hooks) + list(m._forward_hooks) for m in net.modules()]
    x, y = make_batch(4)
    try:
        mbcompile.compile(net, 4, world, 1, example_kwargs={"x": x, "y": y},
                          backend="torch.distributed")
        message = None
    except CaptureError as exc:
        message = str(exc)
    kept = all(torch.equal(p.to_local(), before[n]) for n, p in net.named_parameters()) and \
        hooks == [list(m._forward_pre_hooks) + list(m._forward_hooks) for m in net.modules()]
    torch.save({"message": message, "kept": kept}, os.path.join(out_dir, f"rank{rank}.pt"))


def mixed_precision_step(rank: int, world: int, out_dir: str, kind: str) -> None:
    """One compiled step of a float64 model sharded with ``MixedPrecisionPolicy(
    param_dtype=float32, reduce_dtype=float64)``: ``kind`` "llama" (transformers as
    shipped, float32 casts in its RMSNorm: export) or "tokennet" (torch.fx, float inputs
    that FSDP casts). Saves the loss and the full gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    if kind == "llama":
        from transformers.models.llama import modeling_llama

        stock = modeling_llama.LlamaRMSNorm.forward
        model = make_llama()
        modeling_llama.LlamaRMSNorm.forward = stock  # its float32 round trip, as shipped
        blocks, batch = model.model.layers, llama_batch(8)
    else:
        model = make_net()
        x, y = make_batch(8)
        blocks, batch = model.blocks, {"x": x, "y": y}
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    cm = mbcompile.compile(model, 8, world, 2, example_kwargs=batch,
                           backend="torch.distributed")
    out = cm(**mbdist.shard(batch, cm.plan, rank))
    loss = out.loss if kind == "llama" else out
    loss.backward()
    torch.save({"loss": loss.detach(), "gathered": cm.estimate.memory.gathered,
                "reshard": cm.plan.reshard_after_forward,
                "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


def post_accumulate_steps(rank: int, world: int, out_dir: str, gbs: int, mbs: int,
                          sync: str) -> None:
    """Two compiled steps of the sharded model with a post-accumulate-grad hook on every
    parameter (SGD between them) that records how often it fires and the local shard of
    the gradient it sees; saves those, and each step's full gradients."""
    net = shard(make_net())
    cm = mbcompile.compile(net, gbs, world, mbs, example_inputs=make_batch(gbs),
                           backend="torch.distributed", gradient_sync=sync)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n, _ in net.named_parameters()}
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda q, name=name: seen[name].append(q.grad.to_local().clone()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    record = []
    for step in range(2):
        loss = cm(*mbdist.shard(make_batch(gbs, seed=1 + step), cm.plan, rank))
        fired = {n: len(s) for n, s in seen.items()}
        loss.backward()
        record.append({"fired_in_call": fired,
                       "seen": {n: s[-1] if s else None for n, s in seen.items()},
                       "count": {n: len(s) for n, s in seen.items()},
                       "local": {n: p.grad.to_local().clone() for n, p in net.named_parameters()},
                       "grads": {n: p.grad.full_tensor() for n, p in net.named_parameters()}})
        for s in seen.values():
            s.clear()
        opt.step()
        opt.zero_grad()
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


class Clipped(TokenNet):
    """Clips the projection's activations in place under no_grad (a straight-through
    clip: the gradient passes as if unclipped)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        with torch.no_grad():
            h.clamp_(-0.1, 0.1)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), ignore_index=-100)


def _sharded_against_eager(cls: type[nn.Module], gbs: int, world: int
                           ) -> tuple[nn.Module, nn.Module, Any]:
    """``cls()`` in float64, an eager copy taken first, and the model sharded (``shard``)
    and compiled at ``gbs`` over ``world`` ranks at MBS 2, planned without the cost model."""
    torch.manual_seed(0)
    net = cls().double()
    eager = copy.deepcopy(net)
    shard(net)
    return net, eager, mbcompile.compile(net, gbs, world, 2, example_inputs=make_batch(gbs),
                                         backend="torch.distributed", cost_model=False)


def clipped_steps(rank: int, world: int, out_dir: str, gbs: int) -> None:
    """Two SGD steps of the sharded ``Clipped`` against eager on the whole batch in this
    rank; saves the largest relative difference of the losses and full gradients."""
    net, eager, cm = _sharded_against_eager(Clipped, gbs, world)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, eager)]
    worst = 0.0
    for step in range(2):
        batch = make_batch(gbs, seed=1 + step)
        loss = cm(*mbdist.shard(batch, cm.plan, rank))
        loss.backward()
        want = eager(*batch)
        want.backward()
        worst = max(worst, float((loss - want).abs() / want.abs()))
        for p, q in zip(net.parameters(), eager.parameters()):
            g = p.grad.full_tensor()
            worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    torch.save({"worst": worst}, os.path.join(out_dir, f"rank{rank}.pt"))


class Reweighted(TokenNet):
    """A class-weighted token loss whose weights the loop changes, scaled by a draw from
    constants (mixup's weight): both were constants of the fx graph under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("class_w", torch.ones(CLASSES))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lam = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample()
        h = self.proj(x * lam.to(x.dtype))
        for block in self.blocks:
            h = block(h)
        w = self.class_w / self.class_w.mean()  # reads the buffer alone
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), weight=w,
                               ignore_index=-100)


def reweighted_steps(rank: int, world: int, out_dir: str, gbs: int) -> None:
    """Three steps of the sharded ``Reweighted`` against eager on the whole batch in this
    rank, the class weights changed between steps, the generator seeded alike before each;
    saves the largest relative difference of the losses and full gradients, and whether
    the generator ended where eager's does."""
    net, eager, cm = _sharded_against_eager(Reweighted, gbs, world)
    worst, same_rng = 0.0, True
    for step in range(3):
        batch = make_batch(gbs, seed=1 + step)
        torch.manual_seed(10 + step)
        loss = cm(*mbdist.shard(batch, cm.plan, rank))
        after = torch.rand(())
        loss.backward()
        torch.manual_seed(10 + step)
        want = eager(*batch)
        same_rng &= bool(torch.equal(after, torch.rand(())))
        want.backward()
        worst = max(worst, float((loss - want).abs() / want.abs()))
        for p, q in zip(net.parameters(), eager.parameters()):
            g = p.grad.full_tensor()
            worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max()))
            p.grad, q.grad = None, None
        with torch.no_grad():
            for m in (net, eager):
                m.class_w.copy_(torch.arange(1.0, CLASSES + 1) + step)
    torch.save({"worst": worst, "same_rng": same_rng}, os.path.join(out_dir, f"rank{rank}.pt"))

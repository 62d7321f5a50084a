"""The construct table, the generated model (``FuzzNet``) and its ``Spec``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import base, globalstate, hooks, modes, pystate, rng, state
from .base import (
    DTYPE,
    WIDTH,
    Construct,
    _lin,
)

#: name -> construct. Comments: what eager does that a microbatched step must keep.
CONSTRUCTS: dict[str, type[Construct]] = {
    "plain": base.Plain,  # control: nothing forward-time
    # grad-mode regions
    "no_grad_teacher": modes.NoGradTeacher,  # teacher params: .grad None; no grad through t
    "set_grad_enabled_attr": modes.SetGradEnabledAttr,  # region mode read from an attribute
    "set_grad_enabled_call": modes.SetGradEnabledCall,  # function form, mode restored after
    "inference_mode": modes.InferenceMode,  # inference tensors, cloned before autograd sees them
    "no_grad_decorated": modes.NoGradDecorated,  # @torch.no_grad() helper method
    "enable_grad_nested": modes.EnableGradNested,  # enable_grad inside no_grad: grads flow there
    "requires_grad_toggle": modes.RequiresGradToggle,  # requires_grad_(False) after compile
    # autocast regions
    "autocast_bf16": modes.AutocastBf16,  # bf16 Linear; enabled= read from an attribute
    "autocast_decorated": modes.AutocastDecorated,  # @torch.autocast helper method
    # tensor hooks
    "tensor_hook_linear": modes.TensorHookLinear,  # g * scale: linear, runs per microbatch
    "tensor_hook_clamp": modes.TensorHookClamp,  # g.clamp: sees the gradient's true scale
    "tensor_hook_norm": modes.TensorHookNorm,  # g / g.norm(): couples the batch in backward
    # module hooks
    "forward_hook_leaf": hooks.ForwardHookLeaf,  # on nn.Linear at compile; removed later
    "forward_pre_hook_leaf": hooks.ForwardPreHookLeaf,  # on nn.Linear at compile; another added
    "forward_hook_inner": hooks.ForwardHookInner,  # on a traced submodule; removed later
    "hook_added_leaf": hooks.HookAddedLeaf,  # forward hook added after compile (leaf)
    "hook_added_inner": hooks.HookAddedInner,  # pre-hook added after compile (traced submodule)
    "reading_hook_added_leaf": hooks.ReadingHookAddedLeaf,  # appends, added later: refused (F6)
    "recording_hook_leaf": hooks.RecordingHookLeaf,  # self.acts[...] = out, count: refused (F6)
    "recording_hook_wrapped": hooks.RecordingHookWrapped,  # the same on a module of one's own
    "backward_hook_leaf": hooks.BackwardHookLeaf,  # g * 0.5 into the layer's input; removed later
    "backward_pre_hook_leaf": hooks.BackwardPreHookLeaf,  # g * 0.5 into the layer's output
    "backward_hook_mixing": hooks.BackwardHookMixing,  # g - g.mean(0): couples the batch
    "forward_hook_mixing": hooks.ForwardHookMixing,  # out - out.mean(0) in a hook: couples
    "root_forward_hook": hooks.RootForwardHook,  # hook on the model itself; removed later
    "root_pre_hook": hooks.RootPreHook,  # pre-hook on the model itself
    "root_hook_added": hooks.RootHookAdded,  # hook on the model itself added after compile
    # attribute reads
    "attr_beta": state.AttrBeta,  # self.beta * term in the loss; beta changed
    "attr_flag": state.AttrFlag,  # if self.flag: ...; flipped
    "training_branch": state.TrainingBranch,  # if self.training: ...; block put in eval
    "dropout_attr": state.DropoutAttr,  # F.dropout(p=self.p): 0 -> 1
    "dropout_module_p": state.DropoutModuleP,  # nn.Dropout(0.0).p = 1.0
    "dropout_module_eval": state.DropoutModuleEval,  # nn.Dropout(1.0) -> eval()
    # Python state of every kind (pystate.py): read (guarded) or written (replayed once)
    "flags_dict": pystate.FlagsDict,  # if self.flags["hard"]; a scale from the dict
    "enum_mode": pystate.EnumMode,  # self.mode is Mode.HARD
    "config_object": pystate.ConfigObject,  # self.cfg.beta of a dataclass
    "private_counter": pystate.PrivateCounter,  # self._step += 1, read in the same forward
    "logs_stats": pystate.LogsStats,  # self.last, self.stats[...], self.history.append(...)
    # state writes
    "buffer_counter": state.BufferCounter,  # self.seen += B: once per step, the full B
    "buffer_counter_read": state.BufferCounterRead,  # the updated count read in the same forward
    "ema_center_before": state.EmaCenterBefore,  # read, then EMA of the batch mean
    "ema_center_after": state.EmaCenterAfter,  # EMA of the batch mean, then read: coupled
    "ema_param_loop": state.EmaParamLoop,  # frozen params updated via .parameters()
    "ema_param_attr": state.EmaParamAttr,  # frozen params updated via attributes
    "input_write": state.InputWrite,  # x.sub_(..).mul_(..): the caller's tensor changes
    # model-owned generators
    "generator_noise": state.GeneratorNoise,  # per-sample draw from self.g
    "generator_shared": state.GeneratorShared,  # batch-free draw from self.g
    # parametrizations
    "spectral_norm": state.SpectralNorm,  # power iteration once per step, u/v buffers
    "spectral_norm_legacy": state.SpectralNormLegacy,  # the pre-hook version
    "weight_norm_legacy": hooks.WeightNormLegacy,  # pre-hook; plain weight set after the step
    "weight_norm": state.WeightNorm,  # stateless: exact
    # random draws (rng.py): made once per step at the full batch, or refused
    "global_rand": rng.GlobalRand,  # torch.rand(B, 1), global generator, returned
    "generator_randperm": rng.GeneratorRandperm,  # randperm(B, g): per-sample places, returned
    "generator_shuffle": rng.GeneratorShuffle,  # h[randperm(B, g)]: mixup, coupled
    "generator_twice": rng.GeneratorTwice,  # per-sample then batch-free draw from one g
    "generator_in_place": rng.GeneratorInPlace,  # new_empty(...).normal_(generator=g)
    "generator_in_place_alias": rng.GeneratorInPlaceAlias,  # new_zeros; normal_ read by name
    "global_in_place": rng.GlobalInPlace,  # new_empty(B, 1).bernoulli_(0.5), returned
    "generator_in_place_like": rng.GeneratorInPlaceLike,  # empty_like(h).normal_(g): refused
    "generator_randint": rng.GeneratorRandint,  # randint(0, 3, (B, 1), generator=g), returned
    "global_mask": rng.GlobalMask,  # torch.rand(B, 1) < 0.5: a drop-path mask, returned
    "seed_in_forward": rng.SeedInForward,  # torch.manual_seed(0) in forward: refused
    "fork_rng_draw": rng.ForkRngDraw,  # a draw inside fork_rng: refused
    "generator_seed_in_forward": rng.GeneratorSeedInForward,  # self.g.manual_seed(0): refused
    # hooks that write (rng.py)
    "param_hook_linear": rng.ParamHookLinear,  # weight.register_hook(g * 0.5)
    "post_accumulate_hook": rng.PostAccumulateHook,  # p.grad.mul_(0.5) once per step
    "hook_writes_data": rng.HookWritesData,  # forward hook: weight.data.mul_(0.9)
    "hook_in_place_output": rng.HookInPlaceOutput,  # forward hook: out.mul_(0.5)
    # module-level state (globalstate.py: each block has globals of its own)
    "helper_global": globalstate.HelperGlobal,  # helpers.scaled reads another module's SCALE
    "helper_swapped": globalstate.HelperSwapped,  # helpers.activation rebound after compile
    "global_dict": globalstate.GlobalDict,  # SETTINGS["scale"], if SETTINGS["hard"]
    "closure_factor": globalstate.ClosureFactor,  # a closure's variable, set by nonlocal
    "global_counter": globalstate.GlobalCounter,  # global CALLS; CALLS += 1, read after
    "global_log": globalstate.GlobalLog,  # LOG.append(...), STATS.calls += 1, STATS.last = ...
    "helper_writes": globalstate.HelperWrites,  # another module's COUNT += 1, LAST = ...
    "global_generator": globalstate.GlobalGenerator,  # per-sample noise from a global generator
    "local_generator": globalstate.LocalGenerator,  # a generator made and seeded in forward
    "class_attribute": globalstate.ClassAttribute,  # self.SCALE set on the class
    "global_schedule": globalstate.GlobalSchedule,  # SCHEDULE(t): a callable object's state
    "held_schedule": globalstate.HeldSchedule,  # self.schedule(t): the same, an attribute
    # refused: seeding (also imported by name), I/O, Python's and numpy's random numbers
    "global_generator_seed": globalstate.GlobalGeneratorSeed,  # GEN.manual_seed(0)
    "seed_imported": globalstate.SeedImported,  # from torch import manual_seed as ...
    "fork_rng_imported": globalstate.ForkRngImported,  # from torch.random import fork_rng
    "rng_state_read": globalstate.RngStateRead,  # self.state = torch.get_rng_state()
    "file_write": globalstate.FileWrite,  # open(...).write(...)
    "python_random": globalstate.PythonRandom,  # random.random()
    "numpy_random": globalstate.NumpyRandom,  # np.random.rand()
}


# --------------------------------------------------------------------------- #
# The generated model
# --------------------------------------------------------------------------- #


def _no_grad_output(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.head(h)


#: extra outputs returned after the loss: name -> fn(model, h)
EXTRAS = {
    "view_slice": lambda m, h: h[:, :2],  # a view of an activation
    "view_t": lambda m, h: h.t(),  # a view with the batch in dim 1
    "feature_dim": lambda m, h: h.shape[-1],  # a Python number (4)
    "batch_size": lambda m, h: h.size(0),  # a Python number: the full batch's size
    "detached": lambda m, h: h.detach(),  # requires_grad False
    "no_grad_output": _no_grad_output,  # computed under no_grad
}


@dataclass(frozen=True)
class Spec:
    """One generated example: the model and how it is compiled."""

    constructs: tuple[str, ...]
    gbs: int = 7
    num_csx: int = 2
    mbs: int = 2
    loss: str = "mse"  # or "ce"
    extras: tuple[str, ...] = ()
    coupled: bool = False  # add a term mbcompile runs as a two-phase step
    recompute: Any = "auto"  # or True
    torch_compile: bool = False  # {"backend": "aot_eager"}
    example_batch: int | None = None  # example_inputs' batch size (None: gbs)
    seed: int = 0

    @property
    def rel(self) -> float:
        return max(CONSTRUCTS[c].rel for c in self.constructs)


class FuzzNet(nn.Module):
    """inp -> constructs -> head -> loss (+ aux terms, + coupled term), extras returned."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.loss_kind, self.extra_names, self.coupled = spec.loss, spec.extras, spec.coupled
        self.inp = _lin()
        self.blocks = nn.ModuleList(CONSTRUCTS[name]() for name in spec.constructs)
        self.head = _lin()

    def forward(self, x, y):
        for block in self.blocks:
            block.prepare(x)
        h = torch.tanh(self.inp(x))
        extras, terms = [], []
        for block in self.blocks:
            h, extra, term = block(h, x)
            if extra is not None:
                extras.append(extra)
            if term is not None:
                terms.append(term)
        out = self.head(h)
        loss = F.mse_loss(out, y) if self.loss_kind == "mse" else F.cross_entropy(out, y)
        for term in terms:
            loss = loss + term
        if self.coupled:  # in-batch similarities: two-phase
            z = F.normalize(h, dim=1)
            loss = loss + 0.1 * (z @ z.T).logsumexp(1).mean()
        return (loss, *[EXTRAS[name](self, h) for name in self.extra_names], *extras)


def build(spec: Spec) -> FuzzNet:
    """The model of ``spec``; the same weights, buffers and generators every time."""
    torch.manual_seed(spec.seed)
    model = FuzzNet(spec).to(DTYPE)
    for block in model.blocks:
        if block.keep_float32:
            block.float()
        block.install(model)
    return model


def make_inputs(spec: Spec, batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    batch = spec.gbs if batch is None else batch
    g = torch.Generator().manual_seed(100 + spec.seed + batch)
    x = torch.randn(batch, WIDTH, generator=g, dtype=DTYPE)
    y = (torch.randint(0, WIDTH, (batch,), generator=g) if spec.loss == "ce"
         else torch.randn(batch, WIDTH, generator=g, dtype=DTYPE))
    return x, y

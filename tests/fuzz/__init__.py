"""A differential fuzz of forward-time constructs (issues 25 and 35), run by
``tests/test_forward_fuzz.py``.

Files: ``base`` (tolerances, ``Construct``), the constructs by kind (``modes``, ``hooks``,
``state``, ``pystate``, ``rng``, ``globalstate``: module globals, another module's
(``global_helpers``), closures, class attributes, callable objects, and the calls no step
can replay), ``fresh`` (a fresh copy of a module per construct, so that the compiled model
and its eager reference never share a global), ``model`` (the table ``CONSTRUCTS``,
``Spec``, ``FuzzNet``), ``oracle`` (``check``, ``assert_ok``).

A forward does more than its ops (DESIGN.md, "Forward-time semantics and guards"):
it switches grad mode, enters autocast regions, registers tensor hooks, runs module
hooks and parametrizations, reads Python attributes and flags, draws from
generators and writes state. Each generated model here is a small float64
``nn.Module`` (features 4) whose forward runs the running activation ``h`` of shape
``(B, 4)`` through 1-4 *constructs* from ``CONSTRUCTS`` (table below) and ends in a
loss (MSE or cross-entropy), sometimes with extra outputs (``EXTRAS``: returned
views, Python numbers, a detached tensor). Each is combined with a random plan
(gbs 5-9, num_csx 1-3, any MBS: mostly uneven), sometimes a coupled loss term that
mbcompile runs as a two-phase step, ``recompute=True``, an example batch of another
size, and (rarely: it is slow) ``torch_compile={"backend": "aot_eager"}``.

The oracle, per example (``check(spec)``):

- ``compile`` raises an ``MbcompileError``: an acceptable refusal, provided the
  model (parameters, buffers, ``.grad``, ``requires_grad``, hooks, ``training``
  flags, generators, Python attributes) and the example inputs are as before.
  A ``CaptureError`` saying "failed in mbcompile itself" is an internal crash, and
  so is any other exception.
- compiled: one training step of the compiled module against one eager full-batch
  step of an identically built model, each from no gradients and the same
  ``torch.manual_seed``: every output leaf (value, dtype, shape, ``requires_grad``;
  Python numbers equal), every ``.grad`` (``None`` exactly where eager's is), every
  buffer and parameter value, every parameter still a leaf (and the same object),
  the inputs as the forward left them, each model-owned generator's state, the
  global RNG state, Python's and numpy's, every module's Python state (attributes of any
  name holding numbers, flags, enums, containers, tensors or a config object:
  ``oracle.python_state``) and the module globals of each ``globalstate`` construct.
  Values to 1e-10 relative in float64; with an autocast construct,
  to bf16 rounding (``BF16_REL``).
- then a plain SGD step on both, the Python state the constructs read is changed on
  both (``Construct.mutate``: a coefficient, a flag, a dropout ``p``, a hook added or
  removed, ``requires_grad`` toggled, a generator reseeded, a submodule put in eval),
  and a second step is compared the same way (a warning about recompiling is fine).
- a call that raises an ``MbcompileError`` is an acceptable refusal if the step
  left the model as it was (DESIGN invariant 3). A ``MicrobatchError`` whose cause
  is not an ``MbcompileError`` (a torch error inside the loop, where eager ran) is
  an internal crash, not a refusal.

Everything here is expected to be exact or refused; this file never relaxes a
comparison because today's code gets it wrong.

Random draws: a draw that reads no sample's data (``torch.rand(B, 1)``, ``randn(h.shape,
generator=g)``, ``randperm(B)``, a batch-free draw), from the global generator or a
model-owned one, is made once per step at the full batch (``passes/draws.py``), so its
values, the outputs it makes and every generator's state are compared strictly. Seeding
in forward (``manual_seed``, ``fork_rng``, ``g.manual_seed``) must be refused. Not
comparable in principle, so not generated: draws that read the samples from the global
generator, dropout with 0 < p < 1 above all (DESIGN: "Dropout and other RNG draws are the
one documented exception"); dropout is only used with p = 0 or p = 1 (which draw nothing).

Runs: ``python -m pytest tests/test_forward_fuzz.py`` (about a minute of CPU: every
construct split and two-phase, the ones recomputation can disturb with ``recompute=True``,
every extra output split and two-phase, ``torch_compile`` cases (marked slow), a check that every
``mutate`` changes what eager computes, and 25 random combinations, derandomized).
``MBCOMPILE_FUZZ_EXAMPLES=500`` searches longer with random seeds, shrinks what it finds,
runs every construct with ``recompute=True`` and draws ``torch_compile`` cases too. A
finding reproduces with
``cd tests && python -c "import fuzz as f; print(f.check(f.Spec(...)))"``
using the ``Spec`` printed in the failure.
"""

from .model import CONSTRUCTS, EXTRAS, Spec, build, make_inputs
from .oracle import assert_ok, check, step_errors

__all__ = ["CONSTRUCTS", "EXTRAS", "Spec", "assert_ok", "build", "check", "make_inputs",
           "step_errors"]

"""A config object a module holds is guarded by what forward read of it
(``passes/attribute_reads.py``).

A change to an attribute forward never reads (the HF Trainer's checkpoint sets
``config.architectures`` and ``config.dtype``) compiles nothing again, and the step stays
eager's; a change to one it reads, found or missing (``hasattr``, ``getattr`` with a
default), through a property, a nested config or a transformers ``attribute_map`` name,
compiles again once and runs eager's step with the new value; a read of the whole object
(``vars``, ``to_dict()``, a copy, a method that reads past ``__getattribute__``) keeps the
whole object guarded: any change compiles again. Each step is compared with one eager
full-batch step of a deep copy (``models.step_errors``), in float64.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, plan_free, step_errors

import mbcompile

GBS, SYSTEMS, MBS = 7, 2, 2

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


@dataclasses.dataclass
class Inner:
    beta: float = 0.5
    tag: str = "a"  # never read by forward


@dataclasses.dataclass
class Settings:
    scale: float = 2.0
    note: str = "run 1"  # never read by forward
    inner: Inner = dataclasses.field(default_factory=Inner)

    @property
    def doubled(self) -> float:
        return 2 * self.scale

    def to_dict(self) -> dict[str, Any]:  # as transformers' configs: the whole __dict__
        return dict(self.__dict__)

    def raw(self, name: str) -> Any:  # a read past __getattribute__: not seen
        return object.__getattribute__(self, name)


class Reads(nn.Module):
    """Forward reads ``read(self.cfg)``: a number that scales the loss."""

    def __init__(self, read: Callable[[Any], float], cfg: Any = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.cfg = Settings() if cfg is None else cfg
        self.read = read

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y) * self.read(self.cfg)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GBS, 4, generator=g), torch.randn(GBS, 3, generator=g)


def _compiled(model: nn.Module, **kw: Any) -> mbcompile.CompiledModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        return mbcompile.compile(model, GBS, SYSTEMS, MBS, **plan_free(MBS, **kw))


def _step(model: nn.Module, cm: Any, seed: int = 1, **kwargs: Any) -> list[str]:
    """One step of ``cm`` against eager's on a copy of ``model``, exact; the
    ``RecompileWarning``s it raised."""
    inputs = () if kwargs else _batch(seed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_close_errors(step_errors(model, cm, inputs, kwargs or None), TOL)
    return [str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]


# --------------------------------------------------------------------------- #
# A dataclass of the user's (captured by torch.fx)
# --------------------------------------------------------------------------- #


def _scale_and_beta(cfg: Any) -> float:
    return cfg.scale * cfg.inner.beta


def test_an_attribute_forward_never_reads_compiles_nothing_again():
    model = Reads(_scale_and_beta)
    cm = _compiled(model, example_inputs=_batch())
    assert _step(model, cm) == []
    model.cfg.note = "run 2"
    model.cfg.inner.tag = "b"  # in the nested config, beside the beta forward reads
    model.cfg.added = 3  # a new attribute: forward never asks for it
    assert _step(model, cm, seed=2) == []


@pytest.mark.parametrize("change, named", [
    (lambda cfg: setattr(cfg, "scale", 3.0), ".scale = 3.0"),
    (lambda cfg: setattr(cfg.inner, "beta", 0.25), ".beta = 0.25"),
    (lambda cfg: setattr(cfg, "inner", Inner(beta=0.125)), ".inner = "),
], ids=["attribute", "nested", "nested_replaced"])
def test_an_attribute_forward_reads_compiles_again_and_runs_its_new_value(change, named):
    """The warning names the read that changed; eager's step with the new value; going back
    to the old value runs the first graph again, with no compile."""
    model = Reads(_scale_and_beta)
    cm = _compiled(model, example_inputs=_batch())
    _step(model, cm)
    inner = model.cfg.inner
    change(model.cfg)
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and named in said[0] and "note" not in said[0], said
    model.cfg.scale, model.cfg.inner, inner.beta = 2.0, inner, 0.5
    assert _step(model, cm, seed=3) == []


def test_a_property_is_guarded_by_what_its_getter_reads():
    model = Reads(lambda cfg: cfg.doubled)
    cm = _compiled(model, example_inputs=_batch())
    assert _step(model, cm) == []
    model.cfg.note = "run 2"
    assert _step(model, cm) == []
    model.cfg.scale = 0.5
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and ".scale = 0.5" in said[0], said


def _gain(cfg: Any) -> float:
    shift = cfg.shift if hasattr(cfg, "shift") else 0.0
    return getattr(cfg, "gain", 1.0) + shift


@pytest.mark.parametrize("name", ["gain", "shift"])
def test_a_missing_attribute_read_by_hasattr_or_getattr_with_a_default_is_guarded(name):
    """Forward asks for attributes the config lacks: another attribute added compiles
    nothing; one of those it asks for compiles again, and the step is eager's with it."""
    model = Reads(_gain)
    cm = _compiled(model, example_inputs=_batch())
    assert _step(model, cm) == []
    model.cfg.other = 1.0
    assert _step(model, cm) == []
    setattr(model.cfg, name, 4.0)
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and f".{name} = 4.0" in said[0], said
    delattr(model.cfg, name)
    assert _step(model, cm, seed=3) == []  # missing again: the first graph


@pytest.mark.parametrize("read", [
    lambda cfg: vars(cfg)["scale"],
    lambda cfg: cfg.to_dict()["scale"],
    lambda cfg: copy.copy(cfg).scale,
    lambda cfg: cfg.raw("scale"),
], ids=["vars", "to_dict", "copy", "past_getattribute"])
def test_a_read_of_the_whole_object_guards_it_whole(read):
    """What forward takes from the object whole (its ``__dict__``, a copy) or past its
    ``__getattribute__`` is not seen name by name: any change compiles again."""
    model = Reads(read)
    cm = _compiled(model, example_inputs=_batch())
    _step(model, cm)
    model.cfg.note = "run 2"
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and ".note = 'run 2'" in said[0], said


# --------------------------------------------------------------------------- #
# transformers configs (torch.export): GPT-2, a composite config's sub-configs
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tf() -> Any:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def _gpt2(tf: Any) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0, attn_implementation="sdpa")
    model = tf.GPT2LMHeadModel(config).double()
    ids = torch.randint(1, 64, (GBS, 8), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_gpt2_saved_with_save_pretrained_compiles_nothing_again(tf, tmp_path):
    """``save_pretrained`` (what the Trainer's checkpoint calls) sets ``architectures`` and
    ``dtype`` on the config; GPT-2's forward reads neither."""
    model, batch = _gpt2(tf)
    cm = _compiled(model, example_kwargs=batch)
    assert _step(model, cm, **batch) == []
    model.save_pretrained(tmp_path)
    assert model.config.architectures == ["GPT2LMHeadModel"]
    assert _step(model, cm, **batch) == []


def test_gpt2_config_values_forward_reads_compile_again(tf):
    """``_attn_implementation``, ``output_attentions`` and ``output_hidden_states`` are read
    by forward: each change compiles again (once, naming it) and the step is eager's."""
    model, batch = _gpt2(tf)
    cm = _compiled(model, example_kwargs=batch)
    _step(model, cm, **batch)
    model.config._attn_implementation = "eager"
    said = _step(model, cm, **batch)
    assert len(said) == 1 and "._attn_implementation = 'eager'" in said[0], said
    model.config.output_attentions = True
    said = _step(model, cm, **batch)
    assert len(said) == 1 and ".output_attentions = True" in said[0], said
    with torch.no_grad():
        assert len(cm(**batch).attentions) == 1
    model.config.output_hidden_states = True
    said = _step(model, cm, **batch)
    assert len(said) == 1 and ".output_hidden_states = True" in said[0], said
    with torch.no_grad():
        assert len(cm(**batch).hidden_states) == 2


class SubConfigs(nn.Module):
    """Reads its composite config's ``decoder`` sub-config: ``num_attention_heads``, which
    GPT-2's ``attribute_map`` maps to ``n_head``, and ``layer_norm_epsilon``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        decoder = self.config.decoder
        heads = decoder.num_attention_heads
        loss = F.mse_loss(self.lin(x)[:, :heads], y[:, :heads])
        return loss * decoder.layer_norm_epsilon * 1e5


@pytest.mark.parametrize("change, named", [
    (lambda c: setattr(c.decoder, "n_head", 2), ".num_attention_heads = 2"),
    (lambda c: setattr(c.decoder, "layer_norm_epsilon", 2e-5), ".layer_norm_epsilon = 2e-05"),
], ids=["mapped_name", "value"])
def test_a_nested_transformers_config_is_guarded_by_what_forward_reads_of_it(tf, change, named):
    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(
        tf.GPT2Config(n_layer=1, n_head=3), tf.GPT2Config(n_layer=1, n_head=3))
    torch.manual_seed(0)
    model = SubConfigs(config)
    cm = _compiled(model, example_inputs=_batch())
    assert _step(model, cm) == []
    config.architectures = ["SubConfigs"]
    config.decoder.architectures = ["GPT2LMHeadModel"]
    config.encoder.n_head = 1  # the encoder's: never read
    assert _step(model, cm) == []
    change(config)
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and named in said[0], said


def test_after_a_change_forward_never_reads_the_new_state_is_checked_fast(monkeypatch):
    """The reads are asked once after the change (``Guard.holds``, called where the
    one-function check of ``passes/guard_code.py`` says no); from then on that check
    compares the new contents, as it compared the first."""
    from mbcompile import guard_cache

    model = Reads(_scale_and_beta)
    cm = _compiled(model, example_inputs=_batch())
    asked = []
    failed_guard = guard_cache.failed_guard
    monkeypatch.setattr(guard_cache, "failed_guard",
                        lambda guards: asked.append(1) or failed_guard(guards))
    _step(model, cm)
    assert asked == []
    model.cfg.note = "run 2"
    for seed in (2, 3, 4):
        assert _step(model, cm, seed=seed) == []
    assert len(asked) == 1, len(asked)


@pytest.mark.zoo  # T5's compile: about 9 s on 2 cores (nested configs: the EncoderDecoderConfig
# test runs the mechanism in CI)
def test_t5s_three_configs_are_each_guarded_by_what_forward_reads_of_them(tf, tmp_path):
    """T5 keeps its config and a copy each for its encoder and its decoder: the checkpoint
    compiles nothing, a field the decoder reads compiles again, and the step is eager's."""
    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                         num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8,
                         pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                         dropout_rate=0.0)
    model = tf.T5ForConditionalGeneration(config).double()
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, 64, (GBS, 7), generator=g),
             "labels": torch.randint(2, 64, (GBS, 5), generator=g)}
    cm = _compiled(model, example_kwargs=batch)
    assert _step(model, cm, **batch) == []
    model.save_pretrained(tmp_path)
    model.encoder.config.architectures = ["T5Stack"]
    assert _step(model, cm, **batch) == []
    model.decoder.config._attn_implementation = "eager"
    said = _step(model, cm, **batch)
    assert len(said) == 1 and "._attn_implementation = 'eager'" in said[0], said


def test_a_config_the_compile_switched_is_checked_fast_from_the_first_call(tf, monkeypatch):
    """compile() captures GPT-2's call as the Trainer makes it (``num_items_in_batch``),
    with ``use_cache`` as the Trainer sets it (False), and puts the user's True back;
    forward never reads it. A call as the Trainer's compiles nothing again, and each is
    checked by the one function (``Guard.holds`` is not asked: it fingerprints the whole
    config on each call)."""
    from mbcompile.passes.guards import Guard

    model, batch = _gpt2(tf)
    assert model.config.use_cache is True
    cm = _compiled(model, example_kwargs=batch)
    batch["num_items_in_batch"] = batch["labels"][:, 1:].ne(-100).sum()
    assert _step(model, cm, **batch) == []
    asked = []
    holds = Guard.holds
    monkeypatch.setattr(Guard, "holds", lambda self: asked.append(self.where or self.name)
                        or holds(self))
    for _ in range(3):
        assert _step(model, cm, **batch) == []
    assert "config" not in asked, asked  # (a logger's level is asked: no dict to walk)


class ReadsItsDict(nn.Module):
    """Reads its transformers config's ``__dict__`` (a user's code cannot call ``to_dict()``
    in forward: a method of an installed package's object is refused there; transformers'
    own code calls it with ``self.__dict__`` read the same way)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x), y) * self.config.__dict__["layer_norm_epsilon"] * 1e5


def test_a_transformers_config_read_through_its_dict_is_guarded_whole(tf):
    model = ReadsItsDict(tf.GPT2Config(n_layer=1))
    cm = _compiled(model, example_inputs=_batch())
    assert _step(model, cm) == []
    model.config.architectures = ["ReadsItsDict"]
    said = _step(model, cm, seed=2)
    assert len(said) == 1 and ".architectures = ['ReadsItsDict']" in said[0], said

"""One source for compile()'s options: ``CompileOptions`` (``mbcompile/options.py``).

Every face of an option is derived from it or checked against it here: compile()'s
signature (derived), docs/api.md (its signature block and one bullet per option), the
Trainer's ``COMPILE_OPTIONS`` and the YAML config's keys that reach compile. Adding a
field to ``CompileOptions`` without its doc line, or without the Trainer knowing it,
fails a test below.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch

import mbcompile
from mbcompile.errors import ArgumentTypeError
from mbcompile.models import make_mlp
from mbcompile.options import CompileOptions, option_names
from mbcompile.request import make_request
from mbcompile.training.config.schema import TOP_KEYS
from mbcompile.training.trainer import COMPILE_OPTIONS

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"
POSITIONAL = ("model", "gbs", "num_csx", "mbs")
#: what the Trainer passes itself (its flags' MBS, gbs and num_csx, each phase's first
#: batch as the example and in_dims), and ``shard``: the Trainer's own argument, which
#: shards the model on its ranks where compile's plans FSDP2 without ranks
TRAINER_SETS = {"example_inputs", "example_kwargs", "in_dims", "shard"}


def _compile_section() -> str:
    text = API.read_text()
    start = text.index("## `mbcompile.compile`")
    return text[start:text.index("\n## ", start + 1)]


def _documented_signature() -> ast.arguments:
    """docs/api.md's signature block, parsed as the ``def`` it spells."""
    block = re.search(r"```python\n(mbcompile\.compile\(.*?)\n```", _compile_section(), re.S)
    assert block is not None, "docs/api.md has no signature block for mbcompile.compile"
    code = block.group(1).replace("mbcompile.compile(", "def compile(", 1) + ": ..."
    func = ast.parse(code).body[0]
    assert isinstance(func, ast.FunctionDef)
    return func.args


def test_compile_signature_lists_every_option_with_its_default() -> None:
    params = inspect.signature(mbcompile.compile).parameters
    assert tuple(params) == (*POSITIONAL, *option_names())
    for f in dataclasses.fields(CompileOptions):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[f.name].default == f.default, f.name
        assert f.metadata["doc"], f"{f.name} has no one-line doc"


def test_docs_api_signature_block_is_the_options() -> None:
    args = _documented_signature()
    assert [a.arg for a in args.args] == list(POSITIONAL)
    documented = {a.arg: ast.literal_eval(d) for a, d in zip(args.kwonlyargs, args.kw_defaults)}
    assert list(documented) == list(option_names()), (
        "docs/api.md's signature block must list CompileOptions' fields in order")
    for f in dataclasses.fields(CompileOptions):
        assert documented[f.name] == f.default, f"docs/api.md: {f.name}={documented[f.name]!r}"


def test_docs_api_describes_every_option_once() -> None:
    bullets = re.findall(r"^- ((?:`\w+`(?:, )?)+):", _compile_section(), re.M)
    names = [n for group in bullets for n in re.findall(r"`(\w+)`", group)]
    assert sorted(names) == sorted((*POSITIONAL, *option_names())), (
        "every compile() parameter has one bullet in docs/api.md")


def test_the_trainer_sets_every_option_but_its_own() -> None:
    assert set(COMPILE_OPTIONS) == set(option_names()) - TRAINER_SETS


def test_the_config_keys_that_reach_compile_are_options() -> None:
    # the YAML keys mbcompile compile/fit pass on to compile() under the same name
    assert {"system", "backend", "in_dims", "compile_only", "validate_only",
            "outputs"} <= set(TOP_KEYS) & set(option_names())


def test_an_unknown_option_is_refused_with_the_known_ones() -> None:
    model, batch = make_mlp(4)
    with pytest.raises(ArgumentTypeError, match="'mbs_max'.*example_inputs, example_kwargs"):
        mbcompile.compile(model, 4, 1, 2, example_inputs=batch, mbs_max=2)
    with pytest.raises(TypeError):  # what Python said before: still a TypeError
        mbcompile.compile(model, 4, 1, 2, example_inputs=batch, mbs_max=2)


def test_the_request_holds_the_options_as_checked() -> None:
    model, batch = make_mlp(4)
    request = make_request(model, 4, 2, 2, example_inputs=batch, outputs=["loss"],
                           torch_compile=True, measure=True)
    options = request.options
    assert options.outputs == ("loss",) and options.recompute == "auto"
    assert options.example_inputs is None  # bound once: request.example
    assert set(request.example) == {"x", "y"} and torch.equal(request.example["x"], batch[0])
    assert request.torch_compile == {} and request.measure == 3  # what they mean, worked out
    assert options == CompileOptions.of({"outputs": ("loss",), "torch_compile": True,
                                         "measure": True,  # "auto": no process group
                                         "backend": "simulated"})

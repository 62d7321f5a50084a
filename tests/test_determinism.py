"""Determinism: the same inputs give bitwise identical outputs and gradients.

Across calls of one compiled module, across two compilations of the same model,
and across fresh Python processes (two subprocesses, run side by side, against
this process). The plan and the rewritten graph's code are part of the digest:
every rank of a distributed job must compute the same ones on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mbcompile
from mbcompile.models import make_cnn, make_tiny_gpt

DTYPE = torch.float64


def _digest_tensors(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _step(cm, model, batch) -> str:
    model.zero_grad(set_to_none=True)
    out = cm(*batch)
    out[0].backward()
    return _digest_tensors([o for o in out] + [p.grad for p in model.parameters()])


# The same computation, written once, run here and in fresh processes.
SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, warnings
    import torch
    import mbcompile
    from mbcompile.models import make_cnn, make_tiny_gpt

    def digest(tensors):
        h = hashlib.sha256()
        for t in tensors:
            t = t.detach().contiguous()
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def run(make, gbs, num_csx, mbs, dtype):
        model, batch = make(gbs, dtype=dtype)
        cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch)
        out = cm(*batch)
        out[0].backward()
        tensors = [o for o in out] + [p.grad for p in model.parameters()]
        return {"values": digest(tensors), "plan": str(cm.plan),
                "code": hashlib.sha256(cm.graph_module.code.encode()).hexdigest(),
                "body": hashlib.sha256(cm.graph_module.body.code.encode()).hexdigest()}

    def tiny(b, dtype):
        return make_tiny_gpt(b, dtype=dtype, vocab=16, width=8, depth=1, heads=2, seq=6)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = {"gpt64": run(tiny, 10, 3, 2, torch.float64),
                  "cnn32": run(make_cnn, 7, 2, 3, torch.float32)}
    print(json.dumps(result))
""")


def _in_this_process() -> dict:
    namespace: dict = {"__name__": "determinism"}
    exec(compile(SCRIPT.replace("print(json.dumps(result))", ""), "<determinism>", "exec"),
         namespace)
    return namespace["result"]


def test_bitwise_identical_across_calls():
    model, batch = make_tiny_gpt(10, dtype=DTYPE, vocab=16, width=8, depth=1, heads=2, seq=6)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    first = _step(cm, model, batch)
    for _ in range(3):
        assert _step(cm, model, batch) == first
    with torch.no_grad():  # the no-grad path gives the same outputs, bit for bit
        a = cm(*batch)
        b = cm(*batch)
    assert _digest_tensors(a) == _digest_tensors(b)


def test_bitwise_identical_across_compilations():
    model, batch = make_cnn(7, dtype=torch.float32)
    one = mbcompile.compile(model, 7, 2, 3, example_inputs=batch)
    two = mbcompile.compile(model, 7, 2, 3, example_inputs=batch)
    assert one.plan == two.plan
    assert one.graph_module.code == two.graph_module.code
    assert one.graph_module.body.code == two.graph_module.body.code
    assert _step(one, model, batch) == _step(two, model, batch)


@pytest.mark.slow  # 19-27 s on 2 cores: two fresh interpreters import torch
def test_bitwise_identical_across_fresh_processes(tmp_path):
    # same interpreter and environment; a neutral working directory, so the children
    # import mbcompile exactly as this process does
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                              cwd=str(tmp_path))
             for _ in range(2)]
    here = _in_this_process()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1], "two fresh processes disagree"
    assert results[0] == here, "a fresh process disagrees with this one"

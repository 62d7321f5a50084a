"""Every figure and graph of 45 compiles, printed, to diff a change against the tree before it.

    python benchmarks/same_figures.py > after.txt
    PYTHONPATH=/tmp/before python benchmarks/same_figures.py > before.txt
    diff before.txt after.txt          # nothing: the change moved no figure

(``/tmp/before``: ``git archive main | tar -x -C /tmp/before`` with ``mbcompile/passes``
linked to ``../passes`` there; the editable install otherwise maps ``mbcompile.passes`` to the
worktree's ``passes/``.) For each compile: ``cm.estimate.memory.peak`` and
``cm.estimate.time.step`` (repr, every digit), the plan, the probes run, the cost model's
``figures(m)`` at m = 1, 2, 3, 5 (activation peak, saved bytes, FLOPs, the first
microbatch's peak and pending gradients, kernels, bytes moved and weight bytes read) and
the code of the bound step, its body and the captured graph (a hash each; ``--code``: the
step's and the body's code in full). The compiles: ``bench_compile.py``'s 8-layer and
2-layer GPT (gbs 32 over 2 systems, MBS 1, 2, 3, 4, ``"auto"``), ``test_memory_accuracy``'s
GPT (gbs 7 over 1 and 2 systems, MBS 1-7, outputs ``"loss"`` and ``"all"``; tied embeddings
at two of them), a 6-layer one (MBS 1 and 3, with and without ``recompute=True``; ``"auto"``
with ``recompute="auto"``), ``compile_only=True`` and an uneven gbs 7 over 2 at MBS 2 (the
probe of the size below too). Paths under the tree are printed relative to it.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GBS, SYSTEMS, make_gpt  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile.models import TinyGPT, token_batch  # noqa: E402

ROOT = str(Path(mbcompile.__file__).resolve().parent.parent)
SEQ, VOCAB = 16, 2048


def _hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def show(label: str, code: bool, *args: Any, **options: Any) -> None:
    """Print the figures and graphs of ``mbcompile.compile(*args, **options)`` (or the error
    it raised)."""
    try:
        cm = mbcompile.compile(*args, **options)
    except Exception as exc:  # noqa: BLE001  (a refused plan is a figure too)
        print(label, "ERROR", type(exc).__name__, str(exc)[:200])
        return
    e, cost = cm.estimate, cm.selection.cost
    print(label, "peak", repr(e.memory.peak), "step", repr(e.time.step))
    print("  plan", str(cm.plan).replace("\n", " | "))
    print("  probes", getattr(cost, "probes_run", None))
    for m in (1, 2, 3, 5):
        try:
            f = cost.figures(m)
        except Exception as exc:  # noqa: BLE001
            print(f"  m={m} ERROR", type(exc).__name__)
            continue
        print(f"  m={m}", *map(repr, (f.activation_peak_bytes, f.saved_bytes, f.flops,
                                       f.first_peak_bytes, f.first_grads_pending, f.kernels,
                                       f.activation_bytes_moved, f.weight_bytes_read)))
    gm = cm.graph_module
    body = gm.body.code if hasattr(gm, "body") else ""
    print("  graph", _hash(gm.code), "body", _hash(body),
          "captured", _hash(cm.original_graph_module.code))
    if code:
        print(gm.code.replace(ROOT, "<tree>"), body.replace(ROOT, "<tree>"), sep="\n")


def main(code: bool = False) -> None:
    torch.set_num_threads(1)
    big, big_batch = make_gpt(batch=8, depth=8)
    small, small_batch = make_gpt(batch=8, depth=2)
    for name, model, batch in (("gpt8", big, big_batch), ("gpt2", small, small_batch)):
        for mbs in (1, 2, 3, 4, "auto"):
            show(f"{name} mbs={mbs}", code, model, GBS, SYSTEMS, mbs, example_inputs=batch)
    for tied in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(vocab=VOCAB, width=32, depth=2, heads=2, seq=SEQ)
        if tied:
            model.head.weight = model.tok.weight
        batch = token_batch(7, SEQ, VOCAB, seed=1)
        for systems in (1, 2):
            for outputs in ("loss", "all"):
                for mbs in (1, 2, 3, 4, 5, 7):
                    if tied and (systems, mbs) not in ((1, 3), (2, 2)):
                        continue
                    show(f"memacc tied={tied} sys={systems} out={outputs} mbs={mbs}", code,
                         model, 7, systems, mbs, example_inputs=batch, outputs=outputs)
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, width=32, depth=6, heads=2, seq=SEQ)
    batch = token_batch(7, SEQ, VOCAB, seed=1)
    for mbs in (1, 3):
        for recompute in (False, True):
            show(f"gpt6 mbs={mbs} recompute={recompute}", code, model, 7, 1, mbs,
                 example_inputs=batch, recompute=recompute)
    show("gpt8 compile_only mbs=2", code, big, GBS, SYSTEMS, 2, example_inputs=big_batch,
         compile_only=True)
    show("gpt8 gbs7 mbs=2", code, big, 7, 2, 2, example_inputs=big_batch)
    show("gpt6 auto recompute=auto", code, model, 7, 1, "auto", example_inputs=batch,
         recompute="auto")


if __name__ == "__main__":
    main(code="--code" in sys.argv)

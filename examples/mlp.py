"""An MLP regression (MSE loss), gbs 13 over 2 systems with mbs 3 (uneven).

    python examples/mlp.py
"""

from _common import run

from mbcompile.models import make_mlp

if __name__ == "__main__":
    run(make_mlp, gbs=13, num_csx=2, mbs=3)

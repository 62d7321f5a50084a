"""A CNN with GroupNorm and label smoothing, gbs 12 over 4 systems, mbs "auto".

    python examples/cnn.py

BatchNorm would be rejected in training (it mixes samples); GroupNorm is per sample.
"""

from _common import run

from mbcompile.models import make_cnn

if __name__ == "__main__":
    run(make_cnn, gbs=12, num_csx=4, mbs="auto")

"""A tiny GPT with right-padded token labels (-100), microbatched over 3 systems.

    python examples/tiny_gpt.py

The loss is the mean over real tokens of the whole batch: mbcompile carries
(sum, count) per microbatch, so it matches one full-batch step exactly.
"""

from _common import run

from mbcompile.models import make_tiny_gpt

if __name__ == "__main__":
    run(make_tiny_gpt, gbs=10, num_csx=3, mbs=2)

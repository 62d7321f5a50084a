"""``mbcompile.buckets``: the gradient bucket sizes (``BUCKET_BYTES``,
``FIRST_BUCKET_BYTES``, ``MIN_BUCKETS``) the run sends and the plan prices.

The public spelling of ``mbcompile.planning.buckets``: ``import mbcompile.buckets`` and
``from mbcompile.buckets import ...`` work as ``mbcompile.buckets.<name>`` does. Importing
it gives that module itself, not a copy, so a setting made here reaches the plan and
the run.
"""

import sys

from mbcompile.planning import buckets

sys.modules[__name__] = buckets  # this name is that module (the import system reads it back)

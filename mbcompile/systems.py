"""``mbcompile.systems``: the system presets and ``SystemSpec``.

The public spelling of ``mbcompile.planning.systems``: ``import mbcompile.systems`` and
``from mbcompile.systems import ...`` work as ``mbcompile.systems.<name>`` does. Importing
it gives that module itself, not a copy, so a setting made here reaches the plan and
the run.
"""

import sys

from mbcompile.planning import systems

sys.modules[__name__] = systems  # this name is that module (the import system reads it back)

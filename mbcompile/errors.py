"""The project's exception and warning types (defined with the passes that raise them).

``mbcompile.errors`` is where users import them from; they live in
``mbcompile.passes.errors`` so that the passes depend only downward.
"""

from mbcompile.passes.errors import *  # noqa: F403
from mbcompile.passes.errors import __all__  # noqa: F401

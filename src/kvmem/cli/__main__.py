"""``python -m kvmem.cli``: the ``kvmem`` command."""

import sys

from . import app

sys.exit(app())

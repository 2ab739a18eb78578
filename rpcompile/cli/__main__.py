"""``python -m rpcompile.cli``: the same as the ``rpcompile`` console script."""

import sys

from rpcompile.cli import main

sys.exit(main())

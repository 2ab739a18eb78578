import sys

from rpcompile.cli import main

sys.exit(main())

"""`python -m lmyard.dispatch STAGE`: the stage entrypoints (lmyard.dispatch)."""

import sys

from lmyard.dispatch import main

sys.exit(main())

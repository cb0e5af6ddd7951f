"""`python -m lmyard.stages STAGE`: the stage entrypoints (lmyard.stages.entry)."""

import sys

from lmyard.stages.entry import main

sys.exit(main())

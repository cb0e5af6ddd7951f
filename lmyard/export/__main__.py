"""`python -m lmyard.export`: see lmyard.export.hf."""

import sys

from lmyard.export.hf import main

sys.exit(main())

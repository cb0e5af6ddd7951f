"""`python -m lmyard.train`: see lmyard.train.trainer."""

import sys

from lmyard.train.trainer import main

sys.exit(main())

"""`python -m lmyard.evaluate`: see lmyard.evaluate.evals."""

import sys

from lmyard.evaluate.evals import main

sys.exit(main())

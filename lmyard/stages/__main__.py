"""`python -m lmyard.stages STAGE`: the stage entrypoints (lmyard.stages.entry)."""

from lmyard.stages.entry import main
from lmyard.stages.runtime import exit_fast

exit_fast(main)

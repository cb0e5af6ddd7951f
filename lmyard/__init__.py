"""lmyard: pretrain GPT-style language models as a workflow of stages.

The library half: config, tokenizer, shards, model, trainer, checkpoints,
store, evals, tracking and launchers. It never imports Prefect.
"""

__version__ = "0.1.0"

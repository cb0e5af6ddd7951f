"""lmyard: pretrain language models as a workflow of stages. The library half: it never imports Prefect.

    data/        sources, tokenizers, tokenize-and-shard, the token-shard format, the loader
    models/      model families (GPT-2, Llama) as specs, their modules, losses
    checkpoint/  one checkpoint API: formats, manifest, commit, catalog, retention
    tracking/    MLflow: the lineage, the trainer's metric sink, the lease
    evaluate/    validation loss, multiple choice, samples, lm-eval (export/: Hugging Face folders, MLflow pyfunc)
    train/       the trainer, its components, memory planning, FSDP2
    launch/      the follower and its jobs (local, Docker), the stage image
    stages/      the stage runtime (exchange folder, specs, results, heartbeats) and the stage entrypoints
At the bottom, used by all: errors, paths, config, layout, store, run (one run's handle: its store, opened once).
"""

__version__ = "0.1.0"

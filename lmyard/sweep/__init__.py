"""Sweeps: one recipe trained as many lineages (trials) at once, as a family of sizes or over a search space.

    space.py    the trials: a family of sizes (the model family's scaling index) or a search space file
    record.py   the sweep's MLflow run (the trials' parent): finished trials, the table, loss against compute
    runner.py   one trial as an ordinary `lmyard run` process, watched for its val loss
    tune.py     trials on a Ray cluster under Ray Tune, a scheduler (ASHA) stopping them early

Torch-free and Prefect-free: the sweep flow (flows/sweep.py) calls these in order.
"""

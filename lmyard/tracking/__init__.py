"""MLflow tracking: the lineage (one MLflow run across attempts), the trainer's metric sink, the lineage lease."""

"""MLflow tracking: the trainer's metric sink (sink), the lineage's one MLflow run (lineage), the model registry
(registry), one writer per lineage (lease), the tracking password kept out of configs (credentials)."""

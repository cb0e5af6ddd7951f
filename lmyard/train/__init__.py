"""Training: the Trainer (`torchrun -m lmyard.stages train`), its components, heartbeats, the retraining decision."""

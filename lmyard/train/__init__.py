"""Training: the Trainer (`torchrun -m lmyard.train`), its components, heartbeats, the retraining decision."""

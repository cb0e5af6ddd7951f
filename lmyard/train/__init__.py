"""Training: the Trainer (`torchrun -m lmyard.stages train`), its components, the model and data it builds."""

"""Training: the Trainer (`torchrun -m lmyard.dispatch train`), its components, the model and data it builds."""

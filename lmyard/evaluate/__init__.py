"""Evaluation of checkpoints: validation loss, multiple choice, samples, lm-eval's harness."""

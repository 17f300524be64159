"""Predictor training with optax; see README.md."""

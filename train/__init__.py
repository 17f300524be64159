"""Predictor training with optax; see README.md."""
from train.predictor import Predictor, fit_layer, train_predictor

__all__ = ["Predictor", "fit_layer", "train_predictor"]

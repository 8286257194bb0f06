"""Loops around the engine and the learner: episodes, evaluation, metrics, the sync loop."""

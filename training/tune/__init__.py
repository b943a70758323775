"""Tuning under a dollar budget: an Optuna study whose trials are resumable runs paused at their rungs."""

"""Held-out loss (validation) and text generation on the model as trained."""

"""The setup path (job: every check, then the model's parts parallelized as the plan says), the
training loop, the optimizer and the dry run."""

"""Training: the loss (the loop, optimizer, checkpoints and metrics arrive with the trainer)."""

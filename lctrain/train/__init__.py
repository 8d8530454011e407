"""Training: the loop (trainer.py), loss, optimizer and schedule, DCP checkpoints and metrics."""

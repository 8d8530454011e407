"""Training: the loop (``trainer``: ``Trainer``, the ``train`` command), the chunked loss (``loss``), AdamW, the
schedule and clipping (``optim``), metrics (``metrics``) and progressive stages (``stages``). Checkpoints are
``lctrain.checkpoint``'s."""

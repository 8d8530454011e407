"""Training: the loop (``trainer``: ``Trainer``, the ``train`` command), the objective a step minimizes
(``objective``), the chunked loss (``loss``), validation during training (``validate``), AdamW, the schedule and
clipping (``optim``), metrics (``metrics``) and progressive stages (``stages``). Checkpoints are
``lctrain.checkpoint``'s."""

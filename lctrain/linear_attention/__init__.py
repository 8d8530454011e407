"""Linear-attention sequence mixers (the gated delta rule of Qwen3-Next and Qwen3.5) under context parallelism:
each rank's pieces summarised, the summaries exchanged and composed in global order, each piece run from its true
entering state."""

"""The cells layer: run one cell on a set of ranks, watch it, and decide what to do after an
error, a deadline or an interrupt (the fault policy); per-rank results and errors."""

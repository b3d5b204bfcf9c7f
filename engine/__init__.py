"""The engine's fast path (the second sitting): the slot runner and its pass, CUDA graphs, the
scheduler and its variants, the request a caller fills in, and the runner contract."""

"""
KV caches for the looped model.

DenseLanes is Ouro's own layout and our baseline: one K/V lane per (loop, layer), so every token
must run every loop to fill every lane (the cache problem P1 of the paper, Eq. 5-6).
"""
import torch


def causal_mask(pos, T, n_keys, device):
    """Queries at positions pos..pos+T-1 may read keys at positions <= their own."""
    q = torch.arange(pos, pos + T, device=device)[:, None]
    return torch.arange(n_keys, device=device)[None, :] <= q


class DenseLanes:
    """Ouro's cache: lane (d, layer) holds depth-d K/V of every position, for depths 1..n_lanes.
    Memory: n_lanes * N rows per layer, whatever the exits."""

    def __init__(self, model, n_lanes, max_len, batch=1):
        cfg, p = model.config, model.lm_head.weight
        shape = (n_lanes, cfg.n_layer, batch, cfg.n_kv_head, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.depth, self.pos = 0, 0

    def begin(self, depth, pos):
        """The next block application runs 0-based `depth` for positions starting at `pos`."""
        self.depth, self.pos = depth, pos

    def layer_kv(self, layer, k, v):
        T, end = k.shape[2], self.pos + k.shape[2]
        lane_k, lane_v = self.k[self.depth, layer], self.v[self.depth, layer]
        lane_k[:, :, self.pos:end] = k
        lane_v[:, :, self.pos:end] = v
        return lane_k[:, :, :end], lane_v[:, :, :end], causal_mask(self.pos, T, end, k.device)

    def rows(self, n_tokens):
        return self.k.shape[0] * n_tokens

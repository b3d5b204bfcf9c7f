"""
The Ouro way, the baseline the engine benchmarks run against: every token runs all U loops on dense
per-depth KV lanes (ragged.DenseLanes), one LM-head call per step for the whole batch, as Ouro's own
code decodes; eager (ouro_way) and at fixed shapes for CUDA graphs (OuroWay on StaticLanes, as
gpt-fast's static cache and decode_one_token).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.ouro_way ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import torch

from engine.graphs import Graphs, allow_recompiles
from engine.request import sample_token
from model import forward_lanes, fuse_projections
from ragged import DenseLanes


def ouro_way(model, prompts, n_new, temperature=0.0, top_p=1.0):
    """The baseline a user compares against: batched full-depth generation as Ouro's own code does
    it: every token runs all U loops on dense per-depth KV lanes, one LM-head call per step for the
    whole batch. prompts: equal lengths (no padding). Row i samples with seed i, as the engine's
    requests of seeds 0..B-1 do (request.sample_token: the same draws)."""
    U, dev = model.config.n_loops, model.lm_head.weight.device
    cache = DenseLanes(model, U, len(prompts[0]) + n_new, batch=len(prompts))
    idx, pos, out = torch.tensor(prompts, device=dev), 0, []
    with torch.inference_mode():
        for _ in range(n_new):
            states, _ = forward_lanes(model, idx, cache, pos, U)
            pos += idx.shape[1]
            logits = model.lm_head(states[-1])
            if temperature == 0:
                idx = logits.argmax(-1)[:, None]
            else:
                idx = torch.tensor([[sample_token(lg, temperature, 0, top_p, i, pos - 1)]
                                    for i, lg in enumerate(logits)], device=dev)
            out.append(idx[:, 0])
    return torch.stack(out, 1).tolist()


# ----------------------------------------------------------------------------- at fixed shapes, for CUDA graphs

class StaticLanes(DenseLanes):
    """DenseLanes at fixed shapes, for a CUDA graph (the baseline's graph, OuroWay): the
    next position is a tensor on the device, each layer writes its K/V there and attends over the
    whole lane through a mask of the positions written so far, as gpt-fast's static cache does;
    `depth` is a Python int (a graph unrolls the loops). A tensor per lane, not views of one, so
    that a compiled step writes each in place."""

    def __init__(self, model, n_lanes, max_len, batch=1):
        cfg, p = model.config, model.lm_head.weight
        lane = lambda: torch.zeros(batch, cfg.n_kv_head, max_len, cfg.head_dim, dtype=p.dtype,
                                   device=p.device)
        self.k = [[lane() for _ in range(cfg.n_layer)] for _ in range(n_lanes)]
        self.v = [[lane() for _ in range(cfg.n_layer)] for _ in range(n_lanes)]
        self.depth = 0
        self.pos = torch.zeros(1, dtype=torch.long, device=p.device)

    def buffers(self):
        """Every tensor a step changes (for a graph capture to restore)."""
        return [t for lanes in (self.k, self.v) for lane in lanes for t in lane] + [self.pos]

    def begin(self, depth, pos=None):
        self.depth = depth

    def layer_kv(self, layer, k, v):
        # this chunk's positions
        at = self.pos + torch.arange(k.shape[2], device=k.device)
        lane_k, lane_v = self.k[self.depth][layer], self.v[self.depth][layer]
        lane_k.index_copy_(2, at, k)
        lane_v.index_copy_(2, at, v)
        return lane_k, lane_v, torch.arange(lane_k.shape[2], device=k.device)[None, :] <= at[:, None]


def lanes_loop(model, lanes, h, cos, sin):
    """One loop of the Ouro way: the block over the lanes of depth lanes.depth, then the exit heads."""
    return model.exit_heads(model.block(h, cos, sin, lanes))


def lanes_step(model, lanes, ids, loop=lanes_loop):
    """One step of the Ouro way on static lanes: the chunk `ids` [B, T] through all U loops, each
    layer's attention over its lane, then the greedy token of the last position. The same maths as
    model.generate's lanes (test_bench.py checks the tokens); `loop` compiled when graphed."""
    h = model.embed_tokens(ids)
    cos, sin = model.rope(lanes.pos + torch.arange(ids.shape[1], device=ids.device), h.dtype)
    for d in range(model.config.n_loops):
        lanes.begin(d)
        hn, _, h = loop(model, lanes, h, cos, sin)
    lanes.pos += ids.shape[1]
    return model.lm_head(hn[:, -1]).argmax(-1)


class OuroWay:
    """The Ouro way at fixed shapes: a graph for the prompt step and one for a decode step (U
    passes, the head and the argmax, gpt-fast's decode_one_token with the loops unrolled), each loop
    compiled whole (one graph for all U: they differ only in their lanes) with the projections
    stacked as the slot engine's (four GEMMs a layer)."""

    def __init__(self, model, batch, graphs, n_prompt, n_new):
        dev = model.lm_head.weight.device
        self.model = fuse_projections(model)
        if graphs:
            # a graph for each depth's lanes and chunk length
            allow_recompiles()
        self.loop = torch.compile(lanes_loop, dynamic=False) if graphs else lanes_loop
        self.lanes = StaticLanes(model, model.config.n_loops, n_prompt + n_new, batch)
        self.prompt = torch.zeros(batch, n_prompt, dtype=torch.long, device=dev)
        self.cur = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(batch, n_new, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs = Graphs(lambda: self.lanes.buffers() + [self.cur, self.out, self.t]) if graphs else None

    def _step(self, ids):
        tok = lanes_step(self.model, self.lanes, ids, self.loop)
        self.out.index_copy_(1, self.t, tok[:, None])
        self.cur.copy_(tok[:, None])
        self.t += 1

    def _replay(self, name, fn):
        if self.graphs is None:
            return fn()
        self.graphs.replay(name, fn)

    def generate(self, prompts):
        self.lanes.pos.zero_()
        self.t.zero_()
        self.prompt.copy_(torch.tensor(prompts))
        with torch.inference_mode():
            self._replay("prompt", lambda: self._step(self.prompt))
            for _ in range(self.out.shape[1] - 1):
                self._replay("decode", lambda: self._step(self.cur))
        return self.out.tolist()


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=engine and --what=gpu run it as their baseline")

"""
The depth-batching pass as a pure function of buffers of fixed shape on the device: what a CUDA graph
replays (slot_engine.py drives it; serve_depthbatch.Engine is its reference).

Every buffer a pass reads or writes is allocated once (Slots): one row slot per row (a token of a
request at a depth), each request slot's page table [U, context] on the device, RoPE of every
position, a ring of log entries. run_pass applies the block to the first R row slots, each row at its
own position and depth, and all that follows, in place: Eq. 4 with each row's τ (model.exit_now), the
LM head and sampling (request.sample_tokens) where an exit samples a token, Eq. 11 where a row stops,
and each row running on, restarting in place at depth 1 with its sampled token, holding it, or going
idle. No value is read on the host and no Python branch depends on data: it runs on the `meta`
device and compiles to one graph (test_slots.py).

Read top to bottom: the buffers; the pass, in its phases; the phases compiled (compiled_phases);
the CUDA graphs that capture a kind of pass once and replay it (Graphs).
"""
from types import SimpleNamespace

import torch

from kernels import paged_attention_table
from model import FULL, Layer, at_least_fp32, exit_now
from request import sample_tokens

LOG = ("req", "pos", "depth", "exit", "tok", "stop", "go")   # per pass and row: what the host reads back
ROWS = ("tok", "pos", "depth", "req", "n_run", "forced", "exit", "pend", "h", "survive", "tau", "full", "active",
        "sample", "fresh", "hold")


def bucket(n, cap):
    """The row count a pass runs: the next power of two >= n, at most cap (a graph per bucket)."""
    return min(cap, 1 << max(n - 1, 0).bit_length())


# ----------------------------------------------------------------------------- the buffers

class Slots:
    """Every buffer a pass reads or writes, allocated once, so that a CUDA graph can hold their
    addresses. R row slots; S request slots plus one, S, the padding request that idle rows belong
    to (its table points at the pool's scratch page); per request slot its page table
    [U, n_keys] on the device; RoPE of every position; a ring of log entries."""

    def __init__(self, model, pool, n_rows, n_reqs, n_keys, log_len, n_stop=8, keep_logits=False):
        cfg, dt = model.config, model.lm_head.weight.dtype
        dev, pdt = pool.k.device, at_least_fp32(dt)
        R, S, U = n_rows, n_reqs, cfg.n_loops
        ints = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.long, device=dev)
        flags = lambda *shape: torch.zeros(shape, dtype=torch.bool, device=dev)
        reals = lambda *shape, fill=0.0: torch.full(shape, fill, dtype=pdt, device=dev)
        self.R, self.S, self.U, self.n_keys, self.scratch = R, S, U, n_keys, pool.scratch
        self.k, self.v = pool.k, pool.v
        # rows: the token a row runs (embedded when fresh), its position, depth (0-based, the one it
        # runs next), request slot, depths it may run, replayed exit (0: decide), decided exit
        # (1-based, 0: none), a sampled token it carries (-1: none); its state and Π(1-λ) (Eq. 4), τ;
        # whether it runs on after its exit (full), runs at all (active), samples at its exit,
        # starts a position (fresh), holds a token until its request's other rows finish (hold)
        self.tok, self.pos, self.depth, self.n_run = ints(R), ints(R), ints(R), ints(R, fill=1)
        self.req, self.forced, self.exit, self.pend = ints(R, fill=S), ints(R), ints(R), ints(R, fill=-1)
        self.h = torch.zeros(R, cfg.n_embd, dtype=dt, device=dev)
        self.survive, self.tau = reals(R, fill=1.0), reals(R, fill=FULL)
        self.full, self.active, self.sample, self.fresh, self.hold = flags(R), flags(R), flags(R), flags(R), flags(R)
        # request slots: page table, tokens sampled and allowed, stop ids, how a decode row runs
        # (τ, full, depths), the sampler's parameters, whether it has ended, the last position
        # whose pages are reserved (horizon)
        self.table = ints(S + 1, U, n_keys, fill=pool.scratch)
        self.ntok, self.max_tok = ints(S + 1), ints(S + 1)
        self.dec_n_run, self.horizon = ints(S + 1, fill=1), ints(S + 1, fill=-1)
        self.stop_ids = ints(S + 1, n_stop, fill=-1)
        self.dec_tau, self.dec_full, self.ended = reals(S + 1, fill=FULL), flags(S + 1), flags(S + 1)
        self.seed, self.top_k = ints(S + 1), ints(S + 1)
        self.temperature, self.top_p = reals(S + 1), reals(S + 1, fill=1.0)
        self.cos, self.sin = model.rope(torch.arange(n_keys, device=dev), dt)    # what model.rope gives, once
        self.t = ints(1)                                                        # passes run (the log's write index)
        self.log = ints(log_len, len(LOG), R)
        self.logits = torch.zeros(log_len, R, cfg.vocab_size, dtype=dt, device=dev) if keep_logits else None

    def buffers(self):
        """Everything a pass changes, but the page pool (for a capture to restore)."""
        return [getattr(self, name) for name in ROWS + ("table", "ntok", "ended", "t", "log")] + (
            [self.logits] if self.logits is not None else [])


# ----------------------------------------------------------------------------- the pass

def run_pass(model, st, R, attn="torch", n_keys=None, n_splits=1, head=True, sampling=False, phases=None):
    """One application of the block to the first R row slots, each row at its own position and depth,
    and all that follows from it, in place: Eq. 4 with each row's τ, the LM head and sampling where an
    exit samples a token, Eq. 11 where a row stops, and each row running on, restarting in place with
    its sampled token, or going idle. head=False: a pass in which no row can exit (inside a fixed
    wave); sampling=False: every row greedy. phases: the functions below (PLAIN), or their compiled
    versions (on CUDA); attn, n_keys, n_splits: how rows read their keys (kernels.paged_attention_table)."""
    ph = phases or PLAIN
    h, cos, sin, wpage, lengths = ph.start(model, st, R)
    for i, layer in enumerate(model.layers):          # model.block, each layer's halves around the paged attention
        q, k, v = ph.before(layer, h, cos, sin)
        h = ph.after(layer, h, attend_rows(st, R, i, q, k, v, wpage, lengths, attn, n_keys, n_splits))
    ph.finish(model, st, R, h, head, sampling)


def start_rows(model, st, R):
    """A row that starts a position embeds its token; every active row writes the page the host
    reserved for its (position, depth) (idle rows write the scratch page) and reads keys 0..its
    position (idle rows one)."""
    fresh, active, req, pos, depth = st.fresh[:R], st.active[:R], st.req[:R], st.pos[:R], st.depth[:R]
    st.h[:R] = torch.where(fresh[:, None], model.embed_tokens(st.tok[:R]), st.h[:R])
    st.survive[:R] = torch.where(fresh, 1.0, st.survive[:R])                 # nothing exited yet
    wpage = torch.where(active, st.table[req, depth, pos], st.scratch)
    return st.h[:R][None], st.cos[pos], st.sin[pos], wpage, torch.where(active, pos + 1, 1)


def attend_rows(st, R, layer, q, k, v, wpage, lengths, attn, n_keys, n_splits):
    """Every row writes its K/V at its page, then (all writes first, so that the rows of a prompt
    chunk see each other at the same depth) reads its request's table column at its depth: every
    earlier token j at depth min(d, e_j) (Eq. 7 through the aliases of Eq. 11)."""
    kl, vl = st.k[layer], st.v[layer]
    kl.index_copy_(0, wpage, k[0].transpose(0, 1))
    vl.index_copy_(0, wpage, v[0].transpose(0, 1))
    y = paged_attention_table(q[0].transpose(0, 1), kl, vl, st.table, st.req[:R], st.depth[:R], lengths, attn,
                              n_keys or st.n_keys, n_splits)
    return y.transpose(0, 1)[None]


def finish_rows(model, st, R, h, head, sampling):
    """After the block: the exits (Eq. 4), the LM head, the aliases (Eq. 11), and each row's next state."""
    hn, gate, h_next = model.exit_heads(h[0])
    newly, runs_on, survive = decide_exits(st, R, gate)
    tok, emit, logits = sample_rows(model, st, R, hn, newly, head, sampling)
    stop = st.active[:R] & ~runs_on
    alias_stopped(st, R, stop)
    advance_rows(st, R, h_next, survive, newly, runs_on, stop, tok, emit, logits)


def decide_exits(st, R, gate):
    """Eq. 4 online, each row with its own τ (model.exit_now, the rule of the references); a replayed
    row exits where it did; the last depth always exits. A full row (Ouro mode, a Dense-Ragged
    prompt) runs on to its last depth after its exit. Returns the rows whose exit is decided now,
    those that run on, and Π(1-λ)."""
    active, depth, forced = st.active[:R], st.depth[:R], st.forced[:R]
    survive, hit = exit_now(st.survive[:R], gate, st.tau[:R])
    hit = torch.where(forced > 0, forced == depth + 1, hit)
    last = depth == st.n_run[:R] - 1
    newly = active & (st.exit[:R] == 0) & (hit | last)
    runs_on = active & torch.where(newly, st.full[:R] & ~last, ~last)
    return newly, runs_on, survive


def sample_rows(model, st, R, hn, newly, head, sampling):
    """The LM head on every row (static shapes), and a token for each row whose exit samples one:
    the argmax, or request.sample_tokens keyed by the request's seed and the row's position."""
    if not head:
        zeros = torch.zeros(R, dtype=torch.long, device=hn.device)
        return zeros, zeros.bool(), None
    logits = model.lm_head(hn)
    req = st.req[:R]
    tok = (sample_tokens(logits, st.temperature[req], st.top_k[req], st.top_p[req], st.seed[req], st.pos[:R])
           if sampling else logits.argmax(-1))
    return tok, newly & st.sample[:R], logits


def alias_stopped(st, R, stop):
    """Eq. 11: a row that stops at depth d points its deeper table entries at its page of depth d
    (A_d[i] = P_{i, min(d, e_i)}), so that later reads find it at every deeper depth. Writes never
    go through an alias: a row writes only its own (position, depth) before it stops."""
    req, pos, depth = st.req[:R], st.pos[:R], st.depth[:R]
    d = torch.arange(st.U, device=pos.device)
    cols = req[:, None], d[None, :], pos[:, None]
    col = st.table[cols]                                                       # [R, U]: the row's position, every depth
    st.table[cols] = torch.where(stop[:, None] & (d[None, :] > depth[:, None]), col.gather(1, depth[:, None]), col)


def advance_rows(st, R, h_next, survive, newly, runs_on, stop, tok, emit, logits):
    """Each row's next state, and the log. A row that runs on carries its state to the next depth. A
    row that stopped with a sampled token restarts in place, at the next position and depth 1 with
    that token, once its request has no other row in flight (the Engine starts a request's next
    token when its previous group has finished), unless the request has ended (max_tokens or a stop
    id) or that position has no pages yet; until then it holds the token. The others go idle."""
    req, pos, depth = st.req[:R], st.pos[:R], st.depth[:R]
    pend = torch.where(emit, tok, st.pend[:R])
    st.ntok.index_add_(0, req, emit.long())
    at_end = emit & ((st.ntok[req] >= st.max_tok[req]) | (st.stop_ids[req] == tok[:, None]).any(1))
    st.ended.logical_or_(torch.zeros_like(st.ntok).index_add_(0, req, at_end.long()) > 0)
    in_flight = torch.zeros_like(st.ntok).index_add_(0, req, runs_on.long())
    waits = (stop | st.hold[:R]) & (pend >= 0)
    ended = st.ended[req]
    go = waits & (in_flight[req] == 0) & ~ended & (pos < st.horizon[req])
    hold = waits & ~go & ~ended
    idle = ~runs_on & ~go & ~hold
    entry = torch.stack([req, pos, torch.where(st.active[:R], depth + 1, 0), torch.where(newly, depth + 1, 0),
                         torch.where(emit, tok, -1), stop.long(), go.long()])
    at = st.t % st.log.shape[0]
    st.log[:, :, :R].index_copy_(0, at, entry[None])
    if st.logits is not None and logits is not None:
        st.logits[:, :R].index_copy_(0, at, logits[None])
    st.t += 1
    new = dict(tok=torch.where(go, pend, st.tok[:R]), pos=pos + go.long(),
               depth=torch.where(go, 0, depth + runs_on.long()),
               exit=torch.where(go, 0, torch.where(newly, depth + 1, st.exit[:R])),
               h=torch.where(runs_on[:, None], h_next, st.h[:R]), survive=torch.where(runs_on, survive, st.survive[:R]),
               tau=torch.where(go, st.dec_tau[req], st.tau[:R]), full=torch.where(go, st.dec_full[req], st.full[:R]),
               n_run=torch.where(go, st.dec_n_run[req], st.n_run[:R]), forced=torch.where(go, 0, st.forced[:R]),
               sample=st.sample[:R] | go, fresh=go, active=runs_on | go, hold=hold,
               pend=torch.where(go | idle, -1, pend), req=torch.where(idle, st.S, req))
    for name, value in new.items():
        getattr(st, name)[:R] = value


PLAIN = SimpleNamespace(start=start_rows, before=Layer.before_attention, after=Layer.after_attention,
                        finish=finish_rows)


def compiled_phases():
    """The pass's phases compiled by torch.compile (Inductor): each fuses its pointwise work (norms,
    RoPE, SwiGLU, residuals, the exit maths) into a few kernels. A layer's halves take the layer as an
    argument, so one compiled graph serves every layer; the paged attention stays outside. Shapes are
    left to Dynamo (a second bucket recompiles a phase once, shape-generic), so that buckets cost few
    compilations; each bucket is then captured as a graph of its own."""
    import torch._dynamo
    for key in ("recompile_limit", "cache_size_limit"):     # kinds of pass: head or not, sampling or not
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    return SimpleNamespace(**{k: torch.compile(f) for k, f in vars(PLAIN).items()})


# ----------------------------------------------------------------------------- graphs of passes

class Graphs:
    """One CUDA graph per kind of pass (bucket, keys read, head flags, sampling), captured on first use
    into one shared memory pool and replayed. A capture runs the passes a few times first (compilation,
    Triton's JIT, cuBLAS's workspaces) on a side stream, restoring the buffers (`buffers()`: all a
    pass changes but the page pool) after each run: the warm-up writes into the pool only the K/V
    that the replay writes again."""

    def __init__(self, buffers):
        self.buffers, self.graphs, self.pool = buffers, {}, None

    def replay(self, key, run):
        if key not in self.graphs:
            self.graphs[key] = self.capture(run)
        self.graphs[key].replay()

    def capture(self, run, warmup=2):
        saved = [b.clone() for b in self.buffers()]
        restore = lambda: [b.copy_(v) for b, v in zip(self.buffers(), saved)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
                restore()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            run()
        self.pool = graph.pool()
        restore()
        return graph

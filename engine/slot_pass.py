"""
The depth-batching pass as a pure function of buffers of fixed shape on the device: what a CUDA graph
replays (engine/slots.py drives it; serve_depthbatch.EagerRunner is its reference).

Every buffer a pass reads or writes is allocated once (Slots): one row slot per row (a token of a
request at a depth), each request slot's page table [U, context] on the device, RoPE of every
position, a ring of log entries. run_pass applies the block to the first R row slots, each row at its
own position and depth, and all that follows, in place: Eq. 4 with each row's τ (model.exit_now), the
LM head and sampling (request.sample_tokens) where an exit samples a token, Eq. 11 where a row stops,
and each row running on, restarting in place at depth 1 with its sampled token, holding it, or going
idle. No value is read on the host and no Python branch depends on data: it runs on the `meta`
device and compiles to one graph (test_slots.py).

Read top to bottom: the buffers, the host's writes into them (one copy a step: Upload) and its copies
of them (Download); the pass, in its phases. engine/graphs.py compiles it and captures it as CUDA
graphs.
"""
import numpy as np
import torch

from kernels import paged_attention_table
from model import FULL, at_least_fp32, exit_now
from engine.request import sample_tokens

LOG = ("req", "pos", "depth", "exit", "tok", "stop", "go")   # per pass and row: what the host reads back
ROWS = ("tok", "pos", "depth", "req", "n_run", "forced", "exit", "pend", "h", "survive", "tau",
        "full", "active", "sample", "fresh", "hold")


def bucket(n, cap):
    """The row count a pass runs: the next power of two >= n, at most cap (a graph per bucket), at
    least 2 (a dimension of 1 the compiler specializes into a graph of its own, which fuses
    worse)."""
    return min(cap, max(2, 1 << max(n - 1, 0).bit_length()))


# ----------------------------------------------------------------------------- the buffers

class Slots:
    """Every buffer a pass reads or writes, allocated once, so that a CUDA graph can hold their
    addresses. R row slots; S request slots plus one, S, the padding request that idle rows belong
    to (its table points at the pool's scratch page); per request slot its page table
    [U, n_keys] on the device; RoPE of every position; a ring of log entries."""

    def __init__(self, model, pool, n_rows, n_reqs, n_keys, log_len, n_stop=8, keep_logits=False):
        cfg, dt = model.config, model.lm_head.weight.dtype
        dev, pdt = pool.k[0].device, at_least_fp32(dt)
        R, S, U = n_rows, n_reqs, cfg.n_loops
        ints = lambda *shape, fill=0: torch.full(shape, fill, dtype=torch.long, device=dev)
        flags = lambda *shape: torch.zeros(shape, dtype=torch.bool, device=dev)
        reals = lambda *shape, fill=0.0: torch.full(shape, fill, dtype=pdt, device=dev)
        self.R, self.S, self.U, self.n_keys, self.scratch = R, S, U, n_keys, pool.scratch
        self.k, self.v = pool.k, pool.v
        # rows: the token a row runs (embedded when fresh), its position, depth (0-based, the one it
        # runs next), request slot, depths it may run, replayed exit (0: decide), decided exit
        # (1-based, 0: none), a sampled token it carries (-1: none); its state and Π(1-λ) (Eq. 4),
        # τ; whether it runs on after its exit (full), runs at all (active), samples at its exit,
        # starts a position (fresh), holds a token until its request's other rows finish (hold)
        self.tok, self.pos, self.depth, self.n_run = ints(R), ints(R), ints(R), ints(R, fill=1)
        self.req, self.forced, self.exit, self.pend = ints(R, fill=S), ints(R), ints(R), ints(R, fill=-1)
        self.h = torch.zeros(R, cfg.n_embd, dtype=dt, device=dev)
        self.survive, self.tau = reals(R, fill=1.0), reals(R, fill=FULL)
        self.full, self.active, self.sample, self.fresh, self.hold = flags(R), flags(R), flags(R), flags(R), flags(R)
        # request slots: page table, tokens sampled and allowed, stop ids, how a decode row runs
        # (τ, full, depths), the sampler's parameters, whether it has ended, the last position
        # whose pages are reserved (horizon)
        # + a column no row reads (alias_stopped)
        self.table = ints(S + 1, U, n_keys + 1, fill=pool.scratch)
        self.ntok, self.max_tok = ints(S + 1), ints(S + 1)
        self.dec_n_run, self.horizon = ints(S + 1, fill=1), ints(S + 1, fill=-1)
        self.stop_ids = ints(S + 1, n_stop, fill=-1)
        self.dec_tau, self.dec_full, self.ended = reals(S + 1, fill=FULL), flags(S + 1), flags(S + 1)
        self.seed, self.top_k = ints(S + 1), ints(S + 1)
        self.temperature, self.top_p = reals(S + 1), reals(S + 1, fill=1.0)
        # what model.rope gives, once
        self.cos, self.sin = model.rope(torch.arange(n_keys, device=dev), dt)
        # passes run (the log's write index)
        self.t = ints(1)
        # a tensor per field (advance_rows)
        self.log_len, self.log = log_len, [ints(log_len, R) for _ in LOG]
        self.logits = torch.zeros(log_len, R, cfg.vocab_size, dtype=dt, device=dev) if keep_logits else None

    def buffers(self):
        """Everything a pass changes, but the page pool (for a capture to restore)."""
        return [getattr(self, name) for name in ROWS + ("table", "ntok", "ended", "t")] + self.log + (
            [self.logits] if self.logits is not None else [])


class Upload:
    """What the host writes into the device's buffers between passes, moved in one copy a step: each
    write is a buffer, the flat positions of what it sets and their values; send() packs a step's
    writes into a host buffer (pinned on CUDA; two, used in turn, so that the host fills one while a
    copy from the other may still be queued), copies it to the device without waiting, and scatters
    the writes there, one index_put a buffer written (where a step sets an element twice, the later
    value only: last_wins), then permutes the rows if the host compacted them. Values travel as
    int64: floats as the bits of their float64, flags as 0 and 1."""

    def __init__(self, device):
        self.device, self.parts, self.where = device, [], {}
        self.host, self.flip, self.dev = {}, 0, torch.empty(0, dtype=torch.long, device=device)

    def write(self, buf, index, values):
        """buf[index] = values at the next send: index anything that indexes buf (a row, a tensor of
        rows, a tuple), values broadcast to what it selects."""
        # each element's flat position, the host's map of buf
        if id(buf) not in self.where:
            self.where[id(buf)] = torch.arange(buf.numel()).view(buf.shape)
        at = self.where[id(buf)][index]
        values = torch.broadcast_to(torch.as_tensor(values), at.shape).reshape(-1)
        bits = values.to(torch.float64).view(torch.long) if buf.is_floating_point() else values.long()
        self.parts.append((buf, at.reshape(-1), bits))

    def send(self, rows=(), perm=None):
        """The step's writes, in one host-to-device copy; then `rows` (buffers of one row each) permuted."""
        if not self.parts and perm is None:
            return
        writes = {}                                  # a buffer's writes together: one scatter each
        for buf, index, bits in self.parts:
            _, ix, bs = writes.setdefault(id(buf), (buf, [], []))
            ix.append(index)
            bs.append(bits)
        writes = [(buf, *last_wins(ix, bs)) for buf, ix, bs in writes.values()]
        pieces = [t for _, index, bits in writes for t in (index, bits)] + ([perm] if perm is not None else [])
        flat = torch.cat(pieces)
        n = len(flat)
        self.flip = 1 - self.flip
        if self.host.get(self.flip) is None or len(self.host[self.flip]) < n:
            size = max(n, 2 * len(self.host.get(self.flip, ())), 1024)
            self.host[self.flip] = torch.empty(size, dtype=torch.long,
                                               pin_memory=self.device.type == "cuda")
        if len(self.dev) < n:
            self.dev = torch.empty(max(n, 2 * len(self.dev), 1024), dtype=torch.long,
                                   device=self.device)
        host = self.host[self.flip]
        host[:n] = flat
        self.dev[:n].copy_(host[:n], non_blocking=True)              # the step's one copy
        at = 0
        for buf, index, bits in writes:
            k = len(index)
            idx, vals = self.dev[at:at + k], self.dev[at + k:at + 2 * k]
            vals = vals.view(torch.float64).to(buf.dtype) if buf.is_floating_point() else vals.to(buf.dtype)
            buf.view(-1).index_put_((idx,), vals)
            at += 2 * k
        if perm is not None:
            p = self.dev[at:at + len(perm)]
            for buf in rows:
                buf.copy_(buf[p])
        self.parts = []


def last_wins(indices, values):
    """A buffer's writes of a step [flat positions], [values] as one scatter that sets what writing
    them in order would: where an element is set twice (a slot admitted and freed in one step), the
    later value only (a scatter of a repeated position may keep either, on CUDA)."""
    index, value = torch.cat(indices), torch.cat(values)
    if len(indices) == 1:
        return index, value
    _, last = np.unique(index.numpy()[::-1], return_index=True)     # each position's last write
    if len(last) == len(index):
        return index, value
    keep = torch.from_numpy(len(index) - 1 - last)
    return index[keep], value[keep]


class Download:
    """Device buffers copied to the host without waiting: two sets of host buffers (pinned on CUDA),
    used in turn, so that the host reads one while the next copy lands in the other (the engine
    reads a copy before it starts the one after next); an event marks when a copy has landed (on a
    CPU the copy has landed when it returns)."""

    def __init__(self, device):
        self.cuda, self.host, self.flip = torch.device(device).type == "cuda", {}, 0

    def start(self, tensors):
        """Copies of `tensors` on the host, and the event to wait for before reading them (None: ready)."""
        self.flip = 1 - self.flip
        if self.flip not in self.host:
            self.host[self.flip] = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
                                    for t in tensors]
        for h, t in zip(self.host[self.flip], tensors):
            h.copy_(t, non_blocking=True)
        done = torch.cuda.Event() if self.cuda else None
        if done is not None:
            done.record()
        return self.host[self.flip], done


# ----------------------------------------------------------------------------- the pass

def run_pass(model, st, R, attn="torch", n_keys=None, n_splits=1, head=True, sampling="greedy"):
    """One application of the block to the first R row slots, each row at its own position and
    depth, and all that follows from it, in place: Eq. 4 with each row's τ, the LM head and sampling
    where an exit samples a token, Eq. 11 where a row stops, and each row running on, restarting in
    place with its sampled token, or going idle. head=False: a pass in which no row can exit (inside
    a fixed wave); sampling: how tokens are drawn (SAMPLING); attn, n_keys, n_splits: how rows read
    their keys (kernels.paged_attention_table). compiled_pass compiles it whole."""
    h, cos, sin, wpage, lengths = start_rows(model, st, R)
    # model.block, each layer's halves around the paged attention
    for i, layer in enumerate(model.layers):
        q, k, v = layer.before_attention(h, cos, sin)
        h = layer.after_attention(h, attend_rows(st, R, i, q, k, v, wpage, lengths, attn, n_keys,
                                                 n_splits))
    finish_rows(model, st, R, h, head, sampling)


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
    y = paged_attention_table(q[0].transpose(0, 1), kl, vl, st.table, st.req[:R], st.depth[:R],
                              lengths, attn, n_keys or st.n_keys, n_splits)
    return y.transpose(0, 1)[None]


def finish_rows(model, st, R, h, head, sampling):
    """After the block: the exits (Eq. 4), the LM head, the aliases (Eq. 11), and each row's next state."""
    hn, gate, h_next = model.exit_heads(h[0])
    newly, runs_on, survive = decide_exits(st, R, gate)
    stop = st.active[:R] & ~runs_on
    alias_stopped(st, R, stop)
    tok, emit, logits = sample_rows(model, st, R, hn, newly, head, sampling)
    advance_rows(st, R, h_next, survive, newly, runs_on, stop, tok, emit, logits)


def decide_exits(st, R, gate):
    """Eq. 4 online, each row with its own τ (model.exit_now, the rule of the references); a
    replayed row exits where it did; the last depth always exits. A full row (Ouro mode, a
    Dense-Ragged prompt) runs on to its last depth after its exit. Returns the rows whose exit is
    decided now, those that run on, and Π(1-λ)."""
    active, depth, forced = st.active[:R], st.depth[:R], st.forced[:R]
    survive, hit = exit_now(st.survive[:R], gate, st.tau[:R])
    hit = torch.where(forced > 0, forced == depth + 1, hit)
    last = depth == st.n_run[:R] - 1
    newly = active & (st.exit[:R] == 0) & (hit | last)
    runs_on = active & torch.where(newly, st.full[:R] & ~last, ~last)
    return newly, runs_on, survive


# A pass's draw, the cheapest that gives every row its own token: "greedy" when every request
# is (the argmax), "plain" when some row samples and none asks for top-k or top-p (the Gumbel-
# max over the whole vocabulary, the greedy rows' argmax in the same kernel), "nucleus" when
# some row does (sorted).
SAMPLING = ("greedy", "plain", "nucleus")


def draw_kind(temperature, top_k, top_p):
    """The draw one request needs (SAMPLING)."""
    return "greedy" if temperature == 0 else "nucleus" if top_k or top_p < 1.0 else "plain"


def sampling_kind(requests):
    """The draw a pass needs for these requests: the cheapest that gives each its own tokens."""
    kinds = {draw_kind(r.temperature, r.top_k, r.top_p) for r in requests}
    return next(k for k in reversed(SAMPLING) if k in kinds) if kinds else "greedy"


def sample_rows(model, st, R, hn, newly, head, sampling):
    """The LM head on every row (static shapes), and a token for each row whose exit samples one:
    the argmax, or request.sample_tokens keyed by the request's seed and the row's position (the
    vocabulary sorted only where a request asks for top-k or top-p)."""
    if not head:
        zeros = torch.zeros(R, dtype=torch.long, device=hn.device)
        return zeros, zeros.bool(), None
    logits = model.lm_head(hn)
    req = st.req[:R]
    tok = (logits.argmax(-1) if sampling == "greedy" else
           sample_tokens(logits, st.temperature[req], st.top_k[req], st.top_p[req], st.seed[req],
                         st.pos[:R], nucleus=sampling == "nucleus"))
    return tok, newly & st.sample[:R], logits


def alias_stopped(st, R, stop):
    """Eq. 11: a row that stops at depth d points its deeper table entries at its page of depth d
    (A_d[i] = P_{i, min(d, e_i)}), so that later reads find it at every deeper depth. Writes never
    go through an alias: a row writes only its own (position, depth) before it stops. One scatter
    of static shape: every row writes its page at every depth, into its own column where it stops
    and d is deeper, else into the table's last column, which no row reads."""
    req, pos, depth = st.req[:R], st.pos[:R], st.depth[:R]
    d = torch.arange(st.U, device=pos.device)[None, :].expand(R, st.U)
    page = st.table[req, depth, pos][:, None].expand(R, st.U)
    col = torch.where(stop[:, None] & (d > depth[:, None]), pos[:, None], st.n_keys)
    st.table.index_put_((req[:, None].expand(R, st.U), d, col), page)


def advance_rows(st, R, h_next, survive, newly, runs_on, stop, tok, emit, logits):
    """Each row's next state, and the log. A row that runs on carries its state to the next depth. A
    row that stopped with a sampled token restarts in place, at the next position and depth 1 with
    that token, once its request has no other row in flight (the Engine starts a request's next
    token when its previous group has finished), unless the request has ended (max_tokens or a stop
    id) or that position has no pages yet; until then it holds the token. The others go idle."""
    req, pos, depth = st.req[:R], st.pos[:R], st.depth[:R]
    pend = torch.where(emit, tok, st.pend[:R])
    # Per request slot, over its rows: tokens emitted, whether one is a stop id, whether a
    # row runs on. A one-hot [S+1, R] compare and one fused reduction (an index_add_ lowers
    # to a sort on CUDA).
    stop_id = emit & (st.stop_ids[req] == tok[:, None]).any(1)
    mine = req[None, :] == torch.arange(st.S + 1, device=req.device)[:, None]
    emitted = (mine & emit[None, :]).sum(1)
    st.ntok += emitted
    st.ended |= (mine & stop_id[None, :]).any(1) | ((emitted > 0) & (st.ntok >= st.max_tok))
    in_flight = (mine & runs_on[None, :]).any(1)
    waits = (stop | st.hold[:R]) & (pend >= 0)
    ended = st.ended[req]
    go = waits & ~in_flight[req] & ~ended & (pos < st.horizon[req])
    hold = waits & ~go & ~ended
    idle = ~runs_on & ~go & ~hold
    rows = torch.arange(R, device=req.device)
    at = (st.t % st.log_len).expand(R)
    entry = dict(req=req, pos=pos, depth=torch.where(st.active[:R], depth + 1, 0),
                 exit=torch.where(newly, depth + 1, 0), tok=torch.where(emit, tok, -1),
                 stop=stop.long(), go=go.long())
    # a tensor a field: each store joins the kernel that computes it
    for buf, name in zip(st.log, LOG):
        buf.index_put_((at, rows), entry[name])
    if st.logits is not None and logits is not None:
        st.logits.index_put_((at, rows), logits)
    st.t += 1
    new = dict(tok=torch.where(go, pend, st.tok[:R]), pos=pos + go.long(),
               depth=torch.where(go, 0, depth + runs_on.long()),
               exit=torch.where(go, 0, torch.where(newly, depth + 1, st.exit[:R])),
               h=torch.where(runs_on[:, None], h_next, st.h[:R]),
               survive=torch.where(runs_on, survive, st.survive[:R]),
               tau=torch.where(go, st.dec_tau[req], st.tau[:R]),
               full=torch.where(go, st.dec_full[req], st.full[:R]),
               n_run=torch.where(go, st.dec_n_run[req], st.n_run[:R]),
               forced=torch.where(go, 0, st.forced[:R]),
               sample=st.sample[:R] | go, fresh=go, active=runs_on | go, hold=hold,
               pend=torch.where(go | idle, -1, pend), req=torch.where(idle, st.S, req))
    for name, value in new.items():
        getattr(st, name)[:R] = value


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=gpu runs the pass")

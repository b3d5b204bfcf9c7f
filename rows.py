"""
The engine's rows and their paged K/V: a request's live state, its rows in flight, and how every
row writes its page and reads its request's table column at its own depth (Eq. 7 through Eq. 11).

A *row* is one token of one request at one depth. serve_depthbatch.Engine decides which rows run
and when they stop; this file is a request's record (Live), what a runner reports of its rows
(Log, Said), the eager runner's rows in flight (Group), those waiting for a shared LM-head call
(HeadQueue) and what one of its passes reads and writes. The slot runner's rows live on the device
(slot_pass.py).
"""
from typing import NamedTuple, Optional

import torch
from torch.nn.utils.rnn import pad_sequence

from kernels import attend_pages, check_inputs, gather_plan, grid_of, paged_chunk_attention, paged_chunk_attention_grid
from model import at_least_fp32


class Live:
    """The engine's record of one request, from its admission to its end: its page table, how far
    its positions have run, its rows in flight and the exits they decided, what preemption has cost
    it. Below the line, what a runner keeps of it: the eager runner's group of rows, the slot
    runner's request slot and pages taken ahead."""

    def __init__(self, req, id):
        self.req, self.id = req, id
        self.seq = None                 # RaggedSeq while it holds pages
        self.done = 0                   # positions whose rows all finished (chunk_end starts here)
        self.started = 0                # positions whose rows have started
        self.rows = 0                   # its rows in flight
        # exits decided, by position, until its positions are done (then req.exits)
        self.exits = {}
        # (position, 0-based depth) of rows that stopped, for the host's table
        self.stops = []
        # the last token is sampled; it ends when its rows have finished
        self.ending = False
        self.evals_before = 0           # block evaluations of caches freed by preemption
        # Σ exits and count of its decode positions run so far (replays not again)
        self.decode_depths = [0, 0]
        # ---- a runner's
        self.group = None               # eager: its rows in flight (a Group), if any
        # eager: passes its exited rows waited for a shared LM-head call
        self.waited = 0
        self.slot = None                # slots: its request slot on the device
        # slots: positions the host starts (later ones restart on the device)
        self.host_end = 0
        self.reserved = -1              # slots: the last position whose pages are taken ahead

    def runnable(self):
        """Positions it must run: every known token but a final sampled one (that one never runs)."""
        return len(self.req.prompt) + len(self.req.tokens) - (1 if self.ending else 0)

    def last_position(self):
        """The last position that runs: that of the token before the final one (which never runs)."""
        return len(self.req.prompt) + self.req.max_tokens - 2

    def preempted(self):
        """Back in the queue: its pages, rows and slot are gone; req.exits stay, replayed on its return."""
        self.seq = None
        self.done = self.started = self.rows = 0
        self.exits, self.stops = {}, []
        self.group, self.slot, self.reserved = None, None, -1


class Said(NamedTuple):
    """One row's entry in a pass's log, where it says something: its request, position and the
    1-based depth it ran, the exit it decided (0: none), the token its exit sampled (-1: none) and
    its logits (where the request keeps them), whether it ran its last depth (stop), whether its
    request's next position started in its place with that token (go)."""
    live: "Live"
    pos: int
    depth: int
    exit: int
    tok: int
    stop: bool
    go: bool
    logits: Optional[torch.Tensor] = None


class Log(NamedTuple):
    """What one pass of a runner did, the contract between a runner and the host: how many rows it
    ran for each request [(Live, rows)], and the entries of its rows that say something [Said], in
    row order (a runner builds them without any work per idle row)."""
    ran: list
    said: list


class HeadQueue:
    """The rows that exited and wait to share one LM-head call (head="shared"): [(Live, position,
    normed state, passes waited)]. Every change to them goes through here;
    serve_depthbatch.EagerRunner._head_rows decides when they go."""

    def __init__(self):
        self.rows = []

    def __bool__(self):
        return bool(self.rows)

    def join(self, exited):
        """One more pass for the rows waiting, and the newly exited [(Live, position, state)] join at 0."""
        self.rows = [(s, p, h, w + 1) for s, p, h, w in self.rows] + [(s, p, h, 0)
                                                                      for s, p, h in exited]

    def waits(self):
        return [(s, w) for s, _, _, w in self.rows]

    def take(self):
        """Every waiting row, out of the queue as [(Live, position, state)], each request charged
        the passes its rows waited."""
        rows, self.rows = self.rows, []
        for s, _, _, w in rows:
            s.waited += w
        return [(s, p, h) for s, p, h, _ in rows]

    def drop(self, live):
        """The rows of a request that ended or was preempted (a replay computes them again)."""
        self.rows = [e for e in self.rows if e[0] is not live]


class Group:
    """The rows of one request in flight: consecutive positions that started together and run
    depth by depth (a prompt chunk, a replay chunk, or one decode token). Rows leave as they
    stop."""

    def __init__(self, live, start, ids, taus, full, forced, keep, n_run):
        self.live, self.start, self.size, self.n_run = live, start, len(ids), n_run
        self.pos = torch.arange(start, start + len(ids))   # host side: page tables
        # token ids; the first step embeds all new groups at once
        self.ids = ids
        # [T, C] on the device, from the first step
        self.h = None
        # Π (1 - λ) so far (Eq. 4), from the first step
        self.survive = None
        # host lists by position (index p - start): τ, runs on after its exit, the exit a replay
        # forces (0: decide), the Table 17 depth it keeps, the exit decided (0: none yet)
        self.tau, self.full, self.forced, self.keep = taus, full, forced, keep
        self.exits = [0] * len(ids)
        self.d = 0                                          # the depth the rows run next (0-based)
        self.sample_pos = None                              # whose exit samples a token
        # its rows of this step's batch (a slice)
        self.rows = None

    def offsets(self):
        """The running rows' indices into the host lists, in batch order (row g.rows.start + i is
        position pos[i] = start + offsets()[i])."""
        return (self.pos - self.start).tolist()


class RowsView:
    """The attention hook of one engine step: every row writes its fresh page for this depth in
    every layer, then (all writes first) each row reads keys 0..its position through its own
    request's table column at its own depth (Eq. 7 through Eq. 11). parts: (kind, page_ids,
    lengths) for consecutive rows, from attention_parts: "rows" is a kernels.paged_attention call
    (decode rows, one per request), "chunks" one kernels.paged_chunk_attention call (prompt chunks
    whose rows share their request's keys)."""

    def __init__(self, pool, pages, groups, impl, device):
        self.pool, self.pages, self.impl = pool, pages, impl
        self.n_rows = pages.shape[0]
        self.parts = attention_parts(groups, impl, device)
        self.sizes = [lengths.shape[0] * (ids.shape[0] if kind == "chunks" else 1)
                      for kind, ids, lengths in self.parts]
        # every layer reads the same tables with queries of the same shape: they are checked in the
        # first layer, and the torch reference's gather list, mask or grid is built once per pass
        # too
        self.plans = [grid_of(ids) if kind == "chunks" else
                      gather_plan(ids, lengths, device) if impl == "torch" else None
                      for kind, ids, lengths in self.parts]

    def attend(self, layer, q, k, v):
        pool = self.pool
        kl, vl = pool.k[layer], pool.v[layer]
        kl[self.pages] = k[0].transpose(0, 1)                    # [R, Hkv, D]
        vl[self.pages] = v[0].transpose(0, 1)
        pool.writes += self.n_rows
        q = q[0].transpose(0, 1)                                 # [R, Hq, D]
        qs = q.split(self.sizes) if len(self.sizes) > 1 else [q]
        if layer == 0:
            for qp, (kind, ids, lengths) in zip(qs, self.parts):
                if kind == "rows":
                    check_inputs(qp, kl, vl, ids, lengths)
        ys = [attend_pages(qp, kl, vl, ids, lengths, self.impl, plan) if kind == "rows" else
              paged_chunk_attention_grid(qp, kl, vl, plan, *ids.shape, lengths)
              if plan is not None else paged_chunk_attention(qp, kl, vl, ids, lengths)
              for qp, (kind, ids, lengths), plan in zip(qs, self.parts, self.plans)]
        return (ys[0] if len(ys) == 1 else torch.cat(ys)).transpose(0, 1)[None]   # (1, Hq, R, D)


def attention_parts(groups, attn, device):
    """What each row reads: entries 0..its position of its request's table column at its depth.
    Column d holds A_d[j] = P_{j, min(d, e_j)} (Eq. 11), so reading it is reading every earlier
    token j at depth min(d, e_j): Eq. 7 without any per-row depth logic. The one-row groups
    (decode tokens) go in padded [rows, maxlen] tables ("rows"); each longer group (a prompt chunk)
    keeps its one shared list, so that prompt rows are not padded to the longest decode row nor
    gathered once per row, and consecutive chunks whose rows sit at the same positions (the prompts
    of a batch that starts together) stack their lists for one call ("chunks", [G, n]). Flex takes
    every row at once."""
    flat = groups if attn == "flex" else [g for g in groups if len(g.pos) == 1]
    ends = [g.pos.tolist()[-1] + 1 for g in flat]        # keys of each group's last (longest) row
    parts = []
    for lo, hi in padded_tables(ends, attn):
        pos = torch.cat([g.pos for g in flat[lo:hi]])
        # column d (Eq. 11), per row
        cols = [g.live.seq.table[:n_keys, g.d] for g, n_keys in zip(flat[lo:hi], ends[lo:hi])
                for _ in range(len(g.pos))]
        # -1: past the row's keys
        page_ids = pad_sequence(cols, batch_first=True, padding_value=-1)
        parts.append(("rows", page_ids.to(device), (pos + 1).to(device)))
    # runs of chunks at equal positions
    chunks = []
    for g in groups[len(flat):]:
        if chunks and torch.equal(chunks[-1][-1].pos, g.pos):
            chunks[-1].append(g)
        else:
            chunks.append([g])
    for run in chunks:
        n_keys = run[0].pos.tolist()[-1] + 1
        page_ids = torch.stack([g.live.seq.table[:n_keys, g.d] for g in run])   # [G, n_keys]
        parts.append(("chunks", page_ids.to(device), (run[0].pos + 1).to(device)))
    return parts


def padded_tables(ends, attn):
    """[(lo, hi)]: the one-row groups of each padded table. The torch reference gathers every row
    of a table padded to its longest; the rows come sorted by length, so the one cut that saves
    the most keys makes two tables, short rows and long rows, when it saves at least 1/8 of them
    (a second call costs far less). (Triton reads each row to its own length: no padding to
    save; flex takes all rows in one call.)"""
    n = len(ends)
    if attn != "torch" or n < 2:
        return [(0, n)] if n else []
    keys, cut = min((i * ends[i - 1] + (n - i) * ends[-1], i) for i in range(1, n))
    return [(0, cut), (cut, n)] if keys <= 0.875 * n * ends[-1] else [(0, n)]


def embed_new(model, groups, device):
    """The groups that start in this step (decode tokens, prompt chunks) are embedded in one call."""
    new = [g for g in groups if g.h is None]
    if new:
        ids = torch.tensor([t for g in new for t in g.ids], device=device)
        hs = model.embed_tokens(ids)
        # nothing exited yet
        ones = torch.ones(len(ids), dtype=at_least_fp32(hs.dtype), device=device)
        for g, h, s in zip(new, hs.split([g.size for g in new]), ones.split([g.size for g in new])):
            g.h, g.survive = h, s


def keep_one_depth(g, stopped, U):
    """Table 17 baselines: a finished token is read at one depth from then on."""
    for p in stopped.tolist():
        rule = g.keep[p - g.start]
        if rule is not None:
            depth = U - 1 if rule == "last" else g.exits[p - g.start] - 1
            g.live.seq.collapse(torch.tensor([p]), torch.tensor([depth]))


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python sample.py runs the engine's rows")

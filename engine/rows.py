"""
The eager runner's rows and their paged K/V: a request's rows in flight (Group), and how every row
writes its page and reads its request's table column at its own depth (Eq. 7 through Eq. 11).

A *row* is one token of one request at one depth. serve_depthbatch.EagerRunner runs them; the slot
runner's rows live on the device (engine/slot_pass.py).
"""
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from engine.contract import Log, Said
from kernels import attend_pages, check_inputs, gather_plan, grid_of, paged_chunk_attention, paged_chunk_attention_grid
from model import at_least_fp32


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
        self.sample_from = None                             # positions from here sample a token at their exit
        # its span of this step's batch of rows (a slice)
        self.span = None

    def offsets(self):
        """The running rows' indices into the host lists, in batch order (row g.span.start + i is
        position pos[i] = start + offsets()[i])."""
        return (self.pos - self.start).tolist()

    def settle(self, newly, going, runs_on, h_next, survive, U):
        """Its rows' exits after a pass (newly: exited now, a list), then advance. Returns its rows'
        entries (group, position, row of the batch, newly exited, stopped)."""
        out = []
        for i, pos in enumerate(self.pos.tolist()):
            if newly[i]:
                self.exits[pos - self.start] = self.d + 1
            out.append((self, pos, self.span.start + i, newly[i], not going[i]))
        self.advance(going, runs_on, h_next, survive, U)
        return out

    def advance(self, going, runs_on, h_next, survive, U):
        """After a pass: the rows that run on (going, a list; runs_on, its mask) keep their state for
        the next depth; the stopped ones leave (Table 17's rows keep one depth from then on)."""
        if all(going):
            self.h, self.survive = h_next, survive
        elif any(going):
            stopped, self.pos = self.pos[~runs_on], self.pos[runs_on]
            keep_one_depth(self, stopped, U)
            on = runs_on.to(h_next.device)
            self.h, self.survive = h_next[on], survive[on]
        else:                             # all stopped (a decode token's one row, most often)
            keep_one_depth(self, self.pos, U)
            self.pos = self.pos[:0]
        self.d += 1


def host_lists(groups):
    """The groups' host lists, row by row in batch order, as tensors: τ, the exit a replay forces (0:
    decide), the exit decided (0: none), runs on after its exit, the depth it runs (0-based), whether
    that is its last."""
    rows = [(g, k) for g in groups for k in g.offsets()]
    tau = torch.from_numpy(np.array([g.tau[k] for g, k in rows], dtype=np.float64))
    forced, decided, full, depth, last = torch.from_numpy(np.array(
        [[g.forced[k], g.exits[k], g.full[k], g.d, g.d == g.n_run - 1] for g, k in rows],
        dtype=np.int64).T)
    return tau, forced, decided, full.bool(), depth, last.bool()


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
        # every layer reads the same tables with queries of the same shape: they are checked
        # in the first layer, and the torch reference's gather list, mask or grid is built
        # once per pass too
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


# A few decoded positions (a speculative verification) are read in the padded tables of the decode
# rows, one call for them all: as a chunk each would cost a call a layer for a few rows, most of a
# pass's time when a batch holds many. (Prompt chunks keep their calls: a batch's prompts that start
# together are read in place, in one.)
ROWS_MAX = 8


def read_as_rows(g):
    return len(g.pos) == 1 or (g.start >= len(g.live.req.prompt) and len(g.pos) <= ROWS_MAX)


def attention_parts(groups, attn, device):
    """What each row reads: entries 0..its position of its request's table column at its depth.
    Column d holds A_d[j] = P_{j, min(d, e_j)} (Eq. 11), so reading it is reading every earlier
    token j at depth min(d, e_j): Eq. 7 without any per-row depth logic. The groups of a few decoded
    rows (read_as_rows: decode tokens, speculative verifications) go in padded [rows, maxlen] tables
    ("rows"), each row to its own length; a prompt chunk keeps its one shared list, so that prompt
    rows are not padded to the longest decode row nor gathered once per row, and consecutive chunks
    whose rows sit at the same positions (the prompts of a batch that starts together) stack their
    lists for one call ("chunks", [G, n]). Flex takes every row at once."""
    flat = groups if attn == "flex" else [g for g in groups if read_as_rows(g)]
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



def pass_logs(rows, n_passes, tokens):
    """The Logs of an eager run (engine/contract.py): its passes (a fixed wave: several, their exits
    in the last) and their rows [(group, position, row, newly exited, stopped)], with the tokens
    sampled [(Live, position, token, logits)], each at its row (a row that waited for a shared head
    call: an entry of its own, at depth 0)."""
    # logits go back where the request keeps them, and where a speculative verification reads them
    kept = lambda r: r.keep_logits or (r.mode == "speculative" and r.temperature > 0)
    sampled = {(s, pos): (tok, lg if kept(s.req) else None) for s, pos, tok, lg in tokens}
    said = []
    for g, pos, _, newly, stopped in rows:          # g.d: the 1-based depth of the last pass
        tok, lg = sampled.pop((g.live, pos), (-1, None))
        if newly or stopped or tok >= 0:
            said.append(Said(g.live, pos, g.d, g.d if newly else 0, tok, stopped, False, lg))
    said += [Said(s, pos, 0, 0, tok, False, False, lg) for (s, pos), (tok, lg) in sampled.items()]
    ran = {}
    for g, *_ in rows:
        ran[g.live] = ran.get(g.live, 0) + 1
    return [Log(list(ran.items()), [])] * (n_passes - 1) + [Log(list(ran.items()), said)]

if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python sample.py runs the engine's rows")

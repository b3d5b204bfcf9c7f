"""
KV caches for the looped model.

DenseLanes is Ouro's own layout and our baseline: one K/V lane per (loop, layer), so every token
must run every loop to fill every lane (the cache problem P1 of the paper, Eq. 5-6).

Ragged KV (App. A.1): a PagePool of physical pages (one token's K/V at one depth, all layers) and a
RaggedSeq per request whose logical table A_d[i] = P_{i,min(d,e_i)} aliases deeper depths to the
terminal page (Eq. 11). Physical rows are exactly Σ e_i. The engine in serve_depthbatch.py writes
fresh pages and reads through the tables (kernels.paged_attention). The Table 17 baselines reuse
the same tables (RaggedSeq.collapse keeps one depth per token).
"""
import os

import torch

from configurator import UserError


def causal_mask(pos, T, n_keys, device):
    """Queries at positions pos..pos+T-1 may read keys at positions <= their own."""
    q = torch.arange(pos, pos + T, device=device)[:, None]
    return torch.arange(n_keys, device=device)[None, :] <= q


class DenseLanes:
    """Ouro's cache: lane (d, layer) holds depth-d K/V of every position, for depths 1..n_lanes.
    A token that reaches depth d reads depth d of every earlier token (Eq. 5), so every lane must be
    filled (Eq. 6): memory n_lanes * N rows per layer, whatever the exits."""

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


# ----------------------------------------------------------------------- Ragged KV pages (App. A.1)

def page_bytes(model):
    """Bytes of one KV page: one token's K and V at one depth, in every layer."""
    cfg, p = model.config, model.lm_head.weight
    return cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * p.element_size()


def memory_bytes(device):
    """Memory a pool may take on `device`: the free memory of a GPU, the physical memory of the host."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return float("inf")


def check_pool(model, kv_pages):
    """A pool of kv_pages must fit the device's memory (UserError naming --kv_pages)."""
    need, have = kv_pages * page_bytes(model), memory_bytes(model.lm_head.weight.device)
    if need > have:
        raise UserError(f"--kv_pages={kv_pages}: a pool of {kv_pages} pages of "
                        f"{page_bytes(model) / 1024:.1f} KiB needs {need / 2**30:.1f} GiB; this "
                        f"machine has {have / 2**30:.1f} GiB", "kv_pages")


def pool_pages(model, kv_pages=0, kv_memory=0.0, max_batch=32):
    """--kv_pages, else --kv_memory GiB, else max_batch full contexts at every depth, at most 2 GiB."""
    cfg = model.config
    if kv_pages:
        return kv_pages
    if kv_memory:
        return int(kv_memory * 2**30 // page_bytes(model))
    return min(max_batch * cfg.block_size * cfg.n_loops, 2 * 2**30 // page_bytes(model))


class PoolExhausted(Exception):
    """The page pool has too few free pages. Nothing was allocated; every sequence is unchanged."""


class PageError(Exception):
    """A bug in page ownership: double free, freeing another sequence's page, writing an alias."""


class PagePool:
    """Physical K/V storage. One page = one token's K and V at one depth, in every layer.
    k[layer][page] has shape (n_kv_head, head_dim): a tensor per layer, not views of one, so that a
    compiled pass writes each in place (a write through a view of a graph's input is copied whole).
    A free list hands pages out."""

    def __init__(self, n_pages, n_layer, n_kv_head, head_dim, dtype=torch.float32, device="cpu"):
        self.n_pages = n_pages
        # one more page, past the last, that padding rows of a static batch write and no row reads
        # (engine/slot_pass.py); it is never handed out
        self.scratch = n_pages
        page = lambda: torch.zeros(n_pages + 1, n_kv_head, head_dim, dtype=dtype, device=device)
        self.k, self.v = [page() for _ in range(n_layer)], [page() for _ in range(n_layer)]
        self.free = list(range(n_pages - 1, -1, -1))  # a stack: pop() hands out low ids first
        self.owner = [None] * n_pages                 # which sequence holds each page
        self.peak = 0
        self.writes = 0

    @classmethod
    def for_model(cls, model, n_pages):
        cfg, p = model.config, model.lm_head.weight
        return cls(n_pages, cfg.n_layer, cfg.n_kv_head, cfg.head_dim, p.dtype, p.device)

    @property
    def used(self):
        return self.n_pages - len(self.free)

    def alloc(self, n, owner):
        """n free pages, lowest ids first, for `owner` (a sequence, or a list of n: one per page): a
        page is taken only for a depth a token runs (App. A.1)."""
        if n > len(self.free):
            raise PoolExhausted(f"need {n} KV pages, {len(self.free)} of {self.n_pages} free")
        pages = [self.free.pop() for _ in range(n)]
        for p, o in zip(pages, owner if isinstance(owner, list) else [owner] * n):
            self.owner[p] = o
        self.peak = max(self.peak, self.used)
        return pages

    def release(self, pages, owner):
        pages = list(pages)
        for p in pages:  # check everything before changing anything
            if self.owner[p] is not owner:
                raise PageError(f"page {p} is not held by this sequence (double free or foreign page)")
        if len(set(pages)) != len(pages):
            raise PageError("the same page released twice in one call")
        for p in pages:
            self.owner[p] = None
            self.free.append(p)

    def check(self):
        """Invariants: every page is free xor owned; the free list has no duplicates."""
        free = set(self.free)
        assert len(free) == len(self.free), "a page is free twice"
        for p in range(self.n_pages):
            assert (p in free) == (self.owner[p] is None), f"page {p} is both free and owned, or neither"


class RaggedSeq:
    """One sequence's logical page table: table[i, d-1] = the page token i is read from at depth d.

    A page is allocated only when a token actually runs a depth. When token i stops running at
    depth r (its exit), rows d > r alias its terminal page (Eq. 11: A_d[i] = P_{i,min(d,e_i)}) and
    nothing deeper is ever held. Reads may alias; writes go only to a token's own page at the depth
    it is running, never through an alias (write_pages checks it).

    A worked example, U = 4: three tokens exit at e = [1, 3, 2]. Depth 1 runs all three (pages 0, 1,
    2), depth 2 tokens 1 and 2 (pages 3, 4), depth 3 token 1 (page 5); each exit aliases the deeper
    entries to the page of its exit depth:

                  d=1  d=2  d=3  d=4
        token 0     0    0    0    0      e = 1
        token 1     1    3    5    5      e = 3
        token 2     2    4    4    4      e = 2

    A query at depth 3 reads column 3, pages [0, 5, 4]: token 0 at depth 1, token 1 at 3, token 2 at 2,
    each at min(3, e_j): Eq. 7 is reading a column. The cache holds 6 physical pages, Σ e_i, against
    N·U = 12 dense rows (Eq. 12)."""

    def __init__(self, pool, n_loops, max_len):
        self.pool, self.U = pool, n_loops
        self.table = torch.full((max_len, n_loops), -1, dtype=torch.long)
        # True: an owned page, not an alias
        self.real = torch.zeros((max_len, n_loops), dtype=torch.bool)
        self.n = 0              # positions so far
        self.block_evals = 0    # token-depth block applications executed
        self.released = False

    def extend(self, T):
        self._live()
        if self.n + T > self.table.shape[0]:
            raise PoolExhausted(f"sequence of {self.n + T} tokens exceeds its table of "
                                f"{self.table.shape[0]}")
        pos = torch.arange(self.n, self.n + T)
        self.n += T
        return pos

    def alloc_depth(self, pos, d, pages=None):
        """Give each token in `pos` a fresh page for 0-based depth d (it is about to run it), or for
        every depth of a slice d (a fixed wave runs them all: pages [len(pos), depths], taken by
        alloc_wave); pages: already taken from the pool for this sequence. (write_pages refuses a
        page the sequence does not own; check() verifies that no page is ever held twice or
        leaked.)"""
        self._live()
        if pages is None:
            pages = torch.tensor(self.pool.alloc(len(pos), self), dtype=torch.long)
        self.table[pos, d] = pages
        self.real[pos, d] = True
        self.block_evals += pages.numel()
        return pages

    def stop(self, pos, d):
        """Tokens in `pos` ran their last depth d (0-based; one for all, or a tensor, one per
        token): deeper rows alias P_{i,d} (Eq. 11). A page taken ahead for a deeper depth (the slot
        runner takes every depth of a position before it runs) was never computed: it goes back."""
        # token by token, on numpy views of the tables: a step stops a few tokens a request
        table, real = self.table.numpy(), self.real.numpy()
        depths = torch.as_tensor(d).reshape(-1).expand(len(pos)).tolist()
        for i, e in zip(torch.as_tensor(pos).tolist(), depths):
            ahead = table[i, e + 1:][real[i, e + 1:]]
            if len(ahead):
                self._give_back(ahead.tolist())
                real[i, e + 1:] = False
            table[i, e + 1:] = table[i, e]                     # Eq. 11: A_d[i] = P_{i, min(d, e_i)}

    def trim(self, n):
        """Positions n.. never ran: the pages taken ahead for them go back, and the table ends at n."""
        n = min(n, self.n)
        if n == self.n:
            return
        ahead = self.real[n:self.n]
        self._give_back(self.table[n:self.n][ahead].tolist())
        self.table[n:self.n], self.real[n:self.n], self.n = -1, False, n

    def rewind(self, n):
        """Positions n.. are taken back though they ran (self-speculative decoding: positions that
        ran on a refused draft, or past the end): their pages go back to the pool and the table ends
        at n; their block evaluations stay counted."""
        n = min(n, self.n)
        self.pool.release(self.table[n:self.n][self.real[n:self.n]].tolist(), self)
        self.table[n:self.n], self.real[n:self.n] = -1, False
        self.n = n

    def _give_back(self, pages):
        """Pages taken and never computed: back to the pool, and off the block evaluations."""
        self.pool.release(pages, self)
        self.block_evals -= len(pages)

    def collapse(self, pos, depth):
        """Table 17 baselines: read token i at one depth (0-based depth[i]) from every depth, and
        free its other pages."""
        keep = self.table[pos, depth]
        drop = self.real[pos] & (self.table[pos] != keep[:, None])
        self.pool.release(self.table[pos][drop].tolist(), self)
        self.table[pos] = keep[:, None]
        self.real[pos] = False
        self.real[pos, depth] = True

    def _live(self):
        if self.released:
            raise PageError("this sequence was released: its pages are freed and may belong to another")

    def write_pages(self, pos, d, pages):
        """Check a K/V write of `pos` at depth d (or every depth of a slice d, pages [len(pos), depths])."""
        self._live()
        if not (self.real[pos, d].all() and torch.equal(self.table[pos, d], pages)):
            raise PageError("a K/V write through an alias or to a page the token "
                            "does not own at this depth")
        if any(self.pool.owner[p] is not self for p in pages.flatten().tolist()):
            raise PageError("a K/V write to a freed page or one held by another sequence")

    def release(self):
        """Return every page this sequence owns."""
        if not self.released:
            self.pool.release(self.table[:self.n][self.real[:self.n]].tolist(), self)
            self.released = True

    def stats(self):
        """Pages this sequence holds (Eq. 12: Σ e_i physical rows, against N·U dense), its logical
        entries (aliases included) and its block evaluations (Eq. 13: FLOPs in the ratio Ē / U)."""
        n = self.n
        return {"physical": int(self.real[:n].sum()), "logical": int((self.table[:n] >= 0).sum()),
                "dense": n * self.U, "block_evals": self.block_evals}

    def check(self):
        """Every table entry points to a live page of this sequence; real pages are distinct."""
        t, r = self.table[:self.n], self.real[:self.n]
        pages = t[t >= 0].tolist()
        assert all(self.pool.owner[p] is self for p in pages), "table points to a page not held"
        real = t[r].tolist()
        assert len(set(real)) == len(real), "a page owned twice"
        assert sum(o is self for o in self.pool.owner) == len(real), "a leaked page"


def alloc_wave(pool, rows):
    """The pages of a fixed wave in one piece: rows = [(seq, pos, depths)], each request's rows and
    the range of depths they run. Taken position by position across the requests, depth innermost
    ([row i][request][depth]): requests that start together on a fresh stretch of the pool get at
    every depth a regular grid of pages, page(request r, position j) = base + r*s_r + j*s_j, which
    the attention reads in place, as Ouro's dense lanes are read (kernels.gather_plan). All or
    nothing: PoolExhausted leaves every sequence unchanged. Returns per entry its pages
    [len(pos), len(depths)]."""
    need = sum(len(pos) * len(depths) for _, pos, depths in rows)
    if need > len(pool.free):
        raise PoolExhausted(f"need {need} KV pages, {len(pool.free)} of {pool.n_pages} free")
    order = [(k, i, di) for i in range(max((len(pos) for _, pos, _ in rows), default=0))
             for k, (_, pos, depths) in enumerate(rows) if i < len(pos)
             for di in range(len(depths))]
    taken = pool.alloc(need, [rows[k][0] for k, _, _ in order])
    grid = [[[0] * len(depths) for _ in range(len(pos))] for _, pos, depths in rows]
    for (k, i, di), p in zip(order, taken):
        grid[k][i][di] = p
    # [len(pos), len(depths)] each
    return [seq.alloc_depth(pos, slice(depths.start, depths.stop),
                            torch.tensor(g, dtype=torch.long))
            for (seq, pos, depths), g in zip(rows, grid)]


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python sample.py runs the Ragged-KV cache")

"""
Which requests run next (App. A.2): the queue, admission, chunks within the row budget and the free
pages, and whom a dry pool costs; with the two baselines' variants (nested waves, fixed waves). The
engine's host (serve_depthbatch.Engine) schedules with it, whichever runner applies the block.

It decides and hands back; the engine acts. `chunks` proposes the chunks of positions to start this
step one at a time, the running requests oldest first, then requests admitted from the queue; the
engine starts each (its rows, its pages) before the next is chosen, since starting one may run the
pool dry. `evict` moves the newest request back to the front of the queue and hands it back: the
engine frees its pages and rows, and on its return rebuilds its cache by replaying the exits it
already had (memory is capacity: a preempted request continues exactly as it would have).

A request in the queues is the engine's own record of it (engine/contract.py's Live): its .req, .done (positions
whose rows have all finished) and .runnable() (positions it must run).
"""
from collections import deque

from configurator import UserError
from modes import as_fixed, keeps_one_depth, n_run, need

SCHEDULERS = ["continuous", "nested", "fixed"]


def scheduler_for(mode):
    """The scheduler for requests all of one mode (sample.py, lab/eval.py): fixed-depth requests go
    in waves, every token all its loops at once (no exits to decide); the others pass by pass."""
    return "fixed" if mode == "fixed" else "continuous"


def chunk_end(s, budget):
    """Where the next chunk of positions of s (s.started.., up to s.runnable()) ends, given the rows
    left in this step's budget; None: wait. A decode token always runs."""
    n, start, avail = len(s.req.prompt), s.started, s.runnable()
    if start >= avail:
        return None
    if keeps_one_depth(s.req.mode):
        return n if start < n else start + 1
    if start == avail - 1:
        return avail                    # one decode token: always runs
    return min(avail, start + budget) if budget > 0 else None


def fit_chunk(s, end, free, U):
    """A chunk that needs more than the free pages (a row takes one per depth it may run) starts
    smaller; None: it waits (nothing fits, or a Table 17 prompt, which runs whole)."""
    depths = n_run(s.req, U)
    if (end - s.started) * depths <= free:
        return end
    end = s.started + max(free // depths, 0)
    return None if end <= s.started or keeps_one_depth(s.req.mode) else end


def dry_pool(r, pool, U):
    """Why a request that runs the pool dry alone ends where it is (its tokens so far kept, finish
    reason "length"): the pool, what it held, and its whole need."""
    return (f"stopped after {len(r.tokens)} of {r.max_tokens} tokens: it held all {pool.used} of "
            f"the pool's {pool.n_pages} KV pages; it needs {need(r, U)}")


class Scheduler:
    """The waiting queue and the running list of one engine, and its rules: at most max_batch
    requests running, at most max_rows rows starting a step, and the kind of scheduler
    (SCHEDULERS): `continuous` starts chunks every step, `nested` only between waves (the engine
    asks only then), `fixed` holds a wave to requests of one depth."""

    def __init__(self, pool, U, max_batch, max_rows, kind):
        if kind not in SCHEDULERS:
            raise UserError(f"--scheduler={kind!r}; allowed: {', '.join(SCHEDULERS)}", "scheduler")
        self.pool, self.U, self.max_batch, self.max_rows, self.kind = pool, U, max_batch, max_rows, kind
        self.waiting, self.running = deque(), []

    def busy(self):
        return bool(self.waiting or self.running)

    def shape(self, r):
        """A request as this scheduler runs it: the fixed scheduler runs every request as Ouro's code
        does, every token all its loops (modes.as_fixed)."""
        if self.kind == "fixed":
            as_fixed(r, self.U)

    def chunks(self, rows, free, ready, wave=None):
        """The chunks to start this step (App. A.2), one at a time: yields (s, end), positions s.started..end-1,
        and the engine starts them before the next is chosen. rows: the rows already in flight;
        free: the pages left for new chunks (a chunk's rows take one per depth they may run).
        ready(s), the runner's: "chunk" if s may start one, "started" if its next row has started
        already (the slot runner restarts decode rows on the device: it counts against the budget of
        the requests after it, as a decode chunk would), anything else if neither. wave: the depth
        of the fixed wave under way, if any. A request admitted from the queue is yielded with .seq
        None. `nested` starts chunks only between waves, when no row is in flight."""
        if self.kind == "nested" and any(s.rows for s in self.running):
            return
        joins = lambda s: self.kind != "fixed" or wave in (None, n_run(s.req, self.U))
        for s in list(self.running):
            how = ready(s)
            if how == "started":
                rows += 1
            if how != "chunk" or not joins(s):
                continue
            end = chunk_end(s, self.max_rows - rows)
            # one decode row always starts (the host makes room for it)
            if end is not None and end - s.started > 1:
                end = fit_chunk(s, end, free, self.U)
            if end is not None:
                wave, n = n_run(s.req, self.U), end - s.started
                rows, free = rows + n, free - n * wave
                yield s, end
        while self.waiting and len(self.running) < self.max_batch and joins(self.waiting[0]):
            s = self.waiting[0]
            end = chunk_end(s, self.max_rows - rows)
            if end is None:
                break
            if s.req.exits and self.running and free < sum(s.req.exits) + n_run(s.req, self.U):
                # a preempted request returns when its replay and one more token fit: no thrashing
                break
            end = fit_chunk(s, end, free, self.U)
            if end is None:
                break
            self.running.append(self.waiting.popleft())
            wave, n = n_run(s.req, self.U), end - s.started
            rows, free = rows + n, free - n * wave
            yield s, end

    def evict(self):
        """The pool ran dry (App. A.2: memory is capacity): the newest request is preempted, back to
        the front of the queue (its exits kept for the replay), and handed back with None; or, when
        it runs alone and still does not fit, handed back with why it ends where it is
        (dry_pool)."""
        s = self.running[-1]
        if len(self.running) == 1:
            return s, dry_pool(s.req, self.pool, self.U)
        self.running.remove(s)
        self.waiting.appendleft(s)
        s.req.preemptions += 1
        return s, None

    def remove(self, s):
        """s has ended: out of the queue or the running list."""
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python server.py --scheduler=... schedules with it")

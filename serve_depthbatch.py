"""
The depth-queue decoder (App. A.2): the engine of continuous mixed-depth batching over one shared
Ragged-KV page pool, and when its LM head runs.

    engine = Engine(model, kv_pages=4000, max_batch=8)
    done = engine.run([Request(prompt_ids, max_tokens=32, mode="dense_ragged", thr=0.5)])   # request.py

All loop iterations share one set of weights, so tokens at different depths can go through the
block in the same batch. A *row* is one token of one request at one depth, with its own position,
its own page-table column and its own K/V page. Each engine step applies the block once to every
in-flight row whatever its depth (`continuous`): a row that exits (Eq. 4, each request with its
own threshold τ) is sampled at once, and its request's next token joins at depth 1 on the next
step, so every pass is useful work and passes approach the work-conserving bound Σ e_i / B.
Baselines in the same engine: `nested` (a wave of rows stays in a nested loop until all of them
have exited) and `fixed` (waves in which every token runs all U loops back to back, as Ouro's code
does; a request of mode fixed keeps its own depth, and sample.py and lab/eval.py run that mode so).

Memory is capacity: one PagePool holds every request's pages, a RaggedSeq per request maps
(position, depth) to pages with aliases (Eq. 11), and admission reserves only what a prefill
chunk needs. When the pool runs out, the most recently admitted request is preempted (pages
freed, requeued); when it returns, its cache is rebuilt by a recomputation that replays the exit
depths it already had, so its continuation is exactly what it would have been.

The LM head runs on the rows whose exit samples a token. With a real vocabulary it weighs as much as
the block, so head="shared" lets exited rows wait a few passes to share one call while waiting is
cheaper than a call; the tokens are the same either way.

How each mode runs a request's tokens is modes.py; which requests run next, scheduler.py; what a
row is (its request's live state, its paged reads and writes), rows.py; the Request that callers
fill in and read back, request.py. The HTTP API over this engine is server.py; its
benchmark is `python -m lab.bench --what=engine`.
"""

import torch

from configurator import UserError
from kernels import resolve_impl
from modes import as_fixed, check_request, n_run, position_rules
from model import exit_now
from ragged import PagePool, RaggedSeq, alloc_wave, memory_bytes, page_bytes
from request import sample_token
from rows import Group, Live, RowsView, embed_new, keep_one_depth
from scheduler import SCHEDULERS, Scheduler

# When the LM head runs: "eager" on every pass where a row exits; "shared" lets exited rows wait to
# share one head call, while the cost model says waiting costs less than a call (with a queue, up to
# MAX_WAIT passes; with none, for the row of the request that ends the batch: Engine._head_rows).
HEADS = ["eager", "shared"]
MAX_WAIT = 2


class HeadQueue:
    """The rows that exited and wait to share one LM-head call (head="shared"): [(Live, normed
    state, passes waited)]. Every change to them goes through here; Engine._head_rows decides when
    they go."""

    def __init__(self):
        self.rows = []

    def __bool__(self):
        return bool(self.rows)

    def join(self, exited):
        """One more pass for the rows waiting, and the newly exited [(Live, state)] join at 0."""
        self.rows = [(s, h, w + 1) for s, h, w in self.rows] + [(s, h, 0) for s, h in exited]

    def waits(self):
        return [(s, w) for s, _, w in self.rows]

    def take(self):
        """Every waiting row, out of the queue as [(Live, state)], each request charged the passes
        its rows waited."""
        rows, self.rows = self.rows, []
        for s, _, w in rows:
            s.waited += w
        return [(s, h) for s, h, _ in rows]

    def drop(self, live):
        """The rows of a request that ended or was preempted (a replay computes them again)."""
        self.rows = [e for e in self.rows if e[0] is not live]


def check_pool(model, kv_pages):
    """A pool of kv_pages must fit the device's memory (UserError naming --kv_pages)."""
    need, have = kv_pages * page_bytes(model), memory_bytes(model.lm_head.weight.device)
    if need > have:
        raise UserError(f"--kv_pages={kv_pages}: a pool of {kv_pages} pages of {page_bytes(model) / 1024:.1f} KiB "
                        f"needs {need / 2**30:.1f} GiB; this machine has {have / 2**30:.1f} GiB", "kv_pages")


def weight_bytes(model):
    """The weights a pass of the block reads (all L layers) and those an LM-head call reads: the two
    prices of the weight-read cost model (decode is weight-bound at small batch)."""
    head = model.lm_head.weight
    return sum(p.numel() * p.element_size() for p in model.layers.parameters()), head.numel() * head.element_size()


# ----------------------------------------------------------------------------- the engine

class Engine:
    """Continuous mixed-depth batching over one shared page pool. Call add() and step() from one
    thread (server.py runs them on an engine thread); Request.cancelled may be set from anywhere.

    The scheduler (scheduler.py) holds the queue and decides which chunks start and whom a dry
    pool costs; the engine runs the rows and frees what it is handed back. stats counts what the
    engine did (passes, rows, preemptions, replayed rows, the most requests in flight); last_pass
    lists (request, rows, is decode) of the latest step's passes, of which there were last_passes
    (1, or n_run in a fixed wave), for observers such as the benchmark, which keeps its own windows."""

    def __init__(self, model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto", head="eager"):
        if scheduler not in SCHEDULERS:
            raise UserError(f"--scheduler={scheduler!r}; allowed: {', '.join(SCHEDULERS)}", "scheduler")
        if head not in HEADS:
            raise UserError(f"--head={head!r}; allowed: {', '.join(HEADS)}", "head")
        self.model, self.U = model, model.config.n_loops
        self.device = model.lm_head.weight.device
        try:
            attn = resolve_impl(attn, self.device)       # "auto": the fastest paged attention on this device
        except ValueError as e:
            raise UserError(str(e), "attn")
        check_pool(model, kv_pages)
        self.pool = PagePool.for_model(model, kv_pages)
        self.scheduler = Scheduler(self.pool, self.U, max_batch, max_rows, scheduler)
        self.attn, self.finished, self.next_id = attn, [], 0
        self.stats = dict(passes=0, rows=0, preemptions=0, replayed_rows=0, max_in_flight=0, head_calls=0, head_rows=0)
        self.last_pass, self.last_passes = [], 0
        # the "shared" head: the exited rows whose tokens wait for a head call (HeadQueue), and the cost
        # model that decides how long: the weight bytes a block pass and a head call read (decode is
        # weight-bound: a call costs about the same for 1 row as for 8)
        self.head, self.pending = head, HeadQueue()
        self.w_block, self.w_head = weight_bytes(model)

    def add(self, r):
        """Queue a request after checking it. Raises UserError (nothing queued) if it is malformed
        or could never fit in the whole pool."""
        if self.scheduler.kind == "fixed":
            as_fixed(r, self.U)
        self.check_request(r)
        self.scheduler.waiting.append(Live(r, self.next_id))
        self.next_id += 1
        return r

    def check_request(self, r):
        check_request(r, self.model.config, self.pool.n_pages)

    def busy(self):
        return self.scheduler.busy()

    def run(self, requests):
        """Add requests and step until all have finished. Returns them."""
        for r in requests:
            self.add(r)
        while self.busy():
            self.step()
        return requests

    # ------------------------------------------------------------------ one step, in phases

    @torch.inference_mode()
    def step(self):
        """One pass of the block over every in-flight row, whatever its depth (App. A.2, continuous
        depth batching). Returns [(request, token)] sampled."""
        self._drop_cancelled()
        groups, pages = self._schedule()                  # admit, start groups, a fresh page per row and pass
        if not groups:                                     # nothing runs: the waiting rows take their head call
            return self._sample(self.pending.take())
        hn, gate, h_next = self._run_block(groups, pages)  # the shared block on every row, at its own depth
        survive, runs_on, to_sample = self._decide_exits(groups, gate)    # Eq. 4, each row with its τ
        self._alias_stopped(groups, runs_on, h_next, survive)   # Eq. 11: stopped rows alias their terminal page
        sampled = self._sample(self._head_rows(groups, [(g.live, hn[i]) for g, i in to_sample]))  # the LM head
        self._retire(groups)                               # positions done; finished requests free their pages
        return sampled

    def _drop_cancelled(self):
        for s in [s for s in self.scheduler.running + list(self.scheduler.waiting) if s.req.cancelled]:
            self._finish(s, "cancelled")

    def _schedule(self):
        """Start groups within the row budget, then give every in-flight row its page for its depth
        (in a fixed wave, for every depth it runs). Returns the groups, sorted: one-row groups
        (decode tokens) first, by position, as the padded attention tables want them, each with
        its rows of the batch (Group.rows); and the pages of every pass this step runs, one tensor
        per pass."""
        self._start_groups()
        batch = self._allocate()
        batch.sort(key=lambda gp: (len(gp[0].pos) > 1, gp[0].pos.tolist()[-1]))
        row = 0
        for g, p in batch:
            g.live.seq.write_pages(g.pos, slice(g.d, g.d + p.shape[1]), p)   # writes never go through an alias
            g.rows, row = slice(row, row + len(g.pos)), row + len(g.pos)
        groups = [g for g, _ in batch]
        n_pass = batch[0][1].shape[1] if batch else 0
        assert all(p.shape[1] == n_pass for _, p in batch), "a fixed wave runs every group to the same depth"
        self.last_pass = [(g.live.req, len(g.pos), g.start >= len(g.live.req.prompt)) for g in groups]
        self.last_passes = n_pass
        self.stats["passes"] += n_pass
        self.stats["rows"] += n_pass * row
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self.scheduler.running))
        return groups, [torch.cat([p[:, d] for _, p in batch]).to(self.device) for d in range(n_pass)]

    def _run_block(self, groups, pages):
        """One application of the block to every row: row r at position p_r and depth d_r writes
        its page and reads its request's table column d_r (RowsView). pages: one tensor per pass;
        a fixed wave runs all its passes here, the rows carrying their state from depth to depth
        with nothing decided in between, as Ouro's code runs its loops. Returns the normed states,
        the gate logits and the states passed to the next depth, of the last pass."""
        embed_new(self.model, groups, self.device)
        h = torch.cat([g.h for g in groups])
        cos, sin = self.model.rope(torch.cat([g.pos for g in groups]).to(self.device), h.dtype)
        for i, p in enumerate(pages):
            if i:
                for g in groups:
                    g.d += 1
            view = RowsView(self.pool, p, groups, self.attn, self.device)
            hn, gate, h = self.model.exit_heads(self.model.block(h[None], cos, sin, view)[0])
        return hn, gate, h

    def _decide_exits(self, groups, gate):
        """Eq. 4 online for every row with its request's τ, through model.exit_now (the rule of the
        references); a replayed row exits where it did before. Records each newly decided exit.
        Returns the updated Π(1-λ), per group whether each of its rows runs on, and the rows whose
        exit samples a token [(group, row of the batch)]."""
        survive = torch.cat([g.survive for g in groups])
        taus = torch.tensor([g.tau[k] for g in groups for k in g.offsets()], dtype=survive.dtype, device=survive.device)
        survive, hit = exit_now(survive, gate, taus)
        hit = hit.tolist()                                 # the decisions, on the host: one copy per step
        runs_on, to_sample = [], []
        for g in groups:
            last, mine = g.d == g.n_run - 1, []
            for row, k in zip(range(g.rows.start, g.rows.stop), g.offsets()):
                now = g.forced[k] == g.d + 1 if g.forced[k] else hit[row]
                if g.exits[k] == 0 and (now or last):
                    g.exits[k] = g.d + 1
                    if g.start + k == g.sample_pos:
                        to_sample.append((g, row))
                    mine.append(g.full[k] and not last)      # a full row (Dense prompt) runs on to depth U
                else:
                    mine.append(not last)
            runs_on.append(mine)
        return survive, runs_on, to_sample

    def _alias_stopped(self, groups, runs_on, h_next, survive):
        """Rows that stopped leave their group: their deeper table entries alias the page of the
        depth they stopped at (Eq. 11: A_d[i] = P_{i,min(d,e_i)}), so later reads find it at every
        deeper depth. The rows that run on carry their state to the next depth."""
        for g, mine in zip(groups, runs_on):
            if all(mine):
                g.h, g.survive = h_next[g.rows], survive[g.rows]
            elif any(mine):
                kept = torch.tensor(mine)
                stopped, g.pos = g.pos[~kept], g.pos[kept]
                dev = kept.to(self.device)
                g.h, g.survive = h_next[g.rows][dev], survive[g.rows][dev]
            else:                          # all stopped (a decode token's one row, most often): no indexing
                stopped, g.pos = g.pos, g.pos[:0]
            if not all(mine):
                g.live.seq.stop(stopped, g.d)
                keep_one_depth(g, stopped, self.U)
            g.d += 1

    def _head_rows(self, groups, exited):
        """The exited rows [(Live, normed state)] that take the LM head now. "eager": all of them.
        "shared": they join the waiting rows, and all go together when one has waited its limit,
        when nothing else would run next pass, or when waiting costs more than the call it saves.
        What a wait costs: while requests queue, each waiting row idles its slot of the batch (about
        w_block / max_batch a pass, against w_head for a call), so no row waits more than MAX_WAIT
        passes. With no queue, nothing, unless the waiting request ends up the last one to finish:
        then each pass it waited is one more pass of the batch (w_block). So rows wait only where a
        call costs more than a pass, and only while one more pass of waiting leaves their request
        short of the one that ends the batch (passes left, waits included); they wait for its row
        (at most U passes: it exits within U) and share its call."""
        if self.head == "eager" or self.scheduler.kind == "fixed":   # a fixed wave's rows all exit on its last pass
            return exited
        self.pending.join(exited)
        waits = self.pending.waits()
        if not waits:
            return []
        sched = self.scheduler
        others = (any(len(g.pos) for g in groups) or sched.waiting
                  or any(s.group is None and s.done < s.runnable() for s in sched.running))
        if sched.waiting:
            dear, limit = len(waits) * self.w_block >= self.w_head * sched.max_batch, MAX_WAIT
        else:
            left = {s: self._passes_left(s) for s in sched.running}
            end = max(left.values())
            dear = self.w_head < self.w_block or any(left[s] + w + 1 > end for s, w in waits)
            limit = self.U
        if others and not dear and max(w for _, w in waits) < limit:
            return []
        return self.pending.take()

    def _passes_left(self, s):
        """Passes a running request still needs: tokens to go x the passes each of its decode tokens
        took so far (its mean decode depth, plus what its rows waited for the head)."""
        total, n = s.decode_depths
        return (s.req.max_tokens - len(s.req.tokens)) * ((total + s.waited) / n if n else n_run(s.req, self.U))

    def _sample(self, rows):
        """The LM head on the rows [(Live, normed state)] whose exit samples their request's next
        token (one call for all), and the sampling, each request keyed by its seed and the position.
        Returns [(request, token)]."""
        if not rows:
            return []
        logits = self.model.lm_head(torch.stack([h for _, h in rows]))
        self.stats["head_calls"] += 1
        self.stats["head_rows"] += len(rows)
        greedy = logits.argmax(-1).tolist()                   # temperature 0, for every row in one call
        sampled = []
        for (s, _), lg, top in zip(rows, logits, greedy):
            r = s.req
            if r.keep_logits:
                r.logits.append(lg.detach().cpu())
            position = len(r.prompt) + len(r.tokens) - 1      # of the row that exited: keys the sampler's noise
            tok = top if r.temperature == 0 else sample_token(lg, r.temperature, r.top_k, r.top_p, r.seed, position)
            r.tokens.append(tok)
            sampled.append((r, tok))
            if r.on_token is not None:
                r.on_token(r, tok)
            if len(r.tokens) >= r.max_tokens or tok in r.stop:
                s.ending = True
                r.finish_reason = "stop" if tok in r.stop else "length"
                if s.group is None and s.done >= s.runnable():    # a row that waited: its positions are done
                    self._finish(s, r.finish_reason)
        return sampled

    def _retire(self, groups):
        """A group whose rows all stopped has finished its positions; a request whose last token is
        sampled and whose positions have all run is done."""
        for g in groups:
            s = g.live
            if len(g.pos) == 0 and s.group is g:
                new = g.exits[max(len(s.req.prompt), len(s.req.exits)) - g.start:]   # positions not recorded before
                s.decode_depths = [s.decode_depths[0] + sum(new), s.decode_depths[1] + len(new)]
                s.req.exits[g.start:g.start + g.size] = g.exits
                s.done = g.start + g.size
                s.group = None
                if s.ending and s.done >= s.runnable():
                    self._finish(s, s.req.finish_reason)

    # ------------------------------------------------------------------ what the scheduler hands over

    def _start_groups(self):
        """The scheduler's chunks become groups (a running request without rows gets its next one;
        a request admitted from the queue gets its page table first). `nested` starts groups only
        between waves; a `fixed` wave holds requests of one depth. When nothing can start and
        nothing runs, the pages are held by requests that need more: the newest is preempted."""
        in_flight = [s for s in self.scheduler.running if s.group is not None]
        if self.scheduler.kind == "nested" and in_flight:
            return
        rows = sum(len(s.group.pos) for s in in_flight)
        started = False
        for s, end in self.scheduler.chunks(rows, len(self.pool.free) - rows,   # in-flight rows take a page each
                                            lambda s: "chunk" if s.group is None else None):
            if s.seq is None:
                s.seq = RaggedSeq(self.pool, self.U, len(s.req.prompt) + s.req.max_tokens)
            s.group, started = self._new_group(s, end), True
        if not started and not in_flight and self.scheduler.running and not self.pending:
            self._evict()

    def _new_group(self, s, end):
        """Rows for positions s.done..end-1: replayed positions run to their recorded exits."""
        r = s.req
        taus, full, forced, keep = position_rules(r, s.done, end)
        if end > s.seq.n:
            s.seq.extend(end - s.seq.n)           # the sequence's table covers every position started
        ctx = r.prompt + r.tokens
        g = Group(s, s.done, ctx[s.done:end], taus, full, forced, keep, n_run(r, self.U))
        if end == len(ctx):                     # the newest token: its exit samples the next one
            g.sample_pos = end - 1
        self.stats["replayed_rows"] += sum(1 for f in forced if f)
        return g

    def _allocate(self):
        """A page for every in-flight row at its depth, oldest request first; on exhaustion the
        scheduler preempts the newest request and the engine tries again. The `fixed` scheduler
        runs waves: its rows take a page for every depth at once, and the step runs all their passes
        (Ouro's way: no row can exit early, and nothing joins a wave under way). The pages are taken
        in one piece (ragged.alloc_wave), so that a batch that starts together reads them in place.
        Returns [(group, its pages [rows, depths])]."""
        out, need, running = [], 0, self.scheduler.running
        for s in list(running):
            g = s.group
            if g is None:
                continue
            depths = range(g.d, g.n_run if self.scheduler.kind == "fixed" else g.d + 1)
            while s in running and s.group is g:      # all of a group's pages or none
                if need + len(g.pos) * len(depths) <= len(self.pool.free):
                    out.append((g, depths))
                    need += len(g.pos) * len(depths)
                    break
                self._evict()
        out = [(g, depths) for g, depths in out if g.live.group is g]
        return list(zip([g for g, _ in out], alloc_wave(self.pool, [(g.live.seq, g.pos, d) for g, d in out])))

    def _evict(self):
        """The pool ran dry: the request the scheduler hands back loses its pages, its rows and any
        of its rows waiting for the shared head (the replay on its return computes them again), or,
        alone and still too big, fails."""
        s, error = self.scheduler.evict()
        if error is not None:
            self._finish(s, "error", error)
            return
        self.pending.drop(s)
        s.evals_before += s.seq.block_evals
        s.seq.release()
        s.seq, s.group, s.done = None, None, 0      # s.req.exits stay: replayed on return
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ endings

    def _finish(self, s, reason, error=None):
        r = s.req
        self.pending.drop(s)
        if s.seq is not None:
            r.kv = dict(s.seq.stats(), block_evals=s.seq.block_evals + s.evals_before)
            s.seq.release()
            s.seq = None
        s.group, r.finish_reason, r.error = None, reason, error
        self.scheduler.remove(s)
        self.finished.append(r)
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    def fail_running(self, error):
        """After an unexpected error inside a step: end every admitted request with `error` and
        return its pages; waiting requests stay queued (they were not part of the step)."""
        for s in list(self.scheduler.running):
            self._finish(s, "error", error)

    def check(self):
        """Page invariants of the pool and of every live sequence (tests call it after every step)."""
        self.pool.check()
        running = self.scheduler.running
        for s in running:
            s.seq.check()
        for s in running:      # the running decode depth that _passes_left reads, against a recount
            dec = s.req.exits[len(s.req.prompt):]
            assert s.decode_depths == [sum(dec), len(dec)], (s.decode_depths, dec)
        held = sum(int(s.seq.real[:s.seq.n].sum()) for s in running)
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "serve with `python server.py --ckpt out/`, sample with `python sample.py --ckpt out/`, "
            "benchmark with `python -m lab.bench --what=engine`")

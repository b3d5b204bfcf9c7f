"""
The depth-queue decoder (App. A.2): the engine of continuous mixed-depth batching over one shared
Ragged-KV page pool: one host, and a runner that applies the block.

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
does; a request of mode fixed keeps its own depth, and sample.py and eval.py run that mode so).

Memory is capacity: one PagePool holds every request's pages, a RaggedSeq per request maps
(position, depth) to pages with aliases (Eq. 11), and admission reserves only what a prefill
chunk needs. When the pool runs out, the most recently admitted request is preempted (pages
freed, requeued); when it returns, its cache is rebuilt by a recomputation that replays the exit
depths it already had, so its continuation is exactly what it would have been.

One host, two runners. Engine is the host: admission and prompt chunks (scheduler.py), the page
budget and preemption, the exits each position decided, token delivery, endings, cancellation and
the checks, each written once. Its step reads as three phases, as nano-vllm's: schedule, run, take
what the run did. The runner applies the block to the rows and reports what each row did in a log
(rows.Log: per pass, the rows it ran and what each row said: its request, position, depth, the
exit it decided, the token it sampled, whether it stopped, whether its request's next token started
in its place), which the host reads
the same way whoever wrote it:
  * EagerRunner (below), the reference: Python groups of rows, a page taken pass by pass for the
    depth a row runs, every decision on the host at once, its log read at once; it alone runs the
    nested scheduler, the shared LM head and the Table 17 modes;
  * SlotRunner (slot_engine.py): the same pass on the device as a pure function of static buffers
    (slot_pass.py), compiled and captured as CUDA graphs, each decode row restarting in place with
    its token; it takes the pages of every depth of a position before it runs and hands back those
    past its exit, and its log arrives a few passes after the passes ran.
What differs by design is the runner's to say: which requests and schedulers it refuses, which
rows the host starts, how pages are taken and handed back, when results arrive. engine_for picks
the runner for a device.

The LM head runs on the rows whose exit samples a token. With a real vocabulary it weighs as much as
the block, so head="shared" lets exited rows wait a few passes to share one call while waiting is
cheaper than a call; the tokens are the same either way.

How each mode runs a request's tokens is modes.py; which requests run next, scheduler.py; a
request's record and its rows' paged reads, rows.py; the Request that callers fill in and read
back, request.py. The HTTP API over this engine is server.py; its benchmark is
`python -m lab.bench --what=engine`.
"""
import numpy as np
import torch

from configurator import UserError
from kernels import resolve_impl
from modes import as_fixed, check_request, n_run, position_rules
from model import exit_now
from ragged import PagePool, RaggedSeq, alloc_wave, memory_bytes, page_bytes
from request import sample_token
from rows import Group, HeadQueue, Live, Log, RowsView, Said, embed_new, keep_one_depth
from scheduler import SCHEDULERS, Scheduler
from slot_engine import SlotRunner
from slot_pass import can_capture

# When the LM head runs: "eager" on every pass where a row exits; "shared" lets exited rows wait to
# share one head call, while the cost model says waiting costs less than a call (with a queue, up to
# MAX_WAIT passes; with none, for the row of the request that ends the batch:
# EagerRunner._head_rows).
HEADS = ["eager", "shared"]
MAX_WAIT = 2
ENGINES = ["auto", "eager", "slots"]       # engine_for: the runner (slots: slot_engine.SlotRunner)


def check_pool(model, kv_pages):
    """A pool of kv_pages must fit the device's memory (UserError naming --kv_pages)."""
    need, have = kv_pages * page_bytes(model), memory_bytes(model.lm_head.weight.device)
    if need > have:
        raise UserError(f"--kv_pages={kv_pages}: a pool of {kv_pages} pages of "
                        f"{page_bytes(model) / 1024:.1f} KiB needs {need / 2**30:.1f} GiB; this "
                        f"machine has {have / 2**30:.1f} GiB", "kv_pages")


def weight_bytes(model):
    """The weights a pass of the block reads (all L layers) and those an LM-head call reads: the two
    prices of the weight-read cost model (decode is weight-bound at small batch)."""
    head = model.lm_head.weight
    return sum(p.numel() * p.element_size() for p in model.layers.parameters()), head.numel() * head.element_size()


# ----------------------------------------------------------------------------- the host

class Engine:
    """Continuous mixed-depth batching over one shared page pool: the host over a runner (runner:
    "eager", the reference EagerRunner, or "slots", slot_engine.SlotRunner, with its options). Call
    add() and step() from one thread (server.py runs them on an engine thread); Request.cancelled
    may be set from anywhere.

    The scheduler (scheduler.py) holds the queue and decides which chunks start and whom a dry pool
    costs; the host starts them on the runner and frees what it is handed back. stats counts what
    the engine did (passes in which a row ran, rows, preemptions, replayed rows, the most requests
    in flight, LM-head calls and the tokens they sampled; the slot runner adds its own)."""

    def __init__(self, model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto",
                 head="eager", runner="eager", **options):
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
        self.pool = PagePool.for_model(model, kv_pages, scratch=runner == "slots")
        self.scheduler = Scheduler(self.pool, self.U, max_batch, max_rows, scheduler)
        self.finished, self.next_id, self.early = [], 0, []
        self.stats = dict(passes=0, rows=0, preemptions=0, replayed_rows=0, max_in_flight=0, head_calls=0, head_rows=0)
        self.runner = (SlotRunner if runner == "slots" else EagerRunner)(self, attn, head, **options)

    def add(self, r):
        """Queue a request after checking it. Raises UserError (nothing queued) if it is malformed,
        could never fit in the whole pool, or asks for what this engine's runner leaves to another."""
        if self.scheduler.kind == "fixed":
            as_fixed(r, self.U)
        self.check_request(r)
        self.scheduler.waiting.append(Live(r, self.next_id))
        self.next_id += 1
        return r

    def check_request(self, r):
        check_request(r, self.model.config, self.pool.n_pages)
        self.runner.refuse(r)

    def busy(self):
        """Whether work is left: requests queued or running, or results the runner still holds."""
        return self.scheduler.busy() or bool(self.early) or self.runner.busy()

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
        """Schedule, run, take what the run did: start the chunks the scheduler hands over
        (admitting requests, preempting when the pool runs dry), let the runner apply the block
        (App. A.2: every in-flight row, whatever its depth), then read its log: exits, tokens,
        Eq. 11 on the host's tables, endings. Returns [(request, token)] delivered."""
        sampled, self.early = self.early, []
        self._drop_cancelled()
        self._start_chunks()                     # admit, start prompt, replay and decode chunks
        return sampled + self._take(self.runner.run())

    def _drop_cancelled(self):
        for s in [s for s in self.scheduler.running + list(self.scheduler.waiting) if s.req.cancelled]:
            self._finish(s, "cancelled")

    def _start_chunks(self):
        """The scheduler's chunks, started on the runner (a request admitted from the queue gets its
        page table first; `nested` starts chunks only between waves). When nothing can start and no
        row runs, the pages are held by requests that need more: the newest is preempted."""
        sched = self.scheduler
        if sched.kind == "nested" and any(s.rows for s in sched.running):
            return
        rows, free = self.runner.budget()
        started = False
        for s, end in sched.chunks(rows, free, self.runner.ready, self.runner.wave()):
            if s.seq is None:
                s.seq = RaggedSeq(self.pool, self.U, len(s.req.prompt) + s.req.max_tokens)
                self.runner.admit(s)
            if self.runner.start(s, end):
                s.started, s.rows, started = end, end - s.done, True
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(sched.running))
        if not started and self.runner.idle() and sched.running:
            self._evict()

    def _take(self, logs):
        """What the runner's passes did, pass by pass (rows.Log): each decided exit kept until its
        position is done (a replayed position keeps the one it had), each stopped row counted off,
        each token delivered, each restart in place noted; after each pass the requests it touched
        settle (their positions done, their end: a request cancelled or ended in a pass takes
        nothing from the passes after it); at the end the stops go into the host's tables (Eq. 11).
        Returns [(request, token)] delivered."""
        sampled, stopped = [], set()
        for log in logs:
            # rows of the requests that still run
            ran = sum(n for s, n in log.ran if s.seq is not None)
            self.stats["passes"] += ran > 0
            self.stats["rows"] += ran
            touched = set()
            for s, pos, depth, exit, tok, stop, go, logits in log.said:
                if s.seq is None:                                     # ended or preempted since
                    continue
                if exit and pos >= len(s.req.exits):
                    s.exits[pos] = exit
                if stop:
                    s.stops.append((pos, depth - 1))
                    s.rows -= 1
                    stopped.add(s)
                if tok >= 0 and not s.req.cancelled:
                    sampled.append(self._deliver(s, tok, logits))
                # its positions so far are done; the next one runs in the row's place
                if go:
                    s.rows, s.done, s.started = s.rows + 1, pos + 1, pos + 2
                touched.add(s)
            for s in touched:
                self._settle(s)
        for s in [s for s in self.scheduler.running if s.req.cancelled]:
            self._finish(s, "cancelled")
        for s in stopped:
            if s.seq is not None:
                self._alias(s)
        return sampled

    def _deliver(self, s, tok, logits):
        """A sampled token to its request: callbacks, and its end (max_tokens or a stop id)."""
        r = s.req
        if r.keep_logits:
            r.logits.append(logits)
        r.tokens.append(tok)
        self.stats["head_rows"] += 1
        if r.on_token is not None:
            r.on_token(r, tok)
        if len(r.tokens) >= r.max_tokens or tok in r.stop:
            s.ending = True
            r.finish_reason = "stop" if tok in r.stop else "length"
        return r, tok

    def _settle(self, s):
        """A request whose rows have all finished has done its positions: their exits join req.exits
        (the decode ones counted for the shared head's cost model), and it ends if its last token is
        sampled; a cancelled one ends now."""
        r = s.req
        if s.rows == 0:
            s.done = s.started
        while len(r.exits) < s.done:
            e = s.exits.pop(len(r.exits))
            if len(r.exits) >= len(r.prompt):
                s.decode_depths = [s.decode_depths[0] + e, s.decode_depths[1] + 1]
            r.exits.append(e)
        if s.rows == 0 and s.ending and s.done >= s.runnable():
            self._finish(s, r.finish_reason)
        elif r.cancelled:
            self._finish(s, "cancelled")

    def _alias(self, s):
        """Eq. 11 on the host's table for the rows of s that stopped: their deeper entries alias the
        page of the depth they stopped at (after the runner takes back any page it took ahead)."""
        if s.stops:
            pos, depth = torch.from_numpy(np.array(s.stops, dtype=np.int64).T)
            self.runner.hand_back(s, pos, depth)
            s.seq.stop(pos, depth)
            s.stops = []

    # ------------------------------------------------------------------ preemption and endings

    def _evict(self):
        """The pool ran dry: the request the scheduler hands back loses its pages and its rows (the
        replay on its return computes them again from its exits so far), or, alone and still too
        big, ends where it is with the tokens it has (finish reason "length", Request.note says why)."""
        s, cut = self.scheduler.evict()
        if cut is not None:                # alone and still too big: it ends here, its tokens kept
            s.req.note = cut
            self._finish(s, "length")
            return
        self._alias(s)
        self.runner.drop(s)
        s.evals_before += s.seq.block_evals
        s.seq.release()
        s.preempted()
        self.stats["preemptions"] += 1

    def _finish(self, s, reason, error=None):
        r = s.req
        if s.seq is not None:
            self._alias(s)
            self.runner.drop(s)
            r.kv = dict(s.seq.stats(), block_evals=s.seq.block_evals + s.evals_before)
            s.seq.release()
            s.seq = None
        r.finish_reason, r.error = reason, error
        self.scheduler.remove(s)
        self.finished.append(r)
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    def fail_running(self, error, queued=False):
        """After an unexpected error inside a step: end every admitted request with `error` and
        return its pages; waiting requests stay queued (they were not part of the step), unless
        `queued` (a server's stop: every request ends)."""
        for s in list(self.scheduler.running) + (list(self.scheduler.waiting) if queued else []):
            self._finish(s, "error", error)

    def check(self):
        """Page invariants of the pool and of every live sequence, the running decode depths against
        a recount, and the runner's own (tests call it after every step). The results of passes not
        read yet are read first (the next step returns their tokens)."""
        with torch.inference_mode():
            self.early += self._take(self.runner.flush())
        self.pool.check()
        running = self.scheduler.running
        for s in running:
            s.seq.check()
            dec = s.req.exits[len(s.req.prompt):]
            assert s.decode_depths == [sum(dec), len(dec)], (s.decode_depths, dec)
        held = sum(int(s.seq.real[:s.seq.n].sum()) for s in running)
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"
        self.runner.check()


def engine_for(model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto",
               head="auto", engine="auto", sampling=None):
    """The engine for this device. "auto": the slot runner with CUDA graphs where graphs can be
    captured (a GPU), where the eager runner waits on the host; the eager runner on a CPU, where it
    is the faster (it gathers only the keys each row reads; docs/benchmarks.md), and for what the
    slot runner leaves to it (the nested scheduler, the shared LM head, the Table 17 modes:
    --engine=eager). head "auto": the runner's own, eager on the slot runner (it runs the head on
    every pass), shared on the eager one. sampling: the draws the slot runner captures when it
    starts (slot_pass.SAMPLING; a script that knows its requests' names theirs)."""
    if engine not in ENGINES:
        raise UserError(f"--engine={engine!r}; allowed: {', '.join(ENGINES)}", "engine")
    if engine == "auto":
        graphs = can_capture(model.lm_head.weight.device)
        engine = "slots" if graphs and scheduler != "nested" and attn != "flex" and head != "shared" else "eager"
    if head == "auto":
        head = "eager" if engine == "slots" else "shared"
    options = {"sampling": sampling} if engine == "slots" and sampling else {}
    return Engine(model, kv_pages, max_batch, max_rows, scheduler, attn, head, engine, **options)


# ----------------------------------------------------------------------------- the eager runner

class EagerRunner:
    """The reference runner: a request's rows in flight are a Group (rows.py) on the host; a pass
    takes a fresh page for every row at the depth it runs, applies the block to every row (RowsView:
    each reads its request's table column at its own depth), decides the exits (Eq. 4) at once and
    samples at once (or lets exited rows wait for a shared head call), and its log is the host's at
    the end of the step. The host starts every position, decode tokens included. Free of device
    ideas: no buckets, no pages taken ahead, no log ring, no graphs."""

    def __init__(self, engine, attn, head):
        self.e, self.model, self.U, self.device = engine, engine.model, engine.U, engine.device
        self.attn, self.head, self.pending = attn, head, HeadQueue()
        # the "shared" head's cost model: the weight bytes a block pass and a head call read (decode
        # is weight-bound: a call costs about the same for 1 row as for 8)
        self.w_block, self.w_head = weight_bytes(self.model)
        # (request, rows, is decode) of the last step's passes, and how many
        self.last_pass, self.last_passes = [], 0

    # ------------------------------------------------------------------ what differs by design

    def refuse(self, r):
        """The eager runner runs every request."""

    def ready(self, s):
        """A request whose rows have all finished may start its next chunk (a decode token too)."""
        return "chunk" if s.rows == 0 else None

    def budget(self):
        """Rows in flight, and the pages left for new chunks: every row in flight takes one next pass."""
        rows = sum(s.rows for s in self.e.scheduler.running)
        return rows, len(self.e.pool.free) - rows

    def wave(self):
        return None                       # a fixed wave runs all its passes within one step

    def admit(self, s):
        pass

    def start(self, s, end):
        """Rows for positions s.done..end-1 (replayed positions run to their recorded exits)."""
        r = s.req
        taus, full, forced, keep = position_rules(r, s.done, end)
        if end > s.seq.n:
            s.seq.extend(end - s.seq.n)           # the sequence's table covers every position started
        ctx = r.prompt + r.tokens
        s.group = Group(s, s.done, ctx[s.done:end], taus, full, forced, keep, n_run(r, self.U))
        if end == len(ctx):                     # the newest token: its exit samples the next one
            s.group.sample_pos = end - 1
        self.e.stats["replayed_rows"] += sum(1 for f in forced if f)
        return True

    def idle(self):
        return not any(s.rows for s in self.e.scheduler.running) and not self.pending

    def hand_back(self, s, pos, depth):
        """Pages are taken pass by pass: none was taken ahead."""

    def drop(self, s):
        self.pending.drop(s)
        s.group = None

    def busy(self):
        return False

    def flush(self):
        return []

    def check(self):
        pass

    # ------------------------------------------------------------------ one pass, in phases

    def run(self):
        """One pass of the block over every in-flight row, whatever its depth (App. A.2; a fixed wave:
        all its passes), the exits (Eq. 4), and the LM head. Returns its Logs (rows.Log, one a pass)."""
        groups, pages = self._allocate()                   # a fresh page per row and pass
        if not groups:                                     # nothing runs: the waiting rows take their head call
            return self._log([], [None], self._sample(self.pending.take())) if self.pending else []
        hn, gate, h_next = self._run_block(groups, pages)  # the shared block on every row, at its own depth
        rows = self._decide_exits(groups, gate, h_next)    # Eq. 4, each row with its τ; stopped rows leave
        exited = [(g.live, pos, hn[i]) for g, pos, i, newly, _ in rows if newly and pos == g.sample_pos]
        tokens = self._sample(self._head_rows(groups, exited))    # the LM head
        for g in groups:
            if len(g.pos) == 0:
                g.live.group = None
        return self._log(rows, pages, tokens)

    def _allocate(self):
        """A page for every in-flight row at its depth, oldest request first; on exhaustion the
        host preempts the newest request and the runner tries again. The `fixed` scheduler runs
        waves: its rows take a page for every depth at once, and the step runs all their passes
        (Ouro's way: no row can exit early, and nothing joins a wave under way). The pages are taken
        in one piece (ragged.alloc_wave), so that a batch that starts together reads them in place.
        Returns the groups, sorted (one-row groups, decode tokens, first, by position, as the padded
        attention tables want them), each with its rows of the batch (Group.rows), and the pages of
        every pass, one tensor per pass."""
        fixed, out, need, running = self.e.scheduler.kind == "fixed", [], 0, self.e.scheduler.running
        for s in list(running):
            g = s.group
            if g is None:
                continue
            depths = range(g.d, g.n_run if fixed else g.d + 1)
            while s in running and s.group is g:      # all of a group's pages or none
                if need + len(g.pos) * len(depths) <= len(self.e.pool.free):
                    out.append((g, depths))
                    need += len(g.pos) * len(depths)
                    break
                self.e._evict()
        out = [(g, depths) for g, depths in out if g.live.group is g]
        batch = list(zip([g for g, _ in out], alloc_wave(self.e.pool, [(g.live.seq, g.pos, d) for g, d in out])))
        batch.sort(key=lambda gp: (len(gp[0].pos) > 1, gp[0].pos.tolist()[-1]))
        row = 0
        for g, p in batch:
            g.live.seq.write_pages(g.pos, slice(g.d, g.d + p.shape[1]), p)   # writes never go through an alias
            g.rows, row = slice(row, row + len(g.pos)), row + len(g.pos)
        n_pass = batch[0][1].shape[1] if batch else 0
        assert all(p.shape[1] == n_pass for _, p in batch), "a fixed wave runs every group to the same depth"
        groups = [g for g, _ in batch]
        self.last_pass = [(g.live.req, len(g.pos), g.start >= len(g.live.req.prompt)) for g in groups]
        self.last_passes = n_pass
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
            view = RowsView(self.e.pool, p, groups, self.attn, self.device)
            hn, gate, h = self.model.exit_heads(self.model.block(h[None], cos, sin, view)[0])
        return hn, gate, h

    def _decide_exits(self, groups, gate, h_next):
        """Eq. 4 online for every row with its request's τ, through model.exit_now (the rule of the
        references), over per-row tensors as the slot pass decides (slot_pass.decide_exits): a replayed
        row exits where it did before, the last depth always exits, a full row (Ouro mode, a
        Dense-Ragged prompt) runs on to its last depth after its exit. The rows that run on carry their
        state to the next depth; the others leave their group (Table 17's rows keep one depth from
        then on). Returns per row of the batch (group, position, row, newly exited, stopped)."""
        offsets = [(g, g.offsets()) for g in groups]      # the groups' host lists, row by row of the batch
        tau = torch.from_numpy(np.array([g.tau[k] for g, ks in offsets for k in ks], dtype=np.float64))
        forced, decided, full, depth, last = torch.from_numpy(np.array(
            [[g.forced[k], g.exits[k], g.full[k], g.d, g.d == g.n_run - 1] for g, ks in offsets for k in ks],
            dtype=np.int64).T)
        full, last = full.bool(), last.bool()
        survive = torch.cat([g.survive for g in groups])
        survive, hit = exit_now(survive, gate, tau.to(gate.device, gate.dtype))
        hit = torch.where(forced > 0, forced == depth + 1, hit.cpu())   # the decisions, on the host: one copy
        newly = (decided == 0) & (hit | last)
        runs_on = torch.where(newly, full & ~last, ~last)
        rows, newly, runs_on_list = [], newly.tolist(), runs_on.tolist()
        for g, ks in offsets:
            mine = runs_on[g.rows]
            for i, (k, pos) in enumerate(zip(ks, g.pos.tolist())):
                row = g.rows.start + i
                if newly[row]:
                    g.exits[k] = g.d + 1
                rows.append((g, pos, row, newly[row], not runs_on_list[row]))
            going = runs_on_list[g.rows]
            if all(going):                # every row runs on (no mask to index with)
                g.h, g.survive = h_next[g.rows], survive[g.rows]
            elif any(going):
                stopped, g.pos = g.pos[~mine], g.pos[mine]
                keep_one_depth(g, stopped, self.U)
                dev = mine.to(self.device)
                g.h, g.survive = h_next[g.rows][dev], survive[g.rows][dev]
            else:                         # all stopped (a decode token's one row, most often)
                keep_one_depth(g, g.pos, self.U)
                g.pos = g.pos[:0]
            g.d += 1
        return rows

    def _log(self, rows, pages, tokens):
        """The step's Logs: a pass's rows (a fixed wave: its passes, the rows at every depth, their
        exits in the last), and the tokens sampled, each at its row (a row that waited for a shared
        head call: an entry of its own, at depth 0)."""
        sampled = {(s, pos): (tok, lg if s.req.keep_logits else None) for s, pos, tok, lg in tokens}
        said = []
        for g, pos, _, newly, stopped in rows:          # g.d: the 1-based depth of the last pass
            tok, lg = sampled.pop((g.live, pos), (-1, None))
            if newly or stopped or tok >= 0:
                said.append(Said(g.live, pos, g.d, g.d if newly else 0, tok, stopped, False, lg))
        said += [Said(s, pos, 0, 0, tok, False, False, lg)
                 for (s, pos), (tok, lg) in sampled.items()]
        ran = {}
        for g, *_ in rows:
            ran[g.live] = ran.get(g.live, 0) + 1
        return [Log(list(ran.items()), [])] * (len(pages) - 1) + [Log(list(ran.items()), said)]

    def _head_rows(self, groups, exited):
        """The exited rows [(Live, position, normed state)] that take the LM head now. "eager": all
        of them. "shared": they join the waiting rows, and all go together when one has waited its
        limit, when nothing else would run next pass, or when waiting costs more than the call it
        saves. What a wait costs: while requests queue, each waiting row idles its slot of the batch
        (about w_block / max_batch a pass, against w_head for a call), so no row waits more than
        MAX_WAIT passes. With no queue, nothing, unless the waiting request ends up the last one to
        finish: then each pass it waited is one more pass of the batch (w_block). So rows wait only
        where a call costs more than a pass, and only while one more pass of waiting leaves their
        request short of the one that ends the batch (passes left, waits included); they wait for
        its row (at most U passes: it exits within U) and share its call."""
        # a fixed wave's rows all exit on its last pass
        if self.head == "eager" or self.e.scheduler.kind == "fixed":
            return exited
        self.pending.join(exited)
        waits = self.pending.waits()
        if not waits:
            return []
        sched = self.e.scheduler
        others = (any(len(g.pos) for g in groups) or sched.waiting
                  or any(s.group is None and s.done < s.runnable() for s in sched.running))
        if sched.waiting:
            dear, limit = len(waits) * self.w_block >= self.w_head * sched.max_batch, MAX_WAIT
        else:
            left = {s: self._passes_expected(s) for s in sched.running}
            end = max(left.values())
            dear = self.w_head < self.w_block or any(left[s] + w + 1 > end for s, w in waits)
            limit = self.U
        if others and not dear and max(w for _, w in waits) < limit:
            return []
        return self.pending.take()

    def _passes_expected(self, s):
        """Passes a running request is expected to need still (an estimate, where the slot runner's
        passes_left is a bound): tokens to go x the passes each of its decode tokens took so far
        (its mean decode depth, plus what its rows waited for the head)."""
        total, n = s.decode_depths
        return (s.req.max_tokens - len(s.req.tokens)) * ((total + s.waited) / n if n
                                                         else n_run(s.req, self.U))

    def _sample(self, rows):
        """The LM head on the rows [(Live, position, normed state)] whose exit samples their
        request's next token (one call for all), and the sampling, each request keyed by its seed
        and the position. Returns [(Live, position, token, logits)]."""
        if not rows:
            return []
        logits = self.model.lm_head(torch.stack([h for _, _, h in rows]))
        self.e.stats["head_calls"] += 1
        # temperature 0, for every row in one call
        greedy = logits.argmax(-1).tolist()
        out = []
        for (s, pos, _), lg, top in zip(rows, logits, greedy):
            r = s.req
            tok = top if r.temperature == 0 else sample_token(lg, r.temperature, r.top_k, r.top_p,
                                                              r.seed, pos)
            out.append((s, pos, tok, lg.detach().cpu()))
        return out


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "serve with `python server.py --ckpt out/`, sample with `python sample.py "
            "--ckpt out/`, benchmark with `python -m lab.bench --what=engine`")

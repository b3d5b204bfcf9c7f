"""
The depth-batching engine over one graph-captured pass: the host that drives slot_pass.run_pass.

serve_depthbatch.Engine is the reference: Python lists of rows, a page table per request on the
host, decisions taken row by row. On a GPU that costs more than the work itself: every pass reads
values back to the host (which rows exited, which tokens were sampled) and launches about fifty
small kernels a layer, so the GPU waits on the host. SlotEngine keeps the Engine's rules and
results (the same tokens, exits of every position, pages and passes; test_slots.py checks it in
float64) and keeps its state on the device, in slot_pass.Slots:

  * one row slot per row. A decode row whose exit samples a token restarts in place at depth 1 with
    that token on the next pass, so the rows change only when requests come and go;
  * the page tables live on the device; the host reserves the pages of every depth of a position
    before it runs and takes back those past its exit;
  * the pass writes what it decided to a log; the host reads it once every few passes and keeps what
    belongs to the host: admission, page ownership and reservation, preemption and replay, the
    requests' tokens and callbacks.

On CUDA the pass is compiled whole (slot_pass.compiled_pass) and every bucket of rows (2, 4, 8, ...)
is captured as a CUDA graph when the engine starts, then replayed; between replays the host's writes
travel in one copy (slot_pass.Upload). What the pass does not cover stays with the Engine: the nested
scheduler, the shared LM head, the Table 17 caches. engine_for picks the engine for a device.

A request's record here is rows.Seat; the queue and admission are scheduler.py's, as the Engine's
are; the graphs are slot_pass.Graphs. Read top to bottom: the engine (its interface, what the host
decides between passes, the passes and their log, endings); engine_for.
"""

import torch

from configurator import UserError
from kernels import resolve_impl, splits_for
from modes import as_fixed, check_request, decode_rule, keeps_one_depth, n_run, position_rules
from ragged import PagePool, RaggedSeq
from request import seed_bits
from scheduler import Scheduler, passes_left, passes_sure, surely_done
from serve_depthbatch import Engine, check_pool
from rows import Seat
from slot_pass import (LOG, ROWS, SAMPLING, Download, Graphs, Slots, Upload, bucket, can_capture, compiled_pass,
                       run_pass, sampling_kind)

SCHEDULERS = ["continuous", "fixed"]        # the Engine's, but nested (a wave is a host loop)
ENGINES = ["auto", "eager", "slots"]       # engine_for: this engine or serve_depthbatch.Engine


# ----------------------------------------------------------------------------- the host

class SlotEngine:
    """The Engine's interface and rules (serve_depthbatch.Engine: add, step, run, busy, check, stats,
    finished), over Slots and run_pass. A step applies the host's decisions, runs `sync_every` passes
    (one when a decision may be due: requests wait, or a prompt has chunks to go) and reads their log.

    Where it departs from the Engine, by design: pages are reserved for every depth of a position
    before it runs (the device decides the exits) and returned at its exit, so a tight pool preempts
    earlier; a fixed wave holds requests of one depth until they finish; the nested scheduler, the
    shared head and the Table 17 modes are the Engine's alone. graphs: capture every bucket as a CUDA
    graph when the engine starts, for each of the `sampling` kinds (slot_pass.SAMPLING; a kind left out
    is captured on its first use); fuse: compile the pass whole (compiled_pass); "auto": both on CUDA.
    The model's projections are stacked (four GEMMs a layer: LoopedLM.fuse_projections)."""

    def __init__(self, model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto",
                 sync_every=8, graphs="auto", fuse="auto", overlap=True, keep_logits=False, n_stop=8,
                 sampling=SAMPLING):
        if scheduler not in SCHEDULERS:
            raise UserError(f"--scheduler={scheduler!r}; allowed with the slot engine: {', '.join(SCHEDULERS)} "
                            "(the nested scheduler runs on --engine=eager)", "scheduler")
        # the engine's model is frozen: no parameter that requires grad reaches a compiled pass (autograd
        # would trace a joint graph, and the survive update of Eq. 4 in place would fail it)
        self.model, self.U = model.requires_grad_(False).fuse_projections(), model.config.n_loops
        self.device = model.lm_head.weight.device
        try:
            attn = resolve_impl(attn, self.device)
        except ValueError as e:
            raise UserError(str(e), "attn")
        if attn == "flex":
            raise UserError("--attn=flex builds its mask on the host; the slot engine reads torch or triton", "attn")
        check_pool(model, kv_pages)
        self.pool = PagePool.for_model(model, kv_pages, scratch=True)
        self.scheduler = Scheduler(self.pool, self.U, max_batch, max_rows, scheduler)
        self.attn = attn
        self.sync_every, self.head = sync_every, "eager"          # the LM head runs on every pass
        n_keys = model.config.block_size
        self.slots = Slots(model, self.pool, max_rows + 2 * max_batch, max_batch, n_keys, max(sync_every, self.U),
                           n_stop, keep_logits)
        self.n_splits = lambda R: splits_for(R * model.config.n_kv_head, n_keys, 32) if attn == "triton" else 1
        capture = can_capture(self.device)
        self.graphs = Graphs(self.slots.buffers) if (capture if graphs == "auto" else graphs) else None
        self.fuse = capture if fuse == "auto" else fuse
        self.upload = Upload(self.device)
        self.finished = []
        self.by_slot, self.free_slots = [None] * max_batch, list(range(max_batch - 1, -1, -1))
        self.next_id = 0
        # the host's copy of the rows, as of the last log read and its own writes since: which are live
        # (running or holding a token), of which request slot, how many run; and what it will write
        self.live = torch.zeros(self.slots.R, dtype=torch.bool)
        self.row_req = torch.full((self.slots.R,), max_batch, dtype=torch.long)
        self.slots_active, self.R_now = 0, 2
        self.restarted = set()                                         # seats the device restarted in the last pass
        self._admits, self._rows, self._pages, self._perm = [], [], [], None     # the host's writes of this step
        # passes whose log is not read yet (see step), and the copies to the host that it reads
        self.overlap, self.ticket, self.download = overlap, None, Download(self.device)
        # passes: those in which a row ran (the Engine's count); launched: all, idle ones too; waits: log reads
        # that waited for the device
        self.stats = dict(passes=0, rows=0, preemptions=0, replayed_rows=0, max_in_flight=0, head_calls=0, head_rows=0,
                          launched=0, waits=0)
        self.passes_run, self.read_early = 0, []
        if self.graphs is not None:       # every kind of pass it runs, now: serving never stalls on a first use
            buckets = sorted({bucket(n, self.slots.R) for n in range(1, self.slots.R + 1)})
            heads = (True,) if scheduler != "fixed" or self.U == 1 else (False, True)     # a fixed wave: both
            self.graphs.capture_all([(R, n_keys, h, k) for R in buckets for h in heads for k in sampling], self._pass)

    # ------------------------------------------------------------------ the Engine's interface

    def add(self, r):
        """Queue a request after checking it (UserError, nothing queued, if it is malformed, could never
        fit the pool, or asks for what this engine leaves to the Engine)."""
        if self.scheduler.kind == "fixed":
            as_fixed(r, self.U)
        self.check_request(r)
        self.scheduler.waiting.append(Seat(r, self.next_id))
        self.next_id += 1
        return r

    def check_request(self, r):
        check_request(r, self.model.config, self.pool.n_pages)
        if keeps_one_depth(r):
            raise UserError(f"mode={r.mode}: the Table 17 caches run on the eager engine (--engine=eager)", "mode")
        if len(r.stop) > self.slots.stop_ids.shape[1]:
            raise UserError(f"stop: {len(r.stop)} stop ids; this engine takes at most {self.slots.stop_ids.shape[1]}",
                            "stop")
        if r.keep_logits and self.slots.logits is None:
            raise UserError("keep_logits: build the engine with keep_logits=True", "keep_logits")

    run = Engine.run                             # the eager engine's: add, then step until not busy

    def busy(self):
        """Whether work is left: requests queued or running, or tokens that check() read for the next
        step to return."""
        return self.scheduler.busy() or bool(self.read_early)

    @torch.inference_mode()
    def step(self):
        """Apply the host's decisions, run a few passes on the device, read a log. While no decision
        can be due (nothing waits, no prompt chunk is to start), the log of these passes is read at
        the next step, while the next passes run, so that the device never waits on the host; else
        at once. Returns [(request, token)] sampled in the passes whose log was read."""
        sampled, self.read_early = self.read_early, []
        if self.ticket is not None and self._due():
            sampled += self._read_log(self.ticket)             # know the state before deciding
            self.ticket = None
        self._drop_cancelled()
        waves = self._schedule()                               # admit, start prompt chunks, reserve pages, preempt
        ticket = self._run(waves) if waves else None           # the passes: graph replays on CUDA
        if self.ticket is not None:
            sampled += self._read_log(self.ticket)             # the previous passes, while these run
        self.ticket = ticket
        if ticket is not None and (self._due() or not self.overlap):
            sampled += self._read_log(ticket)
            self.ticket = None
        return sampled

    def _due(self):
        """Whether the host may have to decide something after the next pass: a request waits, or a
        prompt (or replay) has chunks to start."""
        return bool(self.scheduler.waiting) or any(s.done < s.host_end for s in self.scheduler.running)

    # ------------------------------------------------------------------ what the host decides between passes

    def _schedule(self):
        """Start prompt (and replay) chunks and admit waiting requests by the Engine's rules, reserve
        the pages the coming passes may write, choose the bucket. Returns the passes to run, as
        waves: tuples of head flags, each run as one graph (a fixed wave: the head on its last pass
        only; otherwise one pass, the head on)."""
        self._start_chunks()
        pending = len(self.ticket[0]) if self.ticket is not None else 0      # passes run but not read yet
        running = self.scheduler.running
        if not self.live.any() or (pending and all(surely_done(s, pending, self.U) for s in running)):
            return []
        due = self._due()
        if self.scheduler.kind == "fixed":  # every live row starts a wave at depth 1, all of one depth
            m = self._wave_depth()
            most = max(passes_left(s, pending, self.U) for s in running)       # exact: a wave runs a whole token
            waves = [(False,) * (m - 1) + (True,)] * (1 if due else max(1, min(self.slots.log_len, most) // m))
        else:
            sure = max(passes_sure(s, pending, self.U) for s in running)       # no pass without a row in it
            if pending and sure <= 0:
                return []                                                     # read the log first
            waves = [(True,)] * (1 if due else max(1, min(self.sync_every, sure)))
        self._reserve_ahead(pending + sum(len(w) for w in waves))
        if self.scheduler.waiting:                    # a preemption left a request waiting: decide again after one wave
            waves = waves[:1]
        self._choose_bucket(due=due)
        self._flush()
        return waves if self.live.any() else []

    def _start_chunks(self):
        """The scheduler's chunks over the slots (as Engine._start_groups): a running request whose
        rows have all finished and whose next positions the host starts (a prompt or replay chunk)
        gets its next chunk, a request admitted from the queue its request slot first. The device
        already started the decode tokens (restarts): like the Engine's decode chunks, each counts
        against the budget of the requests after it."""
        sched = self.scheduler
        self.restarted &= set(sched.running)
        wave = self._wave_depth() if sched.kind == "fixed" and self.live.any() else None
        ready = lambda s: ("started" if s in self.restarted else
                           None if s.rows or s.holding or s.done >= s.host_end else "chunk")
        started = bool(self.restarted)
        for s, end in sched.chunks(self.slots_active - len(self.restarted), len(self.pool.free), ready, wave):
            if s.seq is None:
                self._admit(s)
            self._start_chunk(s, end)
            started = True
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(sched.running))
        if not started and not self.live.any() and sched.running:
            self._evict()                   # nothing can start: the pages are held by requests that need more

    def _wave_depth(self):
        """The depth of the fixed wave under way: that of the request of any live row."""
        return n_run(self.by_slot[int(self.row_req[self.live][0])].req, self.U)

    def _admit(self, s):
        """A request slot for s, filled with what its decode rows need on the device."""
        r, st = s.req, self.slots
        s.slot = self.free_slots.pop()
        self.by_slot[s.slot] = s
        s.seq = RaggedSeq(self.pool, self.U, len(r.prompt) + r.max_tokens)
        s.host_end = len(r.prompt) + len(r.tokens) - (1 if s.ending else 0)
        tau, full = decode_rule(r)
        stop = list(r.stop) + [-1] * (st.stop_ids.shape[1] - len(r.stop))
        self._admits.append((s.slot, dict(ntok=len(r.tokens), max_tok=r.max_tokens, dec_n_run=n_run(r, self.U),
                                          horizon=-1, stop_ids=stop, dec_tau=tau, dec_full=full, ended=s.ending,
                                          seed=seed_bits(r.seed), top_k=r.top_k, temperature=r.temperature,
                                          top_p=r.top_p)))

    def _start_chunk(self, s, end):
        """Rows for positions s.done..end-1 (replayed positions run to their recorded exits), with the
        pages of every depth they may run; the last position of the context samples the next token."""
        r, start, m = s.req, s.done, n_run(s.req, self.U)
        if not self._reserve(s, start, end - 1):
            return
        taus, full, forced, _ = position_rules(r, start, end)
        ctx = r.prompt + r.tokens
        free_rows = (~self.live).nonzero()[:, 0]
        assert len(free_rows) >= end - start, "more rows in flight than row slots"
        idx = free_rows[:end - start]
        self._rows.append((idx, dict(tok=ctx[start:end], pos=list(range(start, end)), depth=0, req=s.slot, n_run=m,
                                     forced=forced, exit=0, pend=-1, tau=taus, full=full, active=True,
                                     sample=[p == len(ctx) - 1 for p in range(start, end)], fresh=True, hold=False)))
        self.live[idx], self.row_req[idx] = True, s.slot
        self.slots_active += end - start
        s.started, s.rows = end, end - start
        self.stats["replayed_rows"] += sum(1 for f in forced if f)

    def _reserve_ahead(self, n_passes):
        """Pages for every position a decode row may reach in the coming passes (a row starts at most
        one position a pass), every depth it may run; the oldest requests first. When the pool runs dry
        the newest request is preempted, as in the Engine."""
        for s in list(self.scheduler.running):
            if s not in self.scheduler.running or s.ending or s.started < s.host_end:
                continue
            self._reserve(s, s.reserved + 1, min(s.started - 1 + n_passes, s.last_position()))

    def _reserve(self, s, first, last):
        """Pages for positions first..last at every depth s may run, in its host table and (at the next
        flush) in its device table; the device restarts a row only where pages are reserved. When the
        pool runs dry the newest request is preempted (s itself, perhaps: then False), as in the Engine."""
        m = n_run(s.req, self.U)
        while s in self.scheduler.running and (last - first + 1) * m > len(self.pool.free):
            self._evict()
        if s not in self.scheduler.running or last < first:
            return s in self.scheduler.running
        if last + 1 > s.seq.n:
            s.seq.extend(last + 1 - s.seq.n)
        pos = torch.arange(first, last + 1)
        pages = torch.tensor(self.pool.alloc(len(pos) * m, s.seq), dtype=torch.long).view(len(pos), m)
        s.seq.alloc_depth(pos, slice(0, m), pages)
        self._pages.append((s.slot, pos, pages))
        s.reserved = max(s.reserved, last)
        return True

    def _flush(self):
        """The host's writes of this step, in one copy (Upload): request slots admitted, new rows, reserved
        pages, horizons, then the compaction's permutation of the rows."""
        st, up = self.slots, self.upload
        for at, fields in self._admits + self._rows:          # a request slot, or the rows of a chunk
            for name, value in fields.items():
                up.write(getattr(st, name), at, value)
        for slot, pos, pages in self._pages:
            up.write(st.table, (slot, torch.arange(pages.shape[1])[None, :], pos[:, None]), pages)
        if self.scheduler.running:
            up.write(st.horizon, torch.tensor([s.slot for s in self.scheduler.running]),
                     [s.reserved for s in self.scheduler.running])
        up.send([getattr(st, name) for name in ROWS], self._perm)
        self._admits, self._rows, self._pages, self._perm = [], [], [], None

    def _choose_bucket(self, due=False):
        """The rows a pass runs: the bucket that holds the highest live row slot. Live rows are moved to
        the front (a permutation, sent with the step's writes) when a smaller bucket would hold them: at
        once when that quarters the bucket, else once no decision is due (a prompt in flight shrinks pass
        by pass: each bucket is one more graph to replay). While passes run unread, the host's copy of
        the rows may list rows that have gone idle since, never one that started: moving them too is
        harmless, and the copy of the rows those passes return is permuted alike when it is read."""
        live = self.live.nonzero()[:, 0]
        cap = self.slots.R
        now, least = (bucket(int(live[-1]) + 1, cap), bucket(len(live), cap)) if len(live) else (2, 2)
        if len(live) and (now >= 4 * least or (now > least and not due)):
            perm = torch.cat([live, (~self.live).nonzero()[:, 0]])
            self._perm = perm if self._perm is None else self._perm[perm]
            if self.ticket is not None:
                self.ticket[4].append(perm)
            self.live, self.row_req = self.live[perm], self.row_req[perm]
            live = self.live.nonzero()[:, 0]
        self.R_now = bucket(int(live[-1]) + 1 if len(live) else 1, cap)

    # ------------------------------------------------------------------ the passes, and what they did

    def _run(self, waves):
        """The passes on the device (a graph replay per wave on CUDA, run_pass itself elsewhere), then
        a copy of their log and of the rows' state, started without waiting. Returns the ticket that
        _read_log takes: (buckets of the passes, the first pass's index, the copies, an event)."""
        R, st = self.R_now, self.slots
        sampling = sampling_kind(s.req for s in self.scheduler.running)
        longest = max(s.started for s in self.scheduler.running) + sum(len(w) for w in waves)
        if self.ticket is not None:
            longest += len(self.ticket[0])
        # the torch read gathers n_keys keys a row: as few as the longest row needs, but all under graphs
        n_keys = st.n_keys if self.attn == "triton" or self.graphs is not None else bucket(longest, st.n_keys)
        launched = []
        for head in (h for wave in waves for h in wave):
            run = self._pass(R, n_keys, head, sampling)
            if self.graphs is not None:
                self.graphs.replay((R, n_keys, head, sampling), run)
            else:
                run()
            launched.append(R)
            self.stats["head_calls"] += head
        self.stats["launched"] += len(launched)
        first, self.passes_run = self.passes_run, self.passes_run + len(launched)
        rows = torch.stack([st.active.long(), st.hold.long(), st.req])
        host, done = self.download.start(st.log + [rows] + ([st.logits] if st.logits is not None else []))
        return launched, first, host, done, []         # [] the compactions made while it is unread

    def _pass(self, R, n_keys, head, sampling):
        """One pass, as a function for a graph to capture (a fixed wave replays the head-less one, then
        the one with the head)."""
        pass_fn, st = compiled_pass() if self.fuse else run_pass, self.slots
        return lambda: pass_fn(self.model, st, R, self.attn, n_keys, self.n_splits(R), head, sampling)

    def _read_log(self, ticket):
        """A ticket's log, pass by pass: exits recorded, tokens delivered (callbacks, stop ids,
        max_tokens), stopped rows aliased in the host tables and their unused pages returned,
        restarts noted, finished and cancelled requests ended. Returns [(request, token)] delivered."""
        launched, first, copies, done, perms = ticket
        log, (rows, *logits) = copies[:len(LOG)], copies[len(LOG):]
        if done is not None:
            done.synchronize()
        self.stats["waits"] += 1
        st = self.slots
        L = st.log_len
        self.live, self.row_req, self.slots_active = (rows[0] + rows[1]) > 0, rows[2].clone(), int(rows[0].sum())
        for perm in perms:                            # the rows as the host has moved them since
            self.live, self.row_req = self.live[perm], self.row_req[perm]
        delivered = []
        for i, R in enumerate(launched):
            at = (first + i) % L
            self.restarted = set()
            ran = 0
            for r, (slot, pos, depth, exit, tok, stop, go) in enumerate(zip(*[f[at, :R].tolist() for f in log])):
                s = self.by_slot[slot] if slot < st.S else None
                if s is None:
                    continue
                ran += depth > 0
                if exit and pos >= len(s.req.exits):
                    s.exits[pos] = exit
                if tok >= 0:
                    self._deliver(s, tok, logits[0][at, r].clone() if logits else None)
                    delivered.append((s.req, tok))
                if stop:
                    s.stops.append((pos, depth - 1))
                    s.rows -= 1
                if go:                                  # its positions so far are done; pos + 1 starts
                    s.rows, s.done, s.started, s.holding = s.rows + 1, pos + 1, pos + 2, False
                    self.restarted.add(s)
            if ran:
                self.stats["passes"] += 1
                self.stats["rows"] += ran
            for s in list(self.scheduler.running):
                self._settle(s)
        for s in self.scheduler.running:
            self._apply_stops(s)
        return delivered

    def _apply_stops(self, s):
        """The host table takes the aliases (Eq. 11) of the rows that stopped, in one call."""
        if s.stops:
            pos, depth = torch.tensor(s.stops).T
            s.seq.stop(pos, depth)
            s.stops = []

    def _deliver(self, s, tok, logits):
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
        else:
            s.holding = True

    def _settle(self, s):
        """After a pass: a request whose rows have all finished has done its positions (their exits join
        req.exits), and ends if its last token is sampled; a cancelled one ends now (what
        the device ran for it after this pass is dropped, as the Engine would not have run it)."""
        r = s.req
        if s.rows == 0:
            s.done = s.started
        while len(r.exits) < s.done:                             # as the Engine records them: when a chunk is done
            r.exits.append(s.exits.pop(len(r.exits)))
        if s.rows == 0:
            if s.ending and s.done >= s.runnable():
                self._apply_stops(s)
                self._finish(s, r.finish_reason)
                return
        if r.cancelled:
            self._finish(s, "cancelled")

    # ------------------------------------------------------------------ endings

    def _drop_cancelled(self):
        for s in [s for s in list(self.scheduler.running) + list(self.scheduler.waiting) if s.req.cancelled]:
            self._finish(s, "cancelled")

    def _evict(self):
        """The pool ran dry: the request the scheduler hands back loses its pages and its slot (its
        exits so far are kept, and on its return its cache is rebuilt by a recomputation that
        replays them, as in the Engine), or, alone and still too big, fails."""
        s, error = self.scheduler.evict()
        if error is not None:
            self._finish(s, "error", error)
            return
        self._apply_stops(s)
        s.seq.unreserve(s.started)
        s.evals_before += s.seq.block_evals
        s.seq.release()
        self._free_slot(s)
        s.seq, s.done, s.started, s.rows, s.holding, s.exits, s.reserved = None, 0, 0, 0, False, {}, -1
        s.stops = []
        self.stats["preemptions"] += 1

    def _finish(self, s, reason, error=None):
        r = s.req
        if s.seq is not None:
            self._apply_stops(s)
            s.seq.unreserve(min(s.started, s.seq.n))          # pages reserved ahead for positions never run
            r.kv = dict(s.seq.stats(), block_evals=s.seq.block_evals + s.evals_before)
            s.seq.release()
            s.seq = None
        self._free_slot(s)
        r.finish_reason, r.error = reason, error
        self.scheduler.remove(s)
        self.finished.append(r)
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    def _free_slot(self, s):
        """Its rows go idle on the device (the padding request), its table points at the scratch page."""
        if s.slot is None:
            return
        st, i = self.slots, s.slot
        mine = st.req == i
        st.active.logical_and_(~mine)
        st.hold.logical_and_(~mine)
        st.pend.masked_fill_(mine, -1)
        st.req.masked_fill_(mine, st.S)
        st.table[i] = st.scratch
        st.ended[i] = True
        gone = self.row_req == i
        self.slots_active -= s.rows
        self.live &= ~gone
        self.row_req[gone] = st.S
        self._pages = [p for p in self._pages if p[0] != i]
        self._rows = [(idx, f) for idx, f in self._rows if f["req"] != i]
        self._admits = [a for a in self._admits if a[0] != i]
        self.by_slot[i], s.slot = None, None
        self.free_slots.append(i)

    def fail_running(self, error):
        """After an unexpected error inside a step: end every admitted request with `error`."""
        for s in list(self.scheduler.running):
            self._finish(s, "error", error)

    def check(self):
        """Page invariants of the pool and of every live sequence, and the device's tables against the
        host's (tests call it after every step): the same pages, aliases included, and no row of a
        running request reads the scratch page. Reads the log of passes not read yet first (the next
        step returns its tokens)."""
        if self.ticket is not None:
            with torch.inference_mode():
                self.read_early += self._read_log(self.ticket)
            self.ticket = None
        self.pool.check()
        held = 0
        st = self.slots
        for s in self.scheduler.running:
            s.seq.check()
            held += int(s.seq.real[:s.seq.n].sum())
            host = s.seq.table[:s.seq.n].T                             # [U, n]
            dev = st.table[s.slot, :, :s.seq.n].cpu()
            assert torch.equal(torch.where(host >= 0, host, st.scratch), dev), "device and host page tables differ"
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"
        act = st.active.cpu()
        for r in act.nonzero()[:, 0].tolist():
            slot, d, p = int(st.req[r]), int(st.depth[r]), int(st.pos[r])
            assert (st.table[slot, d, :p + 1] != st.scratch).all(), "a running row reads the scratch page"


def engine_for(model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto", head="auto",
               engine="auto", sampling=SAMPLING):
    """The engine for this device. "auto": the slot engine with CUDA graphs on a GPU, where the eager
    engine waits on the host; the eager Engine on a CPU, where it is the faster (it gathers only the
    keys each row reads; docs/benchmarks.md), and for what the slot engine leaves to it (the nested
    scheduler, the shared LM head, the Table 17 modes: --engine=eager). head "auto": the engine's own,
    eager on the slot engine (it runs the head on every pass), shared on the eager engine. sampling: the
    draws the slot engine captures when it starts (slot_pass.SAMPLING; a script that knows its
    requests' names theirs)."""
    if engine not in ENGINES:
        raise UserError(f"--engine={engine!r}; allowed: {', '.join(ENGINES)}", "engine")
    if engine == "auto":
        cuda = torch.device(model.lm_head.weight.device).type == "cuda"
        engine = "slots" if cuda and scheduler in SCHEDULERS and attn != "flex" and head != "shared" else "eager"
    if head == "auto":
        head = "eager" if engine == "slots" else "shared"
    if engine == "slots":
        if head != "eager":
            raise UserError(f"--head={head}: the slot engine runs the LM head on every pass (--engine=eager shares it)",
                            "head")
        return SlotEngine(model, kv_pages, max_batch, max_rows, scheduler, attn, sampling=sampling)
    return Engine(model, kv_pages, max_batch, max_rows, scheduler, attn, head)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "serve with `python server.py --ckpt out/`, benchmark on a GPU with "
            "`python -m lab.bench --what=gpu`")

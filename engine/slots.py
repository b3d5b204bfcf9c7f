"""
The slot runner: the engine's pass on the device (engine/slot_pass.py), driven by the one host,
serve_depthbatch.Engine, through the runner contract (engine/contract.py); its graphs and its pages
taken ahead.

The eager runner (serve_depthbatch.EagerRunner) is the reference: Python groups of rows, a page
table per request on the host, decisions taken row by row. On a GPU that costs more than the work
itself: every pass reads values back to the host (which rows exited, which tokens were sampled) and
launches about fifty small kernels a layer, so the GPU waits on the host. The slot runner gives the
same results (the same tokens, exits of every position and pages; test_slots.py checks it in
float64, against the eager runner and against each request alone) and keeps its rows on the
device, in engine/slot_pass.py's Slots:

  * one row slot per row. A decode row whose exit samples a token restarts in place at depth 1 with
    that token on the next pass, so the rows change only when requests come and go;
  * the page tables live on the device: the runner takes the pages of every depth of a position
    before it runs (reserve; the host makes room first), and those past its exit go back when the
    log says where it was (RaggedSeq.stop);
  * the pass writes what it decided to a ring of log entries; each step launches a few passes and
    reads the log of the step before, while its own passes run, so that the device does not wait
    for the host's reading, admitting or deciding: a request admitted, a prompt chunk started,
    joins the passes of the next step.

On CUDA the pass is compiled whole (engine/graphs.py) and every bucket of rows (2, 4, 8, ...)
is captured as a CUDA graph when the engine starts, for each kind of pass (with and without the LM
head, each draw), then replayed; the host's writes between replays travel in one copy
(Upload), the log and the rows' state back in one (Download). What the pass does
not cover is the eager runner's: the nested scheduler, the shared LM head, the Table 17 caches.

Read top to bottom: how many passes a request may still need; the runner and its contract (what it
refuses, the rows the host starts, the pages its passes take); what it decides between passes; the
passes and their log; endings and checks.
"""
import torch

from configurator import UserError
from kernels import splits_for
from model import fuse_projections
from modes import MODES, decode_rule, keeps_one_depth, n_run, position_rules
from engine.contract import Log, Runner, Said
from engine import graphs as graph_api
from engine.graphs import Graphs, can_capture, compiled_pass
from engine.request import seed_bits
from engine.slot_pass import LOG, ROWS, SAMPLING, Download, Slots, Upload, bucket, run_pass, sampling_kind


def runs_mode(mode):
    """Whether the slot runner runs a mode: not speculative (its drafts are kept, verified and their
    positions started by the host between passes) nor a Table 17 cache (its tokens one at a time, as defined);
    those run on the eager runner (engine/build.engine_for picks it for them)."""
    return mode != "speculative" and not keeps_one_depth(mode)


# --------------------------------------------------------------------- passes a request still needs
# The runner launches passes before it reads what earlier ones did: how many passes a request's
# remaining tokens may take, with `pending` passes run but not read yet.

def per_token(r, U):
    """The fewest and the most passes a decode token of r takes: all its depths where its rows run
    to the last (fixed, Ouro mode), else 1 to all."""
    m = n_run(r, U)
    rule = MODES[r.mode].decode
    return (m, m) if rule.exit == "never" or rule.run_full else (1, m)


def surely_done(s, pending, U):
    """Whether s may have sampled its last token within `pending` passes not read yet (each token
    takes at least its fewest passes)."""
    return s.ending or len(s.req.tokens) + pending // per_token(s.req, U)[0] >= s.req.max_tokens


def passes_sure(s, host_end, pending, U):
    """The passes in which s surely still runs a row, after `pending` passes not read yet: a request
    with tokens to come always has a row running, its current token takes at least one more pass and
    each later one at least its fewest; a prompt or replay still to run (before host_end, where the
    device takes over): one (its next chunk waits)."""
    if s.done < host_end:
        return 1 - pending
    return (s.req.max_tokens - len(s.req.tokens) - 1) * per_token(s.req, U)[0] + 1 - pending


def passes_left(s, host_end, pending, U):
    """The most passes s may still run after `pending` passes not read yet: its tokens to come, each
    at most all its depths (exactly that in a fixed wave), less the passes already run; a prompt or
    replay still to run: one pass at a time."""
    if s.done < host_end:
        return 1
    return max((s.req.max_tokens - len(s.req.tokens)) * per_token(s.req, U)[1] - pending, 0)


class Ticket:
    """Passes launched and not read yet: the bucket of each, the index of the first in the log ring,
    the copies of their log and of the rows' state coming to the host and the event that marks their
    landing, and what the host did to the rows since they were launched (replayed on the copies)."""

    def __init__(self, launched, first, copies, landed):
        self.launched, self.first, self.copies, self.landed = launched, first, copies, landed
        # ("perm", permutation) | ("start", row slots, request slot) | ("free", slot)
        self.since = []


# ----------------------------------------------------------------------------- the runner

class SlotRunner(Runner):
    """The engine's runner on the device, over Slots and run_pass. A step launches up to
    `sync_every` passes (`due_every` while the host has a decision due: requests wait, or a prompt
    has chunks to start) and, with overlap, reads the log of the step before while they run
    (overlap=False: its own, at once, the eager runner's order of passes exactly). graphs: capture
    every bucket as a CUDA graph when the engine starts, for each kind of pass and each of the
    `sampling` draws (SAMPLING; a draw left out is captured on its first use); fuse: compile the
    pass whole (engine/graphs.py); "auto": all three where graphs can be captured (CUDA). On a CPU
    the passes run in the host's own thread: nothing overlaps, and a late read would only leave the
    host an older copy of the rows (larger buckets). The model is frozen and its projections
    stacked (four GEMMs a layer: model.fuse_projections)."""

    def __init__(self, model, pool, stats, attn="torch", head="eager", scheduler="continuous",
                 max_batch=32, max_rows=256, sync_every=8, due_every=2, graphs="auto", fuse="auto",
                 overlap="auto", keep_logits=False, n_stop=8, sampling=SAMPLING):
        if scheduler == "nested":
            raise UserError("--scheduler=nested: a wave is a host loop; it runs on --runner=eager",
                            "scheduler")
        if attn == "flex":
            raise UserError("--attn=flex builds its mask on the host; the slot "
                            "runner reads torch or triton", "attn")
        if head != "eager":
            raise UserError(f"--head={head}: the slot runner runs the LM head on every pass "
                            "(--runner=eager shares it)", "head")
        # frozen: no parameter that requires grad reaches a compiled pass (autograd would trace a
        # joint graph, and the survive update of Eq. 4 in place would fail it)
        super().__init__(fuse_projections(model.requires_grad_(False)), pool, stats)
        self.attn, self.fixed = attn, scheduler == "fixed"
        self.depths = torch.arange(self.U)[None, :]
        self.sync_every, self.due_every = sync_every, due_every
        # request slots: twice max_batch, as a slot freed while passes it ran in are unread
        # waits for their log
        R, S, n_keys = max_rows + 2 * max_batch, 2 * max_batch, self.model.config.block_size
        self.slots = Slots(self.model, pool, R, S, n_keys, max(sync_every, self.U), n_stop,
                           keep_logits)
        self.n_splits = (lambda R: splits_for(R * self.model.config.n_kv_head, n_keys, 32)
                         if attn == "triton" else 1)
        capture = can_capture(self.device)
        self.graphs = Graphs(self.slots.buffers) if (capture if graphs == "auto" else graphs) else None
        self.fuse = capture if fuse == "auto" else fuse
        self.overlap = capture if overlap == "auto" else overlap
        self.upload, self.download = Upload(self.device), Download(self.device)
        # what it keeps of each request: its request slot, the positions the host starts (later
        # ones restart on the device), the last position whose pages are taken
        self.slot_of, self.host_end, self.reserved = {}, {}, {}
        self.by_slot, self.free_slots, self.freed = [None] * S, list(range(S - 1, -1, -1)), []
        # the host's copy of the rows, as of the last log read and its own writes since: which are
        # live (running or holding a token), of which request slot, how many run
        self.live = torch.zeros(self.slots.R, dtype=torch.bool)
        self.row_req = torch.full((self.slots.R,), S, dtype=torch.long)
        self.slots_active, self.R_now, self.restarted = 0, 2, set()
        # the host's writes of this step, the chunks whose pages it takes at the run, the plan
        self._admits, self._rows, self._pages, self._perm, self._chunks = [], [], [], None, []
        self._waves, self._due, self._n_ahead = [], False, 0
        self.ticket, self.passes_run = None, 0
        # launched: passes, idle ones too (passes with rows: the host's count); waits: log reads
        # that waited for the device; drained: passes whose log was read with no pass launched
        # behind them (the device then waits for the host)
        stats.update(launched=0, waits=0, drained=0)
        if self.graphs is not None:
            with graph_api.GRAPHS.on(self.device):
                self._capture_all(R, n_keys, sampling)

    def _capture_all(self, R, n_keys, sampling):
        """Every kind of pass it runs, captured now (serving never stalls on a first use): each bucket
        of rows, with the LM head (a fixed wave: and without), each draw."""
        buckets = sorted({bucket(n, R) for n in range(1, R + 1)})
        heads = (True,) if not self.fixed or self.U == 1 else (False, True)
        self.graphs.capture_all([(b, n_keys, h, k) for b in buckets for h in heads for k in sampling],
                                self._pass)

    # --------------------------------------------------------- the contract: what differs by design

    def refuse(self, r):
        """What the eager runner alone runs: runs_mode's modes; more stop ids than the slots hold;
        logits kept without keep_logits (UserError, nothing queued)."""
        st = self.slots
        if not runs_mode(r.mode):
            what = ("its drafts and verifications" if r.mode == "speculative" else
                    "the Table 17 caches")
            raise UserError(f"mode={r.mode}: {what} run on the eager runner (--runner=eager)", "mode")
        if len(r.stop) > st.stop_ids.shape[1]:
            raise UserError(f"stop: {len(r.stop)} stop ids; this runner takes at most "
                            f"{st.stop_ids.shape[1]}", "stop")
        if r.keep_logits and st.logits is None:
            raise UserError("keep_logits: build the engine with keep_logits=True", "keep_logits")

    def ready(self, s):
        """The host starts a request's prompt and replay chunks; its decode tokens restart on the
        device, and one that restarted in the last pass read counts against the budget of the
        requests after it, as the eager runner's decode chunk would."""
        if s in self.restarted:
            return "started"
        return None if s.rows or s.done >= self.host_end.get(s, s.runnable()) else "chunk"

    def budget(self, running):
        """Rows running (those restarted in the last pass read count at their request: ready), and
        the free pages (a position's pages are all taken before it runs)."""
        self.restarted &= set(running)
        return self.slots_active - len(self.restarted), len(self.pool.free)

    def wave(self, running):
        """The depth of the fixed wave under way (that of the request of any live row), if any."""
        if not self.fixed or not self.live.any():
            return None
        return n_run(self.by_slot[int(self.row_req[self.live][0])].req, self.U)

    def start(self, s, end):
        """Rows for positions s.done..end-1 (replayed positions run to their recorded exits); the
        last position of the context samples the next token. The pages of every depth they may run
        are taken at the run (a request admitted now gets a request slot first)."""
        if s not in self.slot_of:
            self._admit(s)
        r, start, m = s.req, s.done, n_run(s.req, self.U)
        taus, full, forced, _ = position_rules(r, start, end)
        ctx = r.prompt + r.tokens
        free_rows = (~self.live).nonzero()[:, 0]
        assert len(free_rows) >= end - start, "more rows in flight than row slots"
        idx, slot = free_rows[:end - start], self.slot_of[s]
        self._rows.append((idx, dict(tok=ctx[start:end], pos=list(range(start, end)), depth=0,
                                     req=slot, n_run=m, forced=forced, exit=0, pend=-1, tau=taus,
                                     full=full, active=True,
                                     sample=[p == len(ctx) - 1 for p in range(start, end)],
                                     fresh=True, hold=False)))
        self._chunks.append((s, start, end - 1))
        self.live[idx], self.row_req[idx] = True, slot
        self.slots_active += end - start
        if self.ticket is not None:
            self.ticket.since.append(("start", idx, slot))
        self.stats["replayed_rows"] += sum(1 for f in forced if f)

    def _admit(self, s):
        """A request slot for s, filled with what its decode rows need on the device."""
        r, st = s.req, self.slots
        slot = self.slot_of[s] = self.free_slots.pop()
        self.by_slot[slot], self.host_end[s], self.reserved[s] = s, s.runnable(), -1
        tau, full = decode_rule(r)
        stop = list(r.stop) + [-1] * (st.stop_ids.shape[1] - len(r.stop))
        self._admits.append((slot, dict(ntok=len(r.tokens), max_tok=r.max_tokens,
                                        dec_n_run=n_run(r, self.U), horizon=-1, stop_ids=stop,
                                        dec_tau=tau, dec_full=full, ended=s.ending,
                                        seed=seed_bits(r.seed), top_k=r.top_k,
                                        temperature=r.temperature, top_p=r.top_p)))

    def plan(self, running, queued):
        """The passes the next run launches (_passes), and the pages they take, by request: every
        depth of the chunks started this step, and of every position a decode row may reach in the
        coming passes (a row starts at most one position a pass)."""
        self._waves, self._due = self._passes(running, queued)
        pending = len(self.ticket.launched) if self.ticket is not None else 0
        self._n_ahead = pending + sum(len(w) for w in self._waves)
        need = {}
        for s, first, last in self._chunks:
            need[s] = need.get(s, 0) + (last - first + 1) * n_run(s.req, self.U)
        if self._waves:
            for s in running:
                first, last = self._ahead(s)
                need[s] = need.get(s, 0) + max(last - first + 1, 0) * n_run(s.req, self.U)
        return need

    def _ahead(self, s):
        """The positions of s whose pages the planned passes may need and are not taken yet (first >
        last: none): none while the host still starts its chunks or once its last token is
        sampled."""
        if s.ending or s.started < self.host_end[s]:
            return 0, -1
        taken = max([self.reserved[s]] + [last for c, _, last in self._chunks if c is s])
        return taken + 1, min(s.started - 1 + self._n_ahead, s.last_position())

    def drop(self, s):
        """s ends or is preempted: its rows go idle on the device (the padding request) and its
        table points at the scratch page. While passes it ran in are unread, its slot waits for
        their log before another request takes it."""
        self._chunks = [c for c in self._chunks if c[0] is not s]
        i = self.slot_of.pop(s, None)
        self.host_end.pop(s, None)
        self.reserved.pop(s, None)
        if i is None:
            return
        st = self.slots
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
        self.by_slot[i] = None
        if self.ticket is not None:
            self.ticket.since.append(("free", i))
            self.freed.append(i)
        else:
            self.free_slots.append(i)

    def idle(self, running):
        return not self.live.any()

    def busy(self):
        return self.ticket is not None

    # ------------------------------------------------------------------ a step

    def run(self, running, queued):
        """A step of depth batching on the device (App. A.2): take the pages the planned passes may
        write (the host has made room), choose the bucket, send the host's writes, launch the passes,
        and read the log of the passes launched before them (overlap: while these run). Returns the
        Logs of the passes read."""
        with graph_api.GRAPHS.on(self.device):       # cuda:N: its streams, events and graphs
            return self._step(running, queued)

    def _step(self, running, queued):
        waves = self._prepare(running, queued)
        ticket = self._launch(waves, running) if waves else None
        logs = []
        if self.ticket is not None:
            # the previous passes, while these run
            logs += self._read(self.ticket, drained=ticket is None)
        self.ticket = ticket
        if ticket is not None and not self.overlap:
            logs += self._read(ticket, drained=True)
            self.ticket = None
        return logs

    def _passes(self, running, queued):
        """The passes to launch, as waves: tuples of head flags (a fixed wave: the head on its last
        pass only; otherwise one pass, the head on). As many as surely have a row in them, at most
        sync_every (due_every while the host has a decision due); none when every request may have
        ended in the passes not read yet (their log first). Returns (waves, due)."""
        pending = len(self.ticket.launched) if self.ticket is not None else 0
        if not self.live.any() or (pending and all(surely_done(s, pending, self.U) for s in running)):
            return [], False
        due = queued or any(s.done < self.host_end[s] for s in running)
        most = 1 if due and not self.overlap else self.due_every if due else None
        if self.fixed:                         # every live row starts a wave at depth 1, all of one depth
            m = self.wave(running)
            # exact: a wave runs a whole token
            left = max(passes_left(s, self.host_end[s], pending, self.U) for s in running)
            return [(False,) * (m - 1) + (True,)] * max(1, min(self.slots.log_len, left,
                                                              most or left) // m), due
        # no pass without a row in it: a chunk started now surely runs in the next
        fresh = {f["req"] for _, f in self._rows}
        sure = max(1 if self.slot_of[s] in fresh else passes_sure(s, self.host_end[s], pending,
                                                                  self.U) for s in running)
        if pending and sure <= 0:
            return [], False
        return [(True,)] * max(1, min(self.sync_every, sure, most or sure)), due

    def _prepare(self, running, queued):
        """The pages of this step's chunks and, where passes are planned, of the positions they may
        reach (oldest request first); a preemption that left a request waiting: one wave, then
        decide again. Then the bucket, and the host's writes in one copy. Returns the waves."""
        for s, first, last in self._chunks:
            self._reserve(s, first, last)
        self._chunks, waves = [], self._waves
        if not waves:
            return []
        for s in running:
            first, last = self._ahead(s)
            self._reserve(s, first, last)
        if queued:
            waves = waves[:1]
        self._choose_bucket(due=self._due)
        self._send_writes()
        return waves if self.live.any() else []

    def _reserve(self, s, first, last):
        """Pages for positions first..last at every depth s may run, in its table and (at the next
        send) in its device table; the device restarts a row only where pages are taken."""
        if last < first:
            return
        m = n_run(s.req, self.U)
        if last + 1 > s.seq.n:
            s.seq.extend(last + 1 - s.seq.n)
        pos = torch.arange(first, last + 1)
        pages = torch.tensor(self.pool.alloc(len(pos) * m, s.seq), dtype=torch.long).view(len(pos), m)
        s.seq.alloc_depth(pos, slice(0, m), pages)
        self._pages.append((self.slot_of[s], pos, pages))
        self.reserved[s] = max(self.reserved[s], last)

    def _send_writes(self):
        """The host's writes of this step, in one copy (Upload): request slots admitted, new rows,
        reserved pages, horizons, then the compaction's permutation of the rows."""
        st, up = self.slots, self.upload
        # a request slot, or the rows of a chunk
        for at, fields in self._admits + self._rows:
            for name, value in fields.items():
                up.write(getattr(st, name), at, value)
        for slot, pos, pages in self._pages:
            up.write(st.table, (slot, torch.arange(pages.shape[1])[None, :], pos[:, None]), pages)
        if self.slot_of:
            up.write(st.horizon, torch.tensor(list(self.slot_of.values())),
                     [self.reserved[s] for s in self.slot_of])
        up.send([getattr(st, name) for name in ROWS], self._perm)
        self._admits, self._rows, self._pages, self._perm = [], [], [], None

    def _choose_bucket(self, due=False):
        """The rows a pass runs: the bucket that holds the highest live row slot. Live rows are
        moved to the front (a permutation, sent with the step's writes) when a smaller bucket would
        hold them: at once when that quarters the bucket, else once no decision is due (a prompt in
        flight shrinks pass by pass: each bucket is one more graph to replay). While passes run
        unread, the host's copy of the rows may list rows that have gone idle since, never one that
        started: moving them too is harmless, and the copy of the rows those passes return is
        permuted alike when it is read."""
        live = self.live.nonzero()[:, 0]
        cap = self.slots.R
        now, least = (bucket(int(live[-1]) + 1, cap), bucket(len(live), cap)) if len(live) else (2, 2)
        if len(live) and (now >= 4 * least or (now > least and not due)):
            perm = torch.cat([live, (~self.live).nonzero()[:, 0]])
            self._perm = perm if self._perm is None else self._perm[perm]
            if self.ticket is not None:
                self.ticket.since.append(("perm", perm))
            self.live, self.row_req = self.live[perm], self.row_req[perm]
            live = self.live.nonzero()[:, 0]
        self.R_now = bucket(int(live[-1]) + 1 if len(live) else 1, cap)

    # ---------------------------------------------------------------- the passes, and what they did

    def _launch(self, waves, running):
        """The passes on the device (a graph replay each on CUDA, run_pass itself elsewhere), then
        one copy of their log and of the rows' state to the host, started without waiting."""
        R, st = self.R_now, self.slots
        sampling = sampling_kind(s.req for s in running)
        longest = max(s.started for s in running) + sum(len(w) for w in waves)
        if self.ticket is not None:
            longest += len(self.ticket.launched)
        # the torch read gathers n_keys keys a row: as few as the longest row needs,
        # but all under graphs
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
        # one copy
        packed = torch.cat([torch.stack(st.log).flatten(), st.active.long(), st.hold.long(), st.req])
        copies, landed = self.download.start([packed] + ([st.logits]
                                                         if st.logits is not None else []))
        return Ticket(launched, first, copies, landed)

    def _pass(self, R, n_keys, head, sampling):
        """One pass, as a function for a graph to capture (a fixed wave replays the head-less one,
        then the one with the head)."""
        pass_fn, st = compiled_pass() if self.fuse else run_pass, self.slots
        return lambda: pass_fn(self.model, st, R, self.attn, n_keys, self.n_splits(R),
                               head, sampling)

    def _read(self, ticket, drained):
        """A ticket's log, as the host reads it (its Logs, one a pass), the requests each slot held
        when the passes ran (None: ended or preempted since), and the host's copy of the rows from
        their state after the passes, with what the host did since replayed on it. drained: no pass
        runs behind these (the device waits for the host meanwhile)."""
        packed, *logits = ticket.copies
        if ticket.landed is not None:
            ticket.landed.synchronize()
        self.stats["waits"] += 1
        self.stats["drained"] += len(ticket.launched) if drained else 0
        st, R = self.slots, ticket.launched[0]
        log, rows = packed[:-3 * st.R].view(len(LOG), st.log_len, st.R), packed[-3 * st.R:].view(3, st.R)
        at = (ticket.first + torch.arange(len(ticket.launched))) % st.log_len
        fields = dict(zip(LOG, log[:, at, :R]))
        self.live, self.row_req, self.slots_active = (rows[0] + rows[1]) > 0, rows[2].clone(), int(rows[0].sum())
        for event, *what in ticket.since:
            if event == "perm":
                self.live, self.row_req = self.live[what[0]], self.row_req[what[0]]
            elif event == "start":
                self.live[what[0]], self.row_req[what[0]] = True, what[1]
                self.slots_active += len(what[0])
            else:
                gone = self.row_req == what[0]
                self.live &= ~gone
                self.row_req[gone] = st.S
        # slot S: the padding request of idle rows
        lives = self.by_slot + [None]
        go = fields["go"][-1].nonzero()[:, 0]
        self.restarted = {lives[i] for i in fields["req"][-1, go].tolist()} - {None}
        # no pass of a slot freed since runs unread
        if self.ticket is None or self.ticket is ticket:
            self.free_slots += self.freed
            self.freed = []
        return self._logs(fields, lives, logits[0][at, :R] if logits else None)

    def _logs(self, fields, lives, logits):
        """The host's Logs of a ticket's passes (rows.Log): the rows each request ran in each pass
        (one sum), and the entries that say something, found for all the passes at once (one mask),
        read one by one: no work per idle row."""
        P = fields["req"].shape[0]
        n = len(lives)
        ran = torch.zeros(P * n, dtype=torch.long).index_add_(
            0, (torch.arange(P)[:, None] * n + fields["req"]).flatten(),
            (fields["depth"] > 0).long().flatten())
        said = [[] for _ in range(P)]
        where = ((fields["exit"] > 0) | (fields["stop"] > 0) | (fields["tok"] >= 0) | (fields["go"] > 0)).nonzero()
        p_r = where.tolist()
        values = zip(*[fields[k][where[:, 0], where[:, 1]].tolist() for k in LOG])
        for (p, r), (slot, pos, depth, decided, tok, stop, go) in zip(p_r, values):
            s = lives[slot]
            if s is not None:
                kept = logits[p, r].clone() if tok >= 0 and s.req.keep_logits else None
                said[p].append(Said(s, pos, depth, decided, tok, bool(stop), bool(go), kept))
        counts = ran.view(P, n).tolist()
        return [Log([(s, c) for s, c in zip(lives, row) if s is not None and c], said[p])
                for p, row in enumerate(counts)]

    # ------------------------------------------------------------------ checks

    def check(self, running):
        """The device's tables against the host's, with the writes not sent yet applied: the same
        pages, aliases included, or, while passes are unread, the page of a shallower depth of the
        same position (the device aliased a row that stopped in them: Eq. 11 there first); and no row
        of a running request reads the scratch page. Reads the device, changes nothing."""
        st, U = self.slots, self.U
        for s in running:
            i, n = self.slot_of[s], s.seq.n
            host = torch.where(s.seq.table[:n].T >= 0, s.seq.table[:n].T, st.scratch)   # [U, n]
            dev = st.table[i, :, :n].cpu().clone()
            for slot, pos, pages in self._pages:
                if slot == i:
                    dev[:, pos] = pages.T
            if self.ticket is None:
                assert torch.equal(host, dev), "device and host page tables differ"
                continue
            shallower = torch.stack([(dev == host[e]) & (torch.arange(U)[:, None] > e)
                                     for e in range(U)]).any(0)
            assert ((dev == host) | shallower).all(), "device and host page tables differ"
        act = st.active.cpu()
        for r in act.nonzero()[:, 0].tolist():
            slot, d, p = int(st.req[r]), int(st.depth[r]), int(st.pos[r])
            assert (st.table[slot, d, :p + 1] != st.scratch).all(), "a running row reads the scratch page"

if __name__ == "__main__":
    from configurator import library
    library(__doc__, "serve with `python server.py --ckpt out/ --runner=slots`, benchmark on a GPU "
            "with `python -m lab.bench --what=gpu`")

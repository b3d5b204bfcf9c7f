"""
The depth-queue decoder (App. A.2): continuous depth-wise batching of a looped LM over one Ragged-KV
page pool. Read top to bottom: one pass of the block over rows at mixed depths (EagerRunner), then the
host loop that feeds it (Engine).

    engine = Engine(model, kv_pages=4000, max_batch=8)
    done = engine.run([Request(prompt_ids, max_tokens=32, mode="dense_ragged", thr=0.5)])

All loops share one set of weights, so tokens at different depths can go through the block in one
batch. A *row* is one token of one request at one depth. Each step applies the block once to every
row in flight, whatever its depth: a row that exits (Eq. 4, with its request's τ) has its token
sampled at once, and its request's next token joins at depth 1 on the next step. Every pass is useful
work, so passes approach the work-conserving bound Σ e_i / B (Ouro's way, every token all U loops, is
kept as `--scheduler=fixed`; the paper's nested waves as `--scheduler=nested`).

Memory is capacity. One PagePool holds every request's pages; a RaggedSeq per request maps (position,
depth) to pages, deeper entries aliasing a token's terminal page (Eq. 11), so a request holds Σ e_i
pages (Eq. 12). When the pool runs dry the newest request is preempted (beyond the paper), and
replayed to the exits it had on its return. The rest is in engine/ (a second sitting, the GPU path).
"""
import torch

from configurator import UserError
from engine.contract import STATS, Live, Runner
from engine.request import sample_token
from engine.rows import Group, RowsView, embed_new, host_lists, pass_logs, read_as_rows
from engine.scheduler import Scheduler
from engine.shared_head import HEADS, SharedHead
from engine.slots import SlotRunner
from engine.speculative import aside, count_passes, turn
from kernels import resolve_impl
from model import exit_now
from modes import check_request, n_run, position_rules
from ragged import PagePool, RaggedSeq, alloc_wave, check_pool

# ----------------------------------------------------------------------------- one pass

class EagerRunner(Runner):
    """The reference runner: a request's rows in flight are Groups (engine/rows.py). A pass takes a
    fresh page for every row, applies the block to every row at its own depth (Eq. 7 through Eq. 11),
    decides the exits (Eq. 4) and samples the rows that exited. waves: the fixed scheduler's, every
    row all its depths in one run, as Ouro's code runs its loops; head="shared": engine/shared_head.py."""

    def __init__(self, model, pool, stats, attn="torch", head="eager", waves=False, max_batch=32):
        super().__init__(model, pool, stats)
        self.attn, self.waves, self.head = attn, waves, head
        self.shared = SharedHead(model, max_batch) if head == "shared" and not waves else None
        # Live -> its rows in flight, [Group] (a speculative request: a position each, each at its depth)
        self.groups = {}

    def start(self, s, end):
        """Rows for positions s.started..end-1, each with its mode's rule (modes.position_rules); a
        speculative request's positions start one at a time, each on its draft (engine/speculative.py)."""
        r = s.req
        taus, full, forced, keep = position_rules(r, s.started, end)
        ctx = r.prompt + r.tokens + [tok for tok, _ in s.drafts]
        g = Group(s, s.started, ctx[s.started:end], taus, full, forced, keep, n_run(r, self.U))
        if end == len(ctx):
            g.sample_from = end - 1             # the newest token: its exit samples the next one
        self.groups.setdefault(s, []).append(g)
        self.stats["replayed_rows"] += max(0, min(end, len(r.exits)) - s.started)

    def depths(self, g):
        """The depths a group's rows run in the next run: the next one (a wave: every one to come)."""
        return range(g.d, g.n_run if self.waves else g.d + 1)

    def plan(self, running, queued):
        """A page for every row at every depth it runs next."""
        return {s: sum(len(g.pos) * len(self.depths(g)) for g in gs) for s, gs in self.groups.items()}

    def run(self, running, queued):
        """One pass of the block over every row in flight, whatever its depth (App. A.2; a fixed
        wave: all its passes), the exits (Eq. 4) and the LM head. Returns one Log a pass."""
        groups, pages = self._allocate(running)              # a fresh page per row and pass
        if not groups:                   # nothing runs: rows waiting for a shared head call take it
            waiting = self.shared is not None and self.shared.waiting()
            return pass_logs([], 1, self._sample(self.shared.take())) if waiting else []
        hn, gate, h_next = self._run_block(groups, pages)    # the block on every row, at its depth
        rows = self._decide_exits(groups, gate, h_next)      # Eq. 4, each row with its τ
        # a row samples at its exit; a speculative one (a draft there) again at its last depth
        exited = [(g.live, pos, hn[i]) for g, pos, i, newly, stopped in rows
                  if g.sample_from is not None and pos >= g.sample_from
                  and (newly or stopped and g.live.req.mode == "speculative")]
        if self.shared is not None:      # rows still to run next pass: in flight, or a chunk to start
            others = (any(len(g.pos) for g in groups) or queued
                      or any(s not in self.groups and s.done < s.runnable() for s in running))
            exited = self.shared.choose(exited, others, running, queued)
        tokens = self._sample(exited)                        # the LM head
        for g in groups:
            if len(g.pos) == 0:
                self.groups[g.live].remove(g)
                if not self.groups[g.live]:
                    del self.groups[g.live]
        return pass_logs(rows, len(pages), tokens)

    def _allocate(self, running):
        """A page for every row at its depths (the host has made room: plan), taken in one piece
        (ragged.alloc_wave) so that a batch that starts together reads them in place. Returns the
        groups, decode tokens first by position (as the padded attention tables want them), each with
        its rows of the batch (Group.span), and the pages of each pass."""
        out = [(g, self.depths(g)) for s in running for g in self.groups.get(s, ())]
        pages = alloc_wave(self.pool, [(g.live.seq, g.pos, depths) for g, depths in out])
        batch = sorted(zip([g for g, _ in out], pages),
                       key=lambda gp: (not read_as_rows(gp[0]), gp[0].pos.tolist()[-1]))
        row = 0
        for g, p in batch:
            g.live.seq.write_pages(g.pos, slice(g.d, g.d + p.shape[1]), p)   # never through an alias
            g.span, row = slice(row, row + len(g.pos)), row + len(g.pos)
        n_pass = batch[0][1].shape[1] if batch else 0
        assert all(p.shape[1] == n_pass for _, p in batch), "a wave runs every group to one depth"
        return ([g for g, _ in batch],
                [torch.cat([p[:, d] for _, p in batch]).to(self.device) for d in range(n_pass)])

    def _run_block(self, groups, pages):
        """One application of the block to every row: row r at position p_r and depth d_r writes its
        page and reads its request's table column d_r (RowsView). A fixed wave runs all its passes
        here, the rows carrying their state from depth to depth with nothing decided in between.
        Returns the normed states, the gate logits and the states passed on, of the last pass."""
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

    def _decide_exits(self, groups, gate, h_next):
        """Eq. 4 online for every row with its request's τ (model.exit_now, the references' rule): a
        replayed row exits where it did before, the last depth always exits, a full row (Ouro mode, a
        Dense-Ragged prompt) runs on to its last depth after its exit. The rows that run on carry
        their state to the next depth; the others leave their group (Group.settle). Returns per row
        of the batch (group, position, row, newly exited, stopped)."""
        tau, forced, decided, full, depth, last = host_lists(groups)    # row by row, in batch order
        survive = torch.cat([g.survive for g in groups])
        survive, hit = exit_now(survive, gate, tau.to(gate.device, gate.dtype))
        hit = torch.where(forced > 0, forced == depth + 1, hit.cpu())     # one copy to the host
        newly = (decided == 0) & (hit | last)
        runs_on = torch.where(newly, full & ~last, ~last)
        newly_list, going = newly.tolist(), runs_on.tolist()
        return [row for g in groups for row in g.settle(newly_list[g.span], going[g.span],
                                                        runs_on[g.span], h_next[g.span],
                                                        survive[g.span], self.U)]

    def _sample(self, rows):
        """The LM head on the rows [(Live, position, normed state)] whose exit samples their request's
        next token (one call for all), each request's draw keyed by its seed and the position.
        Returns [(Live, position, token, logits)]."""
        if not rows:
            return []
        logits = self.model.lm_head(torch.stack([h for _, _, h in rows]))
        self.stats["head_calls"] += 1
        greedy = logits.argmax(-1).tolist()               # temperature 0, every row in one call
        out = []
        for (s, pos, _), lg, top in zip(rows, logits, greedy):
            r = s.req
            tok = top if r.temperature == 0 else sample_token(lg, r.temperature, r.top_k, r.top_p,
                                                              r.seed, pos)
            out.append((s, pos, tok, lg.detach().cpu()))
        return out

    def drop(self, s):
        self.groups.pop(s, None)
        if self.shared is not None:
            self.shared.drop(s)

    def idle(self, running):
        return super().idle(running) and not (self.shared is not None and self.shared.waiting())


# ----------------------------------------------------------------------------- the host

class Engine:
    """The host: admission and chunks (engine/scheduler.py), the page budget and preemption (the one
    place that evicts), the exits decided, token delivery, endings and checks, over a runner: "eager"
    (EagerRunner) or "slots" (engine/slots.py, the same pass as CUDA graphs). Call add() and step()
    from one thread; Request.cancelled may be set from anywhere. A request is held from add() to its
    end only (its caller keeps it). stats counts what it did (engine/contract.STATS)."""

    def __init__(self, model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous",
                 attn="auto", head="eager", runner="eager", **options):
        if head not in HEADS:
            raise UserError(f"--head={head!r}; allowed: {', '.join(HEADS)}", "head")
        self.model, self.U = model, model.config.n_loops
        self.device = model.lm_head.weight.device
        try:
            attn = resolve_impl(attn, self.device)       # "auto": the fastest paged attention here
        except ValueError as e:
            raise UserError(str(e), "attn")
        check_pool(model, kv_pages)
        self.pool = PagePool.for_model(model, kv_pages)
        self.scheduler = Scheduler(self.pool, self.U, max_batch, max_rows, scheduler)
        self.next_id = 0
        self.stats = dict.fromkeys(STATS, 0)
        if runner == "slots":
            self.runner = SlotRunner(model, self.pool, self.stats, attn, head, scheduler, max_batch,
                                     max_rows, **options)
        else:
            self.runner = EagerRunner(model, self.pool, self.stats, attn, head, scheduler == "fixed",
                                      max_batch, **options)

    def add(self, r):
        """Queue a request after checking it (check_request: nothing is queued if it fails)."""
        self.scheduler.shape(r)                  # the fixed scheduler runs every request as fixed
        self.check_request(r)
        self.scheduler.waiting.append(Live(r, self.next_id))
        self.next_id += 1
        return r

    def check_request(self, r):
        """UserError if r is malformed, could never fit in the pool or its runner leaves it to another."""
        check_request(r, self.model.config, self.pool.n_pages)
        self.runner.refuse(r)

    def busy(self):
        """Whether work is left: requests queued or running, or results the runner still holds."""
        return self.scheduler.busy() or self.runner.busy()

    def run(self, requests):
        """Add requests and step until all have finished. Returns them."""
        for r in requests:
            self.add(r)
        while self.busy():
            self.step()
        return requests

    @torch.inference_mode()
    def step(self):
        """Schedule, run, take what the run did: start the chunks the scheduler hands over, make
        room for what the runner will take, let it apply the block (App. A.2: every row in flight,
        whatever its depth), then read its log. Returns [(request, token)] delivered."""
        sched = self.scheduler
        self._drop_cancelled()
        self._start_chunks()                    # admit; start prompt, replay and decode chunks
        self._make_room()                       # preempt while the run needs more than is free
        return self._take(self.runner.run(sched.running, bool(sched.waiting)))

    def _drop_cancelled(self):
        for s in [s for s in self.scheduler.running + list(self.scheduler.waiting) if s.req.cancelled]:
            self._finish(s, "cancelled")

    def _start_chunks(self):
        """The scheduler's chunks, started on the runner (a request admitted from the queue gets its
        page table first). When nothing can start and no row runs, the pages are held by requests
        that need more: the newest is preempted."""
        sched, runner = self.scheduler, self.runner
        rows, free = runner.budget(sched.running)
        started = False
        for s, end in sched.chunks(rows, free, runner.ready, runner.wave(sched.running)):
            if s.seq is None:
                s.seq = RaggedSeq(self.pool, self.U, len(s.req.prompt) + s.req.max_tokens)
            if end > s.seq.n:
                s.seq.extend(end - s.seq.n)       # the table covers every position started
            runner.start(s, end)
            s.rows, s.started, started = s.rows + end - s.started, end, True
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(sched.running))
        if not started and runner.idle(sched.running) and sched.running:
            self._evict()

    def _make_room(self):
        """The pages the runner's next run takes, by request: while they outgrow the free pages, the
        newest request is preempted (App. A.2: memory is capacity; the oldest keep their pages)."""
        sched = self.scheduler
        need = self.runner.plan(sched.running, bool(sched.waiting))
        while sched.running and sum(need.get(s, 0) for s in sched.running) > len(self.pool.free):
            self._evict()

    def _take(self, logs):
        """What the runner's passes did, pass by pass (engine/contract.py's Log): each decided exit
        kept until its position is done (a replayed position keeps the one it had), each stopped row
        counted off, each token delivered, each restart in place noted; after each pass the requests
        it touched settle (a request ended in a pass takes nothing from the passes after it); at the
        end the stops go into the tables (Eq. 11). Returns [(request, token)] delivered."""
        sampled, stopped = [], set()
        for log in logs:
            ran = sum(n for s, n in log.ran if s.seq is not None)     # rows of requests still running
            self.stats["passes"] += ran > 0
            self.stats["rows"] += ran
            count_passes(log, self.stats)              # the speculative draft and verify passes
            touched = set()
            for row in log.said:
                s = row.live
                if s.seq is None:                                      # ended or preempted since
                    continue
                if row.exit and row.pos >= len(s.req.exits):
                    s.exits[row.pos] = row.exit
                if row.stop:
                    s.stops.append((row.pos, row.depth - 1))
                    s.rows -= 1
                    stopped.add(s)
                if s.req.mode == "speculative":
                    aside(s, row)                 # its samples wait for its turn after the pass
                elif row.tok >= 0 and not s.req.cancelled:
                    sampled.append(s.deliver(row.tok, row.logits))
                if row.go:                   # its positions so far are done; the next runs in its place
                    s.rows, s.done, s.started = s.rows + 1, row.pos + 1, row.pos + 2
                touched.add(s)
            for s in touched:
                sampled += self._settle(s)
        for s in [s for s in self.scheduler.running if s.req.cancelled]:
            self._finish(s, "cancelled")
        for s in stopped:
            if s.seq is not None:
                self._alias(s)
        self.stats["head_rows"] += len(sampled)
        return sampled

    def _settle(self, s):
        """After a pass: a speculative request takes its turn (engine/speculative.py); a request whose
        rows have all finished has done its positions; the exits of positions done join req.exits
        (Live.settle_exits), and it ends if its last token is sampled; a cancelled one ends now.
        Returns the tokens a speculative turn delivered [(request, token)]."""
        r, out = s.req, []
        if r.mode == "speculative":
            out, cut = turn(s, self.stats)
            if cut is not None:                # the positions that went back: their rows go too
                self.runner.drop(s)
        if s.rows == 0:
            s.done = s.started
        s.settle_exits()
        if s.rows == 0 and s.ending and s.done >= s.runnable():
            self._finish(s, r.finish_reason)
        elif r.cancelled:
            self._finish(s, "cancelled")
        return out

    def _alias(self, s):
        """Eq. 11 on the request's table for its rows that stopped: their deeper entries alias the
        page of the depth they stopped at (RaggedSeq.stop)."""
        if s.stops:
            s.seq.stop(*zip(*s.stops))
            s.stops = []

    # ------------------------------------------------------------------ preemption and endings

    def _evict(self):
        """The pool ran dry (App. A.2): the request the scheduler hands back loses its pages and its
        rows (the replay on its return computes them again from its exits so far), or, alone and
        still too big, ends where it is with the tokens it has (finish reason "length", Request.note
        says why)."""
        s, cut = self.scheduler.evict()
        if cut is not None:
            s.req.note = cut
            self._finish(s, "length")
            return
        self._release(s)
        s.preempted()
        self.stats["preemptions"] += 1

    def _release(self, s):
        """s lets go of its pages (Live.release) after Eq. 11 for its last stops; the runner forgets
        it. Returns its page accounting."""
        self._alias(s)
        self.runner.drop(s)
        return s.release()

    def _finish(self, s, reason, error=None):
        r = s.req
        if s.seq is not None:
            r.kv = dict(self._release(s), block_evals=s.evals_before)
        r.finish_reason, r.error = reason, error
        self.scheduler.remove(s)          # nothing here keeps it: its owner holds the request
        self.stats["finished"] += 1
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    @torch.inference_mode()
    def fail_running(self, error, queued=False):
        """After an unexpected error inside a step: end every admitted request with `error` and
        return its pages; waiting requests stay queued (they were not part of the step), unless
        `queued` (a server's stop: every request ends)."""
        for s in list(self.scheduler.running) + (list(self.scheduler.waiting) if queued else []):
            self._finish(s, "error", error)

    def check(self):
        """Page invariants of the pool and of every live sequence, the running decode depths against
        a recount, and the runner's own (tests call it after every step). It reads nothing that
        changes what runs next."""
        self.pool.check()
        running = self.scheduler.running
        for s in running:
            s.seq.check()
            dec = s.req.exits[len(s.req.prompt):]
            assert s.decode_depths == [sum(dec), len(dec)], (s.decode_depths, dec)
        held = sum(int(s.seq.real[:s.seq.n].sum()) for s in running)
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"
        self.runner.check(running)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "serve with `python server.py --ckpt out/`, sample with `python sample.py "
            "--ckpt out/`, benchmark with `python -m lab.bench --what=engine`")

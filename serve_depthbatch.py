"""
The depth-queue decoder (App. A.2): inference modes, the scheduler, and the engine of continuous
mixed-depth batching over one shared Ragged-KV page pool.

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

The LM head runs on the rows whose exit samples a token. With a real vocabulary it weighs as much as
the block, so head="shared" lets exited rows wait a few passes to share one call while waiting is
cheaper than a call; the tokens are the same either way.

What a row is (its request's live state, its paged reads and writes) is rows.py; the Request that
callers fill in and read back is request.py. The HTTP API over this engine is server.py; its
benchmark is `python bench.py --what=engine`.
"""
import math
import sys
from collections import deque
from typing import NamedTuple, Optional

import torch

from configurator import UserError
from kernels import resolve_impl
from model import FULL, check_prompt, exit_now
from ragged import PagePool, RaggedSeq, alloc_wave, memory_bytes, page_bytes
from request import SEED_MAX, sample_token
from rows import Group, Live, RowsView, embed_new, keep_one_depth

# ----------------------------------------------------------------------------- modes (§3, Table 17)

class Rule(NamedTuple):
    """How one kind of token (a prompt's or a decoded one) runs in a mode."""
    exit: str             # "never": to the last depth; "thr": the request's τ; "prefill": the ETE options (App. E.2)
    run_full: bool        # keep running to the last depth after the exit is decided (Ouro's lanes, every depth filled)
    keep: Optional[str]   # the one depth every later read keeps (Table 17: "last" = U, "exit" = e_i); None: Eq. 7


class Mode(NamedTuple):
    prompt: Rule
    decode: Rule


MODES = {
    "fixed":        Mode(prompt=Rule("never", False, None), decode=Rule("never", False, None)),
    "ouro":         Mode(prompt=Rule("thr", True, None), decode=Rule("thr", True, None)),
    "dense_ragged": Mode(prompt=Rule("never", False, None), decode=Rule("thr", False, None)),
    "ete_ragged":   Mode(prompt=Rule("prefill", False, None), decode=Rule("thr", False, None)),
    "last_kv":      Mode(prompt=Rule("never", True, "last"), decode=Rule("thr", True, "last")),
    "shared_kv":    Mode(prompt=Rule("never", True, "last"), decode=Rule("thr", False, "exit")),
    "collapse_kv":  Mode(prompt=Rule("prefill", True, "exit"), decode=Rule("thr", False, "exit")),
}
SCHEDULERS = ["continuous", "nested", "fixed"]
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

    def take(self, live=None):
        """The rows of every request (or of one Live), out of the queue as [(Live, state)], each
        request charged the passes its rows waited."""
        mine = [e for e in self.rows if live is None or e[0] is live]
        self.rows = [e for e in self.rows if not (live is None or e[0] is live)]
        for s, _, w in mine:
            s.waited += w
        return [(s, h) for s, h, _ in mine]

    def drop(self, live):
        self.rows = [e for e in self.rows if e[0] is not live]


def scheduler_for(mode):
    """The scheduler for requests all of one mode (sample.py, eval.py): fixed-depth requests go in
    waves, every token all its loops at once (no exits to decide); the others pass by pass."""
    return "fixed" if mode == "fixed" else "continuous"


def prompt_thresholds(n, thr, prefill_thr=None, prefill_schedule="", prefix_full=0):
    """Per-token thresholds for an ETE-Ragged prefill (App. E.2): a threshold of its own, a cosine
    schedule from 1 (full depth) at the first prompt token down to τ at the last, and the first k
    tokens at full depth (the Ouro-2.6B prefix fix)."""
    base = thr if prefill_thr is None else prefill_thr
    taus = torch.full((n,), float(base), dtype=torch.float64)
    if prefill_schedule == "cosine" and n > 1:
        t = torch.arange(n, dtype=torch.float64) / (n - 1)
        taus = base + (1 - base) * (1 + torch.cos(math.pi * t)) / 2
    taus[:prefix_full] = FULL
    return taus


# ----------------------------------------------------------------------------- requests against the modes

def n_run(r, U):
    """The depths a request's tokens may run: U, or its own depth in fixed mode."""
    return (r.depth or U) if r.mode == "fixed" else U


def min_pages(r, U):
    """Pages a request needs even with every token exiting as early as it can."""
    prompt = MODES[r.mode].prompt
    prompt_full = prompt.exit == "never" or prompt.run_full
    return len(r.prompt) * (n_run(r, U) if prompt_full else 1) + max(r.max_tokens - 1, 0)


def check_request(r, cfg, n_pages):
    """The one validation of a request (the server's too): UserError naming the field when r is
    malformed or could never fit in a pool of n_pages. Reads nothing that the engine changes, so
    any thread may call it."""
    U = cfg.n_loops
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    num = lambda v: whole(v) or (isinstance(v, float) and math.isfinite(v))      # no NaN, no infinity
    if not isinstance(r.mode, str) or r.mode not in MODES:
        raise UserError(f"mode={r.mode!r}; allowed: {', '.join(MODES)}", "mode")
    for key, ok, allowed in [
            ("thr", num(r.thr) and 0 <= r.thr <= 1, "a number in [0, 1]"),
            ("max_tokens", whole(r.max_tokens) and r.max_tokens >= 1, "an integer >= 1"),
            ("temperature", num(r.temperature) and 0 <= r.temperature <= 2, "a number in [0, 2]"),
            ("top_p", num(r.top_p) and 0 < r.top_p <= 1, "a number in (0, 1]"),
            ("top_k", whole(r.top_k) and r.top_k >= 0, "an integer >= 0"),
            ("depth", whole(r.depth) and 0 <= r.depth <= U, f"an integer in 0..{U}"),
            ("seed", whole(r.seed) and 0 <= r.seed <= SEED_MAX, "an integer in [0, 2**64 - 1]"),
            ("prefix_full", whole(r.prefix_full) and r.prefix_full >= 0, "an integer >= 0"),
            ("prefill_schedule", r.prefill_schedule in ("", "cosine"), "'' or 'cosine'"),
            ("prefill_thr", r.prefill_thr is None or (num(r.prefill_thr) and 0 <= r.prefill_thr <= 1),
             "a number in [0, 1]")]:
        if not ok:
            raise UserError(f"{key}={getattr(r, key)!r}: must be {allowed}", key)
    if (r.prefill_thr is not None or r.prefill_schedule or r.prefix_full) and MODES[r.mode].prompt.exit != "prefill":
        raise UserError(f"prefill_thr/prefill_schedule/prefix_full shape a ragged prefill; mode={r.mode} has none",
                        "mode")
    check_prompt(cfg, r.prompt, r.max_tokens)
    if min_pages(r, U) > n_pages:
        raise UserError(f"the request needs at least {min_pages(r, U)} KV pages (prompt of {len(r.prompt)} tokens "
                        f"in mode {r.mode}, {r.max_tokens} new tokens) but the pool has {n_pages}")


def as_fixed(r, U):
    """The fixed scheduler runs every request as Ouro's code does, every token all its loops: the
    request becomes a fixed one (a fixed request keeps its depth)."""
    if r.mode in MODES:
        depth = (r.depth if r.mode == "fixed" else 0) or U
        r.mode, r.depth, r.prefill_thr, r.prefill_schedule, r.prefix_full = "fixed", depth, None, "", 0


def position_rules(r, start, end):
    """How the rows of positions start..end-1 of request r run, by its mode (MODES): per position the
    threshold τ, whether it runs on to its last depth after its exit (full), the exit it replays
    after a preemption (forced; 0: decide) and the Table 17 depth it keeps."""
    n = len(r.prompt)
    taus, full, forced, keep = [], [], [], []
    ptaus = None
    for p in range(start, end):
        kind, run_full, keep_rule = MODES[r.mode].prompt if p < n else MODES[r.mode].decode
        if kind == "prefill":
            if ptaus is None:
                ptaus = prompt_thresholds(n, r.thr, r.prefill_thr, r.prefill_schedule, r.prefix_full).tolist()
            tau = ptaus[p]
        else:
            tau = FULL if kind == "never" else r.thr
        taus.append(tau)
        full.append(run_full)
        forced.append(r.exits[p] if p < len(r.exits) else 0)
        keep.append(keep_rule)
    return taus, full, forced, keep


def decode_rule(r):
    """How r's decode tokens run (its position_rules past the prompt): (τ, runs on to its last depth)."""
    rule = MODES[r.mode].decode
    return (FULL if rule.exit == "never" else r.thr), rule.run_full


def keeps_one_depth(r):
    """Table 17 baselines: their prompt runs whole and their tokens one at a time, as defined."""
    return MODES[r.mode].prompt.keep is not None or MODES[r.mode].decode.keep is not None


def chunk_end(s, budget):
    """Where the next chunk of positions of s (s.done.., up to s.runnable()) ends, given the rows left
    in this step's budget; None: wait. A decode token always runs."""
    n, start, avail = len(s.req.prompt), s.done, s.runnable()
    if start >= avail:
        return None
    if keeps_one_depth(s.req):
        return n if start < n else start + 1
    if start == avail - 1:
        return avail                    # one decode token: always runs
    return min(avail, start + budget) if budget > 0 else None


def fit_chunk(s, end, free, U):
    """A chunk that needs more than the free pages (a row takes one per depth it may run) starts
    smaller; None: it waits (nothing fits, or a Table 17 prompt, which runs whole)."""
    depths = n_run(s.req, U)
    if (end - s.done) * depths <= free:
        return end
    end = s.done + max(free // depths, 0)
    return None if end <= s.done or keeps_one_depth(s.req) else end


def check_pool(model, kv_pages):
    """A pool of kv_pages must fit the device's memory (UserError naming --kv_pages)."""
    need, have = kv_pages * page_bytes(model), memory_bytes(model.lm_head.weight.device)
    if need > have:
        raise UserError(f"--kv_pages={kv_pages}: a pool of {kv_pages} pages of {page_bytes(model) / 1024:.1f} KiB "
                        f"needs {need / 2**30:.1f} GiB; this machine has {have / 2**30:.1f} GiB", "kv_pages")


def dry_pool(r, pool, U):
    """The error of a request that runs the pool dry alone: how many pages it held and could need."""
    worst = (len(r.prompt) + r.max_tokens - 1) * n_run(r, U)
    return (f"the pool has {pool.n_pages} KV pages; this request held {pool.used} after {len(r.tokens)} of "
            f"{r.max_tokens} tokens and needs up to {worst} (prompt of {len(r.prompt)} tokens in mode {r.mode}, "
            "every position at every depth)")


def weight_bytes(model):
    """The weights a pass of the block reads (all L layers) and those an LM-head call reads: the two
    prices of the weight-read cost model (decode is weight-bound at small batch)."""
    head = model.lm_head.weight
    return sum(p.numel() * p.element_size() for p in model.layers.parameters()), head.numel() * head.element_size()


# ----------------------------------------------------------------------------- the engine

class Engine:
    """Continuous mixed-depth batching over one shared page pool. Call add() and step() from one
    thread (server.py runs them on an engine thread); Request.cancelled may be set from anywhere.

    stats counts what the engine did (passes, rows, preemptions, replayed rows, the most requests
    in flight); last_pass lists (request, rows, is decode) of the latest step's passes, of which
    there were last_passes (1, or n_run in a fixed wave), for observers such as the benchmark,
    which keeps its own windows."""

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
        self.max_batch, self.max_rows, self.scheduler, self.attn = max_batch, max_rows, scheduler, attn
        self.waiting, self.running, self.finished = deque(), [], []     # Live, Live, Request
        self.next_id = 0
        self.stats = dict(passes=0, rows=0, preemptions=0, replayed_rows=0, max_in_flight=0, head_calls=0, head_rows=0)
        self.last_pass, self.last_passes = [], 0
        # the "shared" head: the exited rows whose tokens wait for a head call (HeadQueue), and the cost
        # model that decides how long: the weight bytes a block pass and a head call read (decode is
        # weight-bound: a call costs about the same for 1 row as for 8)
        self.head, self.pending, self.emitted = head, HeadQueue(), []
        self.w_block, self.w_head = weight_bytes(model)

    def add(self, r):
        """Queue a request after checking it. Raises UserError (nothing queued) if it is malformed
        or could never fit in the whole pool."""
        if self.scheduler == "fixed":
            as_fixed(r, self.U)
        self.check_request(r)
        self.waiting.append(Live(r, self.next_id))
        self.next_id += 1
        return r

    def check_request(self, r):
        check_request(r, self.model.config, self.pool.n_pages)

    def busy(self):
        return bool(self.waiting or self.running)

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
        self.emitted = []
        self._drop_cancelled()
        groups, pages = self._schedule()                  # admit, start groups, a fresh page per row and pass
        if not groups:                                     # nothing runs: the waiting rows take their head call
            self._sample(self.pending.take())
            return self.emitted
        hn, gate, h_next = self._run_block(groups, pages)  # the shared block on every row, at its own depth
        survive, keep, to_sample = self._decide_exits(groups, gate)    # Eq. 4, each row with its τ
        self._alias_stopped(groups, keep, h_next, survive)  # Eq. 11: stopped rows alias their terminal page
        self._sample(self._head_rows(groups, [(s, hn[i]) for s, i in to_sample]))   # the LM head, and sampling
        self._retire(groups)                               # positions done; finished requests free their pages
        return self.emitted

    def _drop_cancelled(self):
        for s in [s for s in list(self.running) + list(self.waiting) if s.req.cancelled]:
            self._finish(s, "cancelled")

    def _schedule(self):
        """Start groups within the row budget, then give every in-flight row its page for its depth
        (in a fixed wave, for every depth it runs). Returns the groups, sorted: one-row groups
        (decode tokens) first, by position, as the padded attention tables want them; and the pages
        of every pass this step runs, one tensor per pass."""
        self._start_groups()
        batch = self._allocate()
        batch.sort(key=lambda gp: (len(gp[0].pos) > 1, gp[0].pos.tolist()[-1]))
        for g, p in batch:
            g.live.seq.write_pages(g.pos, slice(g.d, g.d + p.shape[1]), p)   # writes never go through an alias
        groups = [g for g, _ in batch]
        n_pass = batch[0][1].shape[1] if batch else 0
        assert all(p.shape[1] == n_pass for _, p in batch), "a fixed wave runs every group to the same depth"
        self.last_pass = [(g.live.req, len(g.pos), g.start >= len(g.live.req.prompt)) for g in groups]
        self.last_passes = n_pass
        self.stats["passes"] += n_pass
        self.stats["rows"] += n_pass * sum(len(g.pos) for g in groups)
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self.running))
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
        Returns the updated Π(1-λ), per group which rows run on, and the rows whose exit samples a
        token [(Live, row)]."""
        survive = torch.cat([g.survive for g in groups])
        taus = torch.tensor([t for g in groups for t in g.tau], dtype=survive.dtype, device=survive.device)
        survive, hit = exit_now(survive, gate, taus)
        hit = hit.tolist()                                 # the decisions, on the host: one copy per step
        keep, to_sample, row = [], [], 0
        for g in groups:
            last, runs_on = g.d == g.n_run - 1, []
            for i, p in enumerate(g.pos.tolist()):
                now = g.forced[i] == g.d + 1 if g.forced[i] else hit[row + i]
                if g.exits[p - g.start] == 0 and (now or last):
                    g.exits[p - g.start] = g.d + 1
                    if p == g.sample_pos:
                        to_sample.append((g.live, row + i))
                    runs_on.append(g.full[i] and not last)      # a full row (Dense prompt) runs on to depth U
                else:
                    runs_on.append(not last)
            keep.append(runs_on)
            row += len(g.pos)
        return survive, keep, to_sample

    def _alias_stopped(self, groups, keep, h_next, survive):
        """Rows that stopped leave their group: their deeper table entries alias the page of the
        depth they stopped at (Eq. 11: A_d[i] = P_{i,min(d,e_i)}), so later reads find it at every
        deeper depth. The rows that run on carry their state to the next depth."""
        row, dev = 0, self.device
        for g, runs_on in zip(groups, keep):
            sl = slice(row, row + len(g.pos))
            row += len(g.pos)
            if all(runs_on):
                g.h, g.survive = h_next[sl], survive[sl]
            elif any(runs_on):
                kept = torch.tensor(runs_on)
                stopped, g.pos = g.pos[~kept], g.pos[kept]
                g.h, g.survive = h_next[sl][kept.to(dev)], survive[sl][kept.to(dev)]
                g.tau, g.full, g.forced = ([x for x, k in zip(v, runs_on) if k] for v in (g.tau, g.full, g.forced))
            else:                          # all stopped (a decode token's one row, most often): no indexing
                stopped, g.pos = g.pos, g.pos[:0]
            if not all(runs_on):
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
        if self.head == "eager" or self.scheduler == "fixed":   # a fixed wave's rows all exit on its last pass
            return exited
        self.pending.join(exited)
        waits = self.pending.waits()
        if not waits:
            return []
        others = (any(len(g.pos) for g in groups) or self.waiting
                  or any(s.group is None and s.done < s.runnable() for s in self.running))
        if self.waiting:
            dear, limit = len(waits) * self.w_block >= self.w_head * self.max_batch, MAX_WAIT
        else:
            left = {s: self._passes_left(s) for s in self.running}
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
        token (one call for all), and the sampling, each request keyed by its seed and the position."""
        if not rows:
            return
        logits = self.model.lm_head(torch.stack([h for _, h in rows]))
        self.stats["head_calls"] += 1
        self.stats["head_rows"] += len(rows)
        greedy = logits.argmax(-1).tolist()                   # temperature 0, for every row in one call
        for (s, _), lg, top in zip(rows, logits, greedy):
            r = s.req
            if r.keep_logits:
                r.logits.append(lg.detach().cpu())
            position = len(r.prompt) + len(r.tokens) - 1      # of the row that exited: keys the sampler's noise
            tok = top if r.temperature == 0 else sample_token(lg, r.temperature, r.top_k, r.top_p, r.seed, position)
            r.tokens.append(tok)
            self.emitted.append((r, tok))
            if r.on_token is not None:
                r.on_token(r, tok)
            if len(r.tokens) >= r.max_tokens or tok in r.stop:
                s.ending = True
                r.finish_reason = "stop" if tok in r.stop else "length"
                if s.group is None and s.done >= s.runnable():    # a row that waited: its positions are done
                    self._finish(s, r.finish_reason)

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

    # ------------------------------------------------------------------ scheduling

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

    def _start_groups(self):
        """Give every running request without rows its next group, and admit waiting requests,
        within the row budget and the free pages. `nested` starts groups only between waves; a
        `fixed` wave holds requests of one depth, that of the oldest request that starts a group."""
        in_flight = [s for s in self.running if s.group is not None]
        if self.scheduler == "nested" and in_flight:
            return
        rows = sum(len(s.group.pos) for s in in_flight)
        free = len(self.pool.free) - rows                   # every in-flight row takes a page this step
        started, wave = False, None
        joins = lambda s: self.scheduler != "fixed" or wave in (None, n_run(s.req, self.U))
        for s in list(self.running):
            if s.group is None and joins(s):
                end = chunk_end(s, self.max_rows - rows)
                if end is not None and end - s.done > 1:    # one decode row always starts (allocation preempts)
                    end = fit_chunk(s, end, free, self.U)
                if end is None:
                    continue
                s.group = self._new_group(s, end)
                rows += end - s.done
                free -= (end - s.done) * n_run(s.req, self.U)
                started, wave = True, n_run(s.req, self.U)
        while self.waiting and len(self.running) < self.max_batch and joins(self.waiting[0]):
            s = self.waiting[0]
            end = chunk_end(s, self.max_rows - rows)
            if end is None:
                break
            if s.req.exits and self.running and free < sum(s.req.exits) + n_run(s.req, self.U):
                break   # a preempted request returns when its replay and one more token fit: no thrashing
            end = fit_chunk(s, end, free, self.U)
            if end is None:
                break
            self.waiting.popleft()
            s.seq = RaggedSeq(self.pool, self.U, len(s.req.prompt) + s.req.max_tokens)
            self.running.append(s)
            s.group = self._new_group(s, end)
            rows += end - s.done
            free -= (end - s.done) * n_run(s.req, self.U)
            started, wave = True, n_run(s.req, self.U)
        if not started and not in_flight and self.running and not self.pending:
            # Nothing can start: the pages are held by requests that need more. Free the newest.
            self._evict(self.running[-1])

    def _evict(self, s):
        """Preempt s, or fail it when it is alone and still does not fit."""
        if len(self.running) == 1:
            self._finish(s, "error", dry_pool(s.req, self.pool, self.U))
        else:
            self.preempt(s)

    def preempt(self, s):
        """Free every page of s and requeue it at the front; its exits so far are kept, so that on
        its return its cache is rebuilt by a recomputation that replays them (App. A.2: memory is
        capacity, and a preempted request continues exactly as it would have). A token of s waiting
        for the shared head is sampled first; if it was the last one, s is done instead."""
        mine = self.pending.take(s)
        if mine:
            self._sample(mine)
            if s not in self.running:         # that was its last token
                return
        s.evals_before += s.seq.block_evals
        s.seq.release()
        s.seq, s.group, s.done = None, None, 0      # s.req.exits stay: replayed on return
        s.req.preemptions += 1
        self.stats["preemptions"] += 1
        self.running.remove(s)
        self.waiting.appendleft(s)

    def _allocate(self):
        """A page for every in-flight row at its depth, oldest request first; on exhaustion preempt
        the most recently admitted request and try again. The `fixed` scheduler runs waves: its
        rows take a page for every depth at once, and the step runs all their passes (Ouro's way:
        no row can exit early, and nothing joins a wave under way). The pages are taken in one piece
        (ragged.alloc_wave), so that a batch that starts together reads them in place. Returns
        [(group, its pages [rows, depths])]."""
        out, need = [], 0
        for s in list(self.running):
            g = s.group
            if g is None:
                continue
            depths = range(g.d, g.n_run if self.scheduler == "fixed" else g.d + 1)
            while s in self.running and s.group is g:      # all of a group's pages or none
                if need + len(g.pos) * len(depths) <= len(self.pool.free):
                    out.append((g, depths))
                    need += len(g.pos) * len(depths)
                    break
                self._evict(self.running[-1])
        out = [(g, depths) for g, depths in out if g.live.group is g]
        return list(zip([g for g, _ in out], alloc_wave(self.pool, [(g.live.seq, g.pos, d) for g, d in out])))

    # ------------------------------------------------------------------ endings

    def _finish(self, s, reason, error=None):
        r = s.req
        self.pending.drop(s)
        if s.seq is not None:
            r.kv = dict(s.seq.stats(), block_evals=s.seq.block_evals + s.evals_before)
            s.seq.release()
            s.seq = None
        s.group, r.finish_reason, r.error = None, reason, error
        if s in self.running:
            self.running.remove(s)
        if s in self.waiting:
            self.waiting.remove(s)
        self.finished.append(r)
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    def fail_running(self, error):
        """After an unexpected error inside a step: end every admitted request with `error` and
        return its pages; waiting requests stay queued (they were not part of the step)."""
        for s in list(self.running):
            self._finish(s, "error", error)

    def check(self):
        """Page invariants of the pool and of every live sequence (tests call it after every step)."""
        self.pool.check()
        for s in self.running:
            s.seq.check()
        for s in self.running:      # the running decode depth that _passes_left reads, against a recount
            dec = s.req.exits[len(s.req.prompt):]
            assert s.decode_depths == [sum(dec), len(dec)], (s.decode_depths, dec)
        held = sum(int(s.seq.real[:s.seq.n].sum()) for s in self.running)
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"


if __name__ == "__main__":
    sys.exit("serve_depthbatch.py is the engine, a library: serve with `python server.py --ckpt out/ --port 8000`, "
             "benchmark with `python bench.py --what=engine`")

"""
The depth-batching engine (App. A.2, continuous mixed-depth batching), its baselines, a benchmark
and an OpenAI-style HTTP API.

    python serve_depthbatch.py --bench                      # schedulers x modes x batch sizes, one JSON line
    python serve_depthbatch.py --ckpt out/ --port 8000      # serve /v1/completions on 127.0.0.1:8000

All loop iterations share one set of weights, so tokens at different depths can go through the
block in the same batch. A *row* is one token of one request at one depth, with its own position,
its own page-table column and its own K/V page. Each engine step applies the block once to every
in-flight row whatever its depth (`continuous`): a row that exits (Eq. 4, each request with its own
threshold τ) is sampled at once and its request's next token joins at depth 1 on the next step, so
every pass is useful work and passes approach the work-conserving bound Σ e_i / B. Baselines in the
same engine: `nested` (the paper's runner: a wave of rows stays in a nested loop until all of them
have exited) and `fixed` (every token runs all U loops, as Ouro's code and vLLM do).

Memory is capacity: one shared PagePool holds every request's pages, a RaggedSeq per request maps
(position, depth) to pages with aliases (Eq. 11), and admission reserves only what a prefill chunk
needs. When the pool runs out, the most recently admitted request is preempted (pages freed,
requeued); when it returns, its cache is rebuilt by recomputation that replays the exit depths it
already had, so its continuation is exactly what it would have been.
"""
import json
import os
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from configurator import device_rule, parse, run_cli
from kernels import IMPLS, paged_attention, paged_chunk_attention, resolve_impl
from model import FULL, UserError, at_least_fp32, exit_stats, load_checkpoint, prompt_thresholds, resolve_device, sample_token
from ragged import PagePool, PoolExhausted, RaggedSeq

# How each mode runs prompt and decode tokens: (threshold, keep running to the last depth after the
# exit is decided, which depth every later read keeps). Thresholds: "never" = run to the last depth,
# "thr" = the request's τ, "prefill" = the ETE prefill options (App. E.2). Keeping one depth per
# token is the Table 17 baselines ("last" = U, "exit" = e_i).
MODES = {
    "fixed":        dict(prompt=("never", False, None), decode=("never", False, None)),
    "ouro":         dict(prompt=("thr", True, None), decode=("thr", True, None)),
    "dense_ragged": dict(prompt=("never", False, None), decode=("thr", False, None)),
    "ete_ragged":   dict(prompt=("prefill", False, None), decode=("thr", False, None)),
    "last_kv":      dict(prompt=("never", True, "last"), decode=("thr", True, "last")),
    "shared_kv":    dict(prompt=("never", True, "last"), decode=("thr", False, "exit")),
    "collapse_kv":  dict(prompt=("prefill", True, "exit"), decode=("thr", False, "exit")),
}
SCHEDULERS = ["continuous", "nested", "fixed"]


@dataclass(eq=False)   # requests compare by identity (they sit in queues and lists)
class Request:
    """One generation. The engine fills the fields below the line."""
    prompt: list                   # token ids
    max_tokens: int = 16           # tokens to sample (the request ends after them, or at a stop id)
    mode: str = "dense_ragged"     # see MODES
    thr: float = 0.5               # this request's exit threshold τ (Eq. 4)
    depth: int = 0                 # fixed mode: loops per token (0: U)
    temperature: float = 0.0       # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0                  # seeds this request's sampler: reproducible whatever else is batched
    stop: tuple = ()               # token ids that end the request (kept in tokens)
    prefill_thr: float = None      # ETE prefill options (App. E.2)
    prefill_schedule: str = ""
    prefix_full: int = 0
    # ---- filled by the engine
    id: int = -1
    tokens: list = field(default_factory=list)       # sampled tokens, in order
    exits: list = field(default_factory=list)        # exit depth of every position that ran (1-based)
    finish_reason: str = None      # length | stop | cancelled | error
    error: str = None
    kv: dict = None                # page accounting of this request at its end
    cancelled: bool = False        # set from any thread; the engine frees the pages at its next step
    preemptions: int = 0
    on_token: object = None        # called as on_token(request, token) by the engine thread (None: ended)
    keep_logits: bool = False      # keep the logits each token was sampled from (in .logits)
    logits: list = field(default_factory=list, repr=False)
    seq: object = field(default=None, repr=False)
    group: object = field(default=None, repr=False)
    done: int = 0                  # positions whose rows all finished
    generator: object = field(default=None, repr=False)
    evals_before: int = 0          # block evaluations of caches freed by preemption
    ending: bool = False           # the last token is sampled; ends when its group finishes

    @property
    def prompt_exits(self):
        return self.exits[:len(self.prompt)]

    @property
    def decode_exits(self):
        return self.exits[len(self.prompt):]

    @property
    def token_exits(self):
        """The depth that produced each sampled token (the exit of the position before it)."""
        return self.exits[len(self.prompt) - 1:len(self.prompt) - 1 + len(self.tokens)]


class Group:
    """The rows of one request in flight: consecutive positions that started together and run
    depth by depth (a prompt chunk, a replay chunk, or one decode token). Rows leave as they stop."""

    def __init__(self, req, start, ids, taus, full, forced, keep, n_run):
        self.req, self.start, self.size, self.n_run = req, start, len(ids), n_run
        self.pos = torch.arange(start, start + len(ids))   # host side: page tables
        self.ids = ids                                      # token ids; the first step embeds all new groups at once
        self.h = None                                       # [T, C] on the device, from the first step
        self.survive = None                                 # Π (1 - λ) so far (Eq. 4), from the first step
        self.tau, self.full, self.forced = taus, full, forced   # host lists, per row still running;
        self.keep = keep                                    # forced: a replayed exit (0: decide)
        self.exits = [0] * len(ids)                         # decided exits, by position (0: none)
        self.d = 0                                          # the depth the rows run next
        self.sample_pos = None                              # whose exit samples a token


class RowsView:
    """The attention hook of one engine step: every row writes its fresh page for this depth in
    every layer, then (all writes first) each row reads keys 0..its position through its own
    request's table column at its own depth (Eq. 7, Eq. 11). parts: (page_ids, lengths) for
    consecutive rows; a 2-D page_ids is a kernels.paged_attention call (decode rows, one per request,
    in one or two tables), a 1-D one a prompt chunk whose rows share their keys
    (kernels.paged_chunk_attention)."""

    def __init__(self, pool, pages, parts, impl):
        self.pool, self.pages, self.parts, self.impl = pool, pages, parts, impl

    def attend(self, layer, q, k, v):
        pool = self.pool
        pool.k[layer, self.pages] = k[0].transpose(0, 1)                    # [R, Hkv, D]
        pool.v[layer, self.pages] = v[0].transpose(0, 1)
        pool.writes += len(self.pages)
        qs = q[0].transpose(0, 1).split([len(lengths) for _, lengths in self.parts])    # [R, Hq, D] in parts
        ys = [paged_chunk_attention(qp, pool.k[layer], pool.v[layer], ids, lengths) if ids.dim() == 1 else
              paged_attention(qp, pool.k[layer], pool.v[layer], ids, lengths, impl=self.impl)
              for qp, (ids, lengths) in zip(qs, self.parts)]
        return (ys[0] if len(ys) == 1 else torch.cat(ys)).transpose(0, 1)[None]   # (1, Hq, R, D)


class Engine:
    """Continuous mixed-depth batching over one shared page pool. Call add() and step() from one
    thread (serve() runs them on an engine thread); Request.cancelled may be set from anywhere."""

    def __init__(self, model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto"):
        if scheduler not in SCHEDULERS:
            raise UserError(f"--scheduler={scheduler!r}; allowed: {', '.join(SCHEDULERS)}")
        self.model, self.U = model, model.config.n_loops
        self.device = model.lm_head.weight.device
        try:
            attn = resolve_impl(attn, self.device)       # "auto": the fastest paged attention on this device
        except ValueError as e:
            raise UserError(str(e))
        self.pool = PagePool.for_model(model, kv_pages)
        self.max_batch, self.max_rows, self.scheduler, self.attn = max_batch, max_rows, scheduler, attn
        self.waiting, self.running, self.finished = deque(), [], []
        self.next_id = 0
        self.stats = dict(passes=0, rows=0, decode_rows=0, prefill_rows=0, max_in_flight=0, preemptions=0,
                          steady_passes=0, steady_slots=0, steady_decode_rows=0, replayed_rows=0)

    # ------------------------------------------------------------------ requests

    def n_run(self, r):
        return (r.depth or self.U) if r.mode == "fixed" else self.U

    def min_pages(self, r):
        """Pages a request needs even with every token exiting as early as it can."""
        prompt_full = MODES[r.mode]["prompt"][0] == "never" or MODES[r.mode]["prompt"][1]
        return len(r.prompt) * (self.n_run(r) if prompt_full else 1) + max(r.max_tokens - 1, 0)

    def add(self, r):
        """Queue a request after checking it. Raises UserError (nothing queued) if it is malformed
        or could never fit in the whole pool."""
        if self.scheduler == "fixed" and r.mode in MODES:   # the Ouro / vLLM behaviour: all U loops
            r.mode, r.depth, r.prefill_thr, r.prefill_schedule, r.prefix_full = "fixed", self.U, None, "", 0
        self.check_request(r)
        r.id, self.next_id = self.next_id, self.next_id + 1
        r.generator = torch.Generator().manual_seed(r.seed)
        self.waiting.append(r)
        return r

    def check_request(self, r):
        """Raise UserError naming the field if r is malformed or could never fit in the pool. Reads
        nothing that the engine thread changes, so any thread may call it."""
        cfg = self.model.config
        if r.mode not in MODES:
            raise UserError(f"mode={r.mode!r}; allowed: {', '.join(MODES)}")
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
        for key, ok, allowed in [("thr", num(r.thr) and 0 <= r.thr <= 1, "a number in [0, 1]"),
                                 ("max_tokens", whole(r.max_tokens) and r.max_tokens >= 1, "an integer >= 1"),
                                 ("temperature", num(r.temperature) and r.temperature >= 0, "a number >= 0"),
                                 ("top_p", num(r.top_p) and 0 < r.top_p <= 1, "a number in (0, 1]"),
                                 ("top_k", whole(r.top_k) and r.top_k >= 0, "an integer >= 0"),
                                 ("depth", whole(r.depth) and 0 <= r.depth <= self.U, f"an integer in 0..{self.U}"),
                                 ("seed", whole(r.seed) and r.seed >= 0, "an integer >= 0"),
                                 ("prefix_full", whole(r.prefix_full) and r.prefix_full >= 0, "an integer >= 0"),
                                 ("prefill_schedule", r.prefill_schedule in ("", "cosine"), "'' or 'cosine'"),
                                 ("prefill_thr", r.prefill_thr is None or (num(r.prefill_thr) and 0 <= r.prefill_thr <= 1),
                                  "a number in [0, 1]")]:
            if not ok:
                raise UserError(f"{key}={getattr(r, key)!r}: must be {allowed}")
        if (r.prefill_thr is not None or r.prefill_schedule or r.prefix_full) and MODES[r.mode]["prompt"][0] != "prefill":
            raise UserError(f"prefill_thr/prefill_schedule/prefix_full shape a ragged prefill; mode={r.mode} has none")
        if not isinstance(r.prompt, list) or not r.prompt:
            raise UserError("prompt: give a non-empty list of token ids")
        bad = [t for t in r.prompt if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
        if bad:
            raise UserError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {cfg.vocab_size})")
        if len(r.prompt) + r.max_tokens > cfg.block_size:
            raise UserError(f"prompt of {len(r.prompt)} tokens + max_tokens={r.max_tokens} exceeds the context "
                            f"length block_size={cfg.block_size}")
        if self.min_pages(r) > self.pool.n_pages:
            raise UserError(f"the request needs at least {self.min_pages(r)} KV pages (prompt of {len(r.prompt)} tokens "
                            f"in mode {r.mode}, {r.max_tokens} new tokens) but the pool has {self.pool.n_pages}")

    def busy(self):
        return bool(self.waiting or self.running)

    def run(self, requests):
        """Add requests and step until all have finished. Returns them."""
        for r in requests:
            self.add(r)
        while self.busy():
            self.step()
        return requests

    # ------------------------------------------------------------------ scheduling

    def _role(self, r, p):
        return MODES[r.mode]["prompt" if p < len(r.prompt) else "decode"]

    def _new_group(self, r, end):
        """Rows for positions r.done..end-1: replayed positions run to their recorded exits."""
        n, start = len(r.prompt), r.done
        ctx = r.prompt + r.tokens
        taus, full, forced, keep = [], [], [], []
        ptaus = None
        for p in range(start, end):
            kind, run_full, keep_rule = self._role(r, p)
            if kind == "never":
                tau = FULL
            elif kind == "thr":
                tau = r.thr
            else:
                if ptaus is None:
                    ptaus = prompt_thresholds(n, r.thr, r.prefill_thr, r.prefill_schedule, r.prefix_full).tolist()
                tau = ptaus[p]
            taus.append(tau)
            full.append(run_full)
            forced.append(r.exits[p] if p < len(r.exits) else 0)
            keep.append(keep_rule)
        if end > r.seq.n:
            r.seq.extend(end - r.seq.n)           # the sequence's table covers every position started
        g = Group(r, start, ctx[start:end], taus, full, forced, keep, self.n_run(r))
        if end == len(ctx):                     # the newest token: its exit samples the next one
            g.sample_pos = end - 1
        self.stats["replayed_rows"] += sum(1 for f in forced if f)
        return g

    def _keeps(self, r):
        """Table 17 baselines: their prompt runs whole and their tokens one at a time, as defined."""
        return MODES[r.mode]["prompt"][2] is not None or MODES[r.mode]["decode"][2] is not None

    def _runnable(self, r):
        """Positions r must run: every known token but a final sampled one (it is never run)."""
        return len(r.prompt) + len(r.tokens) - (1 if r.ending else 0)

    def _group_end(self, r, budget):
        """Where the next group of r ends, given the rows left in this step's budget; None: wait."""
        n, start, avail = len(r.prompt), r.done, self._runnable(r)
        if start >= avail:
            return None
        if self._keeps(r):
            return n if start < n else start + 1
        if start == avail - 1:
            return avail                    # one decode token: always runs
        return min(avail, start + budget) if budget > 0 else None

    def _start_groups(self):
        """Give every running request without rows its next group, and admit waiting requests,
        within the row budget and the free pages. `nested` starts groups only between waves."""
        in_flight = [r for r in self.running if r.group is not None]
        if self.scheduler == "nested" and in_flight:
            return
        rows = sum(len(r.group.pos) for r in in_flight)
        free = len(self.pool.free) - rows                   # every in-flight row takes a page this step
        started = False
        for r in list(self.running):
            if r.group is None:
                end = self._group_end(r, self.max_rows - rows)
                if end is None:
                    continue
                if end - r.done > 1 and (end - r.done) * self.n_run(r) > free:   # a chunk waits for its pages,
                    end = r.done + max(free // self.n_run(r), 0)                 # or starts smaller
                    if end <= r.done or self._keeps(r):
                        continue
                r.group = self._new_group(r, end)
                rows += end - r.done
                free -= (end - r.done) * self.n_run(r)
                started = True
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            end = self._group_end(r, self.max_rows - rows)
            if end is None:
                break
            if r.exits and self.running and free < sum(r.exits) + self.n_run(r):
                break   # a preempted request returns when its replay and one more token fit: no thrashing
            if (end - r.done) * self.n_run(r) > free:
                end = r.done + max(free // self.n_run(r), 0)
                if end <= r.done or self._keeps(r):
                    break
            self.waiting.popleft()
            r.seq = RaggedSeq(self.pool, self.U, len(r.prompt) + r.max_tokens)
            self.running.append(r)
            r.group = self._new_group(r, end)
            rows += end - r.done
            free -= (end - r.done) * self.n_run(r)
            started = True
        if not started and not in_flight and self.running:
            # Nothing can start: the pages are held by requests that need more. Free the newest.
            self._evict(self.running[-1])

    def _evict(self, r):
        """Preempt r, or fail it when it is alone and still does not fit."""
        if len(self.running) == 1:
            worst = (len(r.prompt) + r.max_tokens - 1) * self.n_run(r)
            self._finish(r, "error", f"the pool has {self.pool.n_pages} KV pages; this request held {self.pool.used} "
                                     f"after {len(r.tokens)} of {r.max_tokens} tokens and needs up to {worst} "
                                     f"(prompt of {len(r.prompt)} tokens in mode {r.mode}, every position at every depth)")
        else:
            self.preempt(r)

    def preempt(self, r):
        """Free every page of r and requeue it at the front; its exits so far are kept for replay."""
        r.evals_before += r.seq.block_evals
        r.seq.release()
        r.seq, r.group, r.done = None, None, 0      # r.exits stay: replayed on return
        r.preemptions += 1
        self.stats["preemptions"] += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _allocate(self):
        """A page for every in-flight row at its depth, oldest request first; on exhaustion preempt
        the most recently admitted request and try again."""
        out = []
        for r in list(self.running):
            while r in self.running and r.group is not None:
                try:
                    out.append((r.group, r.seq.alloc_depth(r.group.pos, r.group.d)))
                    break
                except PoolExhausted:
                    self._evict(self.running[-1])
        return [(g, p) for g, p in out if g.req.group is g]

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self):
        """One pass of the block over every in-flight row. Returns [(request, token)] sampled."""
        for r in [r for r in list(self.running) + list(self.waiting) if r.cancelled]:
            self._finish(r, "cancelled")
        # requests wait, enough to fill the batch: a work-conserving scheduler would run a full pass
        steady = len(self.waiting) > 0 and len(self.waiting) + len(self.running) >= self.max_batch
        self._start_groups()
        batch = self._allocate()
        if not batch:
            return []
        batch.sort(key=lambda gp: (len(gp[0].pos) > 1, gp[0].pos.tolist()[-1]))   # one-row groups first, by position
        groups = [g for g, _ in batch]
        for g, pages in batch:
            g.req.seq.write_pages(g.pos, g.d, pages)          # writes never go through an alias
        sizes = [len(g.pos) for g in groups]
        pos = torch.cat([g.pos for g in groups])
        dev = self.device
        view = RowsView(self.pool, torch.cat([p for _, p in batch]).to(dev), self._attention_parts(groups), self.attn)
        self._embed_new(groups)
        h = torch.cat([g.h for g in groups])
        cos, sin = self.model.rope(pos.to(dev), h.dtype)
        hn, gate, h_next = self.model.exit_heads(self.model.block(h[None], cos, sin, view)[0])
        # Eq. 4 online, per row with its own τ; the decisions are made on the host (one copy per step)
        survive = torch.cat([g.survive for g in groups]) * (1 - torch.sigmoid(gate.to(at_least_fp32(gate.dtype))))
        hit = ((1 - survive).cpu() >= torch.tensor([t for g in groups for t in g.tau], dtype=survive.dtype)).tolist()
        self._count(groups, sizes, steady)
        emitted, to_sample, row = [], [], 0
        for g, n in zip(groups, sizes):
            last, keep = g.d == g.n_run - 1, []
            for i, p in enumerate(g.pos.tolist()):
                now = g.forced[i] == g.d + 1 if g.forced[i] else hit[row + i]   # replayed rows exit where they did
                if g.exits[p - g.start] == 0 and (now or last):
                    g.exits[p - g.start] = g.d + 1
                    if p == g.sample_pos:
                        to_sample.append((g.req, row + i))
                    keep.append(g.full[i] and not last)          # a full row (Dense prompt) runs on to depth U
                else:
                    keep.append(not last)
            sl = slice(row, row + n)
            if all(keep):
                g.h, g.survive = h_next[sl], survive[sl]
            else:
                if any(keep):                  # some rows go on
                    kept = torch.tensor(keep)
                    stopped, g.pos = g.pos[~kept], g.pos[kept]
                    g.h, g.survive = h_next[sl][kept.to(dev)], survive[sl][kept.to(dev)]
                    g.tau, g.full, g.forced = ([x for x, k in zip(v, keep) if k] for v in (g.tau, g.full, g.forced))
                else:                          # all stopped (a decode token's one row, most often): no indexing
                    stopped, g.pos = g.pos, g.pos[:0]
                g.req.seq.stop(stopped, g.d)                              # Eq. 11: deeper rows alias P_{i,e_i}
                self._keep(g, stopped)
            g.d += 1
            row += n
        if to_sample:
            logits = self.model.lm_head(hn[[i for _, i in to_sample]])
            greedy = logits.argmax(-1).tolist()                   # temperature 0, for every row in one call
            for (r, _), lg, top in zip(to_sample, logits, greedy):
                if r.keep_logits:
                    r.logits.append(lg.detach().cpu())
                tok = top if r.temperature == 0 else sample_token(lg.cpu(), r.temperature, r.top_k, r.top_p, r.generator)
                r.tokens.append(tok)
                emitted.append((r, tok))
                if r.on_token is not None:
                    r.on_token(r, tok)
                if len(r.tokens) >= r.max_tokens or tok in r.stop:
                    r.ending = True
                    r.finish_reason = "stop" if tok in r.stop else "length"
        for g in groups:
            r = g.req
            if len(g.pos) == 0 and r.group is g:                 # every row stopped: the positions are done
                r.exits[g.start:g.start + g.size] = g.exits
                r.done = g.start + g.size
                r.group = None
                if r.ending and r.done >= self._runnable(r):
                    self._finish(r, r.finish_reason)
        return emitted

    def _embed_new(self, groups):
        """The groups that start in this step (decode tokens, prompt chunks) are embedded in one call."""
        new = [g for g in groups if g.h is None]
        if new:
            ids = torch.tensor([t for g in new for t in g.ids], device=self.device)
            hs = self.model.embed_tokens(ids)
            ones = torch.ones(len(ids), dtype=at_least_fp32(hs.dtype), device=self.device)   # nothing exited yet
            for g, h, s in zip(new, hs.split([g.size for g in new]), ones.split([g.size for g in new])):
                g.h, g.survive = h, s

    def _attention_parts(self, groups):
        """What each row reads: entries 0..its position of its request's table column at its depth
        (Eq. 7 via Eq. 11). The one-row groups (decode tokens) go in padded [rows, maxlen] tables;
        each longer group (a prompt chunk) keeps its one shared list, so that prompt rows are not
        padded to the longest decode row nor gathered once per row. Flex takes every row at once."""
        flat = groups if self.attn == "flex" else [g for g in groups if len(g.pos) == 1]
        ends = [g.pos.tolist()[-1] + 1 for g in flat]        # keys of each group's last (longest) row
        parts = []
        for lo, hi in self._tables(ends):
            pos = torch.cat([g.pos for g in flat[lo:hi]])
            page_ids = torch.full((len(pos), max(ends[lo:hi])), -1, dtype=torch.long)
            row = 0
            for g, n_keys in zip(flat[lo:hi], ends[lo:hi]):
                page_ids[row:row + len(g.pos), :n_keys] = g.req.seq.table[:n_keys, g.d]   # column d
                row += len(g.pos)
            parts.append((page_ids.to(self.device), (pos + 1).to(self.device)))
        for g in groups[len(flat):]:
            n_keys = g.pos.tolist()[-1] + 1
            parts.append((g.req.seq.table[:n_keys, g.d].to(self.device), (g.pos + 1).to(self.device)))
        return parts

    def _tables(self, ends):
        """[(lo, hi)]: the one-row groups of each padded table. The torch reference gathers every row
        of a table padded to its longest; the rows come sorted by length (step sorts them), so the
        one cut that saves the most keys makes two tables, short rows and long rows, when it saves at
        least 1/8 of them (a second call costs far less). (Triton reads each row to its own length:
        no padding to save; flex takes all rows in one call.)"""
        n = len(ends)
        if self.attn != "torch" or n < 2:
            return [(0, n)] if n else []
        keys, cut = min((i * ends[i - 1] + (n - i) * ends[-1], i) for i in range(1, n))
        return [(0, cut), (cut, n)] if keys <= 0.875 * n * ends[-1] else [(0, n)]

    def _keep(self, g, stopped):
        """Table 17 baselines: a finished token is read at one depth from then on."""
        for p in stopped.tolist():
            rule = g.keep[p - g.start]
            if rule is not None:
                depth = self.U - 1 if rule == "last" else g.exits[p - g.start] - 1
                g.req.seq.collapse(torch.tensor([p]), torch.tensor([depth]))

    def _count(self, groups, sizes, steady):
        s = self.stats
        dec = sum(n for g, n in zip(groups, sizes) if g.start >= len(g.req.prompt))
        s["passes"] += 1
        s["rows"] += sum(sizes)
        s["decode_rows"] += dec
        s["prefill_rows"] += sum(sizes) - dec
        s["max_in_flight"] = max(s["max_in_flight"], len(self.running))
        if steady:   # the passes and slots that the work-conserving bound speaks of
            s["steady_passes"] += 1
            s["steady_slots"] += len(groups)   # requests that ran a depth (a prompt chunk is one wide row)
            s["steady_decode_rows"] += dec

    def _finish(self, r, reason, error=None):
        if r.seq is not None:
            r.kv = dict(r.seq.stats(), block_evals=r.seq.block_evals + r.evals_before)
            r.seq.release()
            r.seq = None
        r.group, r.finish_reason, r.error = None, reason, error
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self.finished.append(r)
        if r.on_token is not None:
            r.on_token(r, None)                              # None: the request has ended

    def check(self):
        """Page invariants of the pool and of every live sequence (tests call it after every step)."""
        self.pool.check()
        for r in self.running:
            r.seq.check()
        held = sum(int(r.seq.real[:r.seq.n].sum()) for r in self.running)
        assert held == self.pool.used, f"{self.pool.used} pages used, {held} held by running requests"


# ----------------------------------------------------------------------------- benchmark

def bench_model(seed=0):
    """A random L=4, d=256 model whose gate spreads the exits (decode Ē about 2.5 at τ 0.5)."""
    from model import GPTConfig, LoopedLM
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, block_size=2048, n_layer=4, n_head=4, n_kv_head=4, n_embd=256, ffn_hidden=704,
                    branch_norm_init=1.0)
    model = LoopedLM(cfg).eval()
    with torch.no_grad():
        torch.manual_seed(seed + 5)
        model.early_exit_gate.weight.normal_(0, 0.2)
        model.early_exit_gate.bias.zero_()
    return model


def workload(n, prompt_range, output_range, vocab, seed):
    """nano-vllm's benchmark workload: random prompts and output lengths, EOS ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=g))
        o = int(torch.randint(output_range[0], output_range[1] + 1, (), generator=g))
        out.append((torch.randint(0, vocab, (p,), generator=g).tolist(), o))
    return out


TURN = 0.05   # bench: seconds one configuration runs before the next takes its turn


def bench_runs(model, work, configs, thr, batch, kv_pages, max_rows, attn, bar=None, seed=0):
    """Every (scheduler, mode) in configs serves the whole workload on its own engine and pool; the
    engines take turns of about TURN seconds of steps until all are done, the next turn going to
    the engine least far through the workload (tokens sampled so far; ties in a seeded random
    order). Returns their records.

    Why turns: timings on this shared machine move by 10-50% within seconds (slow spells that last
    seconds to minutes), so runs one after the other compare a fast spell with a slow one; in turns
    of 50 ms a spell hits every configuration alike. Why the least advanced goes next: in plain
    rotation the fast configurations finished first and fixed@U ran the last ~40% of its window
    alone, so whatever the machine did then counted for fixed only (at batch 4, 0.79-1.09 of U/Ē
    from round to round, two copies of one configuration agreeing within 1%). Kept level, the
    engines move through the workload together and every spell falls on each in proportion to its
    share of the work. A turn is long enough that each engine runs with its own data in cache (tens
    of passes at batch 1). bar: a tqdm of requests done."""
    order = random.Random(seed)
    total = sum(o for _, o in work)
    runs = []
    for scheduler, mode in configs:
        e = Engine(model, kv_pages, max_batch=batch, max_rows=max_rows, scheduler=scheduler, attn=attn)
        reqs = [e.add(Request(p, o, mode, thr)) for p, o in work]
        runs.append(dict(engine=e, reqs=reqs, seconds=0.0, window_seconds=0.0, window_rows=[0, 0], window_tokens=[]))
    progress = lambda run: (sum(len(r.tokens) for r in run["reqs"]) / total, order.random())
    while any(run["engine"].busy() for run in runs):
        run = min((run for run in runs if run["engine"].busy()), key=progress)
        turn, done = time.perf_counter(), len(run["engine"].finished)
        timed_step(run)                                       # a turn is at least one step
        while run["engine"].busy() and time.perf_counter() - turn < TURN:
            timed_step(run)
        if bar is not None:
            bar.update(len(run["engine"].finished) - done)
    return [bench_record(run, thr, batch) for run in runs]


def timed_step(run):
    """One engine step, timed; counted in the throughput window from the end of the first request
    to the last admission."""
    e = run["engine"]
    measured = len(e.waiting) > 0 and len(e.finished) > 0
    before = e.stats["prefill_rows"], e.stats["decode_rows"]
    t0 = time.perf_counter()
    out = e.step()
    dt = time.perf_counter() - t0
    run["seconds"] += dt
    if measured:
        run["window_seconds"] += dt
        run["window_tokens"] += [(r, len(r.tokens) - 1) for r, _ in out]   # (request, index) of every token
        run["window_rows"][0] += e.stats["prefill_rows"] - before[0]
        run["window_rows"][1] += e.stats["decode_rows"] - before[1]


def bench_record(run, thr, batch):
    """The record of one engine's run for the JSON line.

    Throughput (tok_s) is that of a loaded server in its steady state: measured from the end of the
    first request to the last admission. Before the first end every request in flight started at
    once (a burst of prompts, nothing finishing); after the last admission the batch drains. The
    window from the start to the last admission would hold every prompt but only part of the
    decoding (with 2 x batch requests, 30-40% more prompt rows per decode row than the workload
    has); this one holds them in the workload's proportion (mix_window against mix_run).
    avg_decode_depth and ideal_ratio are those of the tokens sampled in the window, the ones tok_s
    counts (avg_decode_depth_run: all of them): a window of harder tokens is not held to the ideal
    of easier ones. Passes and the work-conserving bound count every pass while requests were
    waiting, enough to fill the batch (the bound holds only then). The whole run, tail included, is
    in tok_s_total and passes_total."""
    e, reqs, seconds, window_seconds = run["engine"], run["reqs"], run["seconds"], run["window_seconds"]
    U, s, mode = e.U, e.stats, reqs[0].mode
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs if r.error][:1]
    dec = [x for r in reqs for x in r.decode_exits]
    kv_physical, sum_exits = sum(r.kv["physical"] for r in reqs), sum(sum(r.exits) for r in reqs)
    if s["preemptions"] == 0:   # pages are exactly Σ e_i (prompt rows at depth U in Dense-Ragged)
        assert kv_physical == sum_exits == s["rows"], (kv_physical, sum_exits, s["rows"])
    tokens = sum(len(r.tokens) for r in reqs)
    avg_run = sum(dec) / max(len(dec), 1)
    win = [r.decode_exits[i - 1] for r, i in run["window_tokens"] if i > 0]   # token i was sampled at decode row i - 1
    avg = sum(win) / len(win) if win else avg_run
    return dict(scheduler=e.scheduler, mode=mode, thr=None if mode == "fixed" else thr, batch=batch,
                tok_s=len(run["window_tokens"]) / window_seconds if window_seconds else None,
                tok_s_total=tokens / seconds, seconds=seconds, window_seconds=window_seconds,
                mix_window=run["window_rows"][0] / max(run["window_rows"][1], 1),
                mix_run=s["prefill_rows"] / max(s["decode_rows"], 1),
                requests_s=len(reqs) / seconds, passes=s["steady_passes"], lower_bound=s["steady_slots"] / batch,
                decode_bound=s["steady_decode_rows"] / batch,
                passes_total=s["passes"], avg_decode_depth=avg, ideal_ratio=U / avg, avg_decode_depth_run=avg_run,
                kv_physical=kv_physical, kv_dense=sum(r.kv["dense"] for r in reqs), sum_exits=sum_exits,
                peak_pages=e.pool.peak, max_in_flight=s["max_in_flight"], preemptions=s["preemptions"], tokens=tokens,
                row_depths=s["rows"])


def fastest(records):
    """Of repeated runs of one configuration, the fastest (contention only ever slows a run down)."""
    return max(records, key=lambda r: r["tok_s"])


def keep_heap():
    """Keep freed CPU buffers in the process. glibc hands out buffers of a few MB (the K/V gathers of
    a pass) by mmap, returns them at free and adapts its threshold only as it goes: until it has,
    every pass page-faults its buffers in afresh (measured: 760k faults and 2.6 s of system time in
    a batch-32 Dense-Ragged run, none when warm), which would time the allocator, not the engine.
    Linux/glibc only; elsewhere a no-op."""
    try:
        import ctypes
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)      # buffers up to 32 MiB come from the heap
    mallopt(M_TRIM_THRESHOLD, 1 << 30)       # and freed heap stays mapped (up to 1 GiB)


def bench(c):
    """Schedulers x modes x batch sizes on one seeded workload, repeats interleaved, then the
    capacity table."""
    if torch.device(resolve_device(c["device"])).type == "cpu":
        keep_heap()
    if c["ckpt"]:
        model, _ = load_checkpoint(c["ckpt"], resolve_device(c["device"]))
    else:
        model = bench_model(c["seed"]).to(resolve_device(c["device"]))
    cfg, U = model.config, model.config.n_loops
    full = c["full"]
    prompts, outputs = ((100, 1024), (100, 1024)) if full else ((16, 64), (32, 128))
    batches = [1, 4, 8, 32] if not c["batches"] else [int(b) for b in str(c["batches"]).split(",")]
    if prompts[1] + outputs[1] > cfg.block_size:
        raise UserError(f"the workload needs a context of {prompts[1] + outputs[1]} tokens; the model has "
                        f"block_size={cfg.block_size}")
    thr = c["thr"] if c["thr"] is not None else 0.5
    if c["requests"] and c["requests"] < 2 * max(batches):
        raise UserError(f"--requests={c['requests']}: the benchmark needs at least 2 x the largest batch "
                        f"({2 * max(batches)}), so that requests wait while the batch runs full")
    configs = [("fixed", "fixed")] + [(s, m) for m in ("dense_ragged", "ete_ragged") for s in ("continuous", "nested")]
    from tqdm import tqdm
    # 2 x batch + 8 requests: the batch runs full while requests wait, and the window of a loaded server
    # (bench_record) lasts 4 s or more at every batch size on 2 CPU cores
    sizes = {B: c["requests"] or (256 if full else 2 * B + 8) for B in batches}
    bar = tqdm(total=sum(sizes.values()) * len(configs) * c["repeats"], desc="bench", unit="req", file=sys.stderr,
               disable=None)
    runs = []
    for B, n in sizes.items():
        work = workload(n, prompts, outputs, cfg.vocab_size, c["seed"])
        pages = c["kv_pages"] or sum(len(p) + o for p, o in work) * U
        tries = {k: [] for k in configs}
        for rep in range(c["repeats"]):
            records = bench_runs(model, work, configs, thr, B, pages, c["max_rows"], c["attn"], bar, seed=c["seed"] + rep)
            for r in records:
                tries[r["scheduler"], r["mode"]].append(r)
        best = {k: fastest(v) for k, v in tries.items()}
        for k, r in best.items():
            r["ratio_vs_fixed"] = r["tok_s"] / best["fixed", "fixed"]["tok_s"]
            # each round against the fixed engine of the same round: the spread that fastest-of hides
            r["ratio_rounds"] = [t["tok_s"] / f["tok_s"] for t, f in zip(tries[k], tries["fixed", "fixed"])]
            r["work_ratio"] = best["fixed", "fixed"]["row_depths"] / r["row_depths"]   # prefill rows included
            runs.append(r)
    bar.close()
    # capacity: one pool of 40% of what fixed@U needs for 32 requests, the whole workload at once
    work = workload(c["requests"] or (256 if full else 64), prompts, outputs, cfg.vocab_size, c["seed"] + 1)
    pages = int(0.4 * sum(len(p) + o for p, o in work[:32]) * U)
    capacity = bench_runs(model, work, [("fixed", "fixed"), ("continuous", "dense_ragged"), ("continuous", "ete_ragged")],
                          thr, len(work), pages, c["max_rows"], c["attn"])
    print_bench(runs, capacity, pages, U)
    device = str(model.lm_head.weight.device)
    rnd = lambda r: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    return {"model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "n_loops": U,
                      "vocab_size": cfg.vocab_size, "ckpt": c["ckpt"] or "random bench model", "device": device,
                      "thr": thr, "prompts": prompts, "outputs": outputs, "attn": c["attn"], "max_rows": c["max_rows"],
                      "repeats": c["repeats"]},
            "runs": [rnd(r) for r in runs], "capacity": {"kv_pages": pages, "runs": [rnd(r) for r in capacity]}}


def print_bench(runs, capacity, pages, U):
    err = sys.stderr
    print(f"{'batch':>5} {'scheduler':<11}{'mode':<13}{'tok/s':>8}{'x fixed':>8}{'ideal':>7}{'work':>6}{'Ē dec':>7}"
          f"{'passes':>8}{'bound':>8}{'ratio':>7}{'KV phys/dense':>16}{'peak':>6}{'mix win/run':>12}"
          f"{'  x fixed by round' if len(runs[0]['ratio_rounds']) > 1 else ''}", file=err)
    for r in runs:
        ratio = r["passes"] / r["lower_bound"] if r["lower_bound"] else float("nan")
        rounds = r["ratio_rounds"]
        spread = f"  {min(rounds):.2f}-{max(rounds):.2f}" if len(rounds) > 1 else ""
        print(f"{r['batch']:>5} {r['scheduler']:<11}{r['mode']:<13}{r['tok_s']:>8.1f}{r['ratio_vs_fixed']:>8.2f}"
              f"{r['ideal_ratio']:>7.2f}{r['work_ratio']:>6.2f}{r['avg_decode_depth']:>7.2f}{r['passes']:>8}"
              f"{r['lower_bound']:>8.1f}{ratio:>7.3f}{r['kv_physical']:>8}/{r['kv_dense']:<7}{r['peak_pages']:>6}"
              f"{r['mix_window']:>7.2f}/{r['mix_run']:.2f}{spread}", file=err)
    print("tok/s: from the first request's end to the last admission (a loaded server), fastest of the repeats "
          "(x fixed by round: each round against that round's fixed engine); "
          "Ē dec and ideal: of the tokens sampled in that window; mix = prompt rows per decode row in that "
          "window / in the whole run. passes and bound: while requests "
          "were waiting; bound = the work-conserving bound: depths run by requests (a prompt chunk or a decode "
          "token each: one row of the batch) / batch. Targets for continuous: ratio <= 1.05, x fixed >= 0.9 x "
          "ideal (ideal = U/Ē); work = row-depths of fixed / of this run, prefill included", file=err)
    print(f"capacity: one pool of {pages} KV pages (40% of what fixed@{U} needs for the first 32 requests), every "
          "request submitted at once, whole run", file=err)
    print(f"{'scheduler':<11}{'mode':<13}{'req/s':>8}{'tok/s':>8}{'max in flight':>14}{'preemptions':>12}{'peak':>6}",
          file=err)
    for r in capacity:
        print(f"{r['scheduler']:<11}{r['mode']:<13}{r['requests_s']:>8.2f}{r['tok_s_total']:>8.1f}{r['max_in_flight']:>14}"
              f"{r['preemptions']:>12}{r['peak_pages']:>6}", file=err)


# ----------------------------------------------------------------------------- HTTP API (OpenAI-style)

class Server:
    """One engine thread steps the engine; HTTP handler threads submit requests and read their tokens
    from a queue. Standard library only: a ThreadingHTTPServer."""

    def __init__(self, engine, encode=None, decode=None, name="looped-lm", chat=False, eos=None):
        self.engine, self.encode, self.decode, self.name, self.chat, self.eos = engine, encode, decode, name, chat, eos
        self.inbox, self.cv, self.stopping = deque(), threading.Condition(), False
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)

    def submit(self, reqs):
        with self.cv:
            self.inbox.extend(reqs)
            self.cv.notify()

    def loop(self):
        while True:
            with self.cv:
                while not self.inbox and not self.engine.busy() and not self.stopping:
                    self.cv.wait()
                if self.stopping:
                    return
                new, self.inbox = list(self.inbox), deque()
            for r in new:
                try:
                    self.engine.add(r)
                except UserError as e:
                    r.finish_reason, r.error = "error", str(e)
                    r.on_token(r, None)
            try:
                self.engine.step()
            except Exception as e:  # a bug must not take the server down: fail what is in flight, say why
                print(f"engine error: {type(e).__name__}: {e}", file=sys.stderr)
                for r in list(self.engine.running) + list(self.engine.waiting):
                    self.engine._finish(r, "error", f"engine error: {type(e).__name__}")

    def stop(self):
        with self.cv:
            self.stopping = True
            self.cv.notify()


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400):
        super().__init__(message)
        self.param, self.status = param, status


def field_of(body, key, kinds, default, check=None, allowed=""):
    """body[key] (or default) after a type and range check; BadRequest names the field."""
    v = body.get(key, default)
    if v is None:
        v = default
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise BadRequest(f"'{key}' must be {allowed or ' or '.join(k.__name__ for k in kinds)}, not {v!r}", key)
    if check is not None and not check(v):
        raise BadRequest(f"'{key}' must be {allowed}, not {v!r}", key)
    return v


UNSUPPORTED = {"logprobs": (None, 0, False), "echo": (None, False), "best_of": (None, 1), "suffix": (None,),
               "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}


def parse_request(server, body, chat):
    """A /v1/completions or /v1/chat/completions body -> (prompt ids, n, stream, stop strings, fields)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key, ok in UNSUPPORTED.items():
        if key in body and body[key] not in ok:
            raise BadRequest(f"'{key}' is not supported by this server", key)
    if chat:
        if not server.chat:
            raise BadRequest("this model has no chat template (Ouro's ChatML tokens); use /v1/completions", "messages")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise BadRequest("'messages' must be a non-empty list of {role, content} strings", "messages")
        from sample import IM_END, chat_ids
        ids = chat_ids([(m["role"], m["content"]) for m in msgs], server.encode)
        stop_ids = (IM_END,)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                      # a batch of one
        if isinstance(prompt, str):
            if server.encode is None:
                raise BadRequest("this model has no tokenizer here: give 'prompt' as a list of token ids", "prompt")
            try:
                ids = server.encode(prompt)
            except UserError as e:
                raise BadRequest(f"'prompt': {e}", "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")
        stop_ids = () if server.eos is None else (server.eos,)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    f = dict(
        max_tokens=field_of(body, "max_tokens", (int,), 16, lambda v: v >= 1, "an integer >= 1"),
        temperature=field_of(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        top_p=field_of(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=field_of(body, "top_k", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
        thr=field_of(body, "thr", (int, float), 0.5, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        mode=field_of(body, "mode", (str,), "dense_ragged", lambda v: v in MODES, "one of " + ", ".join(MODES)),
        depth=field_of(body, "depth", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
        prefill_thr=field_of(body, "prefill_thr", (int, float), None, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        prefill_schedule=field_of(body, "prefill_schedule", (str,), "", lambda v: v in ("", "cosine"), "'' or 'cosine'"),
        prefix_full=field_of(body, "prefix_full", (int,), 0, lambda v: v >= 0, "an integer >= 0"),
    )
    seed = field_of(body, "seed", (int,), None, lambda v: v >= 0, "an integer >= 0")
    n = field_of(body, "n", (int,), 1, lambda v: 1 <= v <= 16, "an integer in 1..16")
    stream = field_of(body, "stream", (bool,), False)
    seed = int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed
    reqs = [Request(ids, seed=seed + i, stop=stop_ids, **f) for i in range(n)]
    for r in reqs:
        try:
            server.engine.check_request(r)
        except UserError as e:       # the engine's messages start with the field they are about
            word = str(e).replace("=", " ").replace(":", " ").split()[0]
            raise BadRequest(str(e), word if word in Request.__dataclass_fields__ else None)
    return reqs, stream, stop


def exit_summary(r, U):
    de = r.decode_exits
    return {"avg_decode_depth": sum(de) / len(de) if de else None,
            "avg_prefill_depth": sum(r.prompt_exits) / len(r.prompt_exits) if r.prompt_exits else None,
            **exit_stats(de, U), "mode": r.mode, "thr": None if r.mode == "fixed" else r.thr}


def make_handler(server):
    import http.server
    import queue

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request on stderr only with --verbose
            if getattr(server, "verbose", False):
                super().log_message(fmt, *args)

        def send_json(self, obj, status=200):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_error_json(self, e):
            self.send_json({"error": {"message": str(e), "type": "invalid_request_error", "param": e.param,
                                      "code": None}}, e.status)

        def do_GET(self):
            if self.path == "/health":
                self.send_json({"status": "ok", "running": len(server.engine.running),
                                "waiting": len(server.engine.waiting), "free_pages": len(server.engine.pool.free)})
            elif self.path == "/v1/models":
                self.send_json({"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                                            "owned_by": "looped-lm"}]})
            else:
                self.send_error_json(BadRequest(f"no route GET {self.path}", status=404))

        def do_POST(self):
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self.send_error_json(BadRequest(f"no route POST {self.path}", status=404))
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"malformed JSON: {e}")
                reqs, stream, stop = parse_request(server, body, chat)
            except BadRequest as e:
                self.send_error_json(e)
                return
            events = queue.Queue()
            for i, r in enumerate(reqs):
                r.index = i
                r.on_token = lambda r, tok: events.put((r.index, tok))
            server.submit(reqs)
            try:
                self.respond(reqs, events, stream, stop, chat)
            except (BrokenPipeError, ConnectionResetError):   # the client went away: free its pages
                for r in reqs:
                    r.cancelled = True
                with server.cv:
                    server.cv.notify()

        def respond(self, reqs, events, stream, stop, chat):
            """Relay the tokens of the request's choices as the engine samples them: one JSON body at
            the end, or server-sent events as they come (ending with data: [DONE])."""
            U = server.engine.U
            kind = "chat.completion" if chat else "text_completion"
            cid = f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].seed:x}{int(time.time() * 1e6) % 10**8:x}"
            created = int(time.time())
            n = len(reqs)
            texts, sent, finish, n_tok = [""] * n, [0] * n, [None] * n, [0] * n
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

            def event(i, delta, reason=None, extra=None):
                if chat:
                    choice = {"index": i, "delta": {"content": delta} if delta else {}, "finish_reason": reason}
                else:
                    choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
                choice.update(extra or {})
                obj = {"id": cid, "object": kind + (".chunk" if chat else ""), "created": created,
                       "model": server.name, "choices": [choice]}
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            if stream and chat:
                for i in range(n):
                    event(i, "", extra={"delta": {"role": "assistant", "content": ""}})
            while None in finish:
                i, tok = events.get()
                r = reqs[i]
                if finish[i] is not None:
                    continue                              # tokens after a stop string
                if tok is None:                           # the engine ended the request
                    finish[i] = r.finish_reason
                    if r.finish_reason == "error" and not stream:
                        for o in reqs:
                            o.cancelled = True
                        self.send_error_json(BadRequest(r.error))
                        return
                else:
                    n_tok[i] += 1
                    if server.decode is not None and tok not in r.stop:
                        text = server.decode(r.tokens[:n_tok[i]])
                        cut = [text.find(s) for s in stop if s in text]
                        if cut:                           # a stop string: the text ends before it
                            text, finish[i], r.cancelled = text[:min(cut)], "stop", True
                        texts[i] = text
                if stream:
                    new = texts[i][sent[i]:]
                    if new and (finish[i] is not None or not new.endswith("\ufffd")):   # not half a character
                        event(i, new)
                        sent[i] += len(new)
                    if finish[i] is not None:
                        event(i, "", finish[i], {"error": r.error} if finish[i] == "error" else
                              {"exit_stats": exit_summary(r, U)})
            if stream:
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                return
            choices = []
            for i, r in enumerate(reqs):
                c = {"index": i, "finish_reason": finish[i], "exit_stats": exit_summary(r, U), "tokens": r.tokens[:n_tok[i]]}
                c.update({"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i], "logprobs": None})
                choices.append(c)
            de = [e for r in reqs for e in r.decode_exits]
            self.send_json({"id": cid, "object": kind, "created": created, "model": server.name, "choices": choices,
                            "usage": {"prompt_tokens": len(reqs[0].prompt), "completion_tokens": sum(n_tok),
                                      "total_tokens": len(reqs[0].prompt) + sum(n_tok)},
                            "exit_stats": {"avg_decode_depth": sum(de) / len(de) if de else None, **exit_stats(de, U)}})

    return Handler


def serve(engine, host="127.0.0.1", port=8000, encode=None, decode=None, name="looped-lm", chat=False, eos=None):
    """Start the engine thread and an HTTP server (not yet serving: call .serve_forever()). Returns
    (http server, Server)."""
    import http.server
    server = Server(engine, encode, decode, name, chat, eos)
    httpd = http.server.ThreadingHTTPServer((host, port), make_handler(server))
    httpd.daemon_threads = True
    server.thread.start()
    return httpd, server


# ----------------------------------------------------------------------------- command line

DEFAULTS = dict(
    ckpt="",               # checkpoint (ckpt.pt file or folder, or an Ouro folder); serving: default out/, --bench: a random model
    host="127.0.0.1",      # address to bind (loopback unless you say otherwise)
    port=8000,             # port to listen on
    kv_pages=0,            # KV pages of the shared pool (0: from --kv_memory)
    kv_memory=0.0,         # KV pool size in GiB (0 with --kv_pages 0: max_batch full contexts at depth U, at most 2 GiB)
    max_batch=32,          # most requests in flight at once
    max_rows=256,          # rows per pass that prefill chunks may fill next to the decode rows
    scheduler="continuous",  # how rows share passes: every pass (continuous), waves (nested), all U loops (fixed)
    attn="auto",           # paged attention (kernels.py): auto = triton on CUDA when installed, else torch
    device="cpu",          # where to run (auto: CUDA when there is one)
    dtype="",              # weights dtype (default: as saved)
    tiktoken_file="",      # gpt2.tiktoken ranks file for GPT-2 tokenized checkpoints, offline
    verbose=False,         # log every HTTP request
    bench=False,           # run the benchmark instead of serving; the last stdout line is JSON
    full=False,            # bench: nano-vllm's size (prompts and outputs of 100-1024 tokens, 256 requests), for a GPU
    batches="",            # bench: batch sizes, comma-separated (default 1,4,8,32)
    requests=0,            # bench: requests per batch size (0: 2 x batch + 8; 256 with --full)
    repeats=1,             # bench: rounds of every configuration, each in turns; the fastest counts (all: ratio_rounds)
    thr=None,              # bench: the exit threshold of the ragged modes (default 0.5)
    seed=0,                # bench: seeds the random model and the workload
)
RULES = dict(port="in [0, 65535]", kv_pages=">= 0", kv_memory=">= 0", max_batch=">= 1", max_rows=">= 1",
             scheduler=SCHEDULERS, attn=IMPLS, device=device_rule, dtype=["", "float32", "float64", "bfloat16"],
             batches=lambda v: None if all(s.strip().isdigit() and int(s) > 0 for s in v.split(",")) or not v
             else "expected comma-separated positive integers", requests=">= 0", repeats=">= 1", thr="in [0, 1]", seed=">= 0")


def page_bytes(model):
    cfg, p = model.config, model.lm_head.weight
    return cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * p.element_size()


def pool_pages(model, kv_pages=0, kv_memory=0.0, max_batch=32):
    """--kv_pages, else --kv_memory GiB, else max_batch full contexts at every depth, at most 2 GiB."""
    cfg = model.config
    if kv_pages:
        return kv_pages
    if kv_memory:
        return int(kv_memory * 2**30 // page_bytes(model))
    return min(max_batch * cfg.block_size * cfg.n_loops, 2 * 2**30 // page_bytes(model))


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    if c["bench"]:
        print(json.dumps(bench(c)))
        return
    dtypes = {"": None, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
    c["ckpt"] = c["ckpt"] or "out"
    model, ckpt = load_checkpoint(c["ckpt"], resolve_device(c["device"]), dtypes[c["dtype"]])
    cfg, size = model.config, page_bytes(model)
    pages = pool_pages(model, c["kv_pages"], c["kv_memory"], c["max_batch"])
    if pages < cfg.n_loops:
        raise UserError(f"--kv_pages={pages}: the pool must hold at least one token at every depth ({cfg.n_loops} pages)")
    meta = ckpt.get("meta") or {}
    encode = decode = None
    eos = {"gpt2": 50256, "hf": 0}.get(meta.get("tokenizer"))
    if meta:
        try:
            from prepare_data import load_tokenizer
            encode, decode = load_tokenizer(meta, c["tiktoken_file"])
        except UserError as e:
            print(f"note: {e}; prompts must be token ids", file=sys.stderr)
    chat = False
    if encode is not None and meta.get("tokenizer") == "hf":
        from sample import check_chat
        try:
            check_chat(meta)
            chat = True
        except UserError:
            pass
    engine = Engine(model, pages, c["max_batch"], c["max_rows"], c["scheduler"], c["attn"])
    name = os.path.basename(os.path.normpath(c["ckpt"]))
    httpd, server = serve(engine, c["host"], c["port"], encode, decode, name, chat, eos)
    server.verbose = c["verbose"]
    print(f"serving {name} (L={cfg.n_layer}, U={cfg.n_loops}) on http://{c['host']}:{httpd.server_address[1]}/v1; "
          f"KV pool {pages} pages x {size / 1024:.1f} KiB = {pages * size / 2**30:.2f} GiB; scheduler {c['scheduler']}, "
          f"max_batch {c['max_batch']}{', chat template' if chat else ''}", file=sys.stderr)
    try:
        httpd.serve_forever()
    finally:
        server.stop()
        httpd.server_close()


if __name__ == "__main__":
    run_cli(main)

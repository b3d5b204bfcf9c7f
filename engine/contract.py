"""
What the host and a runner share: the host's record of a request (Live), what a runner reports of its
passes (Log, Said), and the questions the host asks a runner (Runner, with the answers of a runner that
takes its pages pass by pass and reads its results at once).

The host (serve_depthbatch.Engine) owns every request's record and its page table; it admits, starts
chunks, makes room in the pool (eviction happens there and nowhere else), records exits, delivers
tokens and ends requests. A runner applies the block: it is built from what it uses (the model, the
page pool, the stats it counts), is told which requests run (their records, oldest first), states the
pages its next run will take, and returns what its passes did. It never holds or calls the host.
"""
from typing import NamedTuple, Optional

import torch


# What an engine counts (Engine.stats): the host and its runner count into one dict (the slot runner
# adds launched, waits and drained: engine/slots.py).
STATS = {"passes": "passes in which a row ran", "rows": "rows run (a token at a depth)",
         "preemptions": "requests preempted", "replayed_rows": "rows run again by a replay",
         "max_in_flight": "the most requests running at once", "head_calls": "LM-head calls",
         "head_rows": "tokens delivered", "finished": "requests ended",
         "draft_passes": "passes in which a speculative draft was sampled",
         "verify_passes": "passes in which a speculative position was verified",
         "verifies": "speculative positions verified (a token each)", "drafted": "drafts sampled",
         "accepted": "drafts kept"}


class Live:
    """The host's record of one request, from its admission to its end: its page table, how far its
    positions have run, its rows in flight and the exits they decided, what preemption has cost it.
    A runner reads it and keeps its own state about it in its own tables."""

    def __init__(self, req, id):
        self.req, self.id = req, id
        self.seq = None                 # RaggedSeq while it holds pages
        self.done = 0                   # positions whose rows all finished (the next chunk starts here)
        self.started = 0                # positions whose rows have started
        self.rows = 0                   # its rows in flight
        self.exits = {}                 # exits decided, by position, until its positions are done
        self.stops = []                 # (position, 0-based depth) of rows that stopped: Eq. 11 to apply
        self.ending = False             # its last token is sampled: it ends when its rows have finished
        self.evals_before = 0           # block evaluations of caches freed by preemption
        self.decode_depths = [0, 0]     # Σ exits and count of its decode positions (replays not again)
        # a speculative request (engine/speculative.py): its drafts not verified yet [(token, logits)],
        # and what the last pass sampled for it [(position, token, logits, verified)]
        self.drafts, self.sampled = [], []

    def runnable(self):
        """Positions it must run: every known token but a final sampled one (that one never runs);
        the drafts of a speculative request count as known."""
        return len(self.req.prompt) + len(self.req.tokens) + len(self.drafts) - (1 if self.ending else 0)

    def base(self):
        """The position of its last token (a speculative request's oldest position not verified)."""
        return len(self.req.prompt) + len(self.req.tokens) - 1

    def settled(self):
        """Positions whose exits are final: those done, short of a speculative request's drafts (their
        exits become final once verified)."""
        return min(self.done, self.base()) if self.req.mode == "speculative" else self.done

    def pipelines(self):
        """Whether its next position may start while its rows run: a speculative request past its
        prompt with a token (a draft) whose position has not started (engine/speculative.py)."""
        return self.req.mode == "speculative" and len(self.req.tokens) > 0 and self.started < self.runnable()

    def draft_room(self):
        """How many more drafts it may hold: draft_k, fewer near max_tokens (the position of a draft
        runs, and a verification emits one token)."""
        return min(self.req.draft_k, self.req.max_tokens - len(self.req.tokens) - 1) - len(self.drafts)

    def last_position(self):
        """The last position that runs: that of the token before the final one (which never runs)."""
        return len(self.req.prompt) + self.req.max_tokens - 2

    def deliver(self, tok, logits):
        """A sampled token to its request: kept, its callback called, and its end decided (max_tokens
        or a stop id: it ends once its rows have finished). Returns (request, token)."""
        r = self.req
        if r.keep_logits:
            r.logits.append(logits)
        r.tokens.append(tok)
        if r.on_token is not None:
            r.on_token(r, tok)
        if len(r.tokens) >= r.max_tokens or tok in r.stop:
            self.ending = True
            r.finish_reason = "stop" if tok in r.stop else "length"
        return r, tok

    def settle_exits(self):
        """The exits of its positions now final join req.exits, in order (the decode ones counted in
        decode_depths for the shared head's cost model)."""
        r = self.req
        while len(r.exits) < self.settled():
            e = self.exits.pop(len(r.exits))
            if len(r.exits) >= len(r.prompt):
                self.decode_depths = [self.decode_depths[0] + e, self.decode_depths[1] + 1]
            r.exits.append(e)

    def release(self):
        """Its pages go back: those taken ahead for positions that never ran first (so its accounting
        counts what ran), then all. Returns that accounting (RaggedSeq.stats)."""
        self.seq.trim(self.started)
        kv = self.seq.stats()
        self.evals_before += kv["block_evals"]
        self.seq.release()
        self.seq = None
        return kv

    def preempted(self):
        """Back in the queue: its pages and rows are gone; req.exits stay, replayed on its return."""
        self.seq = None
        self.done = self.started = self.rows = 0
        self.exits, self.stops = {}, []
        self.drafts, self.sampled = [], []


class Said(NamedTuple):
    """One row's entry in a pass's log, where it says something: its request, position and the
    1-based depth it ran, the exit it decided (0: none), the token its exit sampled (-1: none) and
    its logits (where the request keeps them), whether it ran its last depth (stop), whether its
    request's next position started in its place with that token (go)."""
    live: "Live"
    pos: int
    depth: int
    exit: int
    tok: int
    stop: bool
    go: bool
    logits: Optional[torch.Tensor] = None


class Log(NamedTuple):
    """What one pass of a runner did: how many rows it ran for each request [(Live, rows)], and the
    entries of its rows that say something [Said], in row order."""
    ran: list
    said: list


class Runner:
    """The questions the host asks a runner (App. A.2), and the answers of one that takes a page for each row
    pass by pass, starts every position from the host and reads what its passes did at once (the
    eager runner, serve_depthbatch.EagerRunner). A runner answers only what it does otherwise
    (engine/slots.py's SlotRunner: decode rows restarted on the device, pages taken ahead, results a
    step late). Built from what it uses: model, pool (ragged.PagePool), stats (the engine's counts)."""

    def __init__(self, model, pool, stats):
        self.model, self.pool, self.stats = model, pool, stats
        self.U, self.device = model.config.n_loops, model.lm_head.weight.device

    def refuse(self, r):
        """UserError for a request it leaves to another runner (nothing queued)."""

    def ready(self, s):
        """"chunk" if s may start its next chunk now (its rows have all finished, or it pipelines:
        Live.pipelines), "started" if its next row has started already (on the device), None if
        neither."""
        return "chunk" if s.rows == 0 or s.pipelines() else None

    def budget(self, running):
        """Rows in flight, and the pages left for new chunks (each row in flight takes one next pass)."""
        rows = sum(s.rows for s in running)
        return rows, len(self.pool.free) - rows

    def wave(self, running):
        """The depth of the fixed wave under way, if a wave spans steps (None: it runs within one)."""
        return None

    def start(self, s, end):
        """Rows for positions s.started..end-1 (replayed positions run to their recorded exits)."""
        raise NotImplementedError

    def plan(self, running, queued):
        """What the next run will do, and the pages it takes, by request: {Live: pages}. running: the
        requests in flight, oldest first; queued: whether requests wait for room."""
        raise NotImplementedError

    def run(self):
        """The planned passes (App. A.2). Returns their Logs, one a pass, in the order they ran."""
        raise NotImplementedError

    def drop(self, s):
        """s ends or is preempted: the runner forgets it (its rows, what it planned for it)."""

    def idle(self, running):
        """Whether no row runs (nothing will run unless a chunk starts)."""
        return not any(s.rows for s in running)

    def busy(self):
        """Whether it holds results of passes not read yet."""
        return False

    def check(self, running):
        """Its own invariants (tests call Engine.check after every step); changes nothing."""

"""
The shared LM head (beyond the paper): exited rows wait a few passes to share one head call, while the
weight-read cost model says that waiting costs less than a call. The tokens are the same either way.

With a real vocabulary the LM head weighs as much as the block (GPT-2's 50,257 words at d = 512: 2.0x a
4-layer block), and decode is weight-read bound: a head call costs about the same for 1 row as for 8.
The eager runner (serve_depthbatch.EagerRunner, head="shared") asks SharedHead which of its exited rows
take the head now.
"""
from modes import n_run

HEADS = ["eager", "shared"]   # when the LM head runs: on every pass where a row exits, or shared
MAX_WAIT = 2                  # with a queue, the most passes an exited row waits for a shared call


def weight_bytes(model):
    """The weights a pass of the block reads (all L layers) and those an LM-head call reads: the two
    prices of the weight-read cost model (decode is weight-bound at small batch)."""
    head = model.lm_head.weight
    block = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    return block, head.numel() * head.element_size()


class SharedHead:
    """The rows that exited and wait to share one LM-head call [(Live, position, normed state,
    passes waited)], the passes each request's rows have waited, and the rule of when they go."""

    def __init__(self, model, max_batch):
        self.w_block, self.w_head = weight_bytes(model)
        self.U, self.max_batch = model.config.n_loops, max_batch
        self.rows, self.waited = [], {}

    def waiting(self):
        return bool(self.rows)

    def take(self):
        """Every waiting row, out of the queue as [(Live, position, state)], each request charged the
        passes its rows waited."""
        rows, self.rows = self.rows, []
        for s, _, _, w in rows:
            self.waited[s] = self.waited.get(s, 0) + w
        return [(s, p, h) for s, p, h, _ in rows]

    def drop(self, live):
        """The rows of a request that ended or was preempted (a replay computes them again)."""
        self.rows = [e for e in self.rows if e[0] is not live]
        self.waited.pop(live, None)

    def choose(self, exited, others, running, queued):
        """The exited rows [(Live, position, normed state)] that take the LM head now (beyond App. A.2,
        where every exited row takes it at once): they join the waiting rows, and all go together
        when one has waited its limit, when nothing else would run next pass (others: False), or
        when waiting costs more than the call it saves. What a wait
        costs: while requests queue, each waiting row idles its slot of the batch (about w_block /
        max_batch a pass, against w_head for a call), so no row waits more than MAX_WAIT passes. With
        no queue, nothing, unless the waiting request ends up the last one to finish: then each pass
        it waited is one more pass of the batch (w_block). So rows wait only where a call costs more
        than a pass, and only while one more pass of waiting leaves their request short of the one
        that ends the batch (passes left, waits included); they wait for its row (at most U passes:
        it exits within U) and share its call. A speculative request's rows never wait: the next
        position starts on what they sample (engine/speculative.py)."""
        now = [x for x in exited if x[0].req.mode == "speculative"]
        exited = [x for x in exited if x[0].req.mode != "speculative"]
        self.rows = [(s, p, h, w + 1) for s, p, h, w in self.rows] + [(s, p, h, 0)
                                                                      for s, p, h in exited]
        waits = [(s, w) for s, _, _, w in self.rows]
        if not waits:
            return now
        if queued:
            dear, limit = len(waits) * self.w_block >= self.w_head * self.max_batch, MAX_WAIT
        else:
            left = {s: self.passes_expected(s) for s in running}
            end = max(left.values())
            dear = self.w_head < self.w_block or any(left[s] + w + 1 > end for s, w in waits)
            limit = self.U
        if others and not dear and max(w for _, w in waits) < limit:
            return now
        return now + self.take()

    def passes_expected(self, s):
        """Passes a running request is expected to need still (an estimate, where the slot runner's
        passes_left is a bound): tokens to go x the passes each of its decode tokens took so far (its
        mean decode depth, plus what its rows waited for the head)."""
        total, n = s.decode_depths
        per_token = (total + self.waited.get(s, 0)) / n if n else n_run(s.req, self.U)
        return (s.req.max_tokens - len(s.req.tokens)) * per_token

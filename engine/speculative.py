"""
Self-speculative decoding: tokens drafted by the model's own shallow loops and verified at full depth
as the positions run on, so that the output is fixed@U's exactly (the greedy tokens, or the sampled
distribution).

A looped model carries its own draft model: the same block at fewer loops, with the same weights,
pages and tokenizer. In a depth-batched engine it also needs no rounds. A speculative request's
position p runs every depth 1..U, as fixed@U's does. At its draft exit (d loops, or its exit gate's
depth under τ: modes.draft_rule) the LM head samples a draft x for position p + 1 and the row runs
on; position p + 1 starts on x at the next step, beside p's row, one depth behind it or more. So a
request holds up to about U / d positions in flight, one row at each depth (at most draft_k drafts
not verified yet), and every pass advances all of them: a pipeline, the passes' depth batching
applied within one request.

Every read is exact. Position p + 1 at depth δ reads the depth-δ K/V of the positions before it,
written passes earlier, when those rows were at δ (Eq. 7 with no early exit: nothing is aliased),
so once its token is right its states are fixed@U's. When p reaches depth U its full-depth result
verifies the draft x that p + 1 runs on (turn, below: accept):

  greedy      x is kept while it equals the full-depth argmax; else the argmax replaces it.
  sampled     x (drawn from the draft distribution q) is kept with probability
              min(1, p(x) / q(x)); else a draw from the normalised max(0, p - q) replaces it. Each
              emitted token is then distributed exactly as fixed@U's (Leviathan et al., 2023; Chen
              et al., 2023): P(x) = q(x) min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y))) r(x) = p(x).

A kept draft costs nothing more: its position is already running. A replaced one drops every position
after p (their rows, pages and drafts go back: they ran on a wrong token) and p + 1 starts again on
the replacement. With drafts kept at rate α a token takes about d + (U - d)(1 - α) passes of the
request against fixed@U's U. p and q are the distributions the sampler draws from (temperature,
top-k and top-p applied to both the same way: engine/request.sample_set). The host
(serve_depthbatch.Engine) keeps a request's samples aside (aside) and takes its turn after each pass.
"""
import torch

from engine.request import keyed_uniform, sample_set, sample_token, seed_bits

# The noise of a verification: a draft is an ordinary draw keyed by (seed, position) (sample_token);
# the acceptance test's uniform and the replacement's draw have streams of their own, so that no
# draw is reused for another decision at the same position.
ACCEPT, REPLACE = 2**30, 2**31


def probs(logits, r):
    """The full-vocabulary distribution a token of r is drawn from at these logits: sample_set's
    nucleus, renormalised (a draw is the Gumbel-max over it), in at least float32."""
    ids, p, _ = sample_set(logits, r.temperature, r.top_k, r.top_p)
    return torch.zeros(logits.shape[-1], dtype=p.dtype, device=p.device).index_put((ids,), p / p.sum())


def accept_uniform(r, position):
    """The acceptance test's uniform for the draft drawn at `position`, keyed like every draw."""
    t = lambda v: torch.tensor(v, dtype=torch.long)
    return float(keyed_uniform(t(seed_bits(r.seed)), t(position + ACCEPT), t([0]), torch.float64)[0])


def draw(p, r, position):
    """A token from the distribution p: the sampler's own keyed draw (sample_token) on log p, in the
    replacement's stream."""
    return sample_token(torch.log(p), 1.0, 0, 1.0, r.seed, position + REPLACE)


def accept(r, position, draft, full):
    """The token r emits after `position`: its draft (x, q's logits or None) drawn there at the draft
    depth, against the full-depth result (y, p's logits) there. Returns (token, whether the draft was
    kept): x if kept, else the replacement (greedy: y; sampled: a draw from max(0, p - q))."""
    (x, q_logits), (y, p_logits) = draft, full
    if r.temperature == 0:
        return (x, True) if x == y else (y, False)
    p, q = probs(p_logits, r), probs(q_logits, r).to(p_logits.device)
    if accept_uniform(r, position) * float(q[x]) <= float(p[x]):     # kept w.p. min(1, p(x)/q(x))
        return x, True
    rest = (p - q).clamp(min=0)
    return draw(rest / rest.sum() if rest.sum() > 0 else p, r, position), False


# ----------------------------------------------------------------------------- on the host

def aside(s, row):
    """A speculative request's row in a pass's log (engine/contract.Said): a row that ran its last
    depth (U) has its position done and its exit U (it was verified there; the draft's exit it
    decided before is not kept); what a row sampled waits for the pass's turn (s.sampled): a draft
    at its draft exit, a verification at its last depth."""
    if row.stop:
        s.done = max(s.done, row.pos + 1)         # positions finish in order: each runs all U depths
        if row.pos >= len(s.req.exits):
            s.exits[row.pos] = row.depth
    if row.tok >= 0:
        s.sampled.append((row.pos, row.tok, row.logits, row.stop))


def count_passes(log, stats):
    """A pass's share of the engine's counts: whether a speculative draft was sampled in it
    (draft_passes), whether a speculative position was verified (verify_passes)."""
    spec = [row for row in log.said if row.tok >= 0 and row.live.req.mode == "speculative"]
    stats["draft_passes"] += any(not row.stop for row in spec)
    stats["verify_passes"] += any(row.stop for row in spec)


def turn(s, stats):
    """A speculative request's turn after a pass (s: its engine/contract.Live). First a position the
    pass verified at depth U emits its token (accept): the draft its successor runs on, kept, or its
    replacement, after which every position past it goes back (rewind), as at its end. Then a draft
    sampled at the frontier (the position of its newest token) joins its drafts while it has room
    (Live.draft_room), and its position starts at the next step (Live.pipelines); a draft sampled
    past a position that went back is dropped. Returns what was delivered [(request, token)], and
    the first position that went back (None: none; the host has the runner forget their rows)."""
    samples, s.sampled, out, cut = s.sampled, [], [], None
    for pos, tok, logits, verified in samples:
        if not verified or s.req.cancelled or s.ending:
            continue
        assert pos == s.base(), (pos, s.base())           # the oldest position in flight
        kept = None                                     # no draft: the token drawn at depth U
        if s.drafts:
            tok, kept = accept(s.req, pos, s.drafts.pop(0), (tok, logits))
            stats["accepted"] += kept
        stats["verifies"] += 1
        out.append(s.deliver(tok, logits))
        if kept is False or s.ending:          # what ran after it ran on a refused draft, or past the end
            cut = pos + 1
            rewind(s, cut)
    for pos, tok, logits, verified in samples:
        frontier = pos == s.base() + len(s.drafts) and (cut is None or pos < cut)
        if not verified and frontier and s.draft_room() > 0 and not s.ending:
            s.drafts.append((tok, logits))
            stats["drafted"] += 1
    return out, cut


def rewind(s, n):
    """Positions n.. of a speculative request go back though they ran (on a refused draft, or past
    its end): their rows, drafts, pages (RaggedSeq.rewind), the exits they decided and the stops
    still to alias."""
    s.drafts = []
    s.seq.rewind(n)
    s.exits = {p: e for p, e in s.exits.items() if p < n}
    s.stops = [(p, d) for p, d in s.stops if p < n]
    s.done = s.started = n
    s.rows = 0

"""
Self-speculative decoding: rounds of tokens drafted by the model's own shallow loops, and what a round
keeps, so that the output is fixed@U's exactly (the greedy tokens, or the sampled distribution).

A looped model carries its own draft model: the same block at fewer loops, with the same weights,
pages and tokenizer. A speculative request (modes.MODES["speculative"]) decodes in rounds. Its last
accepted token c sits at position b, not yet run. Draft: positions b, b+1, .. b+k-1 run one at a time
at the draft depth d (or each at its exit gate's depth under τ), each sampling the next token, x_1 ..
x_k; their deeper K/V is aliased as for any early exit (Eq. 11), so a draft costs d loops. Verify: the
k + 1 positions b .. b+k (tokens c, x_1 .. x_k) run as one chunk to depth U with the LM head on every
position, giving the full-depth distributions p_1 .. p_{k+1}. This file decides what is kept:

  greedy      x_i is kept while it equals the full-depth argmax; the first that differs is replaced
              by the argmax; if all k are kept, the argmax after x_k comes free (the bonus token).
  sampled     x_i (drawn from the draft distribution q_i) is kept with probability
              min(1, p_i(x_i) / q_i(x_i)); the first one refused is replaced by a draw from the
              normalised max(0, p_i - q_i); all kept: a bonus draw from p_{k+1}. Each emitted token is
              then distributed exactly as fixed@U's (Leviathan et al., 2023; Chen et al., 2023):
              P(x) = q(x) min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y))) r(x) = p(x).

p and q are the distributions the sampler draws from (temperature, top-k and top-p applied to both the
same way: engine/request.sample_set), so the output is that of fixed@U under the same settings.

Exactness of the cache: a draft at position j > b read its predecessors' K/V above their draft depth
through aliases, so its deeper states are not fixed@U's; at depths 1..d its reads were exact (every
earlier draft ran them), so its state at depth d is fixed@U's. With a fixed draft depth d the round
therefore runs one more row at depth d, at position b+k (x_k, which samples nothing), and the
verification resumes all k + 1 positions from their states at depth d (keep_drafts, resume, below):
only their pages and aliases past depth d go back first (RaggedSeq.rewind), and the chunk runs U - d
passes. Under the gate the drafts exit at depths of their own and a later draft reads aliases from
the first exit on, so the verification runs every position again from depth 1. After it the
positions of rejected tokens go back too; the positions kept hold exact full-depth K/V. A draft row
and a verify chunk are ordinary rows of the depth-batched passes (serve_depthbatch.EagerRunner); the
host (serve_depthbatch.Engine) keeps a round's tokens aside (aside, below) and turns the round with
next_round whenever the request has no row in flight.
"""
import torch

from engine.request import keyed_uniform, sample_set, sample_token, seed_bits
from model import at_least_fp32
from modes import draft_rule

# The noise of a round: a draft is an ordinary draw keyed by (seed, position) (sample_token); the
# acceptance test's uniform and the replacement's draw have streams of their own, so that no draw is
# reused for another decision at the same position.
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


def accept(r, base, drafts, verified):
    """The tokens a round emits: drafts [(x_i, q_i's logits or None)], i = 1..k, drawn by the rows at
    positions base .. base+k-1; verified [(the full-depth token, its logits)] of positions base ..
    base+k. Returns [(token, its full-depth logits)]: the drafts kept, then the replacement of the
    first refused one or the bonus token."""
    out = []
    for i, ((x, q_logits), (y, p_logits)) in enumerate(zip(drafts, verified)):
        if r.temperature == 0:
            if x != y:                                  # greedy: the full-depth argmax replaces it
                return out + [(y, p_logits)]
        else:
            p, q = probs(p_logits, r), probs(q_logits, r).to(p_logits.device)
            # refused with probability 1 - min(1, p(x)/q(x))
            if accept_uniform(r, base + i) * float(q[x]) > float(p[x]):
                rest = (p - q).clamp(min=0)
                return out + [(draw(rest / rest.sum() if rest.sum() > 0 else p, r, base + i),
                               p_logits)]
        out.append((x, p_logits))
    return out + [verified[len(drafts)]]                # all kept: the bonus token, drawn from p_{k+1}


# ----------------------------------------------------------------------------- a round, on the host

def resume_depth(r):
    """The depth a verification resumes from: a fixed draft depth d (every draft's reads up to d
    were exact), or 0 under the gate (a later draft read aliases from the first exit on: depth 1
    again). It is the draft's forced exit (modes.draft_rule)."""
    return draft_rule(r)[1]


def keep_drafts(rows, h_next, kept):
    """The eager runner's rows after a pass [(group, position, row, newly exited, stopped)]: a draft
    row that stops at a fixed draft depth d keeps its state there (h_next[row]) in kept[Live]
    {position: state}: its reads were all exact, so its verification resumes from it."""
    for g, pos, i, _, stopped in rows:
        s = g.live
        if stopped and resume_depth(s.req) and s.drafting():
            kept.setdefault(s, {})[pos] = h_next[i]


def resume(g, s, kept):
    """A verification chunk (engine/rows.Group) resumes from its drafts' states at the draft depth d
    (keep_drafts; a chunk at a time where the pool is short): its rows run depths d + 1 .. U."""
    states = kept[s]
    g.h = torch.stack([states.pop(p) for p in range(g.start, g.start + g.size)])
    g.survive = torch.ones(g.size, dtype=at_least_fp32(g.h.dtype), device=g.h.device)
    g.d = resume_depth(s.req)
    if not states:
        del kept[s]


def count_passes(log, stats):
    """A pass's share of the engine's counts: whether a speculative request ran a draft row in it
    (draft_passes) or a verify row (verify_passes)."""
    spec = [s for s, n in log.ran if n and s.seq is not None and s.req.mode == "speculative"]
    stats["draft_passes"] += any(s.drafting() for s in spec)
    stats["verify_passes"] += any(s.verifying for s in spec)


def aside(s, row):
    """A token its row sampled (engine/contract.Said), kept for the round where it is not delivered:
    a draft, or the full-depth result of a verified position. Returns whether it was kept aside."""
    if s.drafting():
        s.drafts.append((row.tok, row.logits))
        return True
    if s.verifying:
        s.verified[row.pos] = (row.tok, row.logits)
        return True
    return False


def next_round(s, stats):
    """The host's turn for a speculative request with no row in flight (s: its engine/contract.Live):
    once its verification has every position, the round delivers what it keeps (Live.deliver) and
    the positions past them go back; once its drafts are all sampled (and, with a fixed draft depth
    d, position b+k has run to d too), the drafted positions go back past depth d (their deeper
    states read aliases) and its verification starts, the k + 1 positions as one chunk from depth
    d + 1 to U. Returns what was delivered."""
    out = []
    if s.verifying and len(s.verified) == len(s.drafts) + 1:
        base, r = s.base(), s.req
        kept = accept(r, base, s.drafts, [s.verified[base + i] for i in range(len(s.drafts) + 1)])
        stats["verifies"] += 1
        stats["drafted"] += len(s.drafts)
        stats["accepted"] += len(kept) - 1
        s.drafts, s.verified, s.verifying = [], {}, False
        for tok, logits in kept:
            out.append(s.deliver(tok, logits))
            if s.ending:                                # a stop id or max_tokens: the rest is dropped
                break
        rewind(s, base + len(out))
    d = resume_depth(s.req)
    last_ran = d == 0 or s.done > s.base() + len(s.drafts)         # position b+k, at a fixed d
    if s.drafting() and s.drafted() and not s.ending and last_ran:
        rewind(s, s.base(), d)
        s.verifying = True
    return out


def rewind(s, n, depth=0):
    """Positions n.. of a speculative request go back, at depths past `depth` (0: whole), though they
    ran (drafts to verify, tokens refused): their pages (RaggedSeq.rewind), the exits they decided
    and the stops still to alias."""
    s.seq.rewind(n, depth)
    s.exits = {p: e for p, e in s.exits.items() if p < n}
    s.stops = [(p, d) for p, d in s.stops if p < n]
    s.done = s.started = n

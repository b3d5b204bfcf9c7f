"""
The inference modes (§3, Table 17) and what they mean for one request: how its prompt and its
decoded tokens run, per position; the pages it needs; the one validation of a request; and the
teacher-forced score of a continuation in each mode that has one (lab/eval.py).

A mode says, for a prompt token and for a decoded one, when the token exits (never before the
last depth, at the request's threshold τ, or by the ETE prefill options of App. E.2), whether it
runs on to the last depth after its exit (Ouro's lanes, every depth filled), and which one depth
later reads keep (Table 17's baselines; None: Eq. 7, every depth read at min(d, e_j)). Both
engines read the modes only through the functions below.
"""
import math
from typing import NamedTuple, Optional

import torch

from configurator import UserError
from model import FULL, check_prompt, forward_ragged, threshold_exit
from engine.request import SEED_MAX


class Rule(NamedTuple):
    """How one kind of token (a prompt's or a decoded one) runs in a mode."""
    # "never": to the last depth; "thr": the request's τ; "prefill": the ETE options (App. E.2)
    exit: str
    # keep running to the last depth after the exit is decided (Ouro's lanes, every depth filled)
    run_full: bool
    # the one depth every later read keeps (Table 17: "last" = U, "exit" = e_i); None: Eq. 7
    keep: Optional[str]


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
    # fixed@U's tokens exactly: a decoded token is drafted at a shallow depth, then verified at U
    # (engine/speculative.py); this is its prompt's rule, a decoded position's is draft_rule
    "speculative":  Mode(prompt=Rule("never", False, None), decode=Rule("never", False, None)),
}


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


# ----------------------------------------------------------------------- requests against the modes

def n_run(r, U):
    """The depths a request's tokens may run: U, or its own depth in fixed mode."""
    return (r.depth or U) if r.mode == "fixed" else U


def min_pages(r, U):
    """Pages a request needs even with every token exiting as early as it can."""
    prompt = MODES[r.mode].prompt
    prompt_full = prompt.exit == "never" or prompt.run_full
    return len(r.prompt) * (n_run(r, U) if prompt_full else 1) + max(r.max_tokens - 1, 0)


def max_pages(r, U):
    """Pages a request needs at worst: every position that runs at every depth it may run."""
    return (len(r.prompt) + max(r.max_tokens - 1, 0)) * n_run(r, U)


def need(r, U):
    """A request's whole need of pages, both bounds, in words (every refusal and every cut says it)."""
    return (f"at least {min_pages(r, U)} KV pages and at worst {max_pages(r, U)} (prompt of "
            f"{len(r.prompt)} tokens in mode {r.mode}, {r.max_tokens} new tokens; at worst every "
            "position at every depth)")


DRAFT_K_MAX = 64       # speculative mode: the most drafts in flight a request may ask for


def check_request(r, cfg, n_pages):
    """The one validation of a request (the server's too): UserError naming the field when r is
    malformed or could never fit in a pool of n_pages. Reads nothing that the engine changes, so
    any thread may call it."""
    U = cfg.n_loops
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)
    # no NaN, no infinity
    num = lambda v: whole(v) or (isinstance(v, float) and math.isfinite(v))
    if not isinstance(r.mode, str) or r.mode not in MODES:
        raise UserError(f"mode={r.mode!r}; allowed: {', '.join(MODES)}", "mode")
    for key, ok, allowed in [
            ("thr", num(r.thr) and 0 <= r.thr <= 1, "a number in [0, 1]"),
            ("max_tokens", whole(r.max_tokens) and r.max_tokens >= 1, "an integer >= 1"),
            ("temperature", num(r.temperature) and 0 <= r.temperature <= 2, "a number in [0, 2]"),
            ("top_p", num(r.top_p) and 0 < r.top_p <= 1, "a number in (0, 1]"),
            ("top_k", whole(r.top_k) and r.top_k >= 0, "an integer >= 0"),
            ("depth", whole(r.depth) and 0 <= r.depth <= U,
             f"an integer in 0..{U} (0: all {U} loops)"),
            ("draft_k", whole(r.draft_k) and 1 <= r.draft_k <= DRAFT_K_MAX,
             f"an integer in 1..{DRAFT_K_MAX}"),
            ("draft_depth", whole(r.draft_depth) and 0 <= r.draft_depth <= U - 1,
             f"an integer in 0..{U - 1} (0: the exit gate at thr)"),
            ("seed", whole(r.seed) and 0 <= r.seed <= SEED_MAX, "an integer in [0, 2**64 - 1]"),
            ("prefix_full", whole(r.prefix_full) and r.prefix_full >= 0, "an integer >= 0"),
            ("prefill_schedule", r.prefill_schedule in ("", "cosine"), "'' or 'cosine'"),
            ("prefill_thr", r.prefill_thr is None
             or (num(r.prefill_thr) and 0 <= r.prefill_thr <= 1), "a number in [0, 1]")]:
        if not ok:
            raise UserError(f"{key}={getattr(r, key)!r}: must be {allowed}", key)
    if (r.prefill_thr is not None or r.prefill_schedule or r.prefix_full) and MODES[r.mode].prompt.exit != "prefill":
        raise UserError("prefill_thr/prefill_schedule/prefix_full shape a ragged prefill; "
                        f"mode={r.mode} has none", "mode")
    check_prompt(cfg, r.prompt, r.max_tokens)
    if min_pages(r, U) > n_pages:
        raise UserError(f"the request needs {need(r, U)}, but the pool has {n_pages}")


def as_fixed(r, U):
    """The fixed scheduler runs every request as Ouro's code does, every token all its loops: the
    request becomes a fixed one (a fixed request keeps its depth)."""
    if r.mode in MODES:
        depth = (r.depth if r.mode == "fixed" else 0) or U
        r.mode, r.depth, r.prefill_thr, r.prefill_schedule, r.prefix_full = "fixed", depth, None, "", 0


def draft_rule(r):
    """How a speculative request's draft runs: (τ, forced exit): its draft depth, or its exit gate
    at thr (Eq. 4) when the draft depth is 0."""
    return (r.thr, 0) if r.draft_depth == 0 else (FULL, r.draft_depth)


def position_rules(r, start, end):
    """How the rows of positions start..end-1 of request r run, by its mode (MODES, §3): per
    position the threshold τ (Eq. 4; App. E.2 for an ETE prefill), whether it runs on to its last
    depth after its exit (full), the exit it replays after a preemption (forced; 0: decide) and the
    Table 17 depth it keeps. A speculative request's decoded positions exit where their draft is
    sampled (draft_rule) and run on to U, where they are verified (engine/speculative.py)."""
    n = len(r.prompt)
    taus, full, forced, keep = [], [], [], []
    ptaus = None
    for p in range(start, end):
        kind, run_full, keep_rule = MODES[r.mode].prompt if p < n else MODES[r.mode].decode
        if kind == "prefill":
            if ptaus is None:
                ptaus = prompt_thresholds(n, r.thr, r.prefill_thr, r.prefill_schedule,
                                          r.prefix_full).tolist()
            tau = ptaus[p]
        else:
            tau = FULL if kind == "never" else r.thr
        forced_exit = r.exits[p] if p < len(r.exits) else 0
        if r.mode == "speculative" and p >= n and not forced_exit:   # a draft, then its verification
            (tau, forced_exit), run_full = draft_rule(r), True
        taus.append(tau)
        full.append(run_full)
        forced.append(forced_exit)
        keep.append(keep_rule)
    return taus, full, forced, keep


def decode_rule(r):
    """How r's decode tokens run (its position_rules past the prompt): (τ, runs on to its last depth)."""
    rule = MODES[r.mode].decode
    return (FULL if rule.exit == "never" else r.thr), rule.run_full


def keeps_one_depth(mode):
    """Table 17 baselines: their prompt runs whole and their tokens one at a time, as defined."""
    return MODES[mode].prompt.keep is not None or MODES[mode].decode.keep is not None


# ---------------------------------------------------------------------------- teacher-forced scores

SCORED = ["fixed", "ouro", "dense_ragged", "ete_ragged"]   # the MODES with a teacher-forced score (not Table 17's)


@torch.no_grad()
def continuation_logprobs(model, pairs, mode, thr, depth, batch_size, device):
    """pairs [(context ids, continuation ids)] -> [(Σ log p(continuation | context), greedy?, exits
    of the positions that predicted the continuation)], teacher-forced, in batches (right padding:
    causal attention keeps it out of every real position). fixed@k reads depth k; ETE-Ragged the
    exits each position would take (Eq. 4, 7); Ouro mode the threshold exit on full lanes;
    Dense-Ragged is fixed@U (a teacher-forced pass is a prefill)."""
    U, T_max = model.config.n_loops, model.config.block_size
    out = [None] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        # keep the end of long contexts
        seqs = [(pairs[i][0] + pairs[i][1])[-(T_max + 1):] for i in idx]
        T = max(len(s) for s in seqs) - 1
        x = torch.zeros(len(seqs), T, dtype=torch.long)
        for r, s in enumerate(seqs):
            x[r, :len(s) - 1] = torch.tensor(s[:-1])
        x = x.to(device)
        if mode == "ete_ragged":
            o = forward_ragged(model, x, taus=thr)
            logits, exits = o["logits"], o["exits"]
        else:
            o = model(x, keep_logits=True)
            if mode == "ouro":
                exits = threshold_exit(o["gate_logits"], thr)
                logits = torch.stack(o["logits"], -2).gather(-2, (exits - 1)[..., None, None].expand(
                    *exits.shape, 1, o["logits"][0].shape[-1]))[..., 0, :]
            else:
                k = depth if mode == "fixed" else U
                logits, exits = o["logits"][k - 1], torch.full(x.shape, k, dtype=torch.long)
        logp = torch.log_softmax(logits.float(), -1).cpu()
        exits = exits.cpu()
        for r, i in enumerate(idx):
            n_cont = len(pairs[i][1])
            s = seqs[r]
            # positions predicting the continuation
            pos = torch.arange(len(s) - 1 - n_cont, len(s) - 1)
            tgt = torch.tensor(s[-n_cont:])
            lp = logp[r, pos, tgt]
            greedy = bool((logp[r, pos].argmax(-1) == tgt).all())
            out[i] = (float(lp.sum()), greedy, exits[r, pos].tolist())
    return out


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python sample.py --mode=... runs them")

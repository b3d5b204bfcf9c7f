"""
The weight-read cost model of the engine benchmark: decode on one device is weight-bound at small
batch, so a run costs the weights its block passes and LM-head calls read (engine/shared_head.py's
weight_bytes prices them). What a run read, fixed@U's bill for the same tokens, and the cheapest head
schedule of a fixed batch whose exits are known (the bound no online policy beats).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.cost_model ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import math


def cost(U, weights, passes, head_calls, avg_depth):
    """Decode on one device is weight-bound at small batch: a block pass reads the block's weights
    (W_block) and a head call the LM head's (W_head), whatever the rows. Weights read by a run, and
    the ideal speed against fixed@U per sampled token at full batch width: (U·W_block + W_head) /
    (Ē·W_block + W_head). weights: (W_block, W_head), engine/shared_head.weight_bytes."""
    wb, wh = weights
    return dict(weight_gb=(passes * wb + head_calls * wh) / 1e9, head_to_block=wh / wb,
                ideal_cost=(U * wb + wh) / (avg_depth * wb + wh))


def fixed_cost(U, weights, n_new):
    """The weights fixed@U (and the Ouro way) read for a fixed batch of n_new tokens each: U passes
    and one head call per token. weights: (W_block, W_head)."""
    wb, wh = weights
    return n_new * (U * wb + wh)


def head_schedule(rows, wb, wh, width=1000):
    """The cheapest LM-head schedule of a fixed batch whose exits are known, after the run: what no
    online policy can beat, since it sees the future. rows[i]: request i's passes per sampled token
    (its prompt chunk's depth, then the exit depth of each decode token). A token's head call must
    come before its request's next token starts (the token is the next input), so a schedule is the
    set of passes after which the head runs, each call serving every row that waits; it costs passes
    x W_block + calls x W_head. Beam search, pass by pass: a state is every request's (tokens
    sampled, depth run of the next), keeping the fewest calls that reach it; the `width` states of
    lowest bound go on (bound: cost so far + the most passes and the most tokens any request still
    needs). Returns the cheapest cost found: a schedule that exists, so the best one costs at most
    this (and at least the makespan's passes + one call per token, the bound of ideal_batch)."""
    n = [len(r) for r in rows]
    # passes still to run from token j
    need = [[sum(r[j:]) for j in range(len(r) + 1)] for r in rows]
    def bound(p, calls, st):
        return ((p + max(need[i][t] - d for i, (t, d) in enumerate(st))) * wb
                + (calls + max(n[i] - t for i, (t, d) in enumerate(st))) * wh)
    frontier, p, best = {tuple((0, 0) for _ in rows): 0}, 0, math.inf
    while frontier:
        p += 1
        nxt = {}
        for st, calls in frontier.items():
            st = tuple((t, d + 1) if t < n[i] and d < rows[i][t] else (t, d)
                       for i, (t, d) in enumerate(st))
            waiting = [t < n[i] and d == rows[i][t] for i, (t, d) in enumerate(st)]
            running = any(t < n[i] and d < rows[i][t] for i, (t, d) in enumerate(st))
            # no call: the waiting rows wait
            options = [(st, calls)] if running else []
            # a call: every waiting row samples
            if any(waiting):
                options.append((tuple((t + 1, 0) if w else (t, d) for (t, d), w in zip(st, waiting)), calls + 1))
            for s, c in options:
                if all(t == n[i] for i, (t, _) in enumerate(s)):
                    best = min(best, p * wb + c * wh)
                elif nxt.get(s, math.inf) > c:
                    nxt[s] = c
        ranked = sorted((bound(p, c, s), s, c) for s, c in nxt.items())
        frontier = {s: c for b, s, c in ranked[:width] if b < best}
    return best


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=engine reports it")

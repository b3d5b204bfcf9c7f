"""
The paper's claims on exits and difficulty (§4, Fig. 3, 12), for lab/claims.py's table: where depth
buys accuracy on the hardest items at all (each row's precondition), whether exits rise with the
difficulty, more under global than local (synthetic labels, the look-up tasks whose k shows), and on
the graded task, where k is hidden, whether the answer's exits follow each model's own need (rule 2:
Spearman against the model's shuffled exits, on the models that learn past one look-up, the two
scopes compared at matched mean depth).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.difficulty ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import numpy as np

from lab.claims import (GRADED_SEEDS, MIN_MODELS, POINTER_TASKS, TASK_PRIORS, THRS, base_runs,
                        deepest, every_k, levels_of, not_run, position_exits, rollouts,
                        row, too_few)
from lab.stats import (boot_diff, ci, interval, per_model, permutation_test, replicates, sign_of,
                       sign_test, spearman, stream)

N_SHUFFLES = 1000                  # rule 2: the shuffles of a model's exits that make its null
NEED_MARGIN = 0.05                 # rule 2: a k's need is the shallowest fixed depth within this of its best
# rule 2's match: each model of one scope is read at the τ whose mean answer depth is nearest the
# other scope's mean answer depth at MATCH_AT (its models at MATCH_AT), both ways round
MATCH_AT = 0.5

# ----------------------------------------------------------------------------- exits and difficulty

GAIN_RULE = "holds when the gain is at least 0.1 with its 95% interval above 0"
RISE_RULE = ("holds when global's rise and global minus local both have 95% intervals above 0 "
             f"(models resampled, each scope apart on its own stream; at least {MIN_MODELS} models "
             "a scope; tested only where its precondition holds)")


def rise_verdict(rise):
    """{scope: (per-model rises, replicates)} of a rise with difficulty -> (numbers, holds):
    global's rise and global minus local (independent trainings: their replicates subtract unpaired,
    from two streams) both clearly above 0, with the tests over the models beside."""
    own = {s: np.asarray(v[0]) for s, v in rise.items()}
    diff = rise["global"][1] - rise["local"][1]
    text = (f"global {ci(own['global'].mean(), rise['global'][1])} "
            f"({sign_test(own['global'], 'rise')}), local "
            f"{ci(own['local'].mean(), rise['local'][1])} ({sign_test(own['local'], 'rise')}); "
            f"global minus local {ci(own['global'].mean() - own['local'].mean(), diff)} "
            f"({permutation_test(own['global'], own['local'])})")
    return text, sign_of(rise["global"][1]) > 0 and sign_of(diff) > 0


def given_precondition(rise, need, counts):
    """A rise with difficulty is tested only where its precondition holds (where depth buys nothing
    at the answer, exits that rise or not with k say nothing of spending depth on need) and on
    enough models."""
    if not need["holds"]:
        return dict(rise, holds=None, verdict="untested (its precondition fails)")
    few = too_few(*counts)
    return dict(rise, holds=None, verdict=few) if few else rise


def difficulty_claims(R):
    """Exits follow difficulty on the synthetic data: first whether depth buys accuracy on the
    labelled tokens at all (fixed@U against fixed@1 on the hardest label, held-out windows), then
    the mean exit depth before difficulty 4 minus difficulty 1 per scope and global minus local."""
    runs = {s: [r for r in base_runs(R, "synthetic", s) if "labels" in r.get("windows", {})]
            for s in ("global", "local")}
    if not all(runs.values()):
        return []
    correct = lambda r, k, d: np.asarray(r["windows"]["label_correct"], float)[:, k, d]
    tokens = lambda r, k: np.asarray(r["windows"]["labels"], float)[:, k, 0]
    with_acc = [r for s in runs for r in runs[s] if "label_correct" in r["windows"]]
    claim = "Exits rise with the next token's difficulty, more under global than local: synthetic"
    if not with_acc:
        return [row(claim, "§4, Fig. 3, 12", RISE_RULE, "no per-label accuracy", "",
                    verdict="untested (no interval)", runs=runs["global"] + runs["local"])]
    U = len(with_acc[0]["final"]["val_loss_fixed"])
    groups = [(correct(r, 4, U - 1), correct(r, 4, 0), tokens(r, 4)) for r in with_acc]
    value, reps = replicates(groups, lambda a, b, n: (a - b) / n, seed=stream("synthetic", "gain"))
    need = dict(holds=sign_of(reps) > 0 and value >= 0.1)
    # (tokens, Σ depth)
    labelled = lambda r, k: tuple(np.asarray(r["windows"]["labels"], dtype=float)[:, k].T)
    rise = {s: per_model([labelled(r, 4) + labelled(r, 1) for r in rs], lambda n4, d4, n1,
                         d1: d4 / n4 - d1 / n1, seed=stream("synthetic", "rise", s))
            for s, rs in runs.items()}
    text, holds = rise_verdict({s: (own, reps) for s, (_, reps, own) in rise.items()})
    n = f"{len(runs['global'])}+{len(runs['local'])} models"
    numbers = (f"precondition, accuracy on difficulty-4 tokens, fixed@{U} minus fixed@1 "
               f"({len(with_acc)} models, held-out windows): {ci(value, reps)} ({GAIN_RULE}); "
               f"ETE-Ragged τ 0.5, mean depth before difficulty 4 minus 1 ({n}): {text}")
    out = row(claim, "§4, Fig. 3, 12", RISE_RULE, "depth buys accuracy on the hardest: "
              f"{ci(value, reps)}; rise, global − local "
              f"{text.split('global minus local ')[1].split(' (')[0]} ({n})", numbers, holds=holds,
              runs=runs["global"] + runs["local"])
    return [given_precondition(out, need, [len(v) for v in runs.values()])]


def pointer_claims(R):
    """The look-up tasks whose k shows in the item (pointer, hops: an item of k look-ups has chains
    of length k), per prior: whether depth buys accuracy there at all (the precondition), then
    whether the answer's exit depth rises with k, global against local."""
    return [c for data in ("pointer", "hops") for prior in TASK_PRIORS[data]
            for c in pointer_prior_claims(R, data, prior)]


def pointer_prior_claims(R, data, prior):
    by_scope = {s: [r for r in base_runs(R, data, s, prior) if r.get("builtin")]
                for s in ("global", "local")}
    suites = {s: [r["builtin"] for r in rs] for s, rs in by_scope.items()}
    runs = by_scope["global"] + by_scope["local"]
    if not all(suites.values()):
        return []
    name = f"{POINTER_TASKS[data][1]}, {prior.capitalize()}"
    levels = sorted({k for b in suites["global"] for k in b["fixed@1"]}, key=int)
    lo, hard, U = levels[0], levels[-1], deepest(suites["global"][0])
    items = {s: [b for b in suites[s] if all(rollouts(b, m, k, "correct") is not None
                                             for k in (lo, hard)
                                             for m in ("fixed@1", f"fixed@{U}", "ete_ragged@0.5"))]
             for s in suites}
    claim = f"The answer's exit depth rises with k, more under global than local: {name} (k visible)"
    n = f"{len(suites['global'])}+{len(suites['local'])} models"
    if not all(items.values()):
        return [row(claim, "§4, Fig. 3", RISE_RULE, f"no rollouts ({n})", "", verdict="untested (no "
                    "interval)", runs=runs)]
    groups = [(rollouts(b, f"fixed@{U}", hard, "correct"), rollouts(b, "fixed@1", hard, "correct"))
              for s in items for b in items[s]]
    gain, reps = replicates(groups, np.subtract, seed=stream(data, prior, "gain"))
    need = dict(holds=sign_of(reps) > 0 and gain >= 0.1)
    # the answer's exit depth at the hardest k minus the easiest: different items, so
    # two arrays a model
    rise = {s: replicates_own([(rollouts(b, "ete_ragged@0.5", hard, "answer_depth"),
                                rollouts(b, "ete_ragged@0.5", lo, "answer_depth"))
                               for b in items[s]],
                              stream(data, prior, "rise", s)) for s in items}
    text, holds = rise_verdict(rise)
    acc = lambda s, m, k: np.mean([b[m][k]["acc"] for b in suites[s]])
    table = lambda s: "; ".join(f"k={k} " + " / ".join(f"{acc(s, f'fixed@{d}', k):.2f}"
                                                       for d in range(1, U + 1))
                                for k in levels)
    numbers = (f"precondition, fixed@{U} minus fixed@1 at k={hard}, both scopes "
               f"({n}, items resampled): "
               f"{ci(gain, reps)} ({GAIN_RULE}); accuracy at fixed@1..{U} per k: global "
               f"{table('global')}; local "
               f"{table('local')}; the answer's exit depth at k={hard} minus k={lo}, ETE-Ragged τ "
               f"0.5: {text}; k shows in the item's length")
    out = row(claim, "§4, Fig. 3", RISE_RULE, f"depth buys: {ci(gain, reps)}; rise global − local "
              f"{text.split('global minus local ')[1].split(' (')[0]} ({n})", numbers, holds=holds,
              runs=runs)
    return [given_precondition(out, need, [len(v) for v in items.values()])]


def replicates_own(groups, seed):
    """(each model's own hi - lo mean, replicates of their mean) for two arrays of different units a
    model: the models drawn, then each array's units drawn on their own."""
    own = [np.mean(a) - np.mean(b) for a, b in groups]
    return own, replicates(groups, np.subtract, paired=False, seed=seed)[1] if len(groups) else np.zeros(0)


# ------------------------------------------------------------------ the graded task's exits: rule 2

def graded_runs(R, scope):
    """The graded task's parents of a scope that hold their builtin suite."""
    return [r for r in base_runs(R, "graded", scope) if r.get("builtin")]


def need_of(suite, k, U):
    """The depth a model needs at k: the shallowest fixed depth whose accuracy on k look-ups is
    within NEED_MARGIN of its best fixed depth's, on the items of `suite`."""
    acc = [rollouts(suite, f"fixed@{d}", k, "correct").mean() for d in range(1, U + 1)]
    return next(d for d in range(1, U + 1) if acc[d - 1] >= max(acc) - NEED_MARGIN)


def need_model(r, levels, U):
    """Rule 2 on one graded model: its need per k, set on the items held apart (builtin_need), and
    on the judging items too (how stable a need is between two held-apart sets); whether depth buys
    accuracy past one look-up (fixed@U minus fixed@1 on the held-apart items of k >= 2, interval
    above 0); and at each τ, Spearman(the answer's exit, the need of its item's k) on the judging
    items against that model's exits shuffled across its items, with its mean answer and prompt
    depths."""
    judge, held = r["builtin"], r["builtin_need"]
    need = [need_of(held, k, U) for k in levels]
    past_one = lambda d: np.concatenate([rollouts(held, f"fixed@{d}", k, "correct")
                                         for k in levels[1:]])
    gain, reps = replicates([(past_one(U), past_one(1))], np.subtract,
                            seed=stream(r["name"], "gain"))
    at = {}
    for t in sorted(THRS):
        mode = f"ete_ragged@{t}"
        exits = every_k(judge, mode, "answer_depth")
        needs = np.concatenate([np.full(len(rollouts(judge, mode, k, "correct")), n)
                                for k, n in zip(levels, need)])
        rho, null = spearman(exits, needs, N_SHUFFLES, stream(r["name"], t))
        prompt = [np.concatenate(x).sum()
                  for x in zip(*(position_exits(judge, mode, k, "prompt") for k in levels))]
        at[t] = dict(rho=rho, above=rho > np.percentile(null, 97.5), depth=exits.mean(),
                     prompt=prompt[0] / prompt[1])
    return dict(name=r["name"], need=need, again=[need_of(judge, k, U) for k in levels], gain=gain,
                enters=interval(reps)[0] > 0, at=at)


def matched(models, other):
    """Rule 2's match: each model read at the τ whose mean answer depth is nearest `other` (the
    other scope's mean answer depth at MATCH_AT)."""
    return [m["at"][min(m["at"], key=lambda t: abs(m["at"][t]["depth"] - other))] for m in models]


def need_claims(R):
    """The graded task, where k is hidden until the chain is followed: do the answer's exits follow
    each model's own need, more under global than local (rule 2)? Within each model that learns past
    one look-up, Spearman(exit, need) against its shuffled exits; global against local at matched
    mean answer depth, both ways round (models resampled, each scope apart)."""
    claim = "Exits follow each model's need more under global than local: graded (k hidden)"
    rule = ("rule 2: per model, Spearman(the answer's exit, the need of its k) against "
            f"{N_SHUFFLES} shuffles of its exits (need: the shallowest fixed depth within "
            f"{NEED_MARGIN} of its best, on items held apart); models enter when fixed@U beats "
            f"fixed@1 past one look-up (interval above 0), at least {MIN_MODELS} a scope. Holds "
            "when global minus local mean Spearman has its 95% interval above 0 both ways round: "
            "each scope's models at the τ whose answer depth is nearest the other scope's at τ 0.5")
    runs = {s: [r for r in graded_runs(R, s) if r.get("builtin_need")] for s in ("global", "local")}
    if not all(runs.values()):
        return [not_run(claim, "§4, Fig. 3, 12", rule, f"grd-{{global,local}}-poisson-s<seed>, "
                        f"{GRADED_SEEDS} seeds a scope")]
    U, levels = deepest(runs["global"][0]["builtin"]), levels_of(runs["global"][0]["builtin"])
    models = {s: [need_model(r, levels, U) for r in rs] for s, rs in runs.items()}
    entering = {s: [m for m in ms if m["enters"]] for s, ms in models.items()}
    used = runs["global"] + runs["local"]
    every = [m for ms in models.values() for m in ms]
    changed = sum(a != b for m in every for a, b in zip(m["need"], m["again"]))
    at = lambda m: m["at"][MATCH_AT]
    lines = [f"{m['name']}: gain past one look-up "
             f"{m['gain']:.2f}{'' if m['enters'] else ' (does not enter)'}, need "
             f"{'/'.join(map(str, m['need']))} (on the judging items "
             f"{'/'.join(map(str, m['again']))}), at τ {MATCH_AT} Spearman "
             f"{at(m)['rho']:.2f}{' (past its null)' if at(m)['above'] else ''}, answer depth "
             f"{at(m)['depth']:.2f}, prompt depth {at(m)['prompt']:.2f}" for m in every]
    numbers = (f"need per k = {'/'.join(levels)} changes between the two held-apart item sets at "
               f"{changed} of {len(every) * len(levels)} (model, k); " + "; ".join(lines))
    count = {s: len(ms) for s, ms in entering.items()}
    if too_few(*count.values()):
        here = (f"{count['global']} of {len(models['global'])} global, {count['local']} of "
                f"{len(models['local'])} local models learn past one look-up")
        return [row(claim, "§4, Fig. 3, 12", rule, here, numbers, verdict="untested "
                    f"(too few learners: {here})", runs=used)]
    cells, holds = [], True
    for a, b in (("global", "local"), ("local", "global")):
        target = np.mean([m["at"][MATCH_AT]["depth"] for m in entering[b]])
        read = {a: matched(entering[a], target), b: [m["at"][MATCH_AT] for m in entering[b]]}
        rho = {s: np.array([x["rho"] for x in read[s]]) for s in read}
        reps = boot_diff(rho["global"], rho["local"], ("need", a))
        holds = holds and interval(reps)[0] > 0
        cells.append(
            f"{a} matched to {b}'s answer depth at τ {MATCH_AT} ({target:.2f}): " + "; ".join(
                f"{s} Spearman {rho[s].mean():.2f} ({sum(x['above'] for x in read[s])} of "
                f"{len(read[s])} past their null), answer depth "
                f"{np.mean([x['depth'] for x in read[s]]):.2f}, prompt depth "
                f"{np.mean([x['prompt'] for x in read[s]]):.2f}" for s in ("global", "local"))
            + f"; global minus local {ci(rho['global'].mean() - rho['local'].mean(), reps)} "
              f"({permutation_test(rho['global'], rho['local'])})")
    first = cells[0].split("global minus local ")[1].split(" (")[0]
    here = f"Spearman(exit, need), global − local at matched depth: {first} ({count['global']}+{count['local']} models)"
    return [row(claim, "§4, Fig. 3, 12", rule, here, " | ".join(cells) + "; " + numbers, holds=holds,
                runs=used)]


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report writes RESULTS.md with its verdicts")

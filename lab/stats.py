"""
Statistics over trained models, for lab/claims.py: bootstrap intervals that draw the models with
replacement and then the units (held-out windows, builtin items) within each drawn model; the tests
over the models printed beside them (a sign test within a scope, an exact permutation test between
two scopes); random streams of their own for things drawn apart; Spearman's rank correlation with
a shuffle null. numpy only; nothing here knows what a run is.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.stats ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import itertools
import math
import zlib

import numpy as np

N_BOOT = 2000                      # bootstrap replicates per interval


# ----------------------------------------------------------------------------- intervals

def replicates(groups, stat=None, paired=True, n=N_BOOT, seed=0, units=True):
    """A statistic of pooled means, on every unit and on n bootstrap replicates. groups: one tuple
    of arrays per seed; a replicate draws the seeds with replacement, then the units of each drawn
    seed (one draw for all of its arrays when paired: they hold the same units in the same order;
    units=False: every unit, the seeds alone resampled), and takes the mean of each array over the
    units drawn. stat maps those means to the statistic (numpy operations on arrays of replicates);
    None: the mean of the one array. Returns (value, replicate values)."""
    rng = np.random.default_rng(seed)
    groups = [[np.asarray(a, dtype=float) for a in g] for g in groups]
    stat = stat or (lambda m: m)
    n_arrays = len(groups[0])
    sums, counts = np.zeros((n_arrays, n)), np.zeros((n_arrays, n))
    drawn = rng.integers(0, len(groups), (n, len(groups)))     # the seeds of each replicate
    for slot in range(len(groups)):
        for i, g in enumerate(groups):
            take = drawn[:, slot] == i
            idx = None
            for j, a in enumerate(g):
                if idx is None or not paired:
                    idx = (rng.integers(0, len(a), (int(take.sum()), len(a))) if units
                           else np.broadcast_to(np.arange(len(a)), (int(take.sum()), len(a))))
                sums[j, take] += a[idx].sum(1)
                counts[j, take] += len(a)
    with np.errstate(invalid="ignore", divide="ignore"):
        value = stat(*[np.concatenate([g[j] for g in groups]).mean() for j in range(n_arrays)])
        return float(value), np.asarray(stat(*(sums / counts)), dtype=float)


def per_model(groups, stat, n=N_BOOT, seed=0):
    """A statistic taken within each model, then averaged over the models: each model's own value,
    their mean, and n bootstrap replicates of that mean (the models drawn with replacement, then the
    units of each drawn model, one draw for all of its arrays: they hold the same units). Where
    replicates() pools the units of every model before its statistic, so that one model's choice can
    lend another a gain, this compares each model with itself only. Returns (mean, replicates,
    own)."""
    rng = np.random.default_rng(seed)
    groups = [[np.asarray(a, dtype=float) for a in g] for g in groups]
    total = np.zeros(n)
    drawn = rng.integers(0, len(groups), (n, len(groups)))
    # a ratio over units none of a replicate holds: nan
    with np.errstate(invalid="ignore", divide="ignore"):
        own = np.array([stat(*[a.mean() for a in g]) for g in groups], dtype=float)
        for slot in range(len(groups)):
            for i, g in enumerate(groups):
                take = np.flatnonzero(drawn[:, slot] == i)
                idx = rng.integers(0, len(g[0]), (len(take), len(g[0])))
                total[take] += stat(*[a[idx].mean(1) for a in g])
    return float(own.mean()), total / len(groups), own


def interval(reps):
    lo, hi = np.nanpercentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


MC_SE = 3          # an endpoint nearer a margin than this many Monte Carlo standard errors: unsettled


def mc_error(reps, q):
    """The Monte Carlo standard error of the q-th percentile of bootstrap replicates: the spread of
    that percentile over ten batches of them, over the square root of ten."""
    batches = [np.nanpercentile(b, q) for b in np.array_split(np.asarray(reps, float), 10)]
    return float(np.std(batches, ddof=1) / np.sqrt(len(batches)))


def unsettled(reps, margins):
    """Whether an endpoint of the 95% interval lies within MC_SE Monte Carlo errors of a margin it is
    compared with: then a verdict would depend on the draw."""
    (lo, hi), errors = interval(reps), (mc_error(reps, 2.5), mc_error(reps, 97.5))
    return any(abs(end - m) < MC_SE * err for end, err in ((lo, errors[0]), (hi, errors[1]))
               for m in margins)


def per_model_settled(groups, stat, margins, seed):
    """per_model, with enough draws that the interval's endpoints are settled against the margins
    they are judged by: N_BOOT, then ten times as many where an endpoint lies within its Monte Carlo
    error of a margin. Returns (mean, replicates, own, settled)."""
    value, reps, own = per_model(groups, stat, seed=seed)
    if unsettled(reps, margins):
        value, reps, own = per_model(groups, stat, n=10 * N_BOOT, seed=seed)
    return value, reps, own, not unsettled(reps, margins)


def ci(value, reps, p=2):
    lo, hi = interval(reps)
    return f"{value:.{p}f} [{lo:.{p}f}, {hi:.{p}f}]"


def sign_of(reps):
    """-1: the interval lies below 0, +1: above, 0: it holds 0 (within noise)."""
    lo, hi = interval(reps)
    return -1 if hi < 0 else 1 if lo > 0 else 0


def stream(*labels):
    """Rule 4: the seed of a random stream of its own for each thing drawn apart (a scope of a
    claim), from its labels, so that two scopes never share their random numbers and a rerun draws
    the same."""
    return zlib.crc32(" ".join(map(str, labels)).encode())


def boot_diff(a, b, labels, n=N_BOOT):
    """Replicates of mean(a) - mean(b) over two scopes' models, each drawn apart on its own stream."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    ra, rb = (np.random.default_rng(stream(*labels, s)) for s in ("a", "b"))
    return a[ra.integers(0, len(a), (n, len(a)))].mean(1) - b[rb.integers(0, len(b), (n, len(b)))].mean(1)


TIE = 1e-9        # a model's value within this of 0 is a tie: floating-point residuals are no direction


def sign_test(values, word="above 0"):
    """Rule 4's check over the models beside a bootstrap interval: how many models' own values lie
    above 0 and the two-sided sign test's p over the models that are not ties (a value within TIE of
    0: floating-point residue, not a direction), with the ties counted."""
    v = np.asarray(values, dtype=float)
    up, down = int((v > TIE).sum()), int((v < -TIE).sum())
    n, ties = up + down, len(v) - up - down
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(up, down) + 1)) / 2 ** n) if n else 1.0
    return (f"{up} of {len(v)} models {word}" + (f", {ties} tied" if ties else "")
            + f", sign test p {p:.2f}")


def permutation_test(a, b):
    """The test over the models of two scopes drawn apart: the exact two-sided p of their difference
    of means, over every way to split the pooled models into groups of these sizes."""
    pooled, n, observed = np.concatenate([a, b]).astype(float), len(a), abs(np.mean(a) - np.mean(b))
    splits = [abs(pooled[list(s)].mean() - np.delete(pooled, list(s)).mean())
              for s in itertools.combinations(range(len(pooled)), n)]
    return f"permutation test over the models p {np.mean(np.asarray(splits) >= observed - 1e-12):.2f}"


# ----------------------------------------------------------------------------- rank correlation

def ranks(x):
    """Ranks 1..n, ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    _, tie, count = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(tie, weights=r) / count)[tie]


def spearman(x, y, shuffles=0, seed=0):
    """Spearman's rank correlation of x and y, and the same for `shuffles` random orders of x (its
    null: what x's values correlate with y by chance). 0 where x or y is constant: a model that
    exits at one depth for every item follows nothing, and its shuffles change nothing."""
    rx, ry = ranks(x) - (len(x) + 1) / 2, ranks(y) - (len(y) + 1) / 2
    norm = np.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    if norm == 0:
        return 0.0, np.zeros(shuffles)
    rng = np.random.default_rng(seed)
    null = np.array([rx[rng.permutation(len(rx))] @ ry for _ in range(shuffles)]) / norm
    return float(rx @ ry / norm), null


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report uses them")

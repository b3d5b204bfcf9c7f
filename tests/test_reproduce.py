"""lab/reproduce.py: the quick grid end to end (every column, every figure, resumable), and the claim
checks, table and figures on a small hand-made results file."""
import functools
import json
import os
import re

import numpy as np
import pytest
import torch

import prepare_data
from lab import claims, report, reproduce
from lab.figures import draw


def fake_run(name, scope="global", prior="poisson", seed=1, jumps=0.2, fractions=(0.4, 0.3, 0.2, 0.1), rho=0.3,
             fixed=(2.0, 1.8, 1.7, 1.65), ragged=1.6, depth=2.0, **extra):
    final = {"val_loss_fixed": list(fixed), "val_loss_ragged": {str(t): ragged for t in (0.5, 0.2, 0.3, 0.7)},
             "ragged_depth": {str(t): depth for t in (0.5, 0.2, 0.3, 0.7)}, "avg_exit_depth": depth,
             "exit_fractions": list(fractions), "jump_rates": [1 - jumps, 0.0, jumps, 0.0], "large_jump_rate": jumps,
             "kl_global": 0.01, "depth_by_difficulty": {str(k): 1.0 + 0.5 * k for k in range(5)},
             "difficulty_spearman": rho}
    curve = [{"iter": i, "tokens": 100 * i, "val_loss_fixed": list(fixed), "val_loss_ragged": {"0.5": ragged},
              "avg_exit_depth": depth, "large_jump_rate": jumps, "exit_fractions": list(fractions)} for i in (0, 5, 10)]
    trace = {"tokens": list("x=3 a=x ; a? 3\n"), "exits": [1, 1, 2, 1, 1, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1],
             "labels": [0] * 13 + [1, 0], "thr": 0.5}
    return dict(name=name, data="synthetic", scope=scope, prior=prior, seed=seed, final=final, curve=curve, trace=trace,
                **extra)


def hand_made():
    return [fake_run("syn-local-poisson-s1", "local", jumps=0.002, rho=0.05, fractions=(0.0, 0.1, 0.8, 0.1), depth=3.0),
            fake_run("syn-local-poisson-s2", "local", seed=2, jumps=0.004, rho=0.07),
            fake_run("syn-global-poisson-s1", jumps=0.19),
            fake_run("syn-global-poisson-s2", seed=2, jumps=0.21, rho=0.35),
            fake_run("syn-global-poisson-s1-ra-direct", ra="direct", parent="syn-global-poisson-s1", ragged=1.5),
            fake_run("syn-global-poisson-s1-flatbeta", beta=0.1, fractions=(0.9, 0.05, 0.03, 0.02), depth=1.2,
                     fixed=(2.0, 1.99, 1.98, 1.99)),
            fake_run("syn-global-uniform-s1", prior="uniform")]


def fake_pointer(scope, seed, rho, accs, depth_of_k=lambda k: 2.0 + 0.5 * k, data="pointer", items=50,
                 ragged_acc=0.5):
    """A look-up-task run whose builtin suite holds rollouts: accs[k-1][d-1] of the items of k
    look-ups right at fixed@d, ragged_acc of them right at ETE-Ragged's answer depth depth_of_k(k);
    span depth 1.5 + 0.25 k."""
    prefix = claims.POINTER_TASKS[data][0]
    r = fake_run(f"{prefix}-{scope}-poisson-s{seed}", scope, seed=seed, rho=rho)   # Poisson only: no uniform claims
    r["data"] = data
    r["final"]["span_depth_by_difficulty"] = {str(k): 1.5 + 0.25 * k for k in range(1, 5)}

    def cell(acc, depth):
        right, d = np.arange(items) < round(acc * items), np.full(items, depth)
        return {"items": items, "acc": float(right.mean()), "answer_depth": float(depth),
                "rollouts": {"correct": right.astype(int).tolist(), "answer_depth": d.tolist(),
                             "sum_exits": (d + 20).tolist()}}
    suite = {f"fixed@{d}": {str(k): cell(accs[k - 1][d - 1], float(d)) for k in range(1, 5)} for d in range(1, 5)}
    suite["ete_ragged@0.5"] = {str(k): cell(ragged_acc, depth_of_k(k)) for k in range(1, 5)}
    r["builtin"] = suite
    return r


@pytest.mark.parametrize("data", ["pointer", "hops"])
def test_pointer_claims_are_computed_from_the_numbers(data):
    """A look-up task whose k shows: the precondition (depth buys accuracy at the hardest k) gates the
    rise of the answer's exit depth with k, global against local, items and seeds resampled."""
    helps = [(0.3, 0.9, 1.0, 1.0), (0.3, 0.4, 0.8, 0.9), (0.3, 0.3, 0.5, 0.8), (0.3, 0.3, 0.3, 0.6)]
    flat = [(0.4, 0.4, 0.4, 0.4)] * 4
    make = functools.partial(fake_pointer, data=data)
    rising, level = (lambda k: 1.0 + 0.5 * k), (lambda k: 2.0)
    results = [make("local", 1, 0.1, helps, level), make("local", 2, 0.2, helps, level),
               make("global", 1, 0.5, helps, rising), make("global", 2, None, helps, rising)]
    [rise] = claims.pointer_prior_claims({r["name"]: r for r in results}, data, "poisson")
    assert rise["claim"].endswith(f"{claims.POINTER_TASKS[data][1]}, Poisson (k visible)") and rise["holds"]
    assert "fixed@4 minus fixed@1 at k=4, both scopes (2+2 seeds, items resampled): 0.30 [" in rise["numbers"]
    assert "global 1.50 [1.50, 1.50], local 0.00 [0.00, 0.00]" in rise["numbers"] and rise["rule"] == claims.RISE_RULE
    assert "global k=1 0.30 / 0.90 / 1.00 / 1.00" in rise["numbers"] and len(rise["here"]) <= 150
    level_everywhere = [make(s, x, 0.5, helps, level) for s in ("local", "global") for x in (1, 2)]
    assert claims.pointer_prior_claims({r["name"]: r for r in level_everywhere}, data, "poisson")[0]["holds"] is False
    results = [make(s, x, 0.1, flat) for s in ("local", "global") for x in (1, 2)]
    [rise] = claims.pointer_prior_claims({r["name"]: r for r in results}, data, "poisson")
    assert rise["holds"] is None and rise["verdict"] == "untested (its precondition fails)"
    for r in results:                       # results from before the suites kept their rollouts
        for cells in r["builtin"].values():
            for cell in cells.values():
                del cell["rollouts"]
    assert claims.pointer_prior_claims({r["name"]: r for r in results}, data, "poisson")[0]["verdict"] == \
        "untested (no interval)"
    assert claims.pointer_claims({}) == []              # no pointer runs: no pointer claims


def test_fixed_envelope_is_the_lower_envelope_of_the_fixed_depths():
    assert claims.fixed_envelope([4.0, 3.0, 2.0, 1.0], 2.5) == 2.5            # a mix of depths 2 and 3
    assert claims.fixed_envelope([4.0, 3.0, 2.0, 1.0], 1.0) == 4.0
    assert claims.fixed_envelope([4.0, 3.0, 2.0, 1.0], 4.0) == 1.0
    assert claims.fixed_envelope([3.0, 2.0, 2.5, 2.8], 3.5) == 2.0      # a U-shaped curve: fixed@2 stays available
    assert abs(claims.fixed_envelope([4.0, 3.9, 3.8, 1.0], 2.0) - 3.0) < 1e-12  # a mix of depths 1 and 4 beats 2 alone


def test_bootstrap_intervals_cover_the_mean_as_theory_says():
    """replicates: fresh normal samples; the interval of a mean is ±1.96 σ/√n (within 15%), a paired
    difference of strongly correlated arrays is much narrower than an unpaired one, and the seed
    level widens the interval when the seeds disagree."""
    g = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    x = g.normal(0.0, 1.0, 400)
    value, reps = claims.replicates([(x,)])
    lo, hi = claims.interval(reps)
    assert value == x.mean() and abs((hi - lo) / 2 / (1.96 * x.std() / 20) - 1) < 0.15
    y = x + g.normal(0.1, 0.05, 400)
    paired = claims.interval(claims.replicates([(y, x)], np.subtract)[1])
    unpaired = claims.interval(claims.replicates([(y, x)], np.subtract, paired=False)[1])
    assert paired[0] > 0 and paired[1] - paired[0] < 0.2 * (unpaired[1] - unpaired[0])
    same = claims.interval(claims.replicates([(x[:200],), (x[200:],)])[1])
    apart = claims.interval(claims.replicates([(x[:200] - 1,), (x[200:] + 1,)])[1])
    assert apart[1] - apart[0] > 3 * (same[1] - same[0])


def windows(fixed, ragged, depth, seed, n=160, noise=0.05):
    """A run's per-window losses whose means are exactly the given ones: a window's own difficulty
    (shared by every depth, and by every run of the same seed) plus noise of its own."""
    g = np.random.default_rng(seed)
    own = lambda: (lambda e: e - e.mean())(g.normal(0, 0.01, n))
    shared = own() * noise / 0.01
    columns = [f + shared + own() for f in fixed]
    return {"fixed": [list(row) for row in zip(*columns)],
            "ragged": {str(t): list(ragged + shared + own()) for t in claims.THRS},
            "depth": {str(t): list(np.full(n, depth)) for t in claims.THRS}}


def test_large_jumps_per_dataset_with_a_seed_interval():
    """Global minus local large-jump rate per dataset, the seeds resampled: many under global and
    almost none under local holds; one seed a scope is untested; a small gap does not hold."""
    runs = {r["name"]: r for r in hand_made()}
    [jumps] = claims.jump_claims(runs)
    assert jumps["holds"] and jumps["claim"].endswith(": synthetic") and "(2+2 seeds" in jumps["here"]
    assert "global 20.0% (seeds 19.0% / 21.0%), local 0.3% (seeds 0.2% / 0.4%)" in jumps["numbers"]
    runs["syn-global-poisson-s1"]["final"]["large_jump_rate"] = runs["syn-global-poisson-s2"]["final"][
        "large_jump_rate"] = 0.01
    assert claims.jump_claims(runs)[0]["holds"] is False
    del runs["syn-global-poisson-s2"]
    assert claims.jump_claims(runs)[0]["verdict"] == "untested (one model)"


def test_the_frontier_per_dataset_and_scope_loss_and_accuracy():
    """Each dataset's row gives each scope (and ragged-aware models) a verdict from its gap to the
    fixed depths' envelope, seeds then units resampled: loss on the windows of text datasets, accuracy
    at the answer on a look-up task's items; one model is untested."""
    seed = int(torch.randint(0, 2**31, ()))
    runs = hand_made()
    fixed = (2.0, 1.8, 1.7, 1.65)                       # at depth 2.0 the envelope is fixed@2's 1.8
    for r in runs:
        r["windows"] = windows(fixed, 1.7 if r["scope"] == "global" else 1.8, 2.0, seed + r["seed"])
    [row] = claims.frontier_claims({r["name"]: r for r in runs})
    assert row["claim"].endswith(": synthetic") and row["paper"] == "Fig. 1"
    assert "global yes" in row["verdict"] and "local no" in row["verdict"]
    assert "global+RA untested (one model)" in row["verdict"] and "4 of 4 τ pass" in row["numbers"]
    helps = [(0.3, 0.9, 1.0, 1.0)] * 4
    good = [fake_pointer("global", s, 0.5, helps, lambda k: 2.0, ragged_acc=0.9) for s in (1, 2)]
    bad = [fake_pointer("local", s, 0.5, helps, lambda k: 2.0, ragged_acc=0.5) for s in (1, 2)]
    [row] = claims.frontier_claims({r["name"]: r for r in good + bad})
    assert row["claim"].endswith(": pointer") and "global yes, local no" == row["verdict"]
    assert claims.accuracy_gap(0.8, 2.5, 0.2, 0.6, 1.0, 1.0) == pytest.approx(0.0)    # a mix of depths 2 and 3


def ra_pair(scope, seed, ra_loss, dense_loss, g):
    """A parent, its ragged-aware branch and its dense continuation, on the same held-out windows."""
    parent = fake_run(f"syn-{scope}-poisson-s{seed}", scope, seed=seed)
    base = windows((2.0, 1.8, 1.7, 1.65), 1.6, 2.0, g)
    at = lambda loss: dict(base, ragged={"0.5": list(np.array(base["ragged"]["0.5"]) + loss - 1.6)})
    ra = fake_run(f"syn-{scope}-poisson-s{seed}-ra-direct", scope, seed=seed, ra="direct", parent=parent["name"],
                  ragged=ra_loss, windows=at(ra_loss))
    dense = fake_run(f"syn-{scope}-poisson-s{seed}-cont-dense", scope, seed=seed, parent=parent["name"],
                     ragged=dense_loss, windows=at(dense_loss))
    return [parent, ra, dense]


def test_ragged_aware_rows_test_what_the_paper_predicts_per_scope():
    """Global: RA minus dense (paired windows, parents resampled) below 0. Local: the paper predicts
    little change, an equivalence within 1% of the dense continuation's loss; a gap wholly outside
    is a no; an interval across the margin is untested; one parent is untested."""
    seed = int(torch.randint(0, 2**31, ()))
    cases = [("global", 1.55, 1.6, True), ("global", 1.6, 1.6, False), ("local", 1.601, 1.6, True),
             ("local", 1.7, 1.6, False)]
    for scope, ra, dense, holds in cases:
        runs = ra_pair(scope, 1, ra, dense, seed) + ra_pair(scope, 2, ra, dense, seed + 1)
        row, *rest = claims.ra_claims({r["name"]: r for r in runs})
        assert row["holds"] is holds, (scope, ra, row)
        # the datasets without branches are still listed, as not run (hops, graded)
        assert [r["verdict"] for r in rest] == ["untested (not run)"] * 2 and "hops" in rest[0]["claim"]
        assert "(2 parents)" in row["here"] and "RA minus dense, ragged@0.5" in row["numbers"]
    runs = ra_pair("local", 1, 1.6, 1.6, seed)
    assert claims.ra_claims({r["name"]: r for r in runs})[0]["verdict"] == "untested (one model)"


def test_flat_beta_is_judged_over_the_training_trajectory():
    """At every evaluation, what loops 2..U gain over loop 1, flat β over the schedule, seeds
    resampled: below 1/2 at most evaluations is a collapse, else not reproduced; one seed untested."""
    def curve_run(name, scope, seed, gains):
        r = fake_run(name, scope, seed=seed, beta=0.1 if "flat" in name else None)
        r["curve"] = [{"iter": 250 * i, "tokens": i, "val_loss_fixed": [2.0, 2.0 - gain, 2.0 - gain, 2.0]}
                      for i, gain in enumerate(gains)]
        r["final"]["loop_shift"] = [0.9, 0.1, 0.1, 0.1]
        return r
    for scope in ("global", "local"):
        for flat_gains, holds in (([0.0, 0.01, 0.02, 0.02, 0.3], True), ([0.0, 0.3, 0.3, 0.3, 0.3], None)):
            runs = [curve_run(f"syn-{scope}-poisson-s{s}", scope, s, [0.0, 0.3, 0.3, 0.3, 0.3]) for s in (1, 2)]
            runs += [curve_run(f"syn-{scope}-poisson-s{s}-flatbeta", scope, s, flat_gains) for s in (1, 2)]
            rows = claims.flat_beta_claims({r["name"]: r for r in runs})
            rows = {r["claim"].split("(")[1].split()[0]: r for r in rows}     # by scope
            row, other = rows[scope], rows["local" if scope == "global" else "global"]
            assert row["holds"] is holds and f"({scope} KL)" in row["claim"]
            assert other["verdict"] == "untested (not run)" and "flatbeta" in other["numbers"]
            assert row["verdict"] == ("yes" if holds else "not reproduced at this scale")
            assert f"ratio < 1/2 at {3 if holds else 0} of 4 evaluations" in row["here"]
        one = claims.flat_beta_claims({r["name"]: r for r in runs[::2]})
        assert [r["verdict"] for r in one if scope in r["claim"]] == ["untested (one model)"]


def test_difficulty_on_synthetic_needs_depth_to_buy_accuracy_first():
    """The depth before difficulty-4 tokens minus difficulty-1 ones, each scope over its held-out
    windows, and global minus local: tested only where fixed@U answers the hardest tokens clearly
    better than fixed@1 (label_correct)."""
    g = np.random.default_rng(int(torch.randint(0, 2**31, ())))

    def run(scope, seed, d1, d4, gain, n=60):
        r = fake_run(f"syn-{scope}-poisson-s{seed}", scope, seed=seed)
        labels, correct = [], []
        for _ in range(n):
            count = g.integers(3, 9, 5)
            depth = np.array([1.5, d1, 2.0, 2.0, d4]) + g.normal(0, 0.3, 5)
            labels.append([[int(c), float(c * d)] for c, d in zip(count, depth)])
            correct.append([[int(c * 0.3), 0, 0, int(c * min(0.3 + gain, 1.0))] for c in count])
        r["windows"] = {"labels": labels, "label_correct": correct}
        return r
    for rise, gain, holds in ((1.5, 0.6, True), (-1.0, 0.6, False), (1.5, 0.0, None)):
        runs = [run("local", s, 2.0, 2.0, gain) for s in (1, 2)] + [run("global", s, 1.5, 1.5 + rise, gain)
                                                                   for s in (1, 2)]
        [row] = claims.difficulty_claims({r["name"]: r for r in runs})
        assert row["holds"] is holds, row
        if holds is None:
            assert row["verdict"] == "untested (its precondition fails)"


def fake_graded(scope, seed, depth_of_k, acc_of_k, g, items=50, needs_depth=True):
    """A graded-task run whose builtin suites hold rollouts: answer depth depth_of_k(k) (rounded at
    random), right with probability acc_of_k(k); fixed@d right on k look-ups when d >= k (the need: k;
    needs_depth=False: at every depth), on the judging items and on those held apart alike."""
    r = fake_run(f"grd-{scope}-poisson-s{seed}", scope, seed=seed)
    r["data"] = "graded"
    for key in ("builtin", "builtin_need"):
        suite = {}
        for mode in [f"fixed@{d}" for d in range(1, 5)] + [f"ete_ragged@{t}" for t in claims.THRS]:
            suite[mode] = {}
            for k in range(1, 5):
                d = (np.full(items, int(mode[6:])) if mode.startswith("fixed") else
                     np.clip(np.round(depth_of_k(k) + g.normal(0, 0.4, items)), 1, 4)).astype(int)
                p = (1.0 if d[0] >= k or not needs_depth else 0.1) if mode.startswith("fixed") else acc_of_k(k)
                right = g.random(items) < p
                suite[mode][str(k)] = {"items": items, "acc": float(right.mean()), "answer_depth": float(d.mean()),
                                       "rollouts": {"correct": right.astype(int).tolist(), "answer_depth": d.tolist(),
                                                    "sum_exits": (d + 20).tolist()}}
        r[key] = suite
    return r


def test_graded_exits_are_judged_against_each_models_need():
    """Each model's need per k from the held-apart items; on the judging items, how far the exit misses
    the need, global minus local: global at its need and local always at 4 holds; global always at 4
    does not."""
    g = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    at_need = [fake_graded("global", s, lambda k: k, lambda k: 0.9, g) for s in range(5)]
    deep = [fake_graded("local", s, lambda k: 4.0, lambda k: 0.9, g) for s in range(5)]
    [row] = claims.graded_claims({r["name"]: r for r in at_need + deep})
    assert row["holds"] and "global [[1, 2, 3, 4]" in row["numbers"] and "5+5 seeds" in row["here"]
    deep_global = [fake_graded("global", s, lambda k: 4.0, lambda k: 0.9, g) for s in range(5)]
    assert claims.graded_claims({r["name"]: r for r in deep_global + deep})[0]["holds"] is False
    lines = report.graded_tables({r["name"]: r for r in at_need + deep})
    per_k = [l for l in lines if l.count("|") == 8]                 # model, mode, k and four values
    assert len([l for l in per_k if l.startswith("| global | ete_ragged@")]) == 16            # 4 τ x 4 k
    gain = float(row["here"].split("depth buys past k = 1: ")[1].split()[0])   # 1 - 0.1, fixed@1 right 1 in 10
    assert abs(gain - 0.9) < 0.04
    flat = [fake_graded("global", s, lambda k: k, lambda k: 0.9, g, needs_depth=False) for s in range(5)]
    flat += [fake_graded("local", s, lambda k: 4.0, lambda k: 0.9, g, needs_depth=False) for s in range(5)]
    assert claims.graded_claims({r["name"]: r for r in flat})[0]["verdict"] == "untested (its precondition fails)"
    few = claims.graded_claims({r["name"]: r for r in at_need[:4] + deep})[0]
    assert few["holds"] is None and few["verdict"] == "untested (4+5 seeds, of 5 a scope)"
    assert claims.graded_claims({})[0]["verdict"] == "untested (not run)" and report.graded_tables({}) == []


def test_the_report_opens_with_one_short_table(tmp_path):
    """RESULTS.md: the claims table first, a line a claim, each cell at most ~150 characters; the
    details, every run (with its training time) and the figures after it."""
    results = hand_made()
    rows = report.table_rows(results)
    assert len(rows) == len(results) and all(len(r) == len(report.COLUMNS) for r in rows)
    assert rows[0][4] == "2.000 / 1.800 / 1.700 / 1.650" and rows[0][10] == "0.2%"
    figures = draw(results, str(tmp_path), [1, 2])
    assert {f for f, _ in figures} == {"frontier.png", "exit_fractions.png", "exit_trace.png", "training_curves.png",
                                       "depth_by_difficulty.png", "flat_beta.png"}
    for f, _ in figures:
        with open(tmp_path / "figures" / f, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    report.write_results(results, str(tmp_path), "quick", "setup", figures)
    text = (tmp_path / "RESULTS.md").read_text()
    table = text.split("| claim | paper | here: 95% interval (seeds) | verdict |")[1].split("\n\n")[0]
    lines = [re.split(r"(?<!\\)\|", line.strip().strip("|")) for line in table.strip().splitlines()[1:]]
    cells = [c.strip() for line in lines for c in line]
    assert cells and max(map(len, cells)) <= 160 and {len(line) for line in lines} == {4}   # four cells a line
    piped = dict(claims.row("c", "p", "r", "|exit − need| 0.1", "n", holds=True), reruns="", untraced=[])
    assert report.claims_table([piped])[2] == "| c | p | \\|exit − need\\| 0.1 | yes |"     # a bar in a cell, escaped
    assert text.index("| claim |") < text.index("## Each claim") < text.index("## Every run") < text.index("![")


def test_each_claim_names_its_runs_their_reruns_and_missing_provenance():
    """A claim's marks come from the runs behind it, and from no other: † where one of them was
    trained twice and moved (the flat-β row through its scheduled parent), ‡ where one records no
    provenance."""
    results = hand_made()
    R = {r["name"]: r for r in results}
    for r in results:
        r["provenance"] = {"commit": "c0ffee", "torch": "2.13.0", "threads": 1, "cpu": "x", "train_seconds": 1.0}
    rerun = R["syn-global-poisson-s1"]
    moved = dict(rerun["final"], val_loss_ragged={"0.5": 1.63}, val_loss_fixed=[2.0, 1.8, 1.7, 1.6])
    rerun["earlier"] = [{"final": moved}]
    flat_run = R["syn-global-poisson-s1-flatbeta"]
    flat_run["earlier"] = [{"final": dict(flat_run["final"])}]        # trained twice, the same numbers
    del R["syn-local-poisson-s2"]["provenance"]
    rows = {c["claim"]: c for c in claims.claims(results)}
    flat, jumps = rows["A flat β = 0.1 collapses the loops after the first (global KL)"], \
        rows["Global gives many large jumps, local almost none: synthetic"]
    assert flat["runs"] == ["syn-global-poisson-s1", "syn-global-poisson-s1-flatbeta"]
    assert flat["reruns"] == ("reruns moved ragged@0.5 by up to 0.030 nats (syn-global-poisson-s1), the best fixed "
                              "depth by up to 0.050") and flat["untraced"] == []
    assert jumps["untraced"] == ["syn-local-poisson-s2"] and jumps["reruns"]
    assert claims.rerun_note(R, dict(flat, runs=["syn-global-poisson-s1-flatbeta"])) == ""  # did not move: no †
    for c in rows.values():       # every mark is the runs' own: the uniform run is behind no claim
        assert "syn-global-uniform-s1" not in c["runs"]
        assert bool(c["untraced"]) == ("syn-local-poisson-s2" in c["runs"])
        assert bool(c["reruns"]) == ("syn-global-poisson-s1" in c["runs"])
    table = report.claims_table(list(rows.values()))
    both = [bool(c["reruns"] and c["untraced"]) for c in rows.values()]
    assert [line.endswith("† ‡ |") for line in table[2:-2]] == both and any(both)
    assert table[-1].startswith("† ") and "‡ a run" in table[-1]       # a legend for each mark in the table
    assert "‡" not in report.claims_table([dict(c, untraced=[]) for c in rows.values()])[-1]
    assert report.claims_table([dict(c, reruns="", untraced=[]) for c in rows.values()])[-1].startswith("| ")
    details = "\n".join(report.claim_details(list(rows.values())))
    assert "0.050. Runs that record no provenance: syn-local-poisson-s2." in details


def test_a_run_trained_twice_at_one_commit_gives_the_same_result(tmp_path):
    """Provenance and determinism: one small run of the grid trained twice gives the same numbers (all
    of result.json but the training's wall time), and records its commit, torch, threads and CPU."""
    a, b = (reproduce.main(["--quick", f"--out={tmp_path / x}", "--only=syn-global-poisson-s1337", "--plots=False"])[0]
            for x in "ab")
    made = [r.pop("provenance") for r in (a, b)]
    assert a == b and {k for k in made[0]} == {"commit", "dirty", "torch", "threads", "cpu", "train_seconds"}
    assert made[0]["torch"] == torch.__version__ and made[0]["commit"] == made[1]["commit"]
    os.remove(tmp_path / "b" / "syn-global-poisson-s1337" / "result.json")    # a run resumed from its checkpoint
    c = reproduce.main(["--quick", f"--out={tmp_path / 'b'}", "--only=syn-global-poisson-s1337", "--plots=False"])[0]
    assert c.pop("provenance")["resumed_at_iter"] == 16 and c == a              # says so, and changes nothing


def test_quick_grid_end_to_end_and_resumable(tmp_path):
    out = str(tmp_path / "r")
    results = reproduce.main(["--quick", f"--out={out}"])
    assert len(results) == 68 and all(len(r["windows"]["fixed"]) == 16 for r in results)
    for r in results:            # synthetic: every token of a window in one label, its depths summing to the mean
        assert ("labels" in r["windows"]) == (r["data"] == "synthetic")
        if r["data"] == "synthetic":
            T = sum(n for n, _ in r["windows"]["labels"][0])
            assert T == 32 and all(sum(n for n, _ in w) == T for w in r["windows"]["labels"])   # block_size
            assert np.allclose([sum(d for _, d in w) / T for w in r["windows"]["labels"]],
                               r["windows"]["depth"]["0.5"], atol=1e-4)
    text = open(os.path.join(out, "RESULTS.md")).read()
    header = "| " + " | ".join(report.COLUMNS) + " |"
    assert text.index("| claim | paper | here: 95% interval (seeds) | verdict |") < text.index("## Each claim")
    assert header in text and sum(text.count(f"\n| {p}-") for p in ("syn", "shk", "ptr", "hop", "grd", "gml")) == 68
    assert "## The graded task, per k" in text and "| global | ete_ragged@0.5 | 4 |" in text
    assert "Exits follow each model's need more under global than local: graded (k hidden)" in text
    assert "RA lowers the ragged loss beyond the dense continuation: synthetic, global, direct" in text
    assert "RA changes the local model little: hops, local, direct" in text and "untested (one model)" in text
    for scope in ("global", "local"):       # flat β over the trajectory, each loop's shift beside
        assert f"A flat β = 0.1 collapses the loops after the first ({scope} KL)" in text
    assert text.count("at each evaluation (1 seeds resampled)") == 2 and text.count("‖Δh‖/‖h‖") == 2
    assert all("label_correct" in r["windows"] for r in results if r["data"] == "synthetic")
    for f in ("frontier.png", "exit_fractions.png", "exit_trace.png", "exit_trace_pointer.png", "exit_trace_hops.png",
              "training_curves.png", "depth_by_difficulty.png", "graded_by_k.png", "exit_trace_graded.png"):
        assert os.path.getsize(os.path.join(out, "figures", f)) > 1000
    ptr = json.load(open(os.path.join(out, "ptr-global-poisson-s1338", "result.json")))
    assert set(ptr["builtin"]) == {f"fixed@{d}" for d in range(1, 5)} | {f"{m}@{t}" for t in reproduce.THRS
                                                                          for m in ("ete_ragged", "dense_ragged")}
    assert set(ptr["final"]["difficulty_spearman_by_thr"]) == {str(t) for t in reproduce.THRS}   # the τ sweep
    assert all(set(b) == {"1", "2", "3", "4"} and all(v["items"] == 2 for v in b.values())
               for b in ptr["builtin"].values())
    assert ptr["trace"]["labels"] and max(ptr["trace"]["labels"]) > 0
    assert "more under global than local: Pointer task, Uniform (k visible)" in text
    hop = json.load(open(os.path.join(out, "hop-local-uniform-s1337", "result.json")))
    assert set(hop["builtin"]) == set(ptr["builtin"]) and hop["data"] == "hops" and max(hop["trace"]["labels"]) > 0
    assert "dc " in prepare_data.HOP_PIECES and set(hop["trace"]["tokens"]) <= set(prepare_data.HOP_PIECES)
    assert "more under global than local: Hops task (one token a fact), Poisson (k visible)" in text
    assert hop["final"]["depth_by_difficulty"]["2"] is not None and hop["final"]["depth_by_difficulty"]["3"] is None
    assert all(set(b) == {"1", "2"} for b in hop["builtin"].values()) and hop["max_k"] == 2   # hops: k = 1, 2
    branch = json.load(open(os.path.join(out, "syn-global-poisson-s1337-ra-direct", "result.json")))
    assert branch["parent"] == "syn-global-poisson-s1337" and branch["final"]["iter"] == 6
    parent = json.load(open(os.path.join(out, "grd-global-poisson-s1337", "result.json")))
    assert set(parent["builtin_need"]) == set(parent["builtin"])      # the items that set each k's need, apart
    graded = json.load(open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json")))
    assert graded["parent"] == "grd-global-poisson-s1337" and graded["max_k"] == 4 and graded["ra"] == "direct"
    assert len(graded["builtin"]["ete_ragged@0.5"]["3"]["rollouts"]["correct"]) == 2     # 2 items per k
    hop_ra = json.load(open(os.path.join(out, "hop-local-poisson-s1337-ra-direct", "result.json")))
    assert hop_ra["parent"] == "hop-local-poisson-s1337" and hop_ra["max_k"] == 2 and hop_ra["ra"] == "direct"
    assert text.count("accuracy on 2 look-ups at ETE-Ragged τ 0.5: RA ") == 2    # RA on hops: answers beside
    stamp = os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json"))
    reproduce.main(["--quick", f"--out={out}"])                 # every result exists: nothing is trained again
    assert os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json")) == stamp
    del graded["windows"]                           # a result from before windows: its checkpoint gives them
    with open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json"), "w") as f:
        json.dump(graded, f)
    branch_path = os.path.join(out, "syn-global-poisson-s1337-ra-direct", "result.json")
    labels = branch["windows"].pop("labels")        # and one from before windows held labels
    with open(branch_path, "w") as f:
        json.dump(branch, f)
    os.remove(os.path.join(out, "RESULTS.md"))
    shk = os.path.join(out, "shk-local-poisson-s1337")
    os.rename(os.path.join(shk, "result.json"), os.path.join(shk, "result.json.away"))    # a run not finished
    reproduce.main(["--quick", f"--out={out}", "--report", "--plots=False"])
    assert "not finished yet" not in text and "1 run(s) of the grid are not finished yet (shk-local-poisson-s1337)" \
        in open(os.path.join(out, "RESULTS.md")).read()
    again = json.load(open(os.path.join(out, "grd-global-poisson-s1337-ra-direct", "result.json")))
    assert len(again["windows"]["fixed"]) == 16 and json.load(open(branch_path))["windows"]["labels"] == labels
    assert os.path.isfile(os.path.join(out, "RESULTS.md"))
    assert os.path.getmtime(os.path.join(out, "syn-local-poisson-s1337", "result.json")) == stamp
    with pytest.raises(Exception, match="--only"):
        reproduce.main(["--quick", f"--out={out}", "--only=nope"])
    with pytest.raises(Exception, match="holds the --quick grid"):     # sizes never mix in one folder
        reproduce.main(["--full", f"--out={out}"])


def test_quick_never_writes_over_the_full_results(tmp_path, monkeypatch):
    """The committed results/ are a --full grid: --quick goes to results-quick/ by default, and is
    refused in a folder that holds the full runs (one written before grid.json, too)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert json.load(open(os.path.join(here, "results", "grid.json"))) == {"size": "full"}
    old = tmp_path / "old"
    old.mkdir()
    (old / "RESULTS.md").write_text("# Reproducing the paper at CPU scale (full)\n")
    with pytest.raises(Exception, match="holds the --full grid"):
        reproduce.main(["--quick", f"--out={old}"])
    assert sorted(os.listdir(old)) == ["RESULTS.md"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reproduce, "prepare", lambda *a: (_ for _ in ()).throw(SystemExit("stop here")))
    with pytest.raises(SystemExit):
        reproduce.main(["--quick"])
    assert json.load(open(tmp_path / "results-quick" / "grid.json")) == {"size": "quick"}

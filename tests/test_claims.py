"""lab/claims.py, lab/difficulty.py and lab/stats.py: each rule on constructed runs whose answer is
known (rule 1: a saturated envelope is untested, a pooled envelope is not a model's own, the compute
saved; rule 2: a model that exits at one depth has correlation 0 against its shuffles, too few
learners is untested; rule 3: the noise floor from the controls alone; rule 4: enough models,
scopes on streams of their own, tests over the models), and the intervals against theory."""
import itertools
import math

import numpy as np
import pytest
import torch

from conftest import fake_run, windows
from lab import claims, difficulty, report, stats


def fresh():
    return np.random.default_rng(int(torch.randint(0, 2**31, ())))


# ----------------------------------------------------------------------------- intervals and tests over models

def test_bootstrap_intervals_cover_the_mean_as_theory_says():
    """replicates: fresh normal samples; the interval of a mean is ±1.96 σ/√n (within 15%), a paired
    difference of strongly correlated arrays is much narrower than an unpaired one, and the seed
    level widens the interval when the seeds disagree; per_model on one model is replicates."""
    g = fresh()
    x = g.normal(0.0, 1.0, 400)
    value, reps = stats.replicates([(x,)])
    lo, hi = stats.interval(reps)
    assert value == x.mean() and abs((hi - lo) / 2 / (1.96 * x.std() / 20) - 1) < 0.15
    y = x + g.normal(0.1, 0.05, 400)
    paired = stats.interval(stats.replicates([(y, x)], np.subtract)[1])
    unpaired = stats.interval(stats.replicates([(y, x)], np.subtract, paired=False)[1])
    assert paired[0] > 0 and paired[1] - paired[0] < 0.2 * (unpaired[1] - unpaired[0])
    same = stats.interval(stats.replicates([(x[:200],), (x[200:],)])[1])
    apart = stats.interval(stats.replicates([(x[:200] - 1,), (x[200:] + 1,)])[1])
    assert apart[1] - apart[0] > 3 * (same[1] - same[0])
    value, reps, own = stats.per_model([(x,)], lambda m: m)
    assert value == pytest.approx(x.mean()) and own == pytest.approx([x.mean()])
    assert abs((np.subtract(*stats.interval(reps)[::-1])) / (hi - lo) - 1) < 0.15


def test_the_tests_over_the_models_count_as_by_hand():
    """The sign test against the binomial by hand; the permutation test against every split by hand
    (3+3 models: 20 splits, the most extreme two of them); zeros count for neither side."""
    g = fresh()
    v = g.normal(0.3, 1.0, 7)
    up, down = int((v > 0).sum()), int((v < 0).sum())
    p = min(1.0, 2 * sum(math.comb(7, i) for i in range(min(up, down) + 1)) / 2 ** 7)
    assert stats.sign_test(v) == f"{up} of 7 models above 0, sign test p {p:.2f}"
    assert stats.sign_test([0.0, 1.0, -1.0], "better") == "1 of 3 models better, 1 tied, sign test p 1.00"
    a, b = g.normal(5, 0.1, 3), g.normal(0, 0.1, 3)
    assert stats.permutation_test(a, b).endswith("p 0.10")                # 2 of the 20 splits are as far apart
    a, b = g.normal(0, 1, 4), g.normal(0, 1, 3)
    pooled, observed = np.concatenate([a, b]), abs(a.mean() - b.mean())
    count = sum(abs(pooled[list(s)].mean() - np.delete(pooled, list(s)).mean()) >= observed - 1e-12
                for s in itertools.combinations(range(7), 4))
    assert stats.permutation_test(a, b).endswith(f"p {count / 35:.2f}")


def test_floating_point_residue_is_a_tie_not_a_direction():
    """A model whose value is ±1e-17 (what a gap of exactly 0 comes out as) counts for neither side of the
    sign test, and the count of ties is said; a real difference still counts."""
    assert stats.sign_test([1e-17, -1e-17, 0.0]) == "0 of 3 models above 0, 3 tied, sign test p 1.00"
    assert stats.sign_test([0.2, 0.3, -1e-17]) == "2 of 3 models above 0, 1 tied, sign test p 0.50"
    assert stats.sign_test([0.2, -0.1, 0.3]) == "2 of 3 models above 0, sign test p 1.00"


def test_a_verdict_never_rests_on_the_monte_carlo_draw():
    """An interval whose endpoint lies within its Monte Carlo error of the margin is redrawn ten times
    as often, and settled is what those draws say (where it is still within, a verdict is
    'untested'); one far from its margin is settled at the first draw."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    groups = [(rng.normal(1.0, 1.0, 200),) for _ in range(4)]
    mean = lambda x: x
    value, reps, _, settled = stats.per_model_settled(groups, mean, (-5.0,), seed=1)
    assert settled and len(reps) == stats.N_BOOT
    hi = stats.interval(reps)[1]
    value, reps, _, settled = stats.per_model_settled(groups, mean, (hi,), seed=1)   # the margin at the end
    assert len(reps) == 10 * stats.N_BOOT and settled == (not stats.unsettled(reps, (hi,)))
    assert stats.mc_error(reps, 97.5) > 0 and stats.unsettled(reps, (stats.interval(reps)[1],))


def test_scopes_drawn_apart_draw_their_own_random_numbers():
    """Rule 4: two scopes' models drawn apart come from streams of their own: the same values on both
    sides give a difference that varies about 0 (one shared stream would give exactly 0 in every
    replicate), and the same labels draw the same numbers again."""
    x = fresh().normal(0, 1, 5)
    reps = stats.boot_diff(x, x, ("a claim",))
    assert reps.std() > 0.1 and abs(reps.mean()) < 0.1
    assert np.array_equal(reps, stats.boot_diff(x, x, ("a claim",)))
    assert not np.array_equal(reps, stats.boot_diff(x, x, ("another claim",)))
    assert stats.stream("global", 1) != stats.stream("local", 1)


# ----------------------------------------------------------------------------- rule 1: the frontier, per model

def test_the_envelope_is_the_best_fixed_depth_so_far_linear_between():
    """At a whole depth the best of fixed@1..d, linear between whole depths; depth_reaching inverts it
    (fresh random curves: the envelope at the depth reaching q is q)."""
    assert claims.envelope([0.2, 0.6, 1.0, 1.0], 2.5) == pytest.approx(0.8)        # half of 2, half of 3
    assert claims.envelope([0.2, 0.6, 0.5, 1.0], 3.0) == pytest.approx(0.6)        # fixed@2 stays available
    assert claims.envelope([0.2, 0.6, 0.5, 1.0], 3.5) == pytest.approx(0.8)
    assert claims.depth_reaching([0.2, 0.6, 1.0, 1.0], 0.8) == pytest.approx(2.5)
    assert claims.depth_reaching([0.2, 0.6, 1.0, 1.0], 1.0) == pytest.approx(3.0)   # fixed@3 already reaches it
    assert claims.depth_reaching([0.2, 0.6, 1.0, 1.0], 0.1) == 1.0
    assert claims.depth_reaching([0.2, 0.6, 1.0, 1.0], 1.01) is None
    g = fresh()
    for _ in range(50):
        fixed = list(g.random(4))
        q = g.uniform(fixed[0], max(fixed))
        assert claims.envelope(fixed, claims.depth_reaching(fixed, q)) == pytest.approx(q)
    reps = claims.envelope([np.full(3, 0.2), np.full(3, 0.6), np.full(3, 1.0), np.full(3, 1.0)], np.array([1, 1.5, 4]))
    assert reps == pytest.approx([0.2, 0.4, 1.0])                                   # arrays of replicates alike


def exits(mean, n):
    """n whole exit depths whose mean is `mean` (to 1/n)."""
    lo = math.floor(mean)
    high = round((mean - lo) * n)
    return [lo + 1] * high + [lo] * (n - high)


def fake_lookup(data, scope, seed, fixed_acc, acc, depth, g, items=40, prompt=10, decode=None, old=False,
                after=""):
    """A look-up-task run with a builtin suite whose every item (4 levels of `items`) runs a prompt of
    `prompt` positions: at fixed@d every position at d, a share fixed_acc[d-1] of them right; ETE- and
    Dense-Ragged at each τ a share acc, the item's positions at mean exit `depth`
    (Dense-Ragged: the prompt at 4) and with decode=(positions, mean) an answer of several tokens.
    old: a result from before the per-position exits were kept (sum_exits only)."""
    r = fake_run(f"{claims.PREFIX[data]}-{scope}-poisson-s{seed}{after}", scope, seed=seed, data=data)

    def cell(p, prompt_exits, decode_exits):
        right = (np.arange(items) < round(p * items)).astype(int)        # exactly p of them, in a random order
        g.shuffle(right)
        roll = {"correct": right.tolist(), "answer_depth": [prompt_exits[-1]] * items,
                "sum_exits": [sum(prompt_exits) + prompt_exits[-1]] * items}
        if not old:
            roll |= {"prompt_exits": [prompt_exits] * items, "decode_exits": [decode_exits] * items}
        return {"items": items, "acc": float(right.mean()), "answer_depth": float(prompt_exits[-1]), "rollouts": roll}
    n_dec, dec = decode or (0, 0)
    suite = {f"fixed@{d}": {str(k): cell(fixed_acc[d - 1], [d] * prompt, [d] * n_dec) for k in range(1, 5)}
             for d in range(1, 5)}
    for t in claims.THRS:
        item = exits(depth, prompt + n_dec)
        suite[f"ete_ragged@{t}"] = {str(k): cell(acc, item[:prompt], item[prompt:]) for k in range(1, 5)}
        suite[f"dense_ragged@{t}"] = {str(k): cell(acc, [4] * prompt, exits(dec, n_dec) if n_dec else [])
                                      for k in range(1, 5)}
    r["builtin"] = suite
    return r


def frontier(runs):
    """The frontier rows of these runs, by mode, dataset and kind ("ETE-Ragged: hops, global")."""
    rows = claims.frontier_claims({r["name"]: r for r in runs})
    name = lambda c: c["claim"].replace(" past the fixed depths' frontier", "")
    return {name(c): c for c in rows if "not run" not in c["verdict"]}


def test_a_saturated_envelope_is_untested_and_the_compute_it_overspends_is_said():
    """Rule 1: accuracy 1.00 from fixed@2 on: a ragged answer that is always right at 2.3 loops a token
    has gap 0 whatever it spends, the envelope does not rise across 2.3, so the row reads untested
    (saturated) and says it spends 0.3 loops a token more than fixed@2; Dense-Ragged on one-token
    answers runs at full depth, one row for every such task."""
    g = fresh()
    runs = [fake_lookup("hops", s, i, (0.0, 1.0, 1.0, 1.0), 1.0, 2.3, g) for s in ("global", "local")
            for i in range(3)]
    rows = frontier(runs)
    row = rows["ETE-Ragged: hops, global"]
    assert row["verdict"] == "untested (saturated)" and row["holds"] is None
    assert "0 of 4 τ testable, 0 pass; saves -0.30 loops a token" in row["here"]
    assert "gap 0.000 [0.000, 0.000]" in row["numbers"] and "(per model -0.30 / -0.30 / -0.30)" in row["numbers"]
    assert rows["Dense-Ragged, one-token answers: hops"]["verdict"] == "untested (runs at full depth)"
    assert claims.frontier_claims({})[0]["verdict"] == "untested (not run)"


def test_ragged_past_a_rising_envelope_is_judged_by_superiority():
    """Rule 1 on accuracy and on loss alike: better than the envelope where it rises (interval strictly
    better than 0) is a yes with the compute saved; as good as it is a no (no non-inferiority margin);
    fewer than 3 models is untested."""
    g = fresh()
    rising = (0.2, 0.4, 0.6, 0.8)
    good = [fake_lookup("pointer", "global", i, rising, 0.8, 2.5, g, items=100) for i in range(3)]
    level = [fake_lookup("pointer", "local", i, rising, 0.5, 2.5, g, items=100) for i in range(3)]
    rows = frontier(good + level)
    assert rows["ETE-Ragged: pointer, global"]["verdict"] == "yes"
    assert rows["ETE-Ragged: pointer, local"]["verdict"] == "no"
    assert "4 of 4 τ testable, 4 pass; saves 1.50 loops a token" in rows["ETE-Ragged: pointer, global"]["here"]
    assert "3 of 3 models better, sign test p 0.25" in rows["ETE-Ragged: pointer, global"]["numbers"]
    assert frontier(good[:2])["ETE-Ragged: pointer, global"]["verdict"] == "untested (2 models, of 3 a scope)"
    seed = int(torch.randint(0, 2**31, ()))                 # loss over held-out windows: lower is better
    runs = [fake_run(f"syn-{s}-poisson-s{i}", s, seed=i) for s in ("global", "local") for i in range(3)]
    for r in runs:                                          # the envelope at 2.5: 1.75
        r["windows"] = windows((2.0, 1.8, 1.7, 1.65), 1.70 if r["scope"] == "global" else 1.80, 2.5, seed + r["seed"])
    rows = frontier(runs)
    assert rows["ETE-Ragged: synthetic, global"]["verdict"] == "yes"
    assert rows["ETE-Ragged: synthetic, local"]["verdict"] == "no"
    assert "loss gap τ 0.5: -0.050 [" in rows["ETE-Ragged: synthetic, global"]["here"]


def test_the_envelope_is_each_models_own_not_the_pooled_one():
    """Rule 1: a model that answers everything at one loop, and one that needs all four and spends
    them: each sits on its own envelope (gap 0), but the envelope of the two pooled is half-way lower
    at their mean depth, where the pooled gap reads +0.5 (a model-level choice of depth read as a
    ragged gain)."""
    g = fresh()
    easy = fake_lookup("graded", "global", 0, (1.0, 1.0, 1.0, 1.0), 1.0, 1.0, g)
    hard = fake_lookup("graded", "global", 1, (0.0, 0.0, 0.0, 1.0), 1.0, 4.0, g)
    groups = [claims.frontier_units(r, "ete_ragged", 0.5) for r in (easy, hard)]
    pooled, _ = stats.replicates(groups, claims.gap_stat(1))
    own, _, each = stats.per_model(groups, claims.gap_stat(1))
    assert pooled == pytest.approx(0.5) and own == pytest.approx(0.0) and each == pytest.approx([0.0, 0.0])


def test_ete_is_judged_on_the_whole_item_and_dense_on_the_decode():
    """Rule 1's axes: ETE-Ragged's depth is the mean over every position the item ran (prompt and
    decode; results from before the per-position exits were kept give the same from sum_exits), and
    Dense-Ragged's is the decode's, on an answer of several tokens (graded_multi)."""
    g = fresh()
    new = fake_lookup("graded", "global", 0, (0.2, 0.4, 0.6, 0.8), 0.5, 2.3, g)
    old = fake_lookup("graded", "global", 0, (0.2, 0.4, 0.6, 0.8), 0.5, 2.3, g, old=True)
    for part in ("item", "prompt"):
        assert np.array_equal(claims.position_exits(new["builtin"], "ete_ragged@0.5", 2, part),
                              claims.position_exits(old["builtin"], "ete_ragged@0.5", 2, part))
    s, n = claims.position_exits(new["builtin"], "ete_ragged@0.5", 2, "item")
    assert (s / n) == pytest.approx(np.full(40, 2.3))
    multi = [fake_lookup("graded_multi", sc, i, (0.2, 0.4, 0.6, 0.8), 0.7, 3.0, g, decode=(5, 1.4))
             for sc in ("global", "local") for i in range(3)]
    rows = frontier(multi)
    dense = rows["Dense-Ragged: graded_multi, global"]
    assert {"Dense-Ragged: graded_multi, local", "ETE-Ragged: graded_multi, local"} <= set(rows)
    assert "τ 0.2: depth 1.40" in dense["numbers"] and "decode's mean depth" in dense["rule"]
    assert "τ 0.2: depth 3.00" in rows["ETE-Ragged: graded_multi, global"]["numbers"]
    assert not any("one-token" in c for c in rows)                 # a decode: no mode runs at full depth only


# ----------------------------------------------------------------------------- rule 2: exits against each model's need

def test_spearman_ranks_ties_and_a_constant_model_is_zero_against_its_shuffles():
    """Spearman: the Pearson correlation of average ranks (by hand, on fresh data with ties); a model
    that exits at one depth for every item has correlation 0 and so has every shuffle of its exits."""
    g = fresh()
    x, y = g.integers(1, 5, 80).astype(float), g.integers(1, 4, 80).astype(float)
    by_hand = lambda v: np.array([np.mean(np.flatnonzero(np.sort(v) == e) + 1) for e in v])
    assert stats.ranks(x) == pytest.approx(by_hand(x))
    rho, null = stats.spearman(x, y, 200, seed=1)
    assert rho == pytest.approx(np.corrcoef(by_hand(x), by_hand(y))[0, 1])
    assert abs(null.mean()) < 0.05 and null.std() > 0.05
    rho, null = stats.spearman(np.full(80, 2.0), y, 200)
    assert rho == 0.0 and not null.any()
    assert stats.spearman(y, y)[0] == pytest.approx(1.0)


def fake_graded(scope, seed, exit_of_need, g, learns=True, items=50, noise=0.3):
    """A graded-task run: a model that learns needs k loops for k look-ups up to 2 (k = 1: 1, else 2),
    95% right at a fixed depth d >= need, 5% below; one that does not, 30% at every depth. Its answer
    exits at exit_of_need(need, τ) plus normal noise, rounded, on the judging items and those held apart."""
    r = fake_run(f"grd-{scope}-poisson-s{seed}", scope, seed=seed, data="graded")
    need = lambda k: 1 if k == 1 else 2
    for key in ("builtin", "builtin_need"):
        suite = {}
        for mode in [f"fixed@{d}" for d in range(1, 5)] + [f"ete_ragged@{t}" for t in claims.THRS]:
            suite[mode] = {}
            for k in range(1, 5):
                if mode.startswith("fixed"):
                    d = np.full(items, int(mode[6:]))
                    p = (0.95 if d[0] >= need(k) else 0.05) if learns else 0.3
                else:
                    d = np.clip(np.round(exit_of_need(need(k), float(mode.split("@")[1])) + g.normal(0, noise, items)),
                                1, 4).astype(int)
                    p = 0.9
                right = np.arange(items) < round(p * items)            # exactly p of them, in a random order
                g.shuffle(right)
                suite[mode][str(k)] = {"items": items, "acc": float(right.mean()), "answer_depth": float(d.mean()),
                                       "rollouts": {"correct": right.astype(int).tolist(), "answer_depth": d.tolist(),
                                                    "sum_exits": (d + 20).tolist()}}
        r[key] = suite
    return r


def test_exits_follow_need_within_each_model_at_matched_depth():
    """Rule 2: global models whose exits track their need against local models that exit at one depth
    whatever the need holds, both ways round at matched depth; with local ones tracking it more closely
    it does not; with two learners a scope it is untested, and the count is said."""
    g = fresh()
    tracking = lambda need, t: need + 0.5 - t                          # deeper at a lower τ
    constant = lambda need, t: 2.0 + 0.5 - t
    follow = [fake_graded("global", s, tracking, g) for s in range(3)]
    flat = [fake_graded("local", s, constant, g, noise=0.0) for s in range(3)]
    [row] = difficulty.need_claims({r["name"]: r for r in follow + flat})
    assert row["holds"] is True and "(3+3 models)" in row["here"], row
    assert "local Spearman 0.00 (0 of 3 past their null)" in row["numbers"]
    assert "global Spearman" in row["numbers"] and "3 of 3 past their null" in row["numbers"]
    also = [fake_graded("local", s, tracking, g, noise=0.1) for s in range(3)]      # tracking it more closely
    assert difficulty.need_claims({r["name"]: r for r in follow + also})[0]["holds"] is False
    few = follow[:2] + [fake_graded("global", 2, tracking, g, learns=False)] + flat
    row = difficulty.need_claims({r["name"]: r for r in few})[0]
    assert row["verdict"] == "untested (too few learners: 2 of 3 global, 3 of 3 local models learn past one look-up)"
    assert "grd-global-poisson-s2: gain past one look-up" in row["numbers"] and "(does not enter)" in row["numbers"]
    assert difficulty.need_claims({})[0]["verdict"] == "untested (not run)"


def test_matching_reads_each_model_at_the_tau_nearest_the_other_scopes_depth():
    models = [{"at": {0.2: {"depth": 3.0}, 0.5: {"depth": 2.0}, 0.7: {"depth": 1.2}}}]
    assert difficulty.matched(models, 1.4) == [{"depth": 1.2}] and difficulty.matched(models, 2.6) == [{"depth": 3.0}]


# ----------------------------------------------------------------------------- rule 3: the noise floor

def ra_family(scope, seed, ra, dense, order2, g):
    """A parent, its ragged-aware branch, its dense continuation and that continuation on another data
    order, on the same held-out windows, with the given mean ragged losses at τ 0.5."""
    parent = fake_run(f"syn-{scope}-poisson-s{seed}", scope, seed=seed)
    base = windows((2.0, 1.8, 1.7, 1.65), 1.6, 2.0, g)
    at = lambda loss: dict(base, ragged={"0.5": list(np.array(base["ragged"]["0.5"]) + loss - 1.6)})
    name = parent["name"]
    out = [parent, fake_run(f"{name}-ra-direct", scope, seed=seed, ra="direct", parent=name, windows=at(ra)),
           fake_run(f"{name}-cont-dense", scope, seed=seed, parent=name, windows=at(dense))]
    return out + ([fake_run(f"{name}-cont-dense-order2", scope, seed=seed, parent=name, windows=at(order2))]
                  if order2 is not None else [])


def test_ragged_aware_rows_are_judged_against_the_noise_floor_of_the_controls():
    """Rule 3: the floor is the 95% upper bound of |dense - dense on another order| over the parents,
    from the controls alone (the same floor whatever the RA runs say); global holds past minus the
    floor, local within ± it; without the controls the rows are untested."""
    seed = int(torch.randint(0, 2**31, ()))
    cases = [("global", 1.55, True), ("global", 1.596, False), ("local", 1.601, True), ("local", 1.7, False)]
    for scope, ra, holds in cases:
        runs = [r for i in range(3) for r in ra_family(scope, i, ra, 1.6, 1.6 + 0.01 * (-1) ** i, seed + i)]
        R = {r["name"]: r for r in runs}
        floor = claims.noise_floor(R, "synthetic", scope)
        assert floor["value"] == pytest.approx(0.01, abs=1e-9) and 0.01 <= floor["floor"] < 0.02
        without_ra = {n: r for n, r in R.items() if "-ra-" not in n}
        assert claims.noise_floor(without_ra, "synthetic", scope)["floor"] == floor["floor"]
        row, *rest = claims.ra_claims(R)
        assert row["holds"] is holds, (scope, ra, row)
        assert f"floor {floor['floor']:.4f}" in row["here"] and "(3 parents)" in row["here"]
        assert [r["verdict"] for r in rest] == ["untested (not run)"] * 2 and "hops" in rest[0]["claim"]
    runs = [r for i in range(3) for r in ra_family("global", i, 1.5, 1.6, None, seed + i)]
    row = claims.ra_claims({r["name"]: r for r in runs})[0]
    assert row["holds"] is None and row["verdict"].startswith("untested (no noise floor")
    runs = [r for i in range(2) for r in ra_family("global", i, 1.5, 1.6, 1.6, seed + i)]
    assert claims.ra_claims({r["name"]: r for r in runs})[0]["verdict"] == "untested (2 models, of 3 a scope)"


# ----------------------------------------------------------------------------- rule 4 and the other rows

def test_large_jumps_need_three_models_a_scope():
    """Global minus local large-jump rate per dataset, each scope drawn apart; many under global and
    almost none under local holds; two models a scope is untested; a small gap does not hold."""
    runs = {r["name"]: r for r in (fake_run(f"syn-{s}-poisson-s{i}", s, seed=i, jumps=rate)
                                   for s, rate in (("global", 0.2), ("local", 0.002)) for i in range(3))}
    [jumps] = claims.jump_claims(runs)
    assert jumps["holds"] and jumps["claim"].endswith(": synthetic") and "(3+3 models; permutation" in jumps["here"]
    assert "global 20.0% (models 20.0% / 20.0% / 20.0%), local 0.2%" in jumps["numbers"]
    for i in range(3):
        runs[f"syn-global-poisson-s{i}"]["final"]["large_jump_rate"] = 0.01
    assert claims.jump_claims(runs)[0]["holds"] is False
    del runs["syn-global-poisson-s2"]
    assert claims.jump_claims(runs)[0]["verdict"] == "untested (2+3 models, of 3 a scope)"


def test_flat_beta_is_judged_over_the_training_trajectory():
    """At every evaluation, what loops 2..U gain over loop 1, flat β over the schedule, seeds
    resampled: below 1/2 at most evaluations is a collapse, else not reproduced; two pairs untested."""
    def curve_run(name, scope, seed, gains):
        r = fake_run(name, scope, seed=seed, beta=0.1 if "flat" in name else None)
        r["curve"] = [{"iter": 250 * i, "tokens": i, "val_loss_fixed": [2.0, 2.0 - gain, 2.0 - gain, 2.0]}
                      for i, gain in enumerate(gains)]
        r["final"]["loop_shift"] = [0.9, 0.1, 0.1, 0.1]
        return r
    for scope in ("global", "local"):
        for flat_gains, holds in (([0.0, 0.01, 0.02, 0.02, 0.3], True), ([0.0, 0.3, 0.3, 0.3, 0.3], None)):
            runs = [curve_run(f"syn-{scope}-poisson-s{s}", scope, s, [0.0, 0.3, 0.3, 0.3, 0.3]) for s in range(3)]
            runs += [curve_run(f"syn-{scope}-poisson-s{s}-flatbeta", scope, s, flat_gains) for s in range(3)]
            rows = claims.flat_beta_claims({r["name"]: r for r in runs})
            rows = {r["claim"].split("(")[1].split()[0]: r for r in rows}     # by scope
            row, other = rows[scope], rows["local" if scope == "global" else "global"]
            assert row["holds"] is holds and f"({scope} KL)" in row["claim"]
            assert other["verdict"] == "untested (not run)" and "flatbeta" in other["numbers"]
            assert row["verdict"] == ("yes" if holds else "not reproduced at this scale")
            assert f"ratio < 1/2 at {3 if holds else 0} of 4 evaluations" in row["here"]
        two = claims.flat_beta_claims({r["name"]: r for r in runs if r["seed"] < 2})
        assert [r["verdict"] for r in two if scope in r["claim"]] == ["untested (2 models, of 3 a scope)"]


def test_difficulty_on_synthetic_needs_depth_to_buy_accuracy_first():
    """The depth before difficulty-4 tokens minus difficulty-1 ones, per model and scope, and global
    minus local: tested only where fixed@U answers the hardest tokens clearly better than fixed@1."""
    g = fresh()

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
        runs = [run("local", s, 2.0, 2.0, gain) for s in range(3)] + [run("global", s, 1.5, 1.5 + rise, gain)
                                                                     for s in range(3)]
        [row] = difficulty.difficulty_claims({r["name"]: r for r in runs})
        assert row["holds"] is holds, row
        if holds is None:
            assert row["verdict"] == "untested (its precondition fails)"
        elif holds:
            assert "(3 of 3 models rise, sign test p 0.25), local" in row["numbers"]


@pytest.mark.parametrize("data", ["pointer", "hops"])
def test_the_answers_exits_rise_with_a_visible_k(data):
    """A look-up task whose k shows: the precondition (depth buys accuracy at the hardest k) gates the
    rise of the answer's exit depth with k, global against local, models then items resampled."""
    helps = [(0.3, 0.9, 1.0, 1.0), (0.3, 0.4, 0.8, 0.9), (0.3, 0.3, 0.5, 0.8), (0.3, 0.3, 0.3, 0.6)]

    def make(scope, seed, accs, depth_of_k, items=50):
        r = fake_run(f"{claims.PREFIX[data]}-{scope}-poisson-s{seed}", scope, seed=seed, data=data)

        def cell(acc, depth):
            right, d = np.arange(items) < round(acc * items), np.full(items, depth)
            return {"items": items, "acc": float(right.mean()), "answer_depth": float(depth),
                    "rollouts": {"correct": right.astype(int).tolist(), "answer_depth": d.tolist(),
                                 "sum_exits": (d + 20).tolist()}}
        r["builtin"] = {f"fixed@{d}": {str(k): cell(accs[k - 1][d - 1], float(d)) for k in range(1, 5)}
                        for d in range(1, 5)}
        r["builtin"]["ete_ragged@0.5"] = {str(k): cell(0.5, depth_of_k(k)) for k in range(1, 5)}
        return r
    rising, level = (lambda k: 1.0 + 0.5 * k), (lambda k: 2.0)
    results = [make("local", s, helps, level) for s in range(3)] + [make("global", s, helps, rising) for s in range(3)]
    [rise] = difficulty.pointer_prior_claims({r["name"]: r for r in results}, data, "poisson")
    assert rise["claim"].endswith(f"{claims.POINTER_TASKS[data][1]}, Poisson (k visible)") and rise["holds"]
    assert "fixed@4 minus fixed@1 at k=4, both scopes (3+3 models, items resampled): 0.30 [" in rise["numbers"]
    assert "global 1.50 [1.50, 1.50] (3 of 3 models rise" in rise["numbers"] and "local 0.00 [0.00, 0.00]" in \
        rise["numbers"] and "permutation test over the models p 0.10" in rise["numbers"]
    assert "global k=1 0.30 / 0.90 / 1.00 / 1.00" in rise["numbers"] and len(rise["here"]) <= 150
    level_everywhere = [make(s, x, helps, level) for s in ("local", "global") for x in range(3)]
    assert difficulty.pointer_prior_claims({r["name"]: r for r in level_everywhere}, data, "poisson")[0]["holds"] \
        is False
    two = [r for r in results if r["seed"] < 2]
    assert difficulty.pointer_prior_claims({r["name"]: r for r in two}, data, "poisson")[0]["verdict"] == \
        "untested (2+2 models, of 3 a scope)"
    flat = [make(s, x, [(0.4, 0.4, 0.4, 0.4)] * 4, level) for s in ("local", "global") for x in range(3)]
    [rise] = difficulty.pointer_prior_claims({r["name"]: r for r in flat}, data, "poisson")
    assert rise["holds"] is None and rise["verdict"] == "untested (its precondition fails)"
    for r in flat:                       # results from before the suites kept their rollouts
        for cells in r["builtin"].values():
            for cell in cells.values():
                del cell["rollouts"]
    assert difficulty.pointer_prior_claims({r["name"]: r for r in flat}, data, "poisson")[0]["verdict"] == \
        "untested (no interval)"
    assert difficulty.pointer_claims({}) == []              # no pointer runs: no pointer claims


def test_a_quick_grid_is_not_judged():
    """Rule 4: the rows of toy models carry their numbers and no verdict."""
    g = fresh()
    runs = [fake_lookup("pointer", s, i, (0.2, 0.4, 0.6, 0.8), 0.8, 2.5, g) for s in ("global", "local")
            for i in range(3)]
    judged, quick = report.claims(runs), report.claims(runs, judged=False)
    assert any(c["holds"] for c in judged) and [c["numbers"] for c in judged] == [c["numbers"] for c in quick]
    assert {c["verdict"] for c in quick} == {claims.QUICK} and not any(c["holds"] is not None for c in quick)


# ----------------------------------------------------------------------------- the ladder's rules

def ladder_run(name, steps, scope="local", kl=0.01, items=40, seed=0):
    """A measured ladder model, constructed: per set, fixed@1..4's answers right a step apart by
    `steps` (shares of the four answers), and ETE-Ragged at three thresholds with known depths."""
    rng = np.random.default_rng(seed)
    base = np.cumsum([0.2] + list(steps))
    def one_set():
        fixed = [list(np.clip(np.round((b + rng.normal(0, 0.02, items)) * 4), 0, 4).astype(int)) for b in base]
        grid = {t: dict(right=list(np.full(items, 4)), sum_e=list(np.full(items, int(d * 10))))
                for t, d in (("0.1", 1.3), ("0.5", 2.2), ("0.9", 3.8))}
        return dict(k=[1] * items, positions=[10] * items, fixed=fixed, ete=grid,
                    dense_ragged={t: dict(g, n=[10] * items) for t, g in grid.items()}, gate_free=grid)
    return dict(name=name, config={"prior": "uniform", "global_kl": scope == "global", "seed": seed},
                final={"kl_global": kl}, sets={"calibration": one_set(), "judging": one_set()})


def test_the_ladder_admits_only_models_that_climb_it():
    """Rules 2-3: a model whose every loop answers better enters; one that stops climbing after depth
    2 does not; a global model that climbs but ends off its prior (KL(π̄ ‖ prior) > 0.02) does not."""
    from lab import ladder_claims as lc
    assert lc.entry(ladder_run("climbs", [0.25, 0.25, 0.25]))[0]
    assert not lc.entry(ladder_run("flat", [0.25, 0.0, 0.0]))[0]
    assert lc.entry(ladder_run("on-prior", [0.25, 0.25, 0.25], "global", kl=0.015))[0]
    assert not lc.entry(ladder_run("off-prior", [0.25, 0.25, 0.25], "global", kl=0.05))[0]


def test_the_operating_points_are_the_thresholds_nearest_each_target():
    """Rule 4: for each target depth the threshold whose calibration depth is nearest, not interpolated;
    several targets may share one."""
    from lab import ladder_claims as lc
    got = lc.points(ladder_run("m", [0.25, 0.25, 0.25]), "ete")
    assert got == {1.25: "0.1", 1.75: "0.1", 2.25: "0.5", 2.75: "0.5", 3.25: "0.9", 3.75: "0.9"}


def test_fewer_than_three_climbers_read_untested_no_ladder():
    """Rules 3 and 1: two entering models of three read 'untested (no ladder: 2 of 3 models)'; with three
    the frontier is judged (here ragged answers everything at every depth: above the envelope)."""
    from lab import ladder_claims as lc
    R = {f"lad-local-uniform-s{i}": ladder_run(f"lad-local-uniform-s{i}", [0.25, 0.25, 0.25], seed=i) for i in range(2)}
    R["lad-local-uniform-s9"] = ladder_run("lad-local-uniform-s9", [0.25, 0.0, 0.0], seed=9)
    rows = {r["claim"]: r for r in lc.claim_rows(R)}
    ete = rows["ETE-Ragged past the fixed depths' frontier: the ladder, local"]
    assert ete["verdict"] == "untested (no ladder: 2 of 3 models)"
    R["lad-local-uniform-s3"] = ladder_run("lad-local-uniform-s3", [0.25, 0.25, 0.25], seed=3)
    ete = {r["claim"]: r for r in lc.claim_rows(R)}["ETE-Ragged past the fixed depths' frontier: the ladder, local"]
    assert ete["here"].startswith("3 of 4 models enter") and ete["verdict"] == "yes"
    # rule 5: a scope whose pilot has no climber stops there, and says so
    pilot = {f"lad-global-uniform-s{i}": ladder_run(f"lad-global-uniform-s{i}", [0.25, 0.0, 0.0], "global",
                                                    seed=i) for i in range(2)}
    rows = {r["claim"]: r for r in lc.claim_rows(pilot)}
    ete = rows["ETE-Ragged past the fixed depths' frontier: the ladder, global"]
    assert ete["verdict"] == "untested (no ladder in the pilot: 0 of 2 models)"



def test_the_ragged_aware_branches_leave_only_entering_models_and_are_judged_alone(tmp_path):
    """Rule 6: the ra stage branches off every measured model that enters (RA direct, the dense
    continuation, that again on another data order) and no other; trained, each is a 4-step branch of
    its parent with its own objective; the branches' rows are judged on the branches alone, and two
    of them read 'no ladder', never 'in the pilot'."""
    import json

    import torch

    from lab import ladder, ladder_claims as lc
    out = str(tmp_path)
    ladder.main(["--stage=pilot", "--quick", f"--out={out}", "--only=lad-local-uniform-s1337,lad-local-uniform-s1338"])
    for name, steps in (("lad-local-uniform-s1337", [0.25, 0.25, 0.25]), ("lad-local-uniform-s1338", [0.25, 0.0, 0.0])):
        with open(tmp_path / name / "result.json", "w") as f:
            json.dump(ladder_run(name, steps, seed=int(name[-4:])), f, default=int)
    runs = ladder.grid(dict(ladder.DEFAULTS, stage="ra", out=out, quick=True))
    assert sorted(runs) == [f"lad-local-uniform-s1337-{b}" for b in ("cont-dense", "cont-dense-order2", "ra-direct")]
    ladder.main(["--stage=ra", "--quick", f"--out={out}"])
    for branch, seed, ra in (("ra-direct", 1337, True), ("cont-dense", 1337, False),
                             ("cont-dense-order2", 2337, False)):
        folder = tmp_path / f"lad-local-uniform-s1337-{branch}"
        config = torch.load(folder / "ckpt.pt", weights_only=True)["config"]
        got = (config["seed"], config["ragged_aware"], config["max_iters"], config["prior"])
        assert got == (seed, ra, 4, "uniform")
        assert config["branch_from"] == str(tmp_path / "lad-local-uniform-s1337")
        with open(folder / "stages.json") as f:
            assert [(s["k"], s["until"]) for s in json.load(f)] == [(4, 4)]
    # the verdicts: the parents' rows count the parents only, the branches' their own models
    R = {n: ladder_run(n, [0.25, 0.25, 0.25], seed=i) for i, n in enumerate(
        ["lad-local-uniform-s1", "lad-local-uniform-s1-ra-direct", "lad-local-uniform-s1-cont-dense",
         "lad-local-uniform-s2-ra-direct", "lad-local-uniform-s1-cont-dense-order2"])}
    R["lad-local-uniform-s2-cont-dense"] = ladder_run("lad-local-uniform-s2-cont-dense", [0.25, 0.0, 0.0], seed=7)
    rows = {r["claim"]: r for r in lc.claim_rows(R)}
    assert rows["ETE-Ragged past the fixed depths' frontier: the ladder, local"]["verdict"] == \
        "untested (no ladder: 1 of 1 models)"
    ra = rows["ETE-Ragged past the fixed depths' frontier: the ladder, local " + lc.BRANCHES["ra-direct"]]
    assert ra["verdict"] == "untested (no ladder: 2 of 2 models)" and len(ra["runs"]) == 2
    assert rows["The ladder after 500 more steps: models that climb it: local"]["verdict"] == "2 of 2, 1 of 2, 1 of 1"

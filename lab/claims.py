"""
The paper's claims checked against the grid's finished runs: for each, the paper's own comparison,
its numbers with a 95% interval, how many trained models it rests on, a rule stated beside it, and
the verdict the rule gives.

The units an interval resamples are the held-out windows of a run (`windows` in its result.json:
the same windows at every depth and for every run of a dataset, so that differences are paired)
or the items of a builtin suite (the same items for every model). Every interval comes from one
bootstrap (`replicates`): the seeds (trained models) drawn with replacement, then the units within
each drawn seed; `seed_share` says how much of an interval's width the seeds' spread makes, not
the units'. A verdict resting on one trained model reads "untested (one model)".

Read top to bottom: intervals; the frontier (Figure 1: loss on the text datasets, accuracy at the
answer on the look-up tasks); large jumps; ragged-aware training (global: beyond the dense
continuation; local: equivalent to it); flat β over the training trajectory (Figure 7); exits and
difficulty (synthetic, the look-up tasks, the graded task against each model's own need); reruns;
the graded task's tables.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    raise SystemExit("error: a lab script runs from the project root as a module: python -m lab.claims ...")
import numpy as np

THRS = [0.5, 0.2, 0.3, 0.7]        # eval thresholds; the exit statistics are taken at the first
# the pointer tasks' priors: Poisson, and the prior whose global run read best on the synthetic grid
POINTER_PRIORS = ["poisson", "uniform"]
# the look-up tasks (prepare_data's datasets): run-name prefix and the name their claims go by
POINTER_TASKS = {"pointer": ("ptr", "Pointer task"), "hops": ("hop", "Hops task (one token a fact)"),
                 "graded": ("grd", "Graded task (hidden k)"),
                 "graded_multi": ("gml", "Graded task, every chain answered in turn (a decode of several tokens)")}
TASK_PRIORS = {"pointer": POINTER_PRIORS, "hops": POINTER_PRIORS, "graded": ["poisson"], "graded_multi": ["poisson"]}
# the hardest item of each task's data and builtin suite (hops: the levels its model learns every time)
MAX_K = {"pointer": 4, "hops": 2, "graded": 4, "graded_multi": 4}
PREFIX = {"synthetic": "syn", "shakespeare": "shk", **{d: p for d, (p, _) in POINTER_TASKS.items()}}
N_BOOT = 2000                      # bootstrap replicates per interval
EQUIVALENCE = 0.01                 # local RA "does not impact much": within 1% of the dense continuation's loss
# the ragged-aware methods branched off each dataset's parents (App. C; the look-up tasks: the direct one)
RA_METHODS = {"synthetic": ["direct", "counterfactual", "reinforce4"], "hops": ["direct"], "graded": ["direct"]}
GRADED_SEEDS = 5                   # the graded verdict's minimum of trained models a scope
NON_INFERIOR = 0.05                # accuracy frontier: ragged at most 5 points under the fixed depths' envelope


# ----------------------------------------------------------------------------- intervals

def replicates(groups, stat=None, paired=True, n=N_BOOT, seed=0, units=True):
    """A statistic of means, on every unit and on n bootstrap replicates. groups: one tuple of
    arrays per seed; a replicate draws the seeds with replacement, then the units of each drawn seed
    (one draw for all of its arrays when paired: they hold the same units in the same order;
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


def interval(reps):
    lo, hi = np.nanpercentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def ci(value, reps, p=2):
    lo, hi = interval(reps)
    return f"{value:.{p}f} [{lo:.{p}f}, {hi:.{p}f}]"


def sign_of(reps):
    """-1: the interval lies below 0, +1: above, 0: it holds 0 (within noise)."""
    lo, hi = interval(reps)
    return -1 if hi < 0 else 1 if lo > 0 else 0


def seed_share(groups, stat=None, paired=True):
    """How much of the interval's width the seeds' spread makes: the width with the seeds alone
    resampled (each seed's units all kept) over the width with both."""
    full = np.subtract(*interval(replicates(groups, stat, paired)[1])[::-1])
    seeds = np.subtract(*interval(replicates(groups, stat, paired, units=False)[1])[::-1])
    return float(seeds / full) if full > 0 else 0.0


def spread_note(groups, stat=None, paired=True):
    share = seed_share(groups, stat, paired) if len(groups) > 1 else 0.0
    return f"{len(groups)} seeds" + (", the seeds' spread sets it" if share >= 0.5 else "")


def row(claim, paper, rule, here, numbers, holds=None, verdict=None, runs=()):
    """A claim as the report shows it: the claim, the paper's figure, the one-line numbers (`here`),
    the verdict (holds True: yes, False: no; else `verdict`), the rule, the full numbers, and the
    names of the runs behind it (for their reruns and provenance)."""
    holds = None if holds is None else bool(holds)
    verdict = {True: "yes", False: "no"}.get(holds) or verdict
    return dict(claim=claim, paper=paper, rule=rule, here=here, numbers=numbers, holds=holds, verdict=verdict,
                runs=sorted({r["name"] for r in runs}))


def not_run(claim, paper, rule, runs):
    """A claim whose runs are not finished yet: listed all the same, with the runs that would test it."""
    return row(claim, paper, rule, "no finished runs", f"not run yet: {runs} (`python -m lab.reproduce --full` trains "
               "them, resuming what it has)", verdict="untested (not run)")


def base_runs(R, data, scope, prior="poisson"):
    """The trained parents of a dataset, scope and prior (no branch, no flat β), by seed."""
    name = f"{PREFIX[data]}-{scope}-{prior}-s"
    return [r for n, r in sorted(R.items()) if n.startswith(name) and n[len(name):].isdigit()]


def branch_runs(R, data, scope, kind):
    """The branches of a kind (ra-direct, cont-dense, flatbeta, ...) of a dataset and scope, by seed."""
    prefix = f"{PREFIX[data]}-{scope}-poisson-s"
    return [r for n, r in sorted(R.items()) if n.startswith(prefix) and n.endswith("-" + kind)]


# ----------------------------------------------------------------------------- the frontier (Figure 1)

def fixed_envelope(loss_fixed, depth):
    """The best loss the fixed depths reach at an average depth of at most `depth`: a whole depth
    d <= depth, or a mix of two depths d1 < depth < d2 (a share of the tokens at each) whose average
    is `depth`: the lower envelope of the points (d, loss at fixed@d). Numbers or arrays of
    bootstrap replicates alike (an accuracy's upper envelope: the negated losses)."""
    U, depth = len(loss_fixed), np.asarray(depth, dtype=float)
    best = np.full(depth.shape, np.inf)
    for d1 in range(1, U + 1):
        best = np.where(d1 <= depth + 1e-9, np.minimum(best, loss_fixed[d1 - 1]), best)
        for d2 in range(d1 + 1, U + 1):
            t = (depth - d1) / (d2 - d1)
            mix = (1 - t) * loss_fixed[d1 - 1] + t * loss_fixed[d2 - 1]
            best = np.where((d1 < depth) & (depth < d2), np.minimum(best, mix), best)
    return best if best.ndim else float(best)


def envelope_gap(ragged, depth, *fixed):
    """A ragged mode's loss minus the fixed envelope at its average depth (< 0: ragged is better)."""
    return ragged - fixed_envelope(fixed, depth)


def accuracy_gap(acc, depth, *fixed):
    """A ragged mode's accuracy minus the fixed depths' upper envelope at its mean answer depth."""
    return acc + fixed_envelope([-a for a in fixed], depth)


def window_units(w, t):
    """One run's held-out windows as the arrays envelope_gap takes at threshold t."""
    return (w["ragged"][t], w["depth"][t], *zip(*w["fixed"]))


def every_k(suite, mode, key):
    """A builtin suite's rollouts of one mode, every k in a row (the same items in every mode)."""
    return np.concatenate([rollouts(suite, mode, k, key) for k in sorted(suite[mode], key=int)])


def frontier_gaps(runs):
    """{mode@τ: (groups, stat)}: the gap to the fixed depths' envelope that a run kind's seeds resample,
    on loss over held-out windows (text datasets), else on accuracy over builtin items."""
    out = {}
    if all(r.get("builtin") for r in runs):
        suites = [r["builtin"] for r in runs]
        U = deepest(suites[0])
        for mode in (f"{m}@{t}" for m in ("ete_ragged", "dense_ragged") for t in sorted(THRS)):
            if all(mode in b and all("rollouts" in c for c in b[mode].values()) for b in suites):
                out[mode] = ([(every_k(b, mode, "correct"), every_k(b, mode, "answer_depth"))
                              + tuple(every_k(b, f"fixed@{d}", "correct") for d in range(1, U + 1)) for b in suites],
                             accuracy_gap)
    elif all(r.get("windows") for r in runs):
        out = {f"ete_ragged@{t}": ([window_units(r["windows"], str(t)) for r in runs], envelope_gap)
               for t in sorted(THRS)}
    return out


def frontier_claims(R):
    """Per dataset, each scope's models (and after ragged-aware training), at every τ: the gap of the
    ragged modes to the envelope of the fixed depths at their average depth, seeds then units
    resampled. Loss (text): holds when ETE-Ragged lies clearly below it at more than half of the τ;
    accuracy at the answer (look-up tasks): when it is at most NON_INFERIOR under it at more than half
    of the τ (Dense-Ragged beside: its answer comes from the prompt's last position, run at full depth)."""
    out = []
    for data in ("synthetic", "shakespeare", "pointer", "hops", "graded"):
        kinds = [("", s, base_runs(R, data, s)) for s in ("global", "local")]
        kinds += [("+RA", s, branch_runs(R, data, s, "ra-direct")) for s in ("global", "local")]
        parts, here, verdicts, holds_all, used = [], [], [], [], []
        for after, scope, runs in kinds:
            gaps = frontier_gaps(runs) if runs else {}
            if not gaps:
                continue
            used += runs
            acc = next(iter(gaps.values()))[1] is accuracy_gap
            passed, cells = 0, []
            for mode, (groups, stat) in gaps.items():
                value, reps = replicates(groups, stat)
                ok = interval(reps)[0] > -NON_INFERIOR if acc else sign_of(reps) < 0
                passed += ok and mode.startswith("ete")
                cells.append(f"{mode} {ci(value, reps, 3)}")
            ete = [m for m in gaps if m.startswith("ete")]
            holds = passed > len(ete) / 2
            groups, stat = gaps["ete_ragged@0.5"]
            value, reps = replicates(groups, stat)
            here.append(f"{scope}{after} {ci(value, reps, 3)}")
            verdicts.append(f"{scope}{after} " + ("untested (one model)" if len(runs) == 1 else
                                                  "yes" if holds else "no"))
            holds_all.append(holds)
            parts.append(f"{scope}{after} ({spread_note(groups, stat)}): {passed} of {len(ete)} τ pass; "
                         + "; ".join(cells))
        if not parts:
            continue
        unit = "accuracy at the answer minus" if data in POINTER_TASKS else "loss minus"
        short = "accuracy" if data in POINTER_TASKS else "loss"
        rule = (f"holds for a kind of model when, at more than half of the τ values, ETE-Ragged's accuracy gap has "
                f"its 95% interval above -{NON_INFERIOR} (at most {NON_INFERIOR:.0%} under fixed depths of the same "
                "compute)" if data in POINTER_TASKS else "holds for a kind of model when, at more than half of the τ "
                "values, ETE-Ragged's loss gap has its 95% interval below 0")
        out.append(row(f"Ragged at or past the fixed depths' frontier: {data}", "Fig. 1", rule,
                       f"{short} gap, τ 0.5: " + "; ".join(here),
                       f"{unit} the fixed depths' envelope at the ragged mode's average depth (seeds, then "
                       f"{'items' if data in POINTER_TASKS else 'held-out windows'} resampled): " + " | ".join(parts),
                       verdict=", ".join(verdicts), runs=used))
    return out


# ----------------------------------------------------------------------------- large jumps

def jump_claims(R):
    """Global enforcement gives many large jumps, local almost none (paper: 19.2% vs 0.2%), per
    dataset: global minus local over the seeds (trained models resampled; the two scopes unpaired)."""
    out = []
    rule = ("holds when global minus local has its 95% interval (seeds resampled) above 2 points and global's mean "
            "is at least 3x local's")
    for data in ("synthetic", "shakespeare", "pointer", "hops", "graded"):
        by_scope = {s: base_runs(R, data, s) for s in ("global", "local")}
        rates = {s: [r["final"]["large_jump_rate"] for r in rs] for s, rs in by_scope.items()}
        runs = by_scope["global"] + by_scope["local"]
        if not all(rates.values()):
            continue
        g, l = np.mean(rates["global"]), np.mean(rates["local"])
        n = f"{len(rates['global'])}+{len(rates['local'])} seeds"
        pcts = lambda vs: " / ".join(f"{100 * v:.1f}%" for v in vs)
        numbers = (f"large-jump rate, Poisson: global {100 * g:.1f}% (seeds {pcts(rates['global'])}), local "
                   f"{100 * l:.1f}% (seeds {pcts(rates['local'])})")
        if min(map(len, rates.values())) < 2:
            out.append(row(f"Global gives many large jumps, local almost none: {data}", "§6, Fig. 5", rule,
                           f"global {100 * g:.1f}%, local {100 * l:.1f}% ({n})", numbers + "; one seed: no interval",
                           verdict="untested (one model)", runs=runs))
            continue
        reps = boot_diff(rates["global"], rates["local"])
        diff = ci(100 * (g - l), 100 * reps, 1)
        holds = interval(reps)[0] > 0.02 and g >= 3 * l
        out.append(row(f"Global gives many large jumps, local almost none: {data}", "§6, Fig. 5", rule,
                       f"global − local {diff} points ({n}, the seeds' spread sets it)",
                       numbers + f"; global minus local {diff} points", holds=holds, runs=runs))
    return out


def boot_diff(a, b, n=N_BOOT, seed=0):
    """Replicates of mean(a) - mean(b), each resampled apart (independent trainings)."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a, float), np.asarray(b, float)
    return a[rng.integers(0, len(a), (n, len(a)))].mean(1) - b[rng.integers(0, len(b), (n, len(b)))].mean(1)


# ----------------------------------------------------------------------------- ragged-aware training

def ra_claims(R):
    """Ragged-aware training against its control, the same continuation with the dense objective,
    each pair from the same parent: RA's ETE-Ragged loss at τ 0.5 minus the control's, paired over the
    held-out windows, seeds (parents) resampled. The paper: under global enforcement RA brings the
    ragged loss down (beyond what more training does); under local it "does not impact much": an
    equivalence, |RA minus dense| within EQUIVALENCE of the control's loss (stated before the runs)."""
    out = []
    for data, methods in RA_METHODS.items():
        pairs_of = {}
        for method in methods:
            for scope in ("global", "local"):
                pairs = [(r, R.get(r["name"].rsplit("-ra-", 1)[0] + "-cont-dense"))
                         for r in branch_runs(R, data, scope, f"ra-{method}")]
                pairs_of[method, scope] = [(a, b) for a, b in pairs if b and a.get("windows") and b.get("windows")]
        if not any(pairs_of.values()):
            rule = f"global: RA minus dense below 0; local: within ±{EQUIVALENCE:.0%} of the dense continuation's loss"
            out.append(not_run(f"RA lowers the global ragged loss, changes the local model little: {data}",
                               "§5, Table 5", rule, f"{PREFIX[data]}-{{global,local}}-poisson-s<seed>-ra-{methods[0]} "
                               "and -cont-dense, from each parent"))
            continue
        out += [ra_row(data, scope, method, pairs) for (method, scope), pairs in pairs_of.items() if pairs]
    return out


def ra_row(data, scope, method, pairs):
    groups = [(a["windows"]["ragged"]["0.5"], b["windows"]["ragged"]["0.5"]) for a, b in pairs]
    value, reps = replicates(groups, np.subtract)
    lo, hi = interval(reps)
    control = np.mean([b["final"]["val_loss_ragged"]["0.5"] for _, b in pairs])
    rag = lambda r: f"{r['final']['val_loss_ragged']['0.5']:.4f}"
    numbers = (f"RA minus dense, ragged@0.5 (nats; {spread_note(groups, np.subtract)}, then held-out windows): "
               f"{ci(value, reps, 4)}; per parent, RA vs dense: " + ", ".join(f"s{a['seed']} {rag(a)} vs {rag(b)}"
                                                                          for a, b in pairs))
    if pairs[0][0].get("builtin") and pairs[0][1].get("builtin"):        # a look-up task: the hardest k's answers
        k = str(pairs[0][0]["max_k"])
        acc = lambda r: r["builtin"]["ete_ragged@0.5"][k]["acc"]
        numbers += (f"; accuracy on {k} look-ups at ETE-Ragged τ 0.5: RA {np.mean([acc(a) for a, _ in pairs]):.2f}, "
                    f"dense {np.mean([acc(b) for _, b in pairs]):.2f}")
    here = f"RA − dense {ci(value, reps, 4)} nats ({len(pairs)} parent{'s' if len(pairs) > 1 else ''})"
    if scope == "global":
        rule = "holds when RA minus dense has its 95% interval below 0"
        claim = f"RA lowers the ragged loss beyond the dense continuation: {data}, global, {method}"
        holds = hi < 0 if len(pairs) > 1 else None
    else:
        margin = EQUIVALENCE * control
        rule = (f"holds when RA minus dense has its 95% interval within ±{EQUIVALENCE:.0%} of the dense continuation's "
                f"ragged loss (here ±{margin:.4f}); no when it lies wholly outside")
        claim = f"RA changes the local model little: {data}, local, {method}"
        holds = (-margin < lo and hi < margin) or (False if hi < -margin or lo > margin else None)
        here += f"; margin ±{margin:.4f}"
    verdict = "untested (one model)" if len(pairs) == 1 else "untested (its interval crosses the margin)"
    return row(claim, "§5, Table 5", rule, here, numbers, holds=holds if len(pairs) > 1 else None, verdict=verdict,
               runs=[r for pair in pairs for r in pair])


# ----------------------------------------------------------------------------- flat β (Figure 7)

def flat_beta_claims(R):
    """A flat β from the start collapses to depth-1 behaviour (Figure 7), which the paper saw over its
    training: loops after the first act as identity, and then gain nothing over loop 1. At every
    evaluation of the training curve, what loops 2..U gain over loop 1, flat β over the App. B schedule
    (each pair from one seed: the same data in the same order), the seeds resampled (the curves have no
    held-out windows: the seeds' spread sets each interval); how far each loop moves the state beside."""
    out = []
    rule = ("holds when flat over schedule has its 95% interval below 1/2 at more than half of the evaluations after "
            "the first; else not reproduced at this scale (a run that does not collapse here says nothing of the "
            "paper's scale)")
    for scope in ("global", "local"):
        flats = branch_runs(R, "synthetic", scope, "flatbeta")
        pairs = [(f, R.get(f["name"].rsplit("-flatbeta", 1)[0])) for f in flats]
        pairs = [(f, s) for f, s in pairs if s]
        claim = f"A flat β = 0.1 collapses the loops after the first ({scope} KL)"
        if not pairs:
            out.append(not_run(claim, "Fig. 7", rule, f"syn-{scope}-poisson-s<seed>-flatbeta, beside each parent"))
            continue
        gain = lambda c: c["val_loss_fixed"][0] - min(c["val_loss_fixed"][1:])
        evals = min(len(f["curve"]) for f, _ in pairs)
        cells, below = [], 0
        for i in range(1, evals):
            flat, sched = [gain(f["curve"][i]) for f, _ in pairs], [gain(s["curve"][i]) for _, s in pairs]
            value, reps = replicates([([a], [b]) for a, b in zip(flat, sched)], np.divide)
            below += interval(reps)[1] < 0.5
            cells.append(f"{pairs[0][0]['curve'][i]['iter']}: {ci(value, reps)}")
        shift = lambda r: " / ".join(f"{v:.2f}" for v in r["final"].get("loop_shift", []))
        numbers = (f"{scope} KL, flat over schedule, the gain of loops 2..U over loop 1 at each evaluation "
                   f"({len(pairs)} seeds resampled): " + "; ".join(cells) + "; how far each loop moves the state at "
                   f"the end, ‖Δh‖/‖h‖ (seed {pairs[0][0]['seed']}): {shift(pairs[0][0])} flat vs {shift(pairs[0][1])} "
                   "schedule")
        here = (f"ratio < 1/2 at {below} of {evals - 1} evaluations; at the end {cells[-1].split(': ')[1]} "
                f"({len(pairs)} seeds)")
        holds = len(pairs) > 1 and below > (evals - 1) / 2
        out.append(row(claim, "Fig. 7", rule, here, numbers, holds=True if holds else None,
                       verdict="untested (one model)" if len(pairs) == 1 else "not reproduced at this scale",
                       runs=[r for pair in pairs for r in pair]))
    return out


# ----------------------------------------------------------------------------- exits and difficulty

GAIN_RULE = "holds when the gain is at least 0.1 with its 95% interval above 0"
RISE_RULE = ("holds when global's rise and global minus local both have 95% intervals above 0 (seeds of the two "
             "scopes drawn apart; tested only where its precondition holds)")


def rise_verdict(rise):
    """{scope: (value, replicates)} of a rise with difficulty -> (numbers, holds): global's rise and
    global minus local (independent trainings: the replicates subtract unpaired) both clearly above 0."""
    diff = rise["global"][1] - rise["local"][1]
    text = (f"global {ci(*rise['global'])}, local {ci(*rise['local'])}; global minus local "
            f"{ci(rise['global'][0] - rise['local'][0], diff)}")
    return text, sign_of(rise["global"][1]) > 0 and sign_of(diff) > 0


def given_precondition(rise, need):
    """A rise with difficulty is tested only where its precondition holds: where depth buys nothing at
    the answer, exits that rise (or not) with k say nothing of spending depth on need."""
    return rise if need["holds"] else dict(rise, holds=None, verdict="untested (its precondition fails)")


def difficulty_claims(R):
    """Exits follow difficulty on the synthetic data: first whether depth buys accuracy on the labelled
    tokens at all (fixed@U against fixed@1 on the hardest label, held-out windows), then the mean exit
    depth before difficulty 4 minus difficulty 1 per scope and global minus local."""
    runs = {s: [r for r in base_runs(R, "synthetic", s) if "labels" in r.get("windows", {})]
            for s in ("local", "global")}
    if not all(runs.values()):
        return []
    correct = lambda r, k, d: np.asarray(r["windows"]["label_correct"], float)[:, k, d]
    tokens = lambda r, k: np.asarray(r["windows"]["labels"], float)[:, k, 0]
    with_acc = [r for s in runs for r in runs[s] if "label_correct" in r["windows"]]
    claim = "Exits rise with the next token's difficulty, more under global than local: synthetic"
    if not with_acc:
        return [row(claim, "§6, Fig. 12", RISE_RULE, "no per-label accuracy", "", verdict="untested (no interval)",
                    runs=runs["global"] + runs["local"])]
    U = len(with_acc[0]["final"]["val_loss_fixed"])
    groups = [(correct(r, 4, U - 1), correct(r, 4, 0), tokens(r, 4)) for r in with_acc]
    acc = lambda a, b, n: (a - b) / n
    value, reps = replicates(groups, acc)
    need = dict(holds=sign_of(reps) > 0 and value >= 0.1)
    labelled = lambda r, k: tuple(np.asarray(r["windows"]["labels"], dtype=float)[:, k].T)   # (tokens, Σ depth)
    rise = {s: replicates([labelled(r, 4) + labelled(r, 1) for r in rs], lambda n4, d4, n1, d1: d4 / n4 - d1 / n1)
            for s, rs in runs.items()}
    text, holds = rise_verdict(rise)
    numbers = (f"precondition, accuracy on difficulty-4 tokens, fixed@{U} minus fixed@1 ({len(with_acc)} models, "
               f"held-out windows): {ci(value, reps)} ({GAIN_RULE}); ETE-Ragged τ 0.5, mean depth before difficulty 4 "
               f"minus 1 ({len(runs['global'])}+{len(runs['local'])} seeds): {text}")
    out = row(claim, "§6, Fig. 12", RISE_RULE, f"depth buys accuracy on the hardest: {ci(value, reps)}; rise, global "
              f"− local {text.split('global minus local ')[1]}", numbers, holds=holds,
              runs=runs["global"] + runs["local"])
    return [given_precondition(out, need)]


def answer_rise(suites, lo, hi, mode="ete_ragged@0.5"):
    """{scope: (value, replicates)}: the answer's exit depth at k = hi minus k = lo over a look-up
    task's builtin items (seeds, then items resampled; different items: unpaired)."""
    groups = lambda s: [(rollouts(b, mode, hi, "answer_depth"), rollouts(b, mode, lo, "answer_depth"))
                        for b in suites[s]]
    return {s: replicates(groups(s), np.subtract, paired=False) for s in suites}


def pointer_claims(R):
    """The look-up tasks whose k shows in the item (pointer, hops: an item of k look-ups has chains of
    length k), per prior: whether depth buys accuracy there at all (the precondition), then whether
    the answer's exit depth rises with k, global against local."""
    return [c for data in ("pointer", "hops") for prior in TASK_PRIORS[data]
            for c in pointer_prior_claims(R, data, prior)]


def pointer_prior_claims(R, data, prior):
    by_scope = {s: [r for r in base_runs(R, data, s, prior) if r.get("builtin")] for s in ("local", "global")}
    suites = {s: [r["builtin"] for r in rs] for s, rs in by_scope.items()}
    runs = by_scope["global"] + by_scope["local"]
    if not all(suites.values()):
        return []
    name = f"{POINTER_TASKS[data][1]}, {prior.capitalize()}"
    levels = sorted({k for b in suites["global"] for k in b["fixed@1"]}, key=int)
    lo, hard, U = levels[0], levels[-1], deepest(suites["global"][0])
    items = {s: [b for b in suites[s] if all(rollouts(b, m, k, "correct") is not None for k in (lo, hard)
                                             for m in ("fixed@1", f"fixed@{U}", "ete_ragged@0.5"))] for s in suites}
    claim = f"The answer's exit depth rises with k, more under global than local: {name} (k visible)"
    n = f"{len(suites['global'])}+{len(suites['local'])} seeds"
    if not all(items.values()):
        return [row(claim, "§6", RISE_RULE, f"no rollouts ({n})", "", verdict="untested (no interval)", runs=runs)]
    groups = [(rollouts(b, f"fixed@{U}", hard, "correct"), rollouts(b, "fixed@1", hard, "correct"))
              for s in items for b in items[s]]
    gain, reps = replicates(groups, np.subtract)
    need = dict(holds=sign_of(reps) > 0 and gain >= 0.1)
    text, holds = rise_verdict(answer_rise(items, lo, hard))
    acc = lambda s, m, k: np.mean([b[m][k]["acc"] for b in suites[s]])
    table = lambda s: "; ".join(f"k={k} " + " / ".join(f"{acc(s, f'fixed@{d}', k):.2f}" for d in range(1, U + 1))
                                for k in levels)
    numbers = (f"precondition, fixed@{U} minus fixed@1 at k={hard}, both scopes ({n}, items resampled): "
               f"{ci(gain, reps)} ({GAIN_RULE}); accuracy at fixed@1..{U} per k: global {table('global')}; local "
               f"{table('local')}; the answer's exit depth at k={hard} minus k={lo}, ETE-Ragged τ 0.5: {text}; "
               "Spearman only measures how well the levels separate, and k shows in the item's length")
    out = row(claim, "§6", RISE_RULE, f"depth buys: {ci(gain, reps)}; rise global − local "
              f"{text.split('global minus local ')[1]} ({n})", numbers, holds=holds, runs=runs)
    return [given_precondition(out, need)]


# ----------------------------------------------------------------------------- the graded task: exits against need

def rollouts(suite, mode, k, key):
    """One run's per-rollout values at difficulty k under a mode of its builtin suite (None: absent)."""
    cell = suite.get(mode, {}).get(str(k))
    return None if not cell or "rollouts" not in cell else np.asarray(cell["rollouts"][key], dtype=float)


def deepest(suite):
    """U: the deepest fixed@d a builtin suite was scored at."""
    return max(int(m.split("@")[1]) for m in suite if m.startswith("fixed@"))


def graded_runs(R, scope):
    return [r for r in base_runs(R, "graded", scope) if r.get("builtin")]


def need_of(suite, k, U, margin=0.05):
    """The depth a model needs at k: the shallowest fixed depth whose accuracy on k look-ups is within
    `margin` of its best fixed depth's, on the items that set the need (builtin_need)."""
    acc = [rollouts(suite, f"fixed@{d}", k, "correct").mean() for d in range(1, U + 1)]
    return next(d for d in range(1, U + 1) if acc[d - 1] >= max(acc) - margin)


def graded_claims(R):
    """The graded task, where k is hidden until the chain is followed (prepare_data._chains in rounds): first
    whether depth buys accuracy past one look-up at all (the precondition), then each model's need per
    k set on items held apart (builtin_need), and on the judging items, at ETE-Ragged
    τ 0.5, how far the answer's exit misses the need (|exit depth - need|; its signed overshoot and
    P(exit >= need) beside), global minus local. Declared pairing: the scopes' seeds are drawn apart
    (independent trainings), the items once for both (the same items judge every model)."""
    claim = "Exits follow each model's need more under global than local: graded (k hidden)"
    rule = (f"holds when global minus local |exit − need| has its 95% interval below 0, with at least {GRADED_SEEDS} "
            "models a scope (tested only where depth buys accuracy past one look-up)")
    runs = {s: [r for r in graded_runs(R, s) if r.get("builtin_need")] for s in ("global", "local")}
    if not all(runs.values()):
        return [not_run(claim, "§4, §6", rule, f"grd-{{global,local}}-poisson-s<seed>, {GRADED_SEEDS} seeds a scope")]
    U = deepest(runs["global"][0]["builtin"])
    levels = sorted(int(k) for k in runs["global"][0]["builtin"]["fixed@1"])
    # the precondition: depth buys accuracy past one look-up (on the items that set the need); where it
    # buys nothing, every need is 1 and |exit - need| only asks which scope exits earlier
    past_one = lambda r, d: np.concatenate([rollouts(r["builtin_need"], f"fixed@{d}", k, "correct")
                                            for k in levels[1:]])
    gain, gain_reps = replicates([(past_one(r, U), past_one(r, 1)) for rs in runs.values() for r in rs], np.subtract)
    stats, needs = {"miss": {}, "over": {}, "reach": {}}, {}
    for s, rs in runs.items():
        needs[s] = [[need_of(r["builtin_need"], k, U) for k in levels] for r in rs]
        depth = [every_k(r["builtin"], "ete_ragged@0.5", "answer_depth") for r in rs]
        need = [np.concatenate([np.full(len(rollouts(r["builtin"], "ete_ragged@0.5", k, "correct")), n)
                                for k, n in zip(levels, ns)]) for r, ns in zip(rs, needs[s])]
        stats["over"][s] = np.stack([d - n for d, n in zip(depth, need)])          # [seeds, items]
        stats["miss"][s] = np.abs(stats["over"][s])
        stats["reach"][s] = np.stack([(d >= n).astype(float) for d, n in zip(depth, need)])
    diff = {key: (float(a["global"].mean() - a["local"].mean()), paired_items(a["global"], a["local"]))
            for key, a in stats.items()}
    n = f"{len(runs['global'])}+{len(runs['local'])} seeds"
    scopes = lambda key: ", ".join(f"{s} {stats[key][s].mean():.2f}" for s in runs)
    numbers = (f"precondition, fixed@{U} minus fixed@1 on the items of k ≥ {levels[1]} that set the need (both scopes, "
               f"items resampled): {ci(gain, gain_reps)} ({GAIN_RULE}); each model's need per k = "
               f"{'/'.join(map(str, levels))} (items held apart; the shallowest fixed depth within 0.05 of its best): "
               f"global {needs['global']}, local {needs['local']}; on the judging items, "
               f"ETE-Ragged τ 0.5 ({n}; seeds drawn apart per scope, the items once for both): |exit − need| "
               f"{scopes('miss')}, global minus local {ci(*diff['miss'])}; exit − need {scopes('over')}, global minus "
               f"local {ci(*diff['over'])}; P(exit ≥ need) {scopes('reach')}, global minus local {ci(*diff['reach'])}")
    here = f"depth buys past k = 1: {ci(gain, gain_reps)}; |exit − need| global − local {ci(*diff['miss'])} ({n})"
    used = runs["global"] + runs["local"]
    if min(map(len, runs.values())) < GRADED_SEEDS:
        out = row(claim, "§4, §6", rule, here, numbers, verdict=f"untested ({n}, of {GRADED_SEEDS} a scope)", runs=used)
    else:
        out = row(claim, "§4, §6", rule, here, numbers, holds=interval(diff["miss"][1])[1] < 0, runs=used)
    return [given_precondition(out, dict(holds=sign_of(gain_reps) > 0 and gain >= 0.1))]


def paired_items(a, b, n=N_BOOT, seed=0):
    """Replicates of mean(a) - mean(b) for [seeds, items] arrays: each side's seeds drawn apart, the
    items drawn once for both (the same items)."""
    rng = np.random.default_rng(seed)
    out = np.empty(n)
    for i in range(n):
        items = rng.integers(0, a.shape[1], a.shape[1])
        sa, sb = rng.integers(0, len(a), len(a)), rng.integers(0, len(b), len(b))
        out[i] = a[sa][:, items].mean() - b[sb][:, items].mean()
    return out


# ----------------------------------------------------------------------------- all of them

def claims(results):
    """Every claim's row (row()), in the report's order."""
    R = {r["name"]: r for r in results}
    out = (frontier_claims(R) + jump_claims(R) + ra_claims(R) + flat_beta_claims(R) + difficulty_claims(R)
           + pointer_claims(R) + graded_claims(R))
    return [dict(c, reruns=rerun_note(R, c), untraced=[n for n in c["runs"] if not R[n].get("provenance")])
            for c in out]


def rerun_note(R, claim):
    """How far the runs behind a claim moved when trained again with the same settings (their
    result.json's `earlier`): the largest change of ragged@0.5 and of the best fixed depth. A rerun
    that gave the same numbers to the 0.001 nats the report prints did not move: nothing to say."""
    moved = [(abs(r["final"]["val_loss_ragged"]["0.5"] - e["final"]["val_loss_ragged"]["0.5"]),
              abs(min(r["final"]["val_loss_fixed"]) - min(e["final"]["val_loss_fixed"])), r["name"])
             for r in map(R.get, claim["runs"]) for e in r.get("earlier", [])]
    if not moved:
        return ""
    (rag, _, name), fixed = max(moved), max(m[1] for m in moved)
    if max(rag, fixed) < 0.0005:
        return ""
    return f"reruns moved ragged@0.5 by up to {rag:.3f} nats ({name}), the best fixed depth by up to {fixed:.3f}"


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report writes RESULTS.md with its verdicts")

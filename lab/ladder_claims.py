"""
The ladder's verdicts (lab/ladder.py's rules 3-7, fixed before its runs): which models climb the ladder
(the entry gate), the operating points chosen on the calibration items, and the frontier judged on the
judging items by lab/claims.py's rule 1, for the gate's exits and for the gate-free baseline's; and
the figure in the style of the paper's Fig. 1.

A model's result.json (lab/ladder.py's measure) holds, per item set and item, the answers right at
each fixed depth and at every threshold of each mode, with the Σ e its positions ran; everything here
recomputes from it.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.ladder_claims ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os

import numpy as np

from lab.claims import MIN_MODELS, frontier_rule, gap_stat, rise_stat, row, saved, saved_text
from lab.stats import ci, interval, per_model_settled, replicates, sign_test, stream

KL_ENTRY = 0.02                                  # rule 2: a global model enters this close to its prior
PILOT_SEEDS = 2                                  # rule 5: no model of a scope's pilot enters: the scope stops
TARGETS = [1.25, 1.75, 2.25, 2.75, 3.25, 3.75]   # rule 4: the whole-item depths operating points aim at

# the modes judged: the gate's ETE-Ragged (whole item) and Dense-Ragged (decode), the gate-free rule
MODES = {"ete": ("ETE-Ragged", "the whole item's mean depth (Σ e / tokens)"),
         "dense_ragged": ("Dense-Ragged", "the decode's mean depth"),
         "gate_free": ("ETE, gate-free (exit where two loops' next-token distributions agree)",
                       "the whole item's mean depth (Σ e / tokens)")}


def load(folder):
    """The measured runs under folder (results/ladder), by name."""
    out = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name, "result.json")
            if os.path.isfile(path):
                with open(path) as f:
                    out[name] = json.load(f)
    return out


def scope_of(run):
    return "global" if run["config"]["global_kl"] else "local"


def fixed(S):
    """Answers right a fixed depth, per item, as a share of the item's four: [U, items]."""
    return np.asarray(S["fixed"], dtype=float) / 4


# ----------------------------------------------------------------------------- rules 2-3: who enters

def entry(run):
    """Rules 2-3 on one model: on the calibration items fixed@(d+1) - fixed@d above 0, its interval
    (items resampled) excluding 0, for every d = 1..U-1; a global model also within KL_ENTRY of its
    prior at the end (KL(π̄ ‖ prior) of its last evaluation). Returns (enters, the steps as
    (d, value, lo, hi), its KL)."""
    F = fixed(run["sets"]["calibration"])
    steps = []
    for d in range(1, len(F)):
        value, reps = replicates([(F[d] - F[d - 1],)], seed=stream("ladder", run["name"], "entry", d))
        steps.append((d, value, *interval(reps)))
    kl = run["final"]["kl_global"]
    enters = all(lo > 0 for _, _, lo, _ in steps) and (scope_of(run) == "local" or kl <= KL_ENTRY)
    return enters, steps, kl


# ----------------------------------------------------------------------------- rule 4: operating points

def depth_of(S, cell):
    """A mode's mean depth on a set: Σ e over the positions it charges (the decode's for Dense-Ragged)."""
    return sum(cell["sum_e"]) / sum(cell.get("n", S["positions"]))


def points(run, mode):
    """Rule 4: for each target depth, the threshold of the mode's grid whose depth on the calibration
    items is nearest (not interpolated; a tie goes to the first of the grid). {target: key}."""
    S = run["sets"]["calibration"]
    return {T: min(S[mode], key=lambda key: abs(depth_of(S, S[mode][key]) - T)) for T in TARGETS}


# ----------------------------------------------------------------------------- rule 1 at each target

def units(run, mode, key):
    """Rule 1's units of one model at one threshold, on the judging items: (share right, Σ e,
    positions, share right at fixed@1..U), an entry an item."""
    S = run["sets"]["judging"]
    cell = S[mode][key]
    return (np.asarray(cell["right"], float) / 4, np.asarray(cell["sum_e"], float),
            np.asarray(cell.get("n", S["positions"]), float), *fixed(S))


def judge(models, mode, labels):
    """Rule 1 over the entering models of a scope, at each target depth (each model at its own
    threshold for it): the accuracy gap to the model's own envelope at its depth, averaged over the
    models, with its interval and sign test; testable where the envelope rises across the depth;
    passes where the gap's interval lies above 0; the compute saved."""
    out = []
    for T in TARGETS:
        groups = [units(r, mode, points(r, mode)[T]) for r in models]
        gap, reps, own, settled = per_model_settled(groups, gap_stat(1), (0.0,), stream(*labels, T, "gap"))
        rise, rise_reps, _, rise_settled = per_model_settled(groups, rise_stat(1), (0.0,),
                                                             stream(*labels, T, "rise"))
        # a target whose interval ends within its Monte Carlo error of 0 is not counted either way
        testable = rise_settled and settled and interval(rise_reps)[0] > 0
        out.append(dict(target=T, gap=gap, reps=reps, own=own, rise=rise, rise_reps=rise_reps,
                        testable=testable, passes=testable and interval(reps)[0] > 0,
                        depth=float(np.mean([np.sum(s) / np.sum(n) for _, s, n, *_ in groups])),
                        keys=[points(r, mode)[T] for r in models],
                        saved=[saved(g, 1) for g in groups]))
    return out


def verdict(entering, trained, targets, pilot=False):
    """Rules 3, 5 and 1: fewer than MIN_MODELS entering models: untested (no ladder; in the pilot
    when a scope's pilot was all it trained and none of its models entered: the scope stopped there);
    else untested (saturated) where at most half the targets are testable, yes where more than half of
    the testable ones pass, no otherwise."""
    if not entering and pilot:
        return f"untested (no ladder in the pilot: 0 of {trained} models)"
    if len(entering) < MIN_MODELS:
        return f"untested (no ladder: {len(entering)} of {trained} models)"
    testable = sum(t["testable"] for t in targets)
    if testable <= len(targets) / 2:
        return "untested (saturated)"
    return "yes" if sum(t["passes"] for t in targets) > testable / 2 else "no"


# rule 6: the branch-offs of the entering models (lab/ladder.py's BRANCHES), as their rows name them
BRANCHES = {"ra-direct": "after ragged-aware training (direct, 500 steps)",
            "cont-dense": "after 500 dense steps (RA's control)",
            "cont-dense-order2": "after 500 dense steps on another data order (the noise floor)"}


def branch_of(run):
    """The branch kind a run's name ends with (rule 6), or None for a model trained from scratch."""
    return next((b for b in sorted(BRANCHES, key=len, reverse=True) if run["name"].endswith("-" + b)), None)


def claim_rows(R):
    """The ladder's rows for RESULTS.md: per scope, who enters (rules 2-3), then rule 1 for each mode
    (rules 4-7) over the entering models; then the same for the ragged-aware branches and their dense
    control (rule 6), beside one row of who enters among all three branch kinds."""
    out = []
    for scope in ("local", "global"):
        runs = [r for r in R.values() if scope_of(r) == scope and branch_of(r) is None]
        if runs:
            out += group_rows(runs, scope, "", pilot=len(runs) <= PILOT_SEEDS)
        kids = {b: [r for r in R.values() if scope_of(r) == scope and branch_of(r) == b] for b in BRANCHES}
        if not any(kids.values()):
            continue
        gates = {b: [entry(r)[0] for r in k] for b, k in kids.items()}
        out.append(row(f"The ladder after 500 more steps: models that climb it: {scope}", "Fig. 1, §5",
                       "rules 2-3 and 6 (lab/ladder.py) on each branch-off of an entering model",
                       "; ".join(f"{b}: {sum(g)} of {len(g)} enter" for b, g in gates.items()),
                       " | ".join(entry_cell(r, scope) for k in kids.values() for r in k),
                       verdict=", ".join(f"{sum(g)} of {len(g)}" for g in gates.values()),
                       runs=[r for k in kids.values() for r in k]))
        for b in ("ra-direct", "cont-dense"):
            if kids[b]:
                out += group_rows(kids[b], scope, f" {BRANCHES[b]}")[1:]
    return out


def entry_cell(run, scope):
    """One model's entry numbers: each loop's gain with its interval, its KL to the prior (global)."""
    ok, steps, kl = entry(run)
    return (f"{run['name']}: " + ", ".join(f"fixed@{d + 1} − fixed@{d} {v:.2f} [{lo:.2f}, {hi:.2f}]"
                                           for d, v, lo, hi in steps)
            + (f"; KL(π̄ ‖ prior) {kl:.4f}" if scope == "global" else "")
            + (" (enters)" if ok else " (does not enter)"))


def group_rows(runs, scope, label, pilot=False):
    """A group's rows: who enters, then rule 1 for each mode over the entering models."""
    entering = [r for r in runs if entry(r)[0]]
    out = [row(f"The ladder: models that climb it (every loop buys one look-up): {scope}",
               "Fig. 1", "rules 2-3 (lab/ladder.py): on the calibration items, each loop "
               "answers better than the one before, interval excluding 0, for every depth "
               f"(a global model within {KL_ENTRY} of its prior)",
               f"{len(entering)} of {len(runs)} models enter", " | ".join(entry_cell(r, scope) for r in runs),
               verdict=f"{len(entering)} of {len(runs)}", runs=runs)]
    for mode, (name, axis) in MODES.items():
        targets = judge(entering, mode, ("ladder", scope, mode) + ((label,) if label else ())) if entering else []
        out.append(ladder_row(name, axis, f"{scope}{label}", entering, runs, targets, pilot))
    return out


def ladder_row(name, axis, scope, entering, runs, targets, pilot):
    v = verdict(entering, len(runs), targets, pilot)
    cells = [f"target {t['target']}: depth {t['depth']:.2f}, gap {ci(t['gap'], t['reps'], 3)} "
             f"({sign_test(t['own'], 'better')}); envelope rise {ci(t['rise'], t['rise_reps'], 3)}"
             f"{'' if t['testable'] else ' (the envelope does not rise there: not counted)'}; "
             f"{saved_text(t['saved'])}; thresholds {', '.join(t['keys'])}" for t in targets]
    testable, passed = sum(t["testable"] for t in targets), sum(t["passes"] for t in targets)
    here = (f"{len(entering)} of {len(runs)} models enter" + (
        f"; {testable} of {len(targets)} targets testable, {passed} pass" if targets else ""))
    return row(f"{name} past the fixed depths' frontier: the ladder, {scope}", "Fig. 1",
               frontier_rule("accuracy over every scored answer", axis, "models, then judging items")
               + "; operating points: rule 4 of lab/ladder.py (the threshold nearest each target depth "
               "on the calibration items)", here,
               " | ".join(cells) or "no model enters", holds={"yes": True, "no": False}.get(v),
               verdict=v, runs=runs)


def runs_table(R):
    """RESULTS.md's table of the ladder's runs: how each was made and what it cost (each curriculum
    stage's commit and CPU minutes, the measurement's commit), and what it reads."""
    if not R:
        return []
    lines = ["", "### The ladder's runs", "",
             "Each run of `python -m lab.ladder` (rules and stages: lab/ladder.py): its curriculum "
             "stages (k <= 2 to step 1,000, then k <= 4 to step 3,000; a branch-off of rule 6: 500 "
             "steps on k <= 4), the commit and CPU minutes of each, the commit it was measured at, and "
             "its calibration accuracy at fixed@1..4 (every answer of 200 items).", "",
             "| run | stage commits (CPU min) | measured at | fixed@1..4 | KL(π̄ ‖ prior) | enters |",
             "|---|---|---|---|---|---|"]
    for name, r in sorted(R.items()):
        stages = ", ".join(f"{s['commit'][:7]}{'+' if s['dirty'] else ''} ({s['cpu_seconds'] / 60:.0f})"
                           for s in r.get("stages", []))
        F = fixed(r["sets"]["calibration"]).mean(1)
        lines.append(f"| {name} | {stages} | {r['measured']['commit'][:7]}"
                     f"{'+' if r['measured']['dirty'] else ''} | {' / '.join(f'{v:.2f}' for v in F)} | "
                     f"{r['final']['kl_global']:.4f} | {'yes' if entry(r)[0] else 'no'} |")
    return lines


# ----------------------------------------------------------------------------- the figure

def draw(R, path):
    """Fig. 1 in the paper's style, a panel an entering model (and entering RA branch): its
    fixed-depth accuracy at depths 1..U and the operating points of each mode at their depth, with 95%
    intervals over the judging items."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = [r for r in R.values() if entry(r)[0] and branch_of(r) in (None, "ra-direct")]
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(3.2 * len(models), 3.0), squeeze=False)
    for ax, r in zip(axes[0], models):
        F = fixed(r["sets"]["judging"])
        ax.plot(range(1, len(F) + 1), F.mean(1), "k-o", label="fixed@d")
        for mode, marker, label in (("ete", "s", "ETE-Ragged"), ("dense_ragged", "^", "Dense-Ragged"),
                                    ("gate_free", "x", "gate-free (KL)")):
            xs, ys, err = [], [], []
            for key in dict.fromkeys(points(r, mode).values()):
                q, s, n, *_ = units(r, mode, key)
                _, reps = replicates([(q,)], seed=stream("ladder-figure", r["name"], mode, key))
                lo, hi = interval(reps)
                xs.append(s.sum() / n.sum())
                ys.append(q.mean())
                err.append((q.mean() - lo, hi - q.mean()))
            ax.errorbar(xs, ys, yerr=np.array(err).T, fmt=marker, label=label)
        ax.set_title(r["name"], fontsize=8)
        ax.set_xlabel("mean depth")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("answers right")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report writes its rows into RESULTS.md")

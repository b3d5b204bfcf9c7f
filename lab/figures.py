"""
The figures of lab/reproduce.py's RESULTS.md, drawn from the runs' result.json files: the loss-depth
frontier (Figure 1), exit fractions (Figure 4), exit traces (Figure 12), training curves (Figures 5
and 7), exits by difficulty, and the graded task per k with its compute-matched frontier.
Needs the optional matplotlib.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.figures ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import os

import numpy as np

from lab.claims import POINTER_TASKS, THRS, branch_runs, deepest, rollouts
from lab.difficulty import graded_runs
from lab.stats import replicates

COLORS = {"local": "tab:blue", "global": "tab:red"}


def draw(results, out, seeds):
    """The PNG figures; returns [(file, caption)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    R = {r["name"]: r for r in results}
    fig_dir = os.path.join(out, "figures")
    os.makedirs(fig_dir, exist_ok=True)
    s0 = seeds[0]
    pair = [(R.get(f"syn-{s}-poisson-s{s0}"), s) for s in ("local", "global")]
    tasks = [[(R.get(f"{prefix}-{s}-poisson-s{s0}"), s) for s in ("local", "global")]
             for prefix, _ in POINTER_TASKS.values()]
    made = []
    figures = ([(figure_frontier, pair), (figure_fractions, pair), (figure_trace, pair)]
               + [(figure_trace, task) for task in tasks]
               + [(figure_curves, pair), (figure_flat_beta, pair), (figure_difficulty, pair),
                  (figure_graded, pair)])
    for figure, runs in figures:
        drawn = figure(plt, R, runs, s0)
        if drawn:
            fig, name, caption = drawn
            fig.tight_layout()
            fig.savefig(os.path.join(fig_dir, name), dpi=110)
            plt.close(fig)
            made.append((name, caption))
    return made


def figure_frontier(plt, R, pair, s0):
    """Figure 1: loss vs average depth, fixed depths against ragged thresholds."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, s in pair + [(R.get(f"syn-global-poisson-s{s0}-ra-direct"), "global + RA direct")]:
        if not r:
            continue
        f, col = r["final"], COLORS.get(s, "tab:green")
        U = len(f["val_loss_fixed"])
        ax.plot(range(1, U + 1), f["val_loss_fixed"], "o--", color=col, alpha=0.6,
                label=f"{s}: fixed@k")
        pts = sorted((f["ragged_depth"][str(t)], f["val_loss_ragged"][str(t)]) for t in THRS)
        ax.plot(*zip(*pts), "s-", color=col, label=f"{s}: ETE-Ragged τ ∈ {{0.2..0.7}}")
    ax.set(xlabel="average exit depth", ylabel="val loss (nats/token)", title="Poisson prior, "
           "synthetic")
    ax.legend(fontsize=7)
    return fig, "frontier.png", "Loss against average depth: fixed depths and ragged thresholds (Figure 1)"


def figure_fractions(plt, R, pair, s0):
    """Figure 4: exit fractions, local vs global, per prior."""
    priors = ["uniform", "geometric", "poisson"]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3), sharey=True)
    for ax, prior in zip(axes, priors):
        for j, s in enumerate(("local", "global")):
            r = R.get(f"syn-{s}-{prior}-s{s0}")
            if r:
                fr = r["final"]["exit_fractions"]
                ax.bar(np.arange(1, len(fr) + 1) + (j - 0.5) * 0.38, fr, 0.38,
                       color=COLORS[s], label=s)
        ax.set(title=prior, xlabel="exit depth")
    axes[0].set_ylabel("fraction of tokens (τ = 0.5)")
    axes[0].legend()
    return fig, "exit_fractions.png", "Exit-depth fractions, local vs global enforcement (Figure 4)"


def figure_trace(plt, R, pair, s0):
    """Figure 12: exit depth along a held-out synthetic stretch, hard tokens marked."""
    traces = [(r["trace"], s) for r, s in pair if r and r.get("trace")]
    if traces:
        fig, axes = plt.subplots(len(traces), 1, figsize=(14, 2.4 * len(traces)), squeeze=False)
        for ax, (tr, s) in zip(axes[:, 0], traces):
            x = np.arange(len(tr["exits"]))
            ax.step(x, tr["exits"], where="mid", color=COLORS[s])
            hard = [i for i, l in enumerate(tr["labels"]) if l > 0]
            ax.scatter(hard, [tr["exits"][i] for i in hard], color="black", zorder=3, s=18,
                       label="hard token (label > 0)")
            ax.set_xticks(x)
            ax.set_xticklabels([t if t.strip() else "·" for t in tr["tokens"]], fontsize=6,
                               family="monospace")
            ax.set(ylabel="exit depth", yticks=range(1, 5),
                   title=f"{s} enforcement: the depth that predicted each token (τ = {tr['thr']})")
            ax.legend(fontsize=7, loc="upper right")
        data = next(r for r, _ in pair if r)["data"]
        if data in POINTER_TASKS:
            return fig, f"exit_trace_{data}.png", f"Exit depth along a held-out {data}-task sequence, answers marked"
        return fig, "exit_trace.png", "Exit depth along a held-out synthetic sequence, hard tokens marked (Figure 12)"


def figure_curves(plt, R, pair, s0):
    """Figure 5 (and 7): training curves, the ragged-aware branch and its dense control after the
    global parent, and the loss gain of loops 2..U over loop 1 (what a collapse to depth 1
    removes)."""
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(14, 3.6))
    runs = pair + [(R.get(f"syn-{s}-poisson-s{s0}-flatbeta"), f"{s}, flat β=0.1")
                   for s in ("global", "local")]
    for r, s in runs:
        if not r:
            continue
        col = COLORS.get(s, "tab:orange" if s.startswith("global") else "tab:purple")
        late = r["curve"][1:]   # the untrained model's loss would flatten everything after it
        toks = [p["tokens"] for p in late]
        a1.plot(toks, [p["val_loss_fixed"][-1] for p in late], "--", color=col,
                label=f"{s}: fixed@U")
        a1.plot(toks, [p["val_loss_ragged"]["0.5"] for p in late], "-", color=col,
                label=f"{s}: ragged@0.5")
        a2.plot([p["tokens"] for p in r["curve"]], [p["avg_exit_depth"] for p in r["curve"]], "-",
                color=col, label=s)
        a3.plot(toks, [p["val_loss_fixed"][0] - min(p["val_loss_fixed"][1:]) for p in late], "-",
                color=col, label=s)
    parent = R.get(f"syn-global-poisson-s{s0}")
    branches = (("ra-direct", "-", "global + RA direct"),
                ("cont-dense", ":", "global, dense continuation"))
    for name, style, label in branches:
        r = R.get(f"syn-global-poisson-s{s0}-{name}")
        if r and parent:      # a branch's tokens count from its parent's end
            start = parent["curve"][-1]["tokens"]
            a1.plot([start + p["tokens"] for p in r["curve"]],
                    [p["val_loss_ragged"]["0.5"] for p in r["curve"]], style,
                    color="tab:green", label=f"{label}: ragged@0.5")
    a1.set(xlabel="tokens", ylabel="val loss (nats/token, from the second eval)")
    a2.set(xlabel="tokens", ylabel="average exit depth (τ = 0.5)")
    a3.set(xlabel="tokens", ylabel="loss gain of loops 2..U over loop 1")
    for ax in (a1, a2, a3):
        ax.legend(fontsize=7)
    caption = ("Training curves, Poisson prior: loss, average exit depth, and what loops 2..U gain "
               "over loop 1, with a flat β and the ragged-aware branch (Figures 5, 7)")
    return fig, "training_curves.png", caption


def figure_flat_beta(plt, R, pair, s0):
    """Figure 7 over the training: at each evaluation, what loops 2..U gain over loop 1 with a flat
    β over what they gain with the schedule, each seed a line, per scope (below 1/2: a collapse)."""
    gain = lambda c: c["val_loss_fixed"][0] - min(c["val_loss_fixed"][1:])
    pairs = {s: [(f, R.get(f["name"].rsplit("-flatbeta", 1)[0]))
                 for f in branch_runs(R, "synthetic", s, "flatbeta")]
             for s in ("global", "local")}
    if not any(pairs.values()):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, ps in pairs.items():
        for f, sched in (p for p in ps if p[1]):
            its = [c["iter"] for c in f["curve"][1:]]
            ax.plot(its, [gain(a) / gain(b) for a, b in zip(f["curve"][1:], sched["curve"][1:])],
                    "-o", ms=3, color=COLORS[s], alpha=0.7, label=f"{s} KL" if f is ps[0][0]
                    else None)
    ax.axhline(0.5, color="gray", ls=":", label="1/2: a collapse")
    ax.set(xlabel="iteration", ylabel="gain of loops 2..U, flat β / schedule", yscale="log")
    ax.legend(fontsize=7)
    return fig, "flat_beta.png", "Flat β against the App. B schedule over the training, each seed a line (Figure 7)"


def figure_graded(plt, R, pair, s0):
    """The graded task: the answer's exit depth and the accuracy at the exit per k, local against
    global at each τ (seed means; bars: 95% intervals over seeds and items), fixed@k's accuracy
    beside."""
    runs = {s: [r["builtin"] for r in graded_runs(R, s)] for s in ("local", "global")}
    if not all(runs.values()):
        return None
    levels = sorted(int(k) for k in runs["global"][0]["fixed@1"])
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 3.8))
    for s, suites in runs.items():
        for j, t in enumerate(sorted(THRS)):
            for ax, key in ((a1, "answer_depth"), (a2, "correct")):
                points = [replicates([(rollouts(b, f"ete_ragged@{t}", k, key),) for b in suites], n=500)
                          for k in levels]
                mid = [p for p, _ in points]
                err = np.abs(np.array([np.percentile(r, [2.5, 97.5]) for _, r in points]).T - mid)
                ax.errorbar(np.array(levels) + (j - 1.5) * 0.06 + (0.25 if s == "global" else 0),
                            mid, yerr=err,
                            fmt="o-" if s == "global" else "s--", color=COLORS[s],
                            alpha=0.4 + 0.15 * j, ms=3, label=f"{s} τ {t}")
    fixed = [np.mean([rollouts(b, f"fixed@{k}", k, "correct").mean() for s in runs for b in runs[s]]) for k in levels]
    a2.plot(levels, fixed, "k^:", label="fixed@k on k look-ups")
    a1.plot(levels, levels, "k:", label="depth = k")
    a1.set(xlabel="k (look-ups the queried chain needs)", ylabel="exit depth at the answer",
           xticks=levels)
    a2.set(xlabel="k", ylabel="accuracy at the exit", xticks=levels, ylim=(0, 1.05))
    a1.legend(fontsize=6, ncol=2)
    a2.legend(fontsize=6, ncol=2)
    compute_frontier(a3, R, runs, levels)
    return fig, "graded_by_k.png", ("The graded task: answer depth and accuracy per hidden k, "
                                    "local vs global, per τ; accuracy against compute (Σ e over "
                                    "the item), every k together")


def compute_frontier(ax, R, runs, levels):
    """Accuracy against the loops spent on the whole item (Σ e), every k pooled: each fixed depth as
    a curve per scope, ETE-Ragged at each τ as points, and after ragged-aware training (the direct
    branches). Seeds and items pooled; the intervals are in RESULTS.md."""
    pool = lambda suites, mode, key: np.concatenate([rollouts(b, mode, k, key) for b in suites
                                                     for k in levels])
    for s, suites in runs.items():
        ra = [r["builtin"] for n, r in sorted(R.items()) if n.startswith(f"grd-{s}-poisson-s")
              and n.endswith("-ra-direct") and r.get("builtin")]
        for label, group, marker in ((s, suites, "o"), (f"{s} + RA", ra, "*")):
            if not group:
                continue
            spend = lambda mode: (pool(group, mode, "sum_exits").mean(),
                                  pool(group, mode, "correct").mean())
            if marker == "o":
                fx = [spend(f"fixed@{d}") for d in range(1, deepest(group[0]) + 1)]
                ax.plot(*zip(*fx), "^:", color=COLORS[s], label=f"{s}: fixed@1..U")
            ete = [spend(f"ete_ragged@{t}") for t in sorted(THRS)]
            ax.plot(*zip(*ete), marker, color=COLORS[s], ms=7 if marker == "*" else 4, ls="none",
                    label=f"{label}: ETE-Ragged τ {' / '.join(map(str, sorted(THRS)))}")
    ax.set(xlabel="Σ e over the item (loops, prompt and answer)", ylabel="accuracy, every k",
           ylim=(0, 1.05))
    ax.legend(fontsize=6)


def figure_difficulty(plt, R, pair, s0):
    """Exits by difficulty, local vs global."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, (r, s) in enumerate(pair):
        if r and r["final"].get("depth_by_difficulty"):
            by = r["final"]["depth_by_difficulty"]
            ys = [by[str(k)] if by.get(str(k)) is not None else np.nan for k in range(5)]
            ax.bar(np.arange(5) + (j - 0.5) * 0.38, ys, 0.38, color=COLORS[s], label=s)
    ax.set(xticks=range(5), xticklabels=["unlabelled", "1", "2", "3", "4"], xlabel="difficulty of "
           "the next token", ylabel="mean exit depth (τ = 0.5)")
    ax.legend()
    return fig, "depth_by_difficulty.png", "Mean exit depth before a token, by its difficulty, local vs global"


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report draws them")

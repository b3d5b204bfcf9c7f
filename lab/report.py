"""
RESULTS.md from the grid's finished runs: the paper's claims in one table (claim, the paper's figure,
the number here with its interval and seeds, the verdict), then each claim's numbers and rule, the
graded tasks per k and against compute, the interpretation (results/notes.md), every run, the figures.

lab/reproduce.py writes it after its runs (and alone with --report); lab/claims.py and
lab/difficulty.py compute the rows, which claims() puts in the report's order.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.report ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import os

import numpy as np

from lab.claims import (QUICK, THRS, base_runs, deepest, every_k, flat_beta_claims, frontier_claims,
                        jump_claims, levels_of, position_exits, ra_claims, rollouts)
from lab import ladder_claims
from lab.difficulty import difficulty_claims, graded_runs, need_claims, pointer_claims
from lab.stats import ci, replicates

COLUMNS = ["run", "data", "objective", "seed", "fixed@1..U", "ragged@0.2/0.3/0.5/0.7",
           "depth@0.2/0.3/0.5/0.7",
           "avg depth", "exit fractions", "J0..J3", "large jumps", "KL(π̄‖prior)",
           "depth by difficulty 1..4", "Spearman", "train (min)"]
EVERY_RUN = ("Each run's own last evaluation in training: its val batches are drawn from its seed, "
             "so two runs of other seeds (a -cont-dense-order2 control and its -cont-dense) see "
             "other batches here; the claims above read the held-out windows that every run of a "
             "dataset shares.")


def claims(results, judged=True):
    """Every claim's row (row()), in the report's order. judged=False (a --quick grid of toy
    models): the numbers without verdicts."""
    R = {r["name"]: r for r in results}
    out = (frontier_claims(R) + jump_claims(R) + ra_claims(R) + flat_beta_claims(R) + difficulty_claims(R)
           + pointer_claims(R) + need_claims(R))
    out = out if judged else [dict(c, holds=None, verdict=QUICK) for c in out]
    return [dict(c, reruns=rerun_note(R, c),
                 untraced=[n for n in c["runs"] if not R[n].get("provenance")])
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


def claims_table(rows):
    """The one-screen table: a line a claim, each cell short (the details follow it)."""
    verdict = lambda c: "**no**" if c["holds"] is False else c["verdict"]
    # |exit − need| inside a cell, not a new cell
    cell = lambda text: text.replace("|", "\\|")
    lines = ["| claim | paper | here: 95% interval (seeds) | verdict |", "|---|---|---|---|"]
    # a claim's marks, and what each means
    keys = {"reruns": "† a run behind it was trained twice with the same settings "
            "and moved: see its details.",
            "untraced": "‡ a run behind it records no provenance (trained before result.json kept "
                        "how a run was made): see its details."}
    marks = lambda c: "".join(" " + text[0] for key, text in keys.items() if c[key])
    lines += [f"| {c['claim']} | {c['paper']} | {cell(c['here'])} | {verdict(c)}{marks(c)} |"
              for c in rows]
    # only the marks used
    legend = " ".join(text for key, text in keys.items() if any(c[key] for c in rows))
    return lines + (["", legend] if legend else [])


def claim_details(rows):
    """Per claim: the rule, every number behind the verdict, how far reruns moved, and which of its
    runs record no provenance."""
    lines = ["## Each claim", ""]
    for c in rows:
        notes = ([c["reruns"][0].upper() + c["reruns"][1:]] if c["reruns"] else []) + \
            ([f"Runs that record no provenance: {', '.join(c['untraced'])}"]
             if c["untraced"] else [])
        lines += [f"**{c['claim']}** ({c['paper']}). Rule: {c['rule']}. Verdict: {c['verdict']}.", "",
                  c["numbers"] + "".join(f". {n}" for n in notes) + ("." if notes else ""), ""]
    return lines


def graded_tables(R):
    """Markdown: the graded task per k (answer depth, P(exit >= k), accuracy at the exit, Σ e over
    the item, each with its interval), and accuracy against compute for every fixed depth and
    threshold, local and global, and after ragged-aware training. [] without graded runs."""
    models = [(s, graded_runs(R, s)) for s in ("local", "global")]
    models += [(f"{s} {kind}", [r for n, r in sorted(R.items())
                                if n.startswith(f"grd-{s}-poisson-s")
                                and n.endswith(kind) and r.get("builtin")])
               for s in ("local", "global") for kind in ("ra-direct", "cont-dense")]
    models = [(m, [r["builtin"] for r in rs]) for m, rs in models if rs]
    if not models:
        return []
    U = deepest(models[0][1][0])
    levels = sorted({int(k) for k in models[0][1][0]["fixed@1"]})
    stat = lambda suites, mode, k, key: replicates([(rollouts(b, mode, k, key),) for b in suites])
    lines = ["## The graded task, per k", "",
             "Held-out items of the builtin graded suite, greedy; each value with its 95% interval "
             "(seeds, then items, resampled). Answer depth: the exit depth of the position that "
             "produced the answer; Σ e: the exit depths summed over every position the item ran "
             "(its prompt; the answer is sampled at its last position).", "",
             "| model | mode | k | answer depth | P(exit ≥ k) | accuracy at the "
             "exit | Σ e over the item |", "|---|---|---|---|---|---|---|"]
    for m, suites in models:
        for t in (THRS if m in ("local", "global") else [0.5]):
            mode = f"ete_ragged@{t}"
            for k in levels:
                if rollouts(suites[0], mode, k, "answer_depth") is None:
                    continue
                reach = replicates([(rollouts(b, mode, k, "answer_depth") >= k,) for b in suites])
                depth, right = stat(suites, mode, k, "answer_depth"), stat(suites, mode, k, "correct")
                spent = replicates([(position_exits(b, mode, k, "item")[0],) for b in suites])
                lines.append(f"| {m} | {mode} | {k} | {ci(*depth)} | {ci(*reach)} | {ci(*right)} | "
                             f"{ci(*spent, 1)} |")
    return lines + [""] + compute_table("graded", models, U) + [""]


def compute_table(data, models, U):
    """Markdown: accuracy against compute for every fixed depth and ragged mode of a look-up task,
    every k together: the answer's accuracy (and, on an answer of several tokens, the share of its
    tokens right), the depth that produced its first token, the decode's mean depth and the whole
    item's (Σ e / tokens: rule 1's axes), each with its 95% interval (seeds, then items,
    resampled)."""
    first = models[0][1][0]
    multi = "token_right" in first["fixed@1"][levels_of(first)[0]]["rollouts"]
    lines = [f"Accuracy against compute on the {data} task, every k together: the answer's accuracy"
             + (", the share of its tokens right" if multi else "") + ", the depth of its first "
             "token, the decode's and the whole item's mean depth (Σ e / tokens).", "",
             "| model | mode | accuracy |" + (" tokens right |" if multi else "") + " answer depth "
             "| decode depth | "
             "item depth |", "|---|---|---|" + ("---|" if multi else "") + "---|---|---|"]
    for m, suites in models:
        for mode in [f"fixed@{d}" for d in range(1, U + 1)] + [f"{r}@{t}" for r in ("ete_ragged", "dense_ragged")
                                                                for t in sorted(THRS)]:
            if any(mode not in b or rollouts(b, mode, levels_of(b)[0], "correct") is None
                   for b in suites):
                continue
            mean = lambda key: ci(*replicates([(every_k(b, mode, key),) for b in suites]))
            depth = lambda part: ci(*replicates([tuple(np.concatenate(x) for x in zip(*(
                position_exits(b, mode, k, part) for k in levels_of(b)))) for b in suites],
                                                np.divide))
            right = [mean_tokens(b, mode) for b in suites] if multi else None
            lines.append(f"| {m} | {mode} | {mean('correct')} | "
                         + (f"{ci(*replicates([(x,) for x in right]))} | " if multi else "")
                         + f"{mean('answer_depth')} | {depth('decode') if multi else '–'} | "
                         f"{depth('item')} |")
    return lines


def mean_tokens(suite, mode):
    """Per rollout of an answer of several tokens: the share of its tokens right."""
    return np.concatenate([[np.mean(t) for t in suite[mode][k]["rollouts"]["token_right"]]
                           for k in levels_of(suite)])


def multi_tables(R):
    """Markdown: the graded task answered in turn (a decode of several tokens), accuracy against
    compute per scope. [] without its runs."""
    models = [(s, [r["builtin"] for r in base_runs(R, "graded_multi", s) if r.get("builtin")])
              for s in ("local", "global")]
    models = [(m, b) for m, b in models if b]
    if not models:
        return []
    return ["## The graded task answered in turn (a decode of several tokens)", ""] + \
        compute_table("graded_multi", models, deepest(models[0][1][0])) + [""]


def table_rows(results):
    rows = []
    for r in results:
        f = r["final"]
        obj = f"{r['scope']} KL, {r['prior']}" + (f", RA {r['ra']}" if r.get("ra") else "") + \
              (", dense continuation" if r.get("parent") and not r.get("ra") else "") + \
              (f", flat β={r['beta']}" if r.get("beta") else "")
        fmt = lambda xs, p=3: " / ".join(f"{x:.{p}f}" for x in xs)
        by = f.get("depth_by_difficulty")
        by_k = fmt([by[str(k)] if by.get(str(k)) is not None else float("nan") for k in range(1, 5)], 2) if by else "–"
        rho = f.get("difficulty_spearman")
        cost = r.get("provenance", {}).get("train_seconds")
        rows.append([r["name"], r["data"], obj, str(r["seed"]), fmt(f["val_loss_fixed"]),
                     fmt([f["val_loss_ragged"][str(t)] for t in (0.2, 0.3, 0.5, 0.7)]),
                     fmt([f["ragged_depth"][str(t)] for t in (0.2, 0.3, 0.5, 0.7)], 2),
                     f"{f['avg_exit_depth']:.2f}",
                     fmt(f["exit_fractions"], 2), fmt(f["jump_rates"], 2),
                     f"{100 * f['large_jump_rate']:.1f}%",
                     f"{f['kl_global']:.4f}", by_k, "–" if rho is None else f"{rho:.3f}",
                     "–" if cost is None else f"{cost / 60:.0f}"])
    return rows


def write_results(results, out, size, setup, figures, notes=None):
    """RESULTS.md in `out`: setup, a sentence on how the grid trains; notes, a person's reading of
    the runs (results/notes.md), or None. With the full grid, the ladder's rows too (lab/ladder.py's
    runs in out/ladder, judged by lab/ladder_claims.py)."""
    ladder = ladder_claims.load(os.path.join(out, "ladder")) if size == "full" else {}
    rows = claims(results, judged=size == "full") + [
        dict(c, reruns="", untraced=[]) for c in ladder_claims.claim_rows(ladder)]
    lines = [f"# Reproducing the paper at CPU scale ({size})", "", setup, "", "## The paper's "
             "claims, checked", "",
             "Each verdict follows its rule from the numbers: 95% bootstrap intervals draw the "
             "trained models (seeds), "
             "then the units of each (held-out windows or builtin items), with a test over the "
             "models beside. Rules "
             "and numbers: below the table." if size == "full" else "A --quick grid trains toy "
             "models for a few steps to test the pipeline: its numbers judge no claim, and no row "
             "has a verdict.", ""]
    R = {r["name"]: r for r in results}
    lines += claims_table(rows) + [""] + claim_details(rows) + graded_tables(R) + multi_tables(R)
    lines += ladder_claims.runs_table(ladder)
    if notes:
        lines += ["", notes.strip()]
    lines += ["", "## Every run", "", EVERY_RUN, "", "| " + " | ".join(COLUMNS) + " |",
              "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    if figures:
        lines += ["", "## Figures", ""]
        for name, caption in figures:
            lines += [f"**{caption}**", "", f"![{caption}](figures/{name})", ""]
    with open(os.path.join(out, "RESULTS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.reproduce --full --report writes RESULTS.md")

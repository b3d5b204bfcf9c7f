"""
Reproduce the paper's findings at CPU scale: one grid of training runs, then RESULTS.md with the
tables and the plots (Figures 1, 4, 5, 7, 12 style) and an honest check of each claim (lab/claims.py).

    python -m lab.reproduce --quick                                        # the whole grid, tiny: a couple of minutes
    python -m lab.reproduce --full --input=PATH/tinyshakespeare.txt   # the real figures: ~22 min a run (hops ~45)
    python -m lab.reproduce --full --only=grd-global-poisson-s1337    # one run (and its parents), then the report
    python -m lab.reproduce --full --report                           # RESULTS.md from the finished runs, no training

The grid (fixed seeds; every run of one seed sees the same data in the same order):
  - local vs global prior enforcement (Eq. 9 vs Eq. 10) x uniform, geometric and Poisson priors;
    the local/global Poisson pair with --seeds seeds;
  - ragged-aware branch-offs (direct, counterfactual, REINFORCE K=4; App. C) from the finished local
    and global Poisson runs, each into its own folder (the parent stays untouched), and as a control
    the same continuation with the dense objective (RA or just more training?), twice: on the RA
    run's data order and on another (-cont-dense-order2), whose difference is the noise floor that
    sets the RA verdicts' margins;
  - a flat β = 0.1 from the start against the App. B schedule (Figure 7), global and local Poisson;
  - synthetic data (difficulty labels) for the whole grid, shakespeare_char for the local/global
    Poisson pair, on the first 3 seeds (--input, a local copy of tiny shakespeare);
  - the pointer task (k look-ups that can only start once the query is read): local vs global with
    the Poisson and the uniform prior (the best global run of the synthetic grid), --seeds seeds
    each, with the builtin pointer suite's accuracy and answer depth per k at fixed@1..U and
    ETE-Ragged (greedy);
  - the same on the hops task (the pointer items with one token per fact, one and two look-ups),
    with a block of one layer, 256 wide: the smallest setting found where depth buys accuracy (a
    look-up a loop); ragged-aware (direct) and the dense continuation from the first 3 seeds' runs;
  - the graded task (hops facts, every item one chain of each length 1..4, two queries each labelled
    with its chain's length: the difficulty is hidden until the chain is followed), the hops model,
    local vs global with the Poisson prior, 5 seeds each; ragged-aware (direct) and the dense
    continuations from every seed's runs. Reported per k, with bootstrap intervals: the answer's
    exit depth, P(exit >= k), accuracy at the exit, Σ e over the item, and accuracy against compute
    for every fixed depth and threshold;
  - the graded task with every chain answered in turn (graded_multi: an answer of four tokens, a
    decode, each digit its own k), the hops model, local vs global with the Poisson prior, --seeds
    seeds: accuracy against the decode depth and the whole item's (Fig. 1's decode regime).
Resumable: a run whose result.json exists is skipped, one with a checkpoint resumes. Results go to
--out (checkpoints, logs, result.json per run; RESULTS.md and figures/*.png at the top).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.reproduce ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from lab import eval as eval_suite
import prepare_data
import train
from checkpoint import load_checkpoint, write_json
from lab.claims import GRADED_SEEDS, MAX_K, POINTER_TASKS, RA_METHODS, TASK_PRIORS, THRS
from configurator import (SEED_RULE, THREADS_RULE, UserError, check_writable, parse, run_cli,
                         set_threads, split_list)
from lab import ladder_claims
from lab.figures import draw
from lab.report import write_results
from model import forward_ragged
from tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))      # the project's root

DEFAULTS = dict(
    quick=False,           # a tiny version of the whole grid (CI smoke test: a couple of minutes)
    full=False,            # the real figures: 18-24 minutes a run, two at a time on 2 CPU cores (hops 30-48)
    out="",                # runs, RESULTS.md, figures/ ("": results/ with --full, results-quick/ with --quick)
    input="",              # tiny shakespeare, a local copy (empty: download it; --quick: a stand-in text)
    seeds=3,               # seeds of the Poisson pairs, the pointer and hops runs (geometric, syn. uniform: the first)
    seed=1337,             # the first seed
    only="",               # comma-separated run names: run just these (their parents too)
    plots=True,            # draw figures/*.png (needs matplotlib)
    report=False,          # write RESULTS.md and the figures from the runs finished in --out; train nothing
    threads=1,             # torch threads (1: two runs side by side on 2 cores, as the grid is run; 0: torch's own)
)
RULES = dict(seeds=">= 1", seed=SEED_RULE, threads=THREADS_RULE)

# model and budget per size: tokens per run = max_iters x batch_size x block_size
SIZES = {
    "quick": dict(base=["--n_layer=1", "--n_head=2", "--n_kv_head=2", "--n_embd=32",
                        "--ffn_hidden=64", "--block_size=32",
                        "--batch_size=8", "--max_iters=16", "--eval_interval=16", "--eval_iters=2",
                        "--warmup_iters=4",
                        "--log_interval=4"], branch_iters=6, synthetic_chars=120_000,
                  pointer_items=2,
                  data_args={"pointer": ["--block_size=64"]},   # a k = 4 pointer item's prompt is 53 characters
                  task_seeds=1, branch_seeds=1, windows=16),
    "full": dict(base=["--block_size=128", "--batch_size=16", "--max_iters=2500",
                       "--eval_interval=250", "--eval_iters=10", "--warmup_iters=100",
                       "--log_interval=25"],
                 branch_iters=500, synthetic_chars=5_000_000, pointer_items=50,
                 # hops: one layer of width 256 (8 heads), where a loop learns one look-up (L=2,
                 # d=128 learns two in its first loop and none in the next), the peak learning rate
                 # held for 2,000 steps (a look-up that continues in the next loop is learned late,
                 # in a jump: results/notes.md)
                 data_args={"hops": ["--n_layer=1", "--n_embd=256", "--n_head=8", "--n_kv_head=8",
                                     "--ffn_hidden=704",
                                     "--learning_rate=1.5e-3", "--max_iters=3000",
                                     "--lr_decay_start=2000", "--eval_interval=500"]},
                 task_seeds=GRADED_SEEDS,    # seeds of each graded-task run (its verdict's minimum)
                 branch_seeds=3,  # parents of the ragged-aware branches and of flat β: the first seeds
                 windows=160),    # held-out windows per run that the claims' intervals resample
}
for data in ("graded", "graded_multi"):      # the hops model: a look-up a loop
    SIZES["full"]["data_args"][data] = SIZES["full"]["data_args"]["hops"]


# ----------------------------------------------------------------------------- the grid

def size_of(c):
    return "quick" if c["quick"] else "full"


def grid(c):
    """Every run: name -> dict(data, args for train.py, parent). The Poisson pairs and the graded runs
    have several seeds; the ragged-aware branches (and their dense control) and flat β are run from
    each of the first `branch_seeds` seeds' runs, so that no verdict rests on one trained model."""
    seeds = [c["seed"] + i for i in range(c["seeds"])]
    size = SIZES[size_of(c)]
    parents = seeds[:size["branch_seeds"]]
    graded = [c["seed"] + i for i in range(size["task_seeds"])]    # the graded task's seeds, and its parents
    kl = lambda scope: ["--global_kl"] if scope == "global" else []
    runs = {}

    def branches(prefix, data, scope, seeds_of_parents=parents, **spec):
        for seed in seeds_of_parents:
            base = dict(data=data, scope=scope, prior="poisson", seed=seed, parent=f"{prefix}-{scope}-poisson-s{seed}",
                        **spec)
            # the control: the same continuation with the dense objective, to tell RA from more training
            runs[f"{prefix}-{scope}-poisson-s{seed}-cont-dense"] = dict(
                base, args=["--prior=poisson", f"--seed={seed}"] + kl(scope))
            # the noise floor: that continuation again on another data order, for how much 500 steps move a loss
            runs[f"{prefix}-{scope}-poisson-s{seed}-cont-dense-order2"] = dict(
                base, control="order2", args=["--prior=poisson", f"--seed={seed + ORDER2}"] + kl(scope))
            for method in RA_METHODS[data]:
                ra = [f"--ra_method={method}"] if method != "reinforce4" else [  # REINFORCE with K = 4 samples
                    "--ra_method=reinforce", "--reinforce_k=4"]
                runs[f"{prefix}-{scope}-poisson-s{seed}-ra-{method}"] = dict(
                    base, ra=method, args=["--prior=poisson", f"--seed={seed}", "--ragged_aware"] + ra + kl(scope))
    for scope in ("local", "global"):
        for prior in ("uniform", "geometric", "poisson"):
            for seed in (seeds if prior == "poisson" else seeds[:1]):
                runs[f"syn-{scope}-{prior}-s{seed}"] = dict(data="synthetic", scope=scope, prior=prior, seed=seed,
                                                            args=[f"--prior={prior}", f"--seed={seed}"] + kl(scope))
        branches("syn", "synthetic", scope)
        for seed in parents:                  # real text: the Poisson pair on as many seeds as the branches
            runs[f"shk-{scope}-poisson-s{seed}"] = dict(data="shakespeare", scope=scope, prior="poisson", seed=seed,
                                                        args=["--prior=poisson", f"--seed={seed}"] + kl(scope))
        for data, (prefix, _) in POINTER_TASKS.items():
            task_seeds = graded if data == "graded" else seeds
            for prior in TASK_PRIORS[data]:
                for seed in task_seeds:
                    runs[f"{prefix}-{scope}-{prior}-s{seed}"] = dict(
                        data=data, scope=scope, prior=prior, seed=seed, max_k=MAX_K[data],
                        args=[f"--prior={prior}", f"--seed={seed}"] + kl(scope))
        branches("hop", "hops", scope, max_k=MAX_K["hops"])   # ragged-aware training on the look-up tasks
        branches("grd", "graded", scope, graded, max_k=MAX_K["graded"])
        for seed in parents:                  # Figure 7's flat β (the paper's runs use Ouro's local objective)
            runs[f"syn-{scope}-poisson-s{seed}-flatbeta"] = dict(
                data="synthetic", scope=scope, prior="poisson", seed=seed, beta=0.1,
                args=["--prior=poisson", f"--seed={seed}", "--beta=0.1"] + kl(scope))
    return runs


ORDER2 = 1000     # the noise-floor control's seed offset: the same continuation, another data order


def branch_args(iters):
    """train.py's schedule of a branch-off (App. C): `iters` steps from the parent's weights at a
    low rate (3e-4, decaying to 1e-4 unless --lr_decay_start holds it), no warmup, evaluated
    half-way and at the end."""
    return [f"--max_iters={iters}", f"--eval_interval={max(iters // 2, 1)}", "--warmup_iters=0",
            "--learning_rate=3e-4", "--min_lr=1e-4"]


def prepare(c, size, data_dir):
    """The datasets of the grid, once."""
    if not os.path.isfile(os.path.join(data_dir, "synthetic", "meta.json")):
        prepare_data.prepare(dict(prepare_data.DEFAULTS, data_dir=data_dir,
                                  size=SIZES[size]["synthetic_chars"]))
    for data in POINTER_TASKS:
        if not os.path.isfile(os.path.join(data_dir, data, "meta.json")):
            prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset=data, data_dir=data_dir,
                                      max_k=MAX_K[data], size=SIZES[size]["synthetic_chars"]))
    if not os.path.isfile(os.path.join(data_dir, "shakespeare", "meta.json")):
        src = dict(prepare_data.DEFAULTS, dataset="shakespeare_char", data_dir=data_dir,
                   name="shakespeare", input=c["input"])
        # offline smoke test: a stand-in text of the same kind
        if not c["input"] and size == "quick":
            stand_in = os.path.join(data_dir, "stand_in.txt")
            os.makedirs(data_dir, exist_ok=True)
            with open(stand_in, "w") as f:
                f.write(("ROMEO:\nBut soft, what light through yonder window breaks?\n"
                         "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo?\n") * 400)
            src["input"] = stand_in
        prepare_data.prepare(src)


def run_one(name, spec, c, size, runs):
    """Train one run (or resume it), then save its result.json. Returns the result. A result
    written before results held per-window losses gets them from its checkpoint, where it has one."""
    folder = os.path.join(c["out"], name)
    result_path = os.path.join(folder, "result.json")
    budget, data = SIZES[size], os.path.join(c["out"], "data", spec["data"])
    if os.path.isfile(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if not window_keys(spec) <= set(result.get("windows", {})) and os.path.isfile(os.path.join(folder, "ckpt.pt")):
            result["windows"] = window_losses(folder, data, budget["windows"], labels="labels" in window_keys(spec))
            write_json(result_path, result)
        return result
    args = budget["base"] + budget["data_args"].get(spec["data"], []) + spec["args"] + [
        f"--out_dir={folder}", f"--data_dir={os.path.join(c['out'], 'data')}", f"--dataset={spec['data']}",
        "--eval_thr=" + ",".join(map(str, THRS))]
    if spec.get("parent"):
        args += branch_args(budget["branch_iters"])
    if os.path.isfile(os.path.join(folder, "ckpt.pt")):
        args += ["--init_from=resume"]
    elif spec.get("parent"):
        args += [f"--branch_from={os.path.join(c['out'], spec['parent'])}"]
    print(f"== {name}: python train.py {' '.join(args)}", file=sys.stderr)
    made, started = provenance(), time.time()
    if "--init_from=resume" in args:   # the steps before it ran earlier, perhaps with other code: say from where
        made["resumed_at_iter"] = torch.load(os.path.join(folder, "ckpt.pt"), map_location="cpu",
                                             weights_only=True)["iter_num"]
    train.main(args)
    made["train_seconds"] = round(time.time() - started, 1)
    with open(os.path.join(folder, "log.jsonl")) as f:
        log = [json.loads(line) for line in f]
    evals = [r for r in log if "val_loss_fixed" in r]
    result = dict({k: v for k, v in spec.items() if k != "args"}, name=name, provenance=made, final=evals[-1],
                  curve=[{k: r[k] for k in ("iter", "tokens", "val_loss_fixed", "val_loss_ragged", "avg_exit_depth",
                                            "large_jump_rate", "exit_fractions")} for r in evals])
    result["windows"] = window_losses(folder, data, budget["windows"], labels="labels" in window_keys(spec))
    if spec["data"] != "shakespeare":
        result["trace"] = exit_trace(folder, data)
    earlier = os.path.join(folder, "result.earlier.json")      # a rerun: the result it replaces, moved here
    if os.path.isfile(earlier):
        with open(earlier) as f:
            before = json.load(f)
        result["earlier"] = before.get("earlier", []) + [{k: before[k] for k in ("final", "provenance") if k in before}]
    if spec["data"] in POINTER_TASKS:
        U = len(evals[-1]["val_loss_fixed"])
        items = budget["pointer_items"] * (spec["max_k"] if spec["data"] == "graded_multi" else 1)  # one level: all k
        result["builtin"] = builtin_by_depth(folder, spec["data"], spec["max_k"], items, U)
        if spec["data"] == "graded":    # the depth each k needs, on items held apart from those that judge the exits
            result["builtin_need"] = builtin_by_depth(folder, spec["data"], spec["max_k"], budget["pointer_items"], U,
                                                      seed=NEED_SEED)
    write_json(result_path, result)
    if os.path.isfile(earlier):
        os.remove(earlier)
    return result


def provenance():
    """How a run was made, so that a rerun that differs can be traced: the code's commit (and
    whether the tree had changes) when it started, torch's version, its threads, the CPU (and, once
    it has trained, the training's wall time, and the step it resumed from if it did)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu}


NEED_SEED = 4321      # the graded suite that estimates each k's needed depth (lab/eval.py's default seed judges)


def builtin_by_depth(folder, kind, max_k, per_level, U, seed=None):
    """The builtin suite of a look-up task (lab/eval.py --builtin=kind, k = 1..max_k; seed: another
    draw of items than lab/eval.py's default), greedy: accuracy and the answer's exit depth per k at
    fixed@1..U and ETE- and Dense-Ragged at each τ of THRS. Returns {mode: {k: {items, acc,
    answer_depth}}}."""
    modes = ",".join([f"fixed@{d}" for d in range(1, U + 1)] + [f"{m}@{t}" for m in ("ete_ragged", "dense_ragged")
                                                                for t in THRS])
    # lab/eval.py's one JSON line is not this script's output
    with contextlib.redirect_stdout(sys.stderr):
        runs = eval_suite.main(["--ckpt", folder, f"--builtin={kind}", f"--builtin_max_k={max_k}",
                                f"--builtin_items={per_level}", f"--modes={modes}",
                                "--temperature=0", "--plots=False",
                                f"--out={os.path.join(folder, 'eval')}"]
                               + ([f"--seed={seed}"] if seed is not None else []))
    return {eval_suite.mode_name(r["mode"], r["thr"], r["depth"]): r["by_difficulty"] for r in runs}


def window_keys(spec):
    """What a run's windows hold (a result from before a key existed gets it from its checkpoint)."""
    labelled = {"labels", "label_correct"} if spec["data"] == "synthetic" else set()
    return {"fixed", "shift", "ragged", "depth"} | labelled


@torch.no_grad()
def window_losses(folder, data, n=160, batch=16, labels=False):
    """The units the claims resample (lab/claims.py): n held-out windows of the model's context,
    drawn with a fixed seed, so that every run of a dataset sees the same ones. Per window: the mean
    loss at each fixed depth, how far each loop moves the state (relative), ETE-Ragged's mean loss
    and mean exit depth at each τ of THRS, and with labels (the synthetic data's per-token
    difficulty), per label 0..4 of the predicted token, how many tokens carry it and their exit
    depths summed (τ 0.5), and how many of them each fixed depth predicts right (label_correct:
    label, then depth). The look-up tasks' difficulty is read on their builtin items instead."""
    model, _ = load_checkpoint(folder)
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16).astype(np.int64)
    labels = np.fromfile(os.path.join(data, "val_labels.bin"), dtype=np.uint8).astype(np.int64) if labels else None
    T = model.config.block_size
    starts = np.random.default_rng(0).integers(0, len(val) - T - 1, n)
    out = {"fixed": [], "shift": [], "ragged": {str(t): [] for t in THRS},
           "depth": {str(t): [] for t in THRS}}
    out.update({"labels": [], "label_correct": []} if labels is not None else {})
    r = lambda xs: [round(float(v), 5) for v in xs]
    for i in range(0, n, batch):
        x = torch.tensor(np.stack([val[s:s + T] for s in starts[i:i + batch]]))
        y = torch.tensor(np.stack([val[s + 1:s + T + 1] for s in starts[i:i + batch]]))
        dense = model(x, y, loop_shift=True, keep_logits=labels is not None)
        out["fixed"] += [r(w) for w in dense["losses"].float().mean(1)]            # (windows, U)
        # per label, the tokens each fixed depth predicts right
        if labels is not None:
            # (B, T, U)
            right = torch.stack([logits.argmax(-1) == y for logits in dense["logits"]], -1)
            for s, ok in zip(starts[i:i + batch], right.numpy()):
                lab = labels[s + 1:s + T + 1]
                out["label_correct"].append([ok[lab == k].sum(0).tolist() for k in range(5)])
        out["shift"] += [r(w) for w in dense["loop_shift"].mean(1)]
        for t in THRS:
            rag = forward_ragged(model, x, y, taus=t)
            out["ragged"][str(t)] += r(rag["token_loss"].mean(1))
            out["depth"][str(t)] += r(rag["exits"].double().mean(1))
            # the depth before each label: [tokens, Σ exit depth] per label
            if t == 0.5 and labels is not None:
                for s, e in zip(starts[i:i + batch], rag["exits"].numpy()):
                    lab = labels[s + 1:s + T + 1]
                    out["labels"].append([[int((lab == k).sum()), int(e[lab == k].sum())]
                                          for k in range(5)])
    return out


@torch.no_grad()
def exit_trace(folder, data, n=96, thr=0.5):
    """Figure 12: the exit depth that predicted each token of a held-out synthetic stretch (the
    position before it, ETE-Ragged at τ), with the token and its difficulty label."""
    model, ckpt = load_checkpoint(folder)
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)
    labels = np.fromfile(os.path.join(data, "val_labels.bin"), dtype=np.uint8)
    # a stretch with hard tokens in it
    start = int(np.nonzero(labels[200:])[0][0]) + 200 - n // 3
    ids = torch.tensor(val[start:start + n + 1].astype(np.int64))[None]
    exits = forward_ragged(model, ids[:, :-1], taus=thr)["exits"][0].tolist()
    decode = load_tokenizer(ckpt["meta"])[1]
    return {"tokens": [decode([i]) for i in ids[0, 1:].tolist()], "exits": exits,
            "labels": labels[start + 1:start + n + 1].tolist(), "thr": thr}


# ----------------------------------------------------------------------------- main

def check_size(out, size):
    """A folder holds the runs of one size: --quick never mixes with (nor writes over) --full runs."""
    made = None
    if os.path.isfile(os.path.join(out, "grid.json")):
        with open(os.path.join(out, "grid.json")) as f:
            made = json.load(f).get("size")
    elif os.path.isfile(os.path.join(out, "RESULTS.md")):
        # a folder written before grid.json existed
        with open(os.path.join(out, "RESULTS.md"), encoding="utf-8") as f:
            first = f.readline()
        made = next((s for s in SIZES if f"({s})" in first), None)
    if made is not None and made != size:
        raise UserError(f"--out={out} holds the --{made} grid; --{size} runs go to a folder of "
                        "their own (give another --out)")


def report(c, size, results, missing):
    """RESULTS.md and the figures from the finished runs (the ladder's, in out/ladder, beside them)."""
    seeds = [c["seed"] + i for i in range(c["seeds"])]
    figures = draw(results, c["out"], seeds) if c["plots"] else []
    ladder = ladder_claims.load(os.path.join(c["out"], "ladder")) if size == "full" else {}
    if c["plots"] and ladder and ladder_claims.draw(ladder, os.path.join(c["out"], "figures",
                                                                          "ladder_frontier.png")):
        figures.append(("ladder_frontier.png", "The ladder (lab/ladder.py): each entering model's "
                        "fixed depths and its operating points, accuracy over every answer (Figure 1)"))
    untraced = sum(not r.get("provenance") for r in results)      # trained before result.json recorded it
    setup = (f"Written by `python -m lab.reproduce {'--full' if size == 'full' else '--quick'}`. Every run trains from "
             f"scratch with the same data order for a given seed (`{' '.join(SIZES[size]['base'])}` plus its "
             f"objective); the ragged-aware branch-offs continue from the finished Poisson runs of the first "
             f"{SIZES[size]['branch_seeds']} seed(s) (the graded task's: every seed's) for "
             f"{SIZES[size]['branch_iters']} steps, beside a dense continuation on the same data order and one on "
             "another (the noise floor of their margins). Losses are validation "
             "cross-entropies (nats/token), ragged ones ETE-Ragged teacher-forced; the exit statistics are ETE-Ragged "
             "at τ = 0.5. Each run's result.json records how it was made (commit, torch, threads, CPU, training time)"
             + (f", but for {untraced} run(s) trained before it did (‡ in the claims, no training time below)."
                if untraced else ".")
             + (f" {len(missing)} run(s) of the grid are not finished yet ({', '.join(missing)}): their claims rest on "
                "the runs that are." if missing else ""))
    notes = os.path.join(ROOT, "results", "notes.md")
    with open(notes) if size == "full" and os.path.isfile(notes) else contextlib.nullcontext() as f:
        write_results(results, c["out"], size, setup, figures, f.read() if f else None)
    print(f"wrote {os.path.join(c['out'], 'RESULTS.md')} ({len(results)} runs, {len(figures)} figures)",
          file=sys.stderr)


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    set_threads(c["threads"])
    if c["quick"] == c["full"]:
        raise UserError("give --quick (a smoke test of the grid) or --full (the real figures)")
    size = size_of(c)
    c["out"] = c["out"] or ("results" if size == "full" else "results-quick")
    check_writable(c["out"], "out")
    if c["input"] and not os.path.isfile(c["input"]):
        raise UserError(f"--input={c['input']}: no such file")
    if c["plots"]:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plots needs the optional matplotlib (pip install matplotlib), or give --plots=False")
    runs = grid(c)
    wanted = split_list("only", c["only"]) or list(runs)
    unknown = [n for n in wanted if n not in runs]
    if unknown:
        raise UserError(f"--only: unknown run {unknown[0]!r}; runs: {', '.join(runs)}")
    order = [runs[n]["parent"] for n in wanted if runs[n].get("parent")] + wanted
    check_size(c["out"], size)
    finished = lambda name: os.path.isfile(os.path.join(c["out"], name, "result.json"))
    if c["report"] and not any(finished(n) for n in runs):
        raise UserError(f"--report: --out={c['out']} holds no finished run of the --{size} grid to report on")
    os.makedirs(c["out"], exist_ok=True)
    write_json(os.path.join(c["out"], "grid.json"), {"size": size})
    if not c["report"]:
        prepare(c, size, os.path.join(c["out"], "data"))
    for name in dict.fromkeys(order):
        if not c["report"] or finished(name):
            run_one(name, runs[name], c, size, runs)
    results = []                  # the report covers every finished run of the grid, not only these
    for name in filter(finished, runs):
        with open(os.path.join(c["out"], name, "result.json")) as f:
            results.append(json.load(f))
    report(c, size, results, [n for n in runs if not finished(n)])
    return results


if __name__ == "__main__":
    run_cli(main)

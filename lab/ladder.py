"""
The frontier test of the paper's Fig. 1 on a task where every loop buys one look-up (the ladder):
the hops items with k uniform on 1..4, a block that learns one look-up a loop, and rules fixed in
this file before the runs they judge.

    python -m lab.ladder --stage=pilot           # 2 seeds a scope: does any model climb the ladder?
    python -m lab.ladder --stage=main            # 6 seeds a scope (8 if the pilot's learners are few)
    python -m lab.ladder --stage=family          # the global arm's other priors (means 1.75, 3.25)
    python -m lab.ladder --stage=ra              # rule 6: RA and its dense controls from each entering model
    python -m lab.reproduce --full --report      # the verdicts (lab/ladder_claims.py), into RESULTS.md
    python -m lab.ladder --only=lad-local-uniform-s1337        # one run

The rules (set before any run; none changes after a result):
  1. Task: the hops items (one token a fact, forward references), k uniform on 1..4, all four
     queries' answers scored (the chain digits drawn with replacement, so no answer is had by
     elimination). A judging item set and a disjoint calibration set, 50 items a k each.
  2. Models: the hops block (L = 1, d = 256, 8 heads, FFN 704, U = 4), trained as a curriculum: a
     resume with a new data folder, 1,000 steps on k <= 2, then 2,000 on k <= 4 (16 x 128 tokens a
     step). Primary arm: local KL (Eq. 9), uniform prior. Secondary arm: global KL (Eq. 10) with
     priors of mean 1.75, 2.5 (uniform) and 3.25, App. B's β schedule; a global model enters only if
     KL(π̄ ‖ prior) <= 0.02 at the end.
  3. Entry gate (calibration items): fixed@(d+1) - fixed@d above 0, its interval excluding 0, for
     d = 1, 2, 3; fewer than 3 entering models a scope: "untested (no ladder: n of m models)".
  4. Operating points: ETE-Ragged at τ = 0.05 .. 0.95 (19 points) on the calibration items; for each
     target whole-item depth in {1.25, 1.75, .., 3.75} the τ whose depth is nearest. Those τ are
     judged on the judging items by lab/claims.py's rule 1 (accuracy over every scored answer, depth
     = the item's Σe / tokens); Dense-Ragged on the decode of the four answers beside it. The
     verdicts: lab/ladder_claims.py.
  5. Seeds: the pilot first (2 seeds a scope); a scope goes on only if a pilot model enters.
  6. Ragged-aware training (direct, 500 steps) from each entering parent with its two dense
     continuations (the noise floor), judged the same way.
  7. A gate-free baseline on the same checkpoints: exit where two consecutive loops' next-token
     distributions differ by less than a KL threshold, chosen by the same nearest-depth rule.

Each run writes its folder under --out (ckpt.pt, log.jsonl, stages.json: each stage's commit, wall
time and CPU seconds); runs are resumable stage by stage.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.ladder ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os
import random
import resource
import sys
import time

import torch

import prepare_data
import train
from checkpoint import load_checkpoint, write_json
from configurator import (SEED_RULE, THREADS_RULE, UserError, check_writable, parse, run_cli,
                         set_threads, split_list)
from lab.ladder_claims import PILOT_SEEDS, entry, load
from lab.reproduce import ORDER2, branch_args, provenance
from model import FULL, exit_pdf, forward_ragged
from tokenizer import load_tokenizer

DEFAULTS = dict(
    stage="pilot",         # which runs: pilot, main, family (the global arm's other priors), ra
    only="",               # comma-separated run names: just these
    out="results/ladder",  # run folders, the datasets (data/), the report
    seed=1337,             # the first seed
    threads=1,             # torch threads (1: two runs side by side on 2 cores)
    quick=False,           # a tiny version (a smoke test: seconds)
)
RULES = dict(stage=["pilot", "main", "family", "ra"], seed=SEED_RULE, threads=THREADS_RULE)

# rule 2: the block, the curriculum, the priors
BLOCK = ["--n_layer=1", "--n_embd=256", "--n_head=8", "--n_kv_head=8", "--ffn_hidden=704",
         "--block_size=128", "--batch_size=16", "--learning_rate=1.5e-3", "--warmup_iters=100",
         "--lr_decay_start=2000", "--max_iters=3000", "--eval_interval=500", "--eval_iters=10",
         "--log_interval=25"]
QUICK = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=2", "--ffn_hidden=64",
         "--block_size=64", "--batch_size=4", "--warmup_iters=2", "--max_iters=12",
         "--eval_interval=4", "--eval_iters=1", "--log_interval=4"]
CURRICULUM = [(2, 1000), (4, 3000)]        # (the hardest k of the data, the step the stage ends at)
QUICK_CURRICULUM = [(2, 4), (4, 12)]
DATA_TOKENS = 5_000_000                    # each stage's dataset (train + val), as the hops grid's
# the global arm's other priors (rule 2), fixed before their runs: Poisson priors whose means over
# 1..4 are 1.75 and 3.25 (λ found by bisection to 3 decimals), beside the uniform one (mean 2.5)
FAMILY = {"poisson1.325": ["--prior=poisson", "--prior_lambda=1.325"],
          "poisson6.311": ["--prior=poisson", "--prior_lambda=6.311"]}
SEEDS = dict(pilot=PILOT_SEEDS, main=6, family=3)    # seeds a scope (main: 8 if the pilot's learners were ~1/3)
# rule 6: each branch-off from an entering model (500 steps on the k <= 4 data, App. C's schedule):
# ragged-aware training (direct), the same continuation with the dense objective, and that again on
# another data order (the noise floor: how much 500 more steps move a model)
BRANCH_ITERS, QUICK_BRANCH_ITERS = 500, 4
BRANCHES = {"ra-direct": ["--ragged_aware", "--ra_method=direct"], "cont-dense": [],
            "cont-dense-order2": []}
TAUS = [round(0.05 * i, 2) for i in range(1, 20)]   # rule 4: 0.05 .. 0.95
ITEMS_PER_K = 50                                    # rule 1: a set's items a k
SETS = {"calibration": 4242, "judging": 2424}       # rule 1: each set's seed (drawn apart, checked disjoint)
# rule 7: the gate-free baseline's KL thresholds between two loops' next-token distributions
KL_THRESHOLDS = [round(10 ** (-4 + 4.5 * i / 18), 6) for i in range(19)]       # 1e-4 .. 3.2e0


def grid(c):
    """Every run of the stage: name -> train.py's objective flags (a branch's: --branch_from first)."""
    if c["stage"] == "ra":
        return branches(c)
    seeds = [c["seed"] + i for i in range(SEEDS[c["stage"]])]
    runs = {}
    if c["stage"] in ("pilot", "main"):
        for scope in ("local", "global"):
            for seed in seeds:
                runs[f"lad-{scope}-uniform-s{seed}"] = ["--prior=uniform", f"--seed={seed}"] + (
                    ["--global_kl"] if scope == "global" else [])
    else:
        for prior, flags in FAMILY.items():
            for seed in seeds:
                runs[f"lad-global-{prior}-s{seed}"] = flags + [f"--seed={seed}", "--global_kl"]
    return runs


def branches(c):
    """Rule 6's runs: the three branch-offs of every measured model that enters (rules 2-3), with
    its own objective flags (its prior, scope and seed; the noise floor's on another seed)."""
    parents = {}
    for stage in ("main", "family"):        # the main stage's seeds include the pilot's
        parents.update(grid(dict(c, stage=stage)))
    runs = {}
    for name, run in load(c["out"]).items():
        if name in parents and entry(run)[0]:
            seed = run["config"]["seed"]
            own = [f for f in parents[name] if not f.startswith("--seed=")]
            for branch, flags in BRANCHES.items():
                other = ORDER2 if branch.endswith("order2") else 0
                runs[f"{name}-{branch}"] = ([f"--branch_from={os.path.join(c['out'], name)}"] + own
                                            + [f"--seed={seed + other}"] + flags)
    return runs


def stage_data(c, k):
    """The dataset of one curriculum stage (hops items, k <= k), prepared once."""
    root = os.path.join(c["out"], "data", f"k{k}")
    if not os.path.isfile(os.path.join(root, "hops", "meta.json")):
        prepare_data.prepare(dict(prepare_data.DEFAULTS, dataset="hops", data_dir=root, max_k=k,
                                  size=20_000 if c["quick"] else DATA_TOKENS))
    return root


def cpu_seconds():
    """CPU time this process has spent so far (what a stage costs, whatever else the machine runs)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def train_run(name, flags, c):
    """A run's curriculum, stage by stage: each stage resumes the run on its own data folder up to
    its step, and records its commit, wall time and CPU time in stages.json. A finished stage is
    skipped, so an interrupted run resumes where it stopped."""
    folder = os.path.join(c["out"], name)
    record = os.path.join(folder, "stages.json")
    done = []
    if os.path.isfile(record):
        with open(record) as f:
            done = json.load(f)
    base = (QUICK if c["quick"] else BLOCK) + [f for f in flags if not f.startswith("--branch_from")] + [
        f"--out_dir={folder}", "--dataset=hops", "--eval_thr=0.5", "--threads=1"]
    stages = QUICK_CURRICULUM if c["quick"] else CURRICULUM
    if flags[0].startswith("--branch_from"):     # a branch-off: one stage, on the hardest data
        stages = [(stages[-1][0], QUICK_BRANCH_ITERS if c["quick"] else BRANCH_ITERS)]
        base += branch_args(stages[0][1])
    for i, (k, until) in enumerate(stages):
        if i < len(done):
            continue
        data = stage_data(c, k)
        args = base + [f"--data_dir={data}", f"--stop_iter={until}"]
        if os.path.isfile(os.path.join(folder, "ckpt.pt")):
            args.append("--init_from=resume")
        elif flags[0].startswith("--branch_from"):
            args.append(flags[0])
        print(f"== {name}, stage {i + 1} (k <= {k}, to step {until}): python train.py "
              f"{' '.join(args)}", file=sys.stderr)
        made, wall, cpu = provenance(), time.time(), cpu_seconds()
        train.main(args)
        made.update(k=k, until=until, wall_seconds=round(time.time() - wall, 1),
                    cpu_seconds=round(cpu_seconds() - cpu, 1))
        done.append(made)
        write_json(record, done)
    return done


# ----------------------------------------------------------------------------- measuring a model

def item_sets(per_k=ITEMS_PER_K):
    """Rule 1's item sets: {name: [(pieces, k)]}, per_k hops items a k (1..4) with every answer
    labelled, drawn on each set's own seed; an item of the judging set that the calibration set
    holds too is drawn again."""
    out, seen = {}, set()
    for name, seed in SETS.items():
        rng, items = random.Random(seed), []
        for k in range(1, 5):
            while len([1 for _, kk in items if kk == k]) < per_k:
                item = prepare_data.hops_item(rng, k, every_answer=True)
                text = "".join(p for p, _ in item)
                if text not in seen:
                    seen.add(text)
                    items.append((item, k))
        out[name] = items
    return out


def encode_items(items, encode):
    """Token ids of each item after the newline that ends the item before it, and the positions that
    predict its four answers (the answer's position - 1), with the answers' ids."""
    out = []
    for pieces, k in items:
        ids, asked, answers = encode("\n"), [], []
        for piece, label in pieces:
            if label:
                asked.append(len(ids) - 1)
                answers.append(encode(piece)[0])
            ids += encode(piece)
        out.append((ids, asked, answers, k))
    return out


def batch_of(encoded):
    """The items right-padded into one batch (causal: the padding reads nothing before it)."""
    T = max(len(ids) for ids, *_ in encoded) - 1
    x = torch.zeros(len(encoded), T, dtype=torch.long)
    for i, (ids, *_) in enumerate(encoded):
        x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
    return x


def right(logits, encoded):
    """Answers right per item (0..4), the argmax at each answer-predicting position."""
    top = logits.argmax(-1)
    return [sum(int(top[i, p]) == a for p, a in zip(asked, answers))
            for i, (_, asked, answers, _) in enumerate(encoded)]


def depths(exits, encoded, decode=False):
    """Σ e and the positions it covers per item: the whole item, or its decode (the positions after
    the first answer-predicting one, the last of the prompt)."""
    out = []
    for i, (ids, asked, _, _) in enumerate(encoded):
        start = asked[0] + 1 if decode else 0
        e = exits[i, start:len(ids) - 1]
        out.append((int(e.sum()), len(e)))
    return out


def kl_rule(model, threshold):
    """Rule 7's exit (gate-free): exit at depth d >= 2 where KL(p_d || p_{d-1}) of the next-token
    distributions of two consecutive loops is below `threshold` (as Huginn exits zero-shot)."""
    last = {}

    def rule(d, hn, gate):
        logp = torch.log_softmax(model.lm_head(hn).double(), -1)
        before, last["p"] = last.get("p"), logp
        if before is None:
            return torch.zeros(hn.shape[:-1], dtype=torch.bool, device=hn.device)
        return (logp.exp() * (logp - before)).sum(-1) < threshold
    return rule


@torch.no_grad()
def measure_set(model, encoded):
    """One set: per item the answers right at fixed@1..U; ETE-Ragged at every τ of TAUS (right, Σ e
    over the whole item, its exits as digits); Dense-Ragged at every τ (the prompt to the first
    query at full depth: right, Σ e over the decode); the gate-free rule at every KL threshold;
    and each position's π(1..U) under the dense forward, in hundredths."""
    x, U = batch_of(encoded), model.config.n_loops
    dense = model(x, keep_logits=True)
    pi = (exit_pdf(dense["gate_logits"]) * 100).round().long()
    out = dict(k=[k for *_, k in encoded], positions=[len(ids) - 1 for ids, *_ in encoded],
               fixed=[right(dense["logits"][d], encoded) for d in range(U)],
               pi=[pi[i, :len(ids) - 1].flatten().tolist() for i, (ids, *_) in enumerate(encoded)],
               ete={}, dense_ragged={}, gate_free={})
    prompt = torch.zeros(x.shape, dtype=torch.bool)
    for i, (_, asked, _, _) in enumerate(encoded):
        prompt[i, :asked[0] + 1] = True
    for t in TAUS:
        o = forward_ragged(model, x, taus=t)
        out["ete"][str(t)] = dict(right=right(o["logits"], encoded),
                                  sum_e=[s for s, _ in depths(o["exits"], encoded)],
                                  exits=["".join(map(str, o["exits"][i, :n].tolist()))
                                         for i, n in enumerate(out["positions"])])
        taus = torch.where(prompt, FULL, t).double()
        o = forward_ragged(model, x, taus=taus)
        d = depths(o["exits"], encoded, decode=True)
        out["dense_ragged"][str(t)] = dict(right=right(o["logits"], encoded), sum_e=[s for s, _ in d],
                                           n=[n for _, n in d])
    for theta in KL_THRESHOLDS:
        o = forward_ragged(model, x, rule=kl_rule(model, theta))
        out["gate_free"][str(theta)] = dict(right=right(o["logits"], encoded),
                                            sum_e=[s for s, _ in depths(o["exits"], encoded)])
    return out


def measure(folder):
    """A trained run measured on both item sets, with its final KL(π̄ ‖ prior) (rule 2), into
    folder/result.json."""
    model, ckpt = load_checkpoint(folder)
    model = model.double().eval()
    encode, _ = load_tokenizer(ckpt["meta"])
    with open(os.path.join(folder, "log.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if "val_loss_fixed" in r]
    made = provenance()
    result = dict(name=os.path.basename(folder), config={k: ckpt["config"][k] for k in
                                                         ("prior", "global_kl", "seed")},
                  final=evals[-1], measured=made,
                  sets={name: measure_set(model, encode_items(items, encode))
                        for name, items in item_sets().items()})
    with open(os.path.join(folder, "stages.json")) as f:
        result["stages"] = json.load(f)
    write_json(os.path.join(folder, "result.json"), result, indent=None)     # per item: compact
    return result


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    set_threads(c["threads"])
    check_writable(c["out"], "out")
    runs = grid(c)
    wanted = split_list("only", c["only"]) or list(runs)
    unknown = [n for n in wanted if n not in runs]
    if unknown:
        raise UserError(f"--only: unknown run {unknown[0]!r}; runs of --stage={c['stage']}: "
                        f"{', '.join(runs)}")
    for name in wanted:
        train_run(name, runs[name], c)
        if not c["quick"] and not os.path.isfile(os.path.join(c["out"], name, "result.json")):
            started = cpu_seconds()
            measure(os.path.join(c["out"], name))
            print(f"== {name}: measured in {cpu_seconds() - started:.0f} CPU s", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)

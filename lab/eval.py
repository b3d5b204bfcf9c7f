"""
Evaluate like the paper (App. D, E.1): log-likelihood and generation tasks, pass@k, and the
compute-accuracy frontier over fixed depths and Ragged-KV thresholds, offline.

    python -m lab.eval --ckpt out/ --builtin synthetic --sweep --out eval-out/          # difficulty-graded suite
    python -m lab.eval --ckpt CKPT --task bbh.jsonl --modes fixed@4,dense_ragged@0.3 --n 4 --k 1,4 --shots 3 --out DIR
    python -m lab.eval --ckpt CKPT --lm_eval hellaswag,arc_challenge --modes fixed@4,ete_ragged@0.5 --out DIR
    python -m lab.eval --convert gsm8k,bbh --out tasks/         # standard benchmarks as our JSONL (datasets, network)

Task files are JSONL, one item a line (lab/tasks.py: the schema, the builtin suite, the converters).

Multiple choice: the log-likelihood of each choice's tokens given the context, accuracy and
length-normalised accuracy, in fixed@k and ETE-Ragged (the continuation scored with the exits it
would take); Dense-Ragged is fixed@U here (the paper: a prefill is at full depth). Generation: n
rollouts per item through the depth-batching engine (serve_depthbatch.py) with the paper's sampling
(temperature 1.0, top-p 0.7) or greedy, strict answer extraction and exact match, unbiased pass@k
with standard errors across items, and the average prefill / decode / overall depth of every run.
Outputs in --out: results.json, records.jsonl (one line per item per mode; any figure can be
recomputed from it) and frontier.png.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.eval ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import contextlib
import json
import math
import os
import sys

import numpy as np
import torch

from checkpoint import load_for_script, write_json
from configurator import (MODEL_RUN, MODEL_RUN_RULES, SAMPLING_NEEDS, SEED_RULE, UserError,
                         check_writable, parse, run_cli, set_threads, split_list)
from kernels import IMPLS
from model import exit_stats
from modes import MODES, SCORED, continuation_logprobs
from ragged import pool_pages
from engine.request import Request
from engine.scheduler import scheduler_for
from engine.shared_head import HEADS
from engine.build import RUNNERS, engine_for
from engine.slot_pass import draw_kind
from lab import harness
from lab.tasks import BENCHMARKS, builtin_items, convert, gen_prompt_text, is_correct, load_task, shot_text, write_lines
from tokenizer import IM_END, chat_ids, check_chat, start_of_text

DEFAULTS = dict(
    ckpt="out",            # the model: our checkpoint, or an Ouro folder
    task="",               # task files (JSONL), comma-separated; --task may also be repeated
    builtin="",            # held-out items of known difficulty (lab/tasks.py): synthetic, pointer, hops, graded, ...
    builtin_items=40,      # items per difficulty level and kind of the builtin suite
    builtin_max_k=4,       # the hardest level of the builtin suite (levels 1..builtin_max_k)
    lm_eval="",            # lm-evaluation-harness task names, comma-separated (needs lm-eval)
    lm_eval_include="",    # a folder of lm-eval task YAMLs of your own (its --include_path)
    convert="",            # write standard benchmarks (tasks.BENCHMARKS) as our JSONL into --out, then stop
    modes="",              # e.g. fixed@1,ete_ragged@0.5,speculative@1 (default: fixed@U, the ragged modes at 0.5)
    sweep=False,           # the frontier of App. E.1: fixed@1..U and every --thresholds for both ragged modes
    thresholds="0.2,0.3,0.4,0.5,0.6,0.75",  # the sweep's thresholds
    out="eval-out",        # results.json, records.jsonl, frontier.png
    n=1,                   # rollouts per generation item
    k="1",                 # pass@k for these k (each <= n)
    shots=0,               # few-shot exemplars (the first items of each task; they are not scored)
    chat=False,            # zero-shot ChatML with thinking (Ouro Thinking models), as App. D.2
    max_tokens=256,        # generation cap
    draft_k=4,             # speculative@d: the most drafts (at d loops) in flight, not verified yet
    temperature=1.0,       # the paper's sampling: 1.0, top-p 0.7, top-k off; 0 = greedy
    top_p=0.7,             # nucleus sampling
    top_k=0,               # 0 = off
    stop="\\nQ:",          # generation stops at this text (few-shot: the next question); empty: none
    limit=0,               # at most this many scored items per task (0: all)
    batch_size=16,         # sequences per log-likelihood forward
    max_batch=32,          # requests in flight in the engine
    kv_pages=0,            # the engine's pool (0: max_batch full contexts at every depth, at most 2 GiB)
    attn="auto",           # paged attention (kernels.py)
    head="auto",           # LM-head calls of the generation runs: shared, eager; auto: the engine's own
    runner="auto",         # auto: graph-captured passes (engine/slots.py) on CUDA, the eager runner on a CPU
    **MODEL_RUN,           # device, threads, dtype, tiktoken_file (configurator.py)
    seed=1234,             # seeds sampling and the builtin suite
    plots=True,            # draw frontier.png (needs matplotlib)
)
RULES = dict(builtin=["", "synthetic", "pointer", "hops", "graded", "graded_multi"],
             builtin_items="in [1, 100000]",
             builtin_max_k="in [1, 4]", thresholds="floats in [0, 1]", n=">= 1", shots=">= 0",
             max_tokens=">= 1", draft_k="in [1, 64]",
             temperature="in [0, 2]", top_p="in (0, 1]", top_k=">= 0", limit=">= 0",
             batch_size=">= 1", max_batch=">= 1", kv_pages=">= 0", attn=IMPLS,
             head=["auto"] + HEADS, runner=RUNNERS, seed=SEED_RULE, **MODEL_RUN_RULES,
             k="ints >= 1")
# the keys that act only with another setting: refused without it (they would do nothing)
builtin = ("--builtin=synthetic (or another suite)", lambda c: c["builtin"])
NEEDS = dict(thresholds=("--sweep", lambda c: c["sweep"]), builtin_items=builtin,
             builtin_max_k=builtin, lm_eval_include=("--lm_eval=TASKS", lambda c: c["lm_eval"]),
             **SAMPLING_NEEDS)


# ----------------------------------------------------------------------------- modes

def parse_modes(text, U):
    """'fixed@2,ete_ragged@0.5,speculative@1' -> [(mode, thr, depth)] (thr None for fixed and
    speculative, depth: fixed's loops or speculative's draft depth, None otherwise)."""
    out = []
    for part in split_list("modes", text):
        mode, _, arg = part.partition("@")
        try:
            value = float(arg)
        except ValueError:
            raise UserError(f"--modes: {part!r} is not mode@value (fixed@k, dense_ragged@τ, "
                            "ete_ragged@τ, ouro@τ, speculative@d)")
        if mode == "speculative":            # fixed@U's output; d: the loops of its drafts
            if value != int(value) or not 1 <= value <= U - 1:
                raise UserError(f"--modes: {part!r}: speculative@d needs a draft depth d in 1..{U - 1}")
            out.append(("speculative", None, int(value)))
            continue
        if mode not in SCORED:
            raise UserError(f"--modes: {part!r}: mode {mode!r} is not scored here; allowed: "
                            f"{', '.join(SCORED)}"
                            + (" (the Table 17 baselines are decode-only: sample.py)"
                               if mode in MODES else ""))
        if mode == "fixed":
            if value != int(value) or not 0 <= value <= U:
                raise UserError(f"--modes: {part!r}: fixed@k needs k in 0..{U} (0: all {U} loops)")
            out.append(("fixed", None, int(value) or U))
        else:
            if not 0 <= value <= 1:
                raise UserError(f"--modes: {part!r}: τ must be in [0, 1]")
            out.append((mode, value, None))
    return out


def mode_name(mode, thr, depth):
    return f"{mode}@{depth}" if mode in ("fixed", "speculative") else f"{mode}@{thr:g}"


# ----------------------------------------------------------------------------- scoring

def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_stderr(xs):
    xs = np.asarray(xs, dtype=np.float64)
    if len(xs) == 0:
        return None, None
    return float(xs.mean()), float(xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0


@contextlib.contextmanager
def item_errors(task, i):
    """A tokenizer's complaint about an item names the task and the item."""
    try:
        yield
    except UserError as e:
        raise UserError(f"--task {task}: item {i}: {e}")


def run_mc(model, items, task, spec, c, encode, device, shots):
    mode, thr, depth = spec
    prefix = "".join(shot_text(s) + "\n\n" for s in shots)
    pairs, owners = [], []
    V, T_max = model.config.vocab_size, model.config.block_size
    for i, item in enumerate(items):
        with item_errors(task, i):
            ctx = encode(prefix + item["context"]) if "context" in item else item["context_ids"]
            for j, ch in enumerate(item.get("choices") or item["choices_ids"]):
                cont = encode(ch) if isinstance(ch, str) else list(ch)
                if max(ctx + cont) >= V:
                    raise UserError(f"token id {max(ctx + cont)} is outside the vocabulary [0, {V})")
                if len(cont) >= T_max:
                    raise UserError(f"choice {j} is {len(cont)} tokens, the context length is {T_max}")
                pairs.append((ctx, cont))
                owners.append((i, j))
    # a teacher-forced score of speculative decoding is fixed@U's: its output is fixed@U's
    scores = (continuation_logprobs(model, pairs, "fixed", None, model.config.n_loops, c["batch_size"], device)
              if mode == "speculative" else
              continuation_logprobs(model, pairs, mode, thr, depth, c["batch_size"], device))
    records, acc, acc_norm, depths = [], [], [], []
    for i, item in enumerate(items):
        mine = [(j, scores[p]) for p, (ii, j) in enumerate(owners) if ii == i]
        ll = [s[0] for _, s in mine]
        lens = [len(ch) for ch in (item.get("choices") or item["choices_ids"])]
        pred, pred_norm = int(np.argmax(ll)), int(np.argmax([l / max(n, 1)
                                                             for l, n in zip(ll, lens)]))
        acc.append(pred == item["answer"])
        acc_norm.append(pred_norm == item["answer"])
        ex = [e for _, s in mine for e in s[2]]
        depths.extend(ex)
        records.append(dict(task=task, mode=mode, thr=thr, depth=depth, item=i, type="mc",
                            loglik=ll, pred=pred,
                            pred_norm=pred_norm, answer=item["answer"],
                            correct=pred == item["answer"], exits=ex,
                            difficulty=item.get("difficulty")))
    d = float(np.mean(depths)) if depths else None
    return dict(acc=mean_stderr(acc)[0], acc_norm=mean_stderr(acc_norm)[0],
                stderr=mean_stderr(acc)[1], avg_depth={"prefill": d, "decode": None, "overall": d}), records


def generation_engine(model, c, mode):
    """The engine of the generation runs (ours and lm-eval's): a pool for --max_batch full contexts
    unless --kv_pages says otherwise, with --attn, --head and --runner, on the scheduler for the
    mode."""
    return engine_for(model, pool_pages(model, c["kv_pages"], 0, c["max_batch"]), c["max_batch"],
                      attn=c["attn"], head=c["head"], scheduler=scheduler_for(mode),
                      runner=c["runner"], modes=[mode],
                      sampling=[draw_kind(c["temperature"], c["top_k"], c["top_p"])])


def gen_prompt_ids(item, shots, c, encode):
    """An item's prompt as token ids: its prompt_ids, or its text in the App. D template (or the
    chat template of App. E.1). The item's own text is encoded first, so that a failure there is
    the item's, and one in the template's text says so."""
    if "prompt_ids" in item:
        return list(item["prompt_ids"]) or list(c["start_ids"])
    encode(item["prompt"])
    text = gen_prompt_text(item, shots, c["chat"])
    try:
        if c["chat"]:                                    # App. E.1: Ouro Thinking, thinking on
            return chat_ids([("system", "You are a helpful assistant."), ("user", text)], encode,
                            think=True)
        # empty: the start of a text, as sample.py and the server
        return encode(text) or list(c["start_ids"])
    except UserError as e:
        raise UserError("the prompt template (App. D: 'Q: ... A:', exemplars, 'The answer is') "
                        f"adds text this model cannot encode: {e}; give prompt_ids, or "
                        "extract='prefix' with --shots=0") from None


def run_gen(model, items, task, spec, c, encode, decode, shots, ks):
    """n rollouts per item through the engine; stop text cuts a rollout (and frees its pages)."""
    mode, thr, depth = spec
    engine = generation_engine(model, c, mode)
    stop = c["stop"].encode().decode("unicode_escape") if c["stop"] else ""
    # the end of text, or of the assistant's turn
    eos = c["eos_ids"]
    reqs = []
    for i, item in enumerate(items):
        with item_errors(task, i):
            ids = gen_prompt_ids(item, shots, c, encode)
        cap = min(item.get("max_tokens", c["max_tokens"]), c["max_tokens"],
                  model.config.block_size - len(ids))
        if cap < 1:
            raise UserError(f"--task {task}: item {i} has a prompt of {len(ids)} tokens; the "
                            f"context is {model.config.block_size}")
        for j in range(c["n"]):
            drafts = mode == "speculative"
            r = Request(ids, cap, mode, thr=0.5 if thr is None else thr,
                        depth=0 if drafts else depth or 0, draft_k=c["draft_k"],
                        draft_depth=depth if drafts else 1,
                        temperature=c["temperature"], top_p=c["top_p"], top_k=c["top_k"],
                        seed=c["seed"] + 1000 * i + j, stop=tuple(eos), tag=i)
            if stop and decode is not None and item.get("extract", "answer_is") != "prefix":
                # the next exemplar begins: this rollout is done
                def on_token(r, tok, stop=stop):
                    if tok is not None and stop in decode(r.tokens):
                        r.cancelled = True
                r.on_token = on_token
            # a token id outside the vocabulary: named before any run
            with item_errors(task, i):
                reqs.append(engine.add(r))
    from tqdm import tqdm
    with tqdm(total=len(reqs), desc=f"{task} {mode_name(*spec)}", unit="rollout", file=sys.stderr,
              disable=None, leave=False) as bar:
        done = 0
        while engine.busy():
            engine.step()
            bar.update(engine.stats["finished"] - done)
            done = engine.stats["finished"]
    failed = [r for r in reqs if r.finish_reason == "error"]
    if failed:
        raise UserError(f"--kv_pages: {failed[0].error}")
    return score_rollouts(items, reqs, task, spec, stop, decode, ks, model.config.n_loops)


def score_rollouts(items, reqs, task, spec, stop, decode, ks, U):
    """Each item's rollouts against its answer (cut at the stop text): the records, unbiased pass@k
    over the items with its standard error, and the depths every run took."""
    mode, thr, depth = spec
    records, per_k = [], {k: [] for k in ks}
    pe, de = [], []
    for i, item in enumerate(items):
        mine = [r for r in reqs if r.tag == i]
        comps, answers, correct = [], [], []
        for r in mine:
            toks = [t for t in r.tokens if t not in r.stop]
            text = decode(toks) if decode is not None else ""
            if stop and stop in text:
                text = text[:text.index(stop)]
            ok, ans = is_correct(item, text, toks)
            comps.append(text if decode is not None else toks)
            answers.append(ans)
            correct.append(bool(ok))
            pe += r.prompt_exits
            de += r.decode_exits
        for k in ks:
            per_k[k].append(pass_at_k(len(correct), sum(correct), k))
        records.append(dict(task=task, mode=mode, thr=thr, depth=depth, item=i, type="gen",
                            completions=comps,
                            extracted=answers, correct=correct,
                            answer=item.get("answer", item.get("answer_ids")),
                            difficulty=item.get("difficulty"), kind=item.get("kind"),
                            answer_depth=[r.token_exits[0] if r.token_exits else None for r in mine],
                            answer_exits=[r.token_exits for r in mine],
                            answer_labels=item.get("answer_labels"),
                            prompt_exits=[r.prompt_exits for r in mine],
                            decode_exits=[r.decode_exits for r in mine]))
    mean = lambda xs: float(np.mean(xs)) if xs else None
    return dict(pass_at={str(k): mean_stderr(v)[0] for k, v in per_k.items()},
                stderr={str(k): mean_stderr(v)[1] for k, v in per_k.items()},
                avg_depth={"prefill": mean(pe), "decode": mean(de), "overall": mean(pe + de)},
                exit_stats=exit_stats(de, U)), records


def by_difficulty(records):
    """Accuracy and the depth that produced the answer, per difficulty level (the builtin suite),
    with the per-rollout values they average (generation: the answer's depth, whether it was right,
    and Σ e over the prompt and the answer), so that intervals can be drawn from them."""
    out = {}
    for level in sorted({r["difficulty"] for r in records if r.get("difficulty")}):
        rs = [r for r in records if r.get("difficulty") == level]
        correct = [x for r in rs for x in r["correct"]] if rs[0]["type"] == "gen" else [r["correct"] for r in rs]
        depth = [d for r in rs for d in (r.get("answer_depth") or []) if d is not None]
        out[str(level)] = {"items": len(rs), "acc": float(np.mean(correct)),
                           "answer_depth": float(np.mean(depth)) if depth else None}
        if rs[0]["type"] == "gen":
            out[str(level)]["rollouts"] = {
                "correct": [int(x) for x in correct],
                "answer_depth": [d for r in rs for d in r["answer_depth"]],
                "sum_exits": [sum(p) + (d or 0) for r in rs
                              for p, d in zip(r["prompt_exits"], r["answer_depth"])],
                # every position run, its exit: the prompt's, then the answer's past its first token
                # (the last prompt position samples that one), and what each answer token needed
                "prompt_exits": [p for r in rs for p in r["prompt_exits"]],
                "decode_exits": [d for r in rs for d in r["decode_exits"]],
                "answer_exits": [a for r in rs for a in r["answer_exits"]]}
            # an answer of several labelled tokens, one character each
            if rs[0].get("answer_labels"):
                out[str(level)]["rollouts"]["answer_labels"] = [r["answer_labels"] for r in rs
                                                                for _ in r["correct"]]
                out[str(level)]["rollouts"]["token_right"] = [
                    [int(c == a) for c, a in zip(text.ljust(len(r["answer"])), r["answer"])]
                    for r in rs for text in r["completions"]]
    return out


# ----------------------------------------------------------------------------- the frontier

def score_of(run):
    return run["pass_at"]["1"] if run.get("pass_at") else run.get("acc")


def draw_frontier(runs, path, U):
    """Score against average decode depth and against average overall depth (App. E.1, Figures
    15-18): fixed depths as a line, each ragged mode as its own curve over thresholds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    styles = (("fixed", "ko--"), ("dense_ragged", "s-"), ("ete_ragged", "^-"), ("ouro", "d:"))

    def points(task, which, mode):
        return sorted((r["avg_depth"][which], score_of(r)) for r in runs if r["task"] == task and r["mode"] == mode
                      and (r.get("avg_depth") or {}).get(which) is not None and score_of(r) is not None)
    # one panel per (task, depth kind) that has data: one-token answers have no decode positions
    panels = [(task, which) for task in sorted({r["task"] for r in runs if r.get("avg_depth")})
              for which in ("decode", "overall") if any(points(task, which, m) for m, _ in styles)]
    if not panels:
        return
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, (task, which) in zip(axes.flat, panels):
        for mode, style in styles:
            pts = points(task, which, mode)
            if pts:
                ax.plot(*zip(*pts), style, label=mode)
        ax.set(xlabel=f"average {which} depth", ylabel="pass@1 / accuracy", title=task, xlim=(0.8, U + 0.2))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def merge_repeated(argv, key):
    """--task a --task b -> --task=a,b (the configurator keeps the last of a repeated key)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == f"--{key}" and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
            continue
        if a.startswith(f"--{key}="):
            values.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return rest + ([f"--{key}=" + ",".join(values)] if values else [])


def check_args(c):
    """Everything about the flags that can be refused before a model loads; returns the k of pass@k
    and the tasks read from --task files {name: items}."""
    ks = split_list("k", c["k"], int)
    if max(ks) > c["n"]:
        raise UserError(f"--k={c['k']}: pass@k needs k <= --n={c['n']} rollouts per item")
    files = split_list("task", c["task"])
    if not files and not c["builtin"] and not c["lm_eval"]:
        raise UserError("--task: give task files (JSONL), --builtin synthetic, or --lm_eval tasks")
    tasks = {os.path.splitext(os.path.basename(f))[0]: load_task(f) for f in files}
    check_writable(c["out"], "out")
    if c["lm_eval"]:
        harness.check_tasks(c)
    if c["plots"]:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plots needs the optional matplotlib (pip install matplotlib), or give --plots=False")
    return ks, tasks


def mode_specs(c, U):
    """The (mode, thr, depth) to score: the App. E.1 sweep, or --modes (default fixed@U and both
    ragged modes at τ 0.5)."""
    if c["sweep"]:
        thrs = split_list("thresholds", c["thresholds"], float)
        return [("fixed", None, k) for k in range(1, U + 1)] + [(m, t, None) for m in ("dense_ragged", "ete_ragged")
                                                                for t in thrs]
    return parse_modes(c["modes"] or f"fixed@{U},dense_ragged@0.5,ete_ragged@0.5", U)


def score_task(model, task, items, specs, c, encode, decode, ks):
    """Every mode on one task's scored items (after --shots exemplars, up to --limit): the runs'
    summaries and the per-item records."""
    shots, scored = items[:c["shots"]], items[c["shots"]:]
    if c["limit"]:
        scored = scored[:c["limit"]]
    if not scored:
        raise UserError(f"--shots={c['shots']}: task {task} has no items left to score")
    runs, records, device = [], [], model.lm_head.weight.device
    for spec in specs:
        for kind in ("mc", "gen"):
            group = [it for it in scored if it["type"] == kind]
            if not group:
                continue
            exemplars = [s for s in shots if s["type"] == kind]
            summary, recs = (run_mc(model, group, task, spec, c, encode, device, exemplars)
                             if kind == "mc" else
                             run_gen(model, group, task, spec, c, encode, decode, exemplars, ks))
            run = dict(task=task, mode=spec[0], thr=spec[1], depth=spec[2],
                       n_items=len(group), acc=None, acc_norm=None, pass_at=None, stderr=None,
                       avg_depth=None)
            run.update(summary)
            if any(r.get("difficulty") for r in recs):
                run["by_difficulty"] = by_difficulty(recs)
            runs.append(run)
            records.extend(recs)
            depths = ", ".join(f"{k} {v:.2f}" for k, v in run["avg_depth"].items() if v is not None)
            print(f"{task:<14} {mode_name(*spec):<18} {kind}: score {score_of(run):.3f} "
                  f"(n={len(group)}); avg depth {depths}", file=sys.stderr)
    return runs, records


def main(argv):
    c = parse(merge_repeated(list(argv), "task"), DEFAULTS, RULES, __file__, needs=NEEDS)
    set_threads(c["threads"])
    if c["convert"]:
        unknown = [n for n in split_list("convert", c["convert"]) if n not in BENCHMARKS]
        if unknown:
            raise UserError(f"--convert: unknown benchmark {unknown[0]!r}; allowed: {', '.join(BENCHMARKS)}")
        check_writable(c["out"], "out")
        return convert(split_list("convert", c["convert"]), c["out"])
    ks, tasks = check_args(c)
    model, meta, encode, decode, eos = load_for_script(c)
    U = model.config.n_loops
    specs = mode_specs(c, U)
    needs_text = any("prompt" in it or "context" in it for items in tasks.values() for it in items)
    if encode is None and (needs_text or c["builtin"] or c["lm_eval"]):
        raise UserError("this checkpoint has no tokenizer: give tasks with context_ids / choices_ids / prompt_ids")
    c["eos_ids"] = [] if eos is None else [eos]
    c["start_ids"] = start_of_text(meta)                 # what an empty prompt means
    if c["chat"]:
        check_chat(meta)
        c["eos_ids"] = [IM_END] + c["eos_ids"]
    if c["builtin"]:
        tasks[c["builtin"]] = builtin_items(c["builtin"], c["builtin_items"], c["seed"], c["builtin_max_k"])
    torch.manual_seed(c["seed"])
    runs, records = [], []                               # --out is written at the end only: a bad item changes nothing
    for task, items in tasks.items():
        task_runs, task_records = score_task(model, task, items, specs, c, encode, decode, ks)
        runs += task_runs
        records += task_records
    if c["lm_eval"]:
        runs += harness.run(model, encode, decode, specs, c, model.lm_head.weight.device,
                            generation_engine)
    write_json(os.path.join(c["out"], "results.json"),
               {"ckpt": c["ckpt"], "config": {k: c[k] for k in ("n", "k", "shots", "chat", "max_tokens", "temperature",
                                                                 "top_p", "top_k", "seed")}, "runs": runs})
    write_lines(os.path.join(c["out"], "records.jsonl"), [json.dumps(r) for r in records])
    if c["plots"] and any(r.get("avg_depth") for r in runs):
        draw_frontier(runs, os.path.join(c["out"], "frontier.png"), U)
    print(json.dumps({"runs": len(runs), "out": c["out"]}))
    return runs


if __name__ == "__main__":
    run_cli(main)

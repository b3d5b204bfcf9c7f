"""
Self-speculative decoding (engine/speculative.py) against fixed@U, the decode it must equal, with
Dense-Ragged beside it: tokens/s as a ratio to fixed@U in the same run, block passes and LM-head
calls a token, and how many drafts are kept, for every draft depth (and the exit gate's) and k, at
fixed batches and in a server's queue, on a trained checkpoint (rows a token beside passes: on a
CPU a pass costs more the more rows it holds); and how often d loops already give
the full-depth token (teacher-forced along fixed@U's own greedy continuations).

    python -m lab.bench --what=speculative --ckpt out/             # the quick-start checkpoint
    python -m lab.bench --what=speculative --ckpt out/ --quick     # one draft setting, batch 1: a minute

Prompts are cut from the validation split the checkpoint was trained on (random ids where it is not
found: a model's acceptance on them means little). Greedy, so that every speculative run's tokens
can be checked against fixed@U's (they must be identical; the run stops if not). Each configuration
runs --rounds times, in turns with the others; the fastest counts.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.bench_speculative ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import os
import sys
import time

import numpy as np
import torch

from checkpoint import load_checkpoint
from configurator import UserError, split_list
from engine.request import Request
from lab.bench_engine import bench_model
from serve_depthbatch import Engine


def prompts_of(ckpt, ckpt_path, model, n, length, seed):
    """n prompts of `length` ids from the validation split the checkpoint names (random ids if there
    is none), and where they came from."""
    cfg = ckpt.get("config", {}) if ckpt else {}
    split = os.path.join(cfg.get("data_dir", ""), cfg.get("dataset", ""), "val.bin")
    # the data folder as train.py was given it: from here, or beside the run's folder
    folder = ckpt_path if os.path.isdir(ckpt_path or "") else os.path.dirname(ckpt_path or "")
    beside = os.path.join(os.path.dirname(os.path.abspath(folder)), split)
    path = split if os.path.isfile(split) else beside
    rng = np.random.default_rng(seed)
    if ckpt and os.path.isfile(path):
        ids = np.memmap(path, dtype=np.uint16, mode="r")
        starts = rng.integers(0, len(ids) - length, n)
        return [ids[s:s + length].astype(np.int64).tolist() for s in starts], path
    return rng.integers(0, model.config.vocab_size, (n, length)).tolist(), "random ids"


@torch.no_grad()
def agreement(model, prompts, continuations):
    """Teacher-forced along fixed@U's greedy continuations: the share of positions whose argmax after
    d loops is the full-depth argmax, d = 1..U-1 (how often a depth-d draft would be kept)."""
    U, same, n = model.config.n_loops, np.zeros(model.config.n_loops - 1), 0
    for p, cont in zip(prompts, continuations):
        x = torch.tensor([p + cont[:-1]])
        logits = model(x, keep_logits=True)["logits"]
        top = [lg[0, len(p) - 1:].argmax(-1) for lg in logits]       # the positions that predict cont
        same += [float((top[d] == top[U - 1]).sum()) for d in range(U - 1)]
        n += len(cont)
    return (same / n).tolist()


def decode(model, prompts, n_new, config, batch):
    """Every prompt through one engine of max_batch `batch` (more prompts than that: a queue).
    config: (mode, thr, draft_depth, k). Returns (seconds, tokens of each, the engine's stats)."""
    mode, thr, draft_depth, k = config
    U = model.config.n_loops
    reqs = [Request(p, n_new, mode, thr, draft_k=k, draft_depth=draft_depth) for p in prompts]
    e = Engine(model, batch * (len(prompts[0]) + n_new) * U, max_batch=batch,
               max_rows=batch * len(prompts[0]), scheduler="continuous")
    t0 = time.perf_counter()
    e.run(reqs)
    return time.perf_counter() - t0, [r.tokens for r in reqs], dict(e.stats)


def name_of(config, U):
    mode, thr, d, k = config
    if mode == "speculative":
        return f"speculative d={d or f'gate@{thr:g}'} k={k}"
    return f"fixed@{U}" if mode == "fixed" else f"{mode}@{thr:g}"


def workloads(c):
    """(label, batch, number of prompts): the fixed batches, then the queue (4x the largest batch)."""
    batches = split_list("batches", c["batches"], int) if c["batches"] else ([1] if c["quick"] else [1, 4, 8])
    out = [(f"batch {B}", B, B) for B in batches]
    if not c["quick"]:
        out.append((f"queue of {4 * max(batches)}, batch {max(batches)}", max(batches), 4 * max(batches)))
    return out


def bench_speculative(c):
    """Every configuration on every workload, in turns, the fastest of --rounds; a table on stderr and
    the JSON record (rows, the teacher-forced agreement by draft depth)."""
    ckpt = None
    if c["ckpt"]:
        model, ckpt = load_checkpoint(c["ckpt"])
    else:
        model = bench_model(c["seed"], "decode")
    model.eval()
    U, n_new, length = model.config.n_loops, c["new_tokens"], c["prompt_len"]
    if length + n_new > model.config.block_size:
        raise UserError(f"prompt_len + new_tokens = {length + n_new} exceeds the model's block_size "
                        f"{model.config.block_size}: give a smaller --prompt_len or --new_tokens")
    depths = [1] if c["quick"] else list(range(1, U)) + [0]
    ks = [4] if c["quick"] else split_list("draft_ks", c["draft_ks"], int)
    configs = [("fixed", 0.5, 1, 1), ("dense_ragged", c["engine_thr"], 1, 1)]
    configs += [("speculative", c["engine_thr"], d, k) for d in depths for k in ks]
    rows, agree = [], None
    from tqdm import tqdm
    for label, batch, n in workloads(c):
        prompts, source = prompts_of(ckpt, c["ckpt"], model, n, length, c["seed"] + n)
        best = {}
        bar = tqdm(total=c["rounds"] * len(configs), desc=label, unit="run", file=sys.stderr,
                   leave=False, mininterval=1 if sys.stderr.isatty() else 10)
        for _ in range(c["rounds"]):
            for config in configs:
                t, tokens, stats = decode(model, prompts, n_new, config, batch)
                if config not in best or t < best[config][0]:
                    best[config] = (t, tokens, stats)
                bar.update(1)
        bar.close()
        t_fixed, fixed_tokens, _ = best[configs[0]]
        if agree is None:
            agree = agreement(model, prompts, fixed_tokens)
        for config in configs:
            t, tokens, st = best[config]
            if config[0] == "speculative" and tokens != fixed_tokens:
                raise AssertionError(f"{label}, {name_of(config, U)}: tokens differ from fixed@{U}'s")
            made = n * n_new
            rows.append(dict(workload=label, config=name_of(config, U), tok_s=round(made / t, 1),
                             x_fixed=round(t_fixed / t, 3), passes_per_token=round(st["passes"] / made, 3),
                             rows_per_token=round(st["rows"] / made, 2),
                             head_calls_per_token=round(st["head_calls"] / made, 3),
                             kept=round(st["accepted"] / st["drafted"], 3) if st["drafted"] else None,
                             identical=tokens == fixed_tokens))
    print_rows(rows, agree, source, U)
    cfg = model.config
    return {"bench": "speculative", "model": f"L={cfg.n_layer} d={cfg.n_embd} V={cfg.vocab_size} U={U}",
            "ckpt": c["ckpt"] or "random", "prompts": source, "prompt_len": length, "new_tokens": n_new,
            "rounds": c["rounds"], "agreement_by_depth": [round(a, 4) for a in agree], "rows": rows}


def print_rows(rows, agree, source, U):
    print(f"prompts from {source}; greedy; the fastest of the rounds; x fixed: fixed@{U}'s time over "
          "this row's, same run", file=sys.stderr)
    print("teacher-forced, the full-depth token after d loops: "
          + ", ".join(f"d={d + 1} {a:.1%}" for d, a in enumerate(agree)), file=sys.stderr)
    print(f"{'workload':<22}{'config':<30}{'tok/s':>9}{'x fixed':>9}{'passes/tok':>11}{'rows/tok':>9}"
          f"{'heads/tok':>10}{'kept':>7}", file=sys.stderr)
    for r in rows:
        kept = "" if r["kept"] is None else f"{r['kept']:.0%}"
        print(f"{r['workload']:<22}{r['config']:<30}{r['tok_s']:>9.1f}{r['x_fixed']:>9.2f}"
              f"{r['passes_per_token']:>11.3f}{r['rows_per_token']:>9.2f}{r['head_calls_per_token']:>10.3f}"
              f"{kept:>7}", file=sys.stderr)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=speculative runs it")

"""
The engine benchmark (`python -m lab.bench --what=engine`): depth batching (App. A.2) in a server's
queue and in a fixed batch, schedulers x modes x head policies x batch sizes, and the capacity table,
against fixed@U of the same engine and against the Ouro way; plus the random models of real
proportions the benchmarks run (SHAPES).

Engine targets (`targets`), at batch 1, 4, 8 and 32 on the realistic model: Dense- and ETE-Ragged
>= 0.9 x their cost-model ideal in both workloads and >= 1.3 x the Ouro way in the fixed batch;
fixed@U >= 1.0 x the Ouro way. `--ouro_code PATH/modeling_ouro.py` adds the public Ouro code
(transformers 4.54/4.55) as a row of the fixed batch. How the engine benchmark measures (turns, the
throughput window, the bound, the cost model) is in docs/benchmarks.md.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.bench_engine ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import random
import sys
import time

import torch

from lab.cost_model import cost, fixed_cost, head_schedule
from lab.ouro_way import ouro_way
from lab.ouro_code import ouro_code_generate, ouro_code_model
from checkpoint import load_checkpoint
from configurator import UserError, resolve_device, split_list
from model import GPTConfig, LoopedLM
from engine.request import Request
from engine.shared_head import HEADS, weight_bytes
from serve_depthbatch import Engine

# Random models whose gates spread the exits over depths 1..4 (decode Ē about 2.5 at τ 0.5). The LM
# head's weights against the block's: 0.08 for Ouro-1.4B (vocabulary 49,152, 24 layers of 2048),
# 0.45 for the paper's 160M (GPT-2's 50,257 words, 12 layers of 768); "realistic" is the paper's
# shape scaled to a 2-core CPU with a 32,000-word vocabulary (1.27: the head weighs more than the
# block, as in any small model with a real vocabulary), "small_vocab" hides the head (0.03).
SHAPES = {
    "decode": dict(cfg=dict(vocab_size=256, block_size=256, n_layer=4, n_head=8, n_kv_head=8,
                            n_embd=512, ffn_hidden=1536), gate_std=0.12, gate_bias=-1.5),
    "realistic": dict(cfg=dict(vocab_size=32000, block_size=2048, n_layer=4, n_head=8, n_kv_head=8,
                               n_embd=512, ffn_hidden=1408), gate_std=0.08, gate_bias=-1.5,
                      gate_seed=5),
    "small_vocab": dict(cfg=dict(vocab_size=256, block_size=2048, n_layer=4, n_head=4, n_kv_head=4,
                                 n_embd=256, ffn_hidden=704), gate_std=0.2, gate_bias=0.0,
                        gate_seed=5),
}


def bench_model(seed, shape="decode", vocab=None, loop_norm=False):
    """A random model of a bench shape (SHAPES), in eval mode; `vocab` replaces the shape's
    vocabulary, loop_norm normalizes the state after every loop (as Ouro's models do)."""
    spec = SHAPES[shape]
    torch.manual_seed(seed)
    cfg = dict(spec["cfg"], **({"vocab_size": vocab} if vocab else {}))
    model = LoopedLM(GPTConfig(**cfg, branch_norm_init=1.0, loop_norm=loop_norm)).eval()
    with torch.no_grad():
        if "gate_seed" in spec:
            torch.manual_seed(seed + spec["gate_seed"])
        model.early_exit_gate.weight.normal_(0, spec["gate_std"])
        model.early_exit_gate.bias.fill_(spec["gate_bias"])
    return model


# ------------------------------------------------------------------------ engine: the two workloads

def engine_model(c):
    device = resolve_device(c["device"])
    if c["ckpt"]:
        return load_checkpoint(c["ckpt"], device)[0]
    # Ouro's code normalizes the state after every loop: a model it runs alike needs the same
    return bench_model(c["seed"], c["shape"], c["vocab"] or None, loop_norm=bool(c["ouro_code"])).to(device)


# The engine benchmark's request lengths: (prompt range, output range) of the queue and the capacity
# table, (prompt, new tokens) of the fixed batch.
LENGTHS = {"full": ((100, 1024), (100, 1024), (128, 512)),
           "default": ((16, 64), (32, 128), (32, 64)), "quick": ((4, 12), (4, 16), (8, 12))}


def size_of(c):
    if c["full"] and c["quick"]:
        raise UserError("--full and --quick: give one")
    return "full" if c["full"] else "quick" if c["quick"] else "default"


def queue_bench(model, c, thr, batches, bar):
    """A server's queue: 2 x batch + 8 requests of random lengths, the engines in turns
    (bench_runs), tok/s in the window of a loaded server. Every configuration against fixed@U of the
    same round."""
    U = model.config.n_loops
    prompts, outputs, _ = LENGTHS[size_of(c)]
    ragged = ("dense_ragged", "ete_ragged")
    configs = ([("fixed", "fixed", "eager")] + [("continuous", m, h) for m in ragged for h in HEADS]
               + [("nested", m, "eager") for m in ragged])
    runs = []
    for B in batches:
        n = c["requests"] or (256 if c["full"] else 2 * B + 8)
        work = workload(n, prompts, outputs, model.config.vocab_size, c["seed"])
        pages = c["kv_pages"] or sum(len(p) + o for p, o in work) * U
        tries = {k: [] for k in configs}
        for rep in range(c["rounds"]):
            for r in bench_runs(model, work, configs, thr, B, pages, c["max_rows"], c["attn"], bar,
                                seed=c["seed"] + rep):
                tries[r["scheduler"], r["mode"], r["head"]].append(r)
        fixed = tries["fixed", "fixed", "eager"]
        best = {k: fastest(v) for k, v in tries.items()}
        for k, r in best.items():
            r["workload"] = "queue"
            r["ratio_vs_fixed"] = r["tok_s"] / fastest(fixed)["tok_s"]
            # each round against the fixed engine of the same round: the
            # spread that fastest-of hides
            r["ratio_rounds"] = [t["tok_s"] / f["tok_s"] for t, f in zip(tries[k], fixed)]
            # prefill rows included
            r["work_ratio"] = fastest(fixed)["row_depths"] / r["row_depths"]
            runs.append(r)
    return runs


# How the fixed batch samples: greedy (lab/eval.py's tasks) or the
# paper's sampling (sample.py's defaults).
SAMPLINGS = {"greedy": (0.0, 1.0), "paper": (1.0, 0.7)}    # (temperature, top-p)


def batch_bench(model, c, thr, batches, bar, hf=None):
    """A fixed batch of exactly B requests (sample.py --num_samples, lab/eval.py): 32-token prompts,
    64 new tokens each, greedy and/or sampled as the paper does, timed from the first step to the
    last token; the batch ends with its deepest request. Against the Ouro way (ouro_way) and
    fixed@U, rounds in a shuffled order; hf: the public Ouro code on the same weights, one more
    row."""
    n_prompt, n_new = LENGTHS[size_of(c)][2]
    configs = [("ouro_way", "fixed", "-"), ("fixed", "fixed", "eager")] + [
        ("continuous", m, h) for m in ("dense_ragged", "ete_ragged") for h in HEADS] + (
        [("ouro_code", "fixed", "-")] if hf is not None else [])
    order, runs = random.Random(c["seed"]), []
    for sampling in split_list("sampling", c["sampling"]):
        for B in batches:
            g = torch.Generator().manual_seed(c["seed"] + B)
            prompts = torch.randint(0, model.config.vocab_size, (B, n_prompt), generator=g).tolist()
            tries = {k: [] for k in configs}
            for _ in range(max(c["rounds"], 3)):
                for k in order.sample(configs, len(configs)):
                    tries[k].append(batch_run(model, prompts, n_new, k, thr, c,
                                              SAMPLINGS[sampling], hf))
                    if bar is not None:
                        bar.update(B)
            best = {k: min(v, key=lambda r: r["seconds"]) for k, v in tries.items()}
            lanes, fixed = best[configs[0]], best[configs[1]]
            ref, schedules, weights = lanes["token_lists"], {}, weight_bytes(model)
            for k, r in best.items():
                same = sum(a == b for x, y in zip(r.pop("token_lists"), ref) for a, b in zip(x, y))
                r.update(workload="batch", sampling=sampling, batch=B,
                         ratio_vs_ouro=lanes["seconds"] / r["seconds"],
                         ratio_vs_fixed=fixed["seconds"] / r["seconds"],
                         tokens_agree_with_ouro_way=same / (B * n_new))
                # fixed depth: one schedule
                rows, r["ideal_schedule"] = r.pop("token_rows", None), 1.0
                if k[0] == "continuous":    # the head policies change no exit: one search per mode
                    if k[1] not in schedules:
                        schedules[k[1]] = rows, head_schedule(rows, *weights)
                    assert schedules[k[1]][0] == rows, "a head policy changed an exit"
                    r["ideal_schedule"] = fixed_cost(model.config.n_loops, weights, n_new) / schedules[k[1]][1]
                if hf is not None:
                    r["ratio_vs_ouro_code"] = best["ouro_code", "fixed", "-"]["seconds"] / r["seconds"]
                runs.append(r)
    return runs


def batch_run(model, prompts, n_new, config, thr, c, sampling=(0.0, 1.0), hf=None):
    scheduler, mode, head = config
    B, U = len(prompts), model.config.n_loops
    temperature, top_p = sampling
    t0 = time.perf_counter()
    wb, wh = weights = weight_bytes(model)
    if scheduler in ("ouro_way", "ouro_code"):   # every token all U loops, one head call per step
        tokens = (ouro_way(model, prompts, n_new, temperature, top_p)
                  if scheduler == "ouro_way" else
                  ouro_code_generate(hf, prompts, n_new, temperature, top_p))
        seconds = time.perf_counter() - t0
        return dict(scheduler=scheduler, mode=mode, head=head, thr=None, seconds=seconds,
                    tok_s=B * n_new / seconds,
                    passes_total=U * n_new, head_calls=n_new, rows_per_head_call=B,
                    avg_decode_depth=float(U),
                    makespan_bound=U * n_new, **cost(U, weights, U * n_new, n_new, U),
                    ideal_batch=1.0, token_lists=tokens)
    # every prompt in one pass, as Ouro's generate does: the batch starts together, and its pages
    # lie on a grid that the attention reads in place (kernels.grid_of), as the dense lanes are read
    e = Engine(model, c["kv_pages"] or B * (len(prompts[0]) + n_new) * U, max_batch=B,
               max_rows=B * len(prompts[0]), scheduler=scheduler, attn=c["attn"], head=head)
    reqs = e.run([Request(p, n_new, mode, thr=thr, temperature=temperature, top_p=top_p, seed=i)
                  for i, p in enumerate(prompts)])
    seconds = time.perf_counter() - t0
    dec = [x for r in reqs for x in r.decode_exits]
    avg = sum(dec) / len(dec)
    # the deepest request alone: its prompt chunk's passes, then one pass per depth
    # of every decode token
    makespan = max(max(r.prompt_exits) + sum(r.decode_exits) for r in reqs)
    return dict(scheduler=scheduler, mode=mode, head=head, thr=None if mode == "fixed" else thr,
                seconds=seconds,
                tok_s=B * n_new / seconds, passes_total=e.stats["passes"],
                head_calls=e.stats["head_calls"],
                rows_per_head_call=e.stats["head_rows"] / e.stats["head_calls"],
                avg_decode_depth=avg,
                makespan_bound=makespan,
                **cost(U, weights, e.stats["passes"], e.stats["head_calls"], avg),
                ideal_batch=fixed_cost(U, weights, n_new) / (makespan * wb + n_new * wh),
                token_lists=[r.tokens for r in reqs],
                token_rows=[[max(r.prompt_exits)] + r.decode_exits for r in reqs])


def bench_engine(c):
    """Both workloads (a server queue, a fixed batch) x schedulers x modes x head policies x batch
    sizes, then the capacity table."""
    if torch.device(resolve_device(c["device"])).type == "cpu":
        keep_heap()
    model = engine_model(c)
    cfg, U = model.config, model.config.n_loops
    batches = [1, 4, 8, 32] if not c["batches"] else split_list("batches", c["batches"], int)
    # the queue's requests (and the capacity table's)
    queue = c["workload"] != "batch" or c["capacity"]
    prompts, outputs, batch = LENGTHS[size_of(c)]
    need = max(([prompts[1] + outputs[1]] if queue else []) + ([sum(batch)]
                                                               if c["workload"] != "queue" else []))
    if need > cfg.block_size:
        raise UserError(f"--workload={c['workload']} --capacity={c['capacity']} needs a context of "
                        f"{need} tokens; the model has block_size={cfg.block_size} "
                        "(--workload=batch --capacity=False needs the least)")
    if c["requests"] and c["requests"] < 2 * max(batches):
        raise UserError(f"--requests={c['requests']}: the benchmark needs at least 2 x the largest "
                        f"batch ({2 * max(batches)}), so that requests wait "
                        "while the batch runs full")
    if c["ouro_code"] and c["workload"] == "queue":
        raise UserError("--ouro_code is a row of the fixed batch: give --workload=batch or both")
    # before any long run
    hf = ouro_code_model(model, c["ouro_code"]) if c["ouro_code"] else None
    thr = c["engine_thr"]
    from tqdm import tqdm
    runs = []
    # a line at least every 10 s where stderr is a log, not a terminal
    with tqdm(desc="bench", unit="req", file=sys.stderr, mininterval=1 if sys.stderr.isatty() else 10) as bar:
        if c["workload"] in ("queue", "both"):
            runs += queue_bench(model, c, thr, batches, bar)
        if c["workload"] in ("batch", "both"):
            runs += batch_bench(model, c, thr, batches, bar, hf)
    # capacity: one pool of 40% of what fixed@U needs for 32 requests, the whole workload at once
    work = workload(c["requests"] or (256 if c["full"] else 64), prompts, outputs, cfg.vocab_size,
                    c["seed"] + 1)
    pages = int(0.4 * sum(len(p) + o for p, o in work[:32]) * U)
    capacity = [] if not c["capacity"] else bench_runs(
        model, work, [("fixed", "fixed", "eager"), ("continuous", "dense_ragged", c["head"]),
                      ("continuous", "ete_ragged", c["head"])], thr, len(work), pages,
        c["max_rows"], c["attn"])
    print_bench(runs, capacity, pages, U)
    rnd = lambda r: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
    return {"model": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
                      "n_loops": U, "vocab_size": cfg.vocab_size, "ffn_hidden": cfg.ffn_hidden,
                      "ckpt": c["ckpt"] or f"random bench model ({c['shape']})",
                      "head_to_block": round(runs[0]["head_to_block"], 4) if runs else None,
                      "device": str(model.lm_head.weight.device), "thr": thr, "attn": c["attn"],
                      "max_rows": c["max_rows"], "rounds": c["rounds"], "loop_norm": cfg.loop_norm,
                      "ouro_code": c["ouro_code"] or None},
            "runs": [rnd(r) for r in runs], "targets": targets(runs),
            "capacity": {"kv_pages": pages, "runs": [rnd(r) for r in capacity]}}


def targets(runs):
    """The engine's targets, each cell as met or not: continuous ragged >= 0.9 x its cost-model
    ideal (queue: against fixed@U, per sampled token; batch: against fixed@U, the deepest request's
    makespan), >= 1.3x the Ouro way in the fixed batch, fixed@U >= 1.0x the Ouro way."""
    out = []
    for r in runs:
        cell = dict(workload=r["workload"],
                    **({"sampling": r["sampling"]} if "sampling" in r else {}),
                    batch=r["batch"], mode=r["mode"], head=r["head"])
        if r["scheduler"] == "continuous":
            ideal = r["ideal_cost"] if r["workload"] == "queue" else r["ideal_batch"]
            seen = {"of_schedule": r["ratio_vs_fixed"] / r["ideal_schedule"]} if r["workload"] == "batch" else {}
            out.append(dict(cell, of_ideal=r["ratio_vs_fixed"] / ideal, **seen,
                            met=r["ratio_vs_fixed"] >= 0.9 * ideal))
            if r["workload"] == "batch":
                out.append(dict(cell, vs_ouro=r["ratio_vs_ouro"], met=r["ratio_vs_ouro"] >= 1.3))
        elif r["scheduler"] == "fixed" and r["workload"] == "batch":
            out.append(dict(cell, vs_ouro=r["ratio_vs_ouro"], met=r["ratio_vs_ouro"] >= 1.0))
    return [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items()} for t in out]


def print_bench(runs, capacity, pages, U):
    err = sys.stderr
    queue = [r for r in runs if r["workload"] == "queue"]
    if queue:
        print("queue workload (a loaded server):", file=err)
        print(f"{'batch':>5} "
              f"{'scheduler':<11}{'mode':<13}{'head':<7}{'tok/s':>8}{'x fixed':>8}{'U/Ē':>6}{'cost':>6}"
              f"{'Ē dec':>7}{'passes':>8}{'bound':>8}{'ratio':>7}{'head calls':>11}{'rows/call':>10}"
              f"{'KV phys/dense':>16}{'mix win/run':>12}"
              f"{'  x fixed by round' if len(queue[0]['ratio_rounds']) > 1 else ''}", file=err)
        for r in queue:
            ratio = r["passes"] / r["lower_bound"] if r["lower_bound"] else float("nan")
            rounds = r["ratio_rounds"]
            spread = f"  {min(rounds):.2f}-{max(rounds):.2f}" if len(rounds) > 1 else ""
            print(f"{r['batch']:>5} "
                  f"{r['scheduler']:<11}{r['mode']:<13}{r['head']:<7}{r['tok_s']:>8.1f}"
                  f"{r['ratio_vs_fixed']:>8.2f}{r['ideal_ratio']:>6.2f}{r['ideal_cost']:>6.2f}"
                  f"{r['avg_decode_depth']:>7.2f}{r['passes']:>8}{r['lower_bound']:>8.1f}{ratio:>7.3f}"
                  f"{r['head_calls']:>11}{r['rows_per_head_call']:>10.2f}{r['kv_physical']:>8}/{r['kv_dense']:<7}"
                  f"{r['mix_window']:>7.2f}/{r['mix_run']:.2f}{spread}", file=err)
        print("tok/s: from the first request's end to the last admission, fastest of the rounds; "
              "U/Ē and cost: the ideal x fixed by depth alone and by the weight-read cost model "
              "(head calls included); passes and bound (the work-conserving bound) while requests "
              "wait; head calls and rows/call over the whole run",
              file=err)
    batch = [r for r in runs if r["workload"] == "batch"]
    if batch:
        print("fixed-batch workload (exactly B requests, the batch ends with its deepest):", file=err)
        print(f"{'sampling':<9}{'batch':>5} "
              f"{'scheduler':<11}{'mode':<13}{'head':<7}{'tok/s':>8}{'x ouro':>8}"
              f"{'x fixed':>8}{'ideal':>7}{'sched':>7}{'Ē dec':>7}{'passes':>8}{'makespan':>9}{'head calls':>11}"
              f"{'rows/call':>10}{'GB read':>9}{'agree':>7}", file=err)
        for r in batch:
            code = f"  x Ouro's code {r['ratio_vs_ouro_code']:.2f}" if "ratio_vs_ouro_code" in r else ""
            print(f"{r['sampling']:<9}{r['batch']:>5} "
                  f"{r['scheduler']:<11}{r['mode']:<13}{r['head']:<7}"
                  f"{r['tok_s']:>8.1f}{r['ratio_vs_ouro']:>8.2f}{r['ratio_vs_fixed']:>8.2f}{r['ideal_batch']:>7.2f}"
                  f"{r['ideal_schedule']:>7.2f}{r['avg_decode_depth']:>7.2f}{r['passes_total']:>8}"
                  f"{r['makespan_bound']:>9}{r['head_calls']:>11}{r['rows_per_head_call']:>10.2f}"
                  f"{r['weight_gb']:>9.2f}{r['tokens_agree_with_ouro_way']:>7.2f}{code}", file=err)
        print("x ouro: against batched full-depth dense lanes (Ouro's way); ideal: x fixed by the "
              "cost model for a batch that ends with its deepest request (makespan = that "
              "request's passes, one head call per token: a bound); sched: x fixed by the cost "
              "model for the best head schedule found knowing every exit (head_schedule: one that "
              "exists, so the best one lies between sched and ideal); agree: share of tokens equal "
              "to the Ouro way's (fixed@U: all of them, sampled too, each request with its own "
              "seed; ragged modes differ by design); sampling: greedy (lab/eval.py) or the "
              "paper's, temperature 1 and top-p 0.7 (sample.py)", file=err)
    if capacity:
        print(f"capacity: one pool of {pages} KV pages (40% of what fixed@{U} needs for the first "
              "32 requests), every request submitted at once, whole run", file=err)
        print(f"{'scheduler':<11}{'mode':<13}{'req/s':>8}{'tok/s':>8}{'max in flight':>14}{'preemptions':>12}"
              f"{'peak':>6}", file=err)
        for r in capacity:
            print(f"{r['scheduler']:<11}{r['mode']:<13}{r['requests_s']:>8.2f}{r['tok_s_total']:>8.1f}"
                  f"{r['max_in_flight']:>14}{r['preemptions']:>12}{r['peak_pages']:>6}", file=err)


# ---------------------------------------------------------------- engine: depth batching (App. A.2)

def workload(n, prompt_range, output_range, vocab, seed):
    """nano-vllm's benchmark workload: random prompts and output lengths, EOS ignored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=g))
        o = int(torch.randint(output_range[0], output_range[1] + 1, (), generator=g))
        out.append((torch.randint(0, vocab, (p,), generator=g).tolist(), o))
    return out


TURN = 0.05   # bench: seconds one configuration runs before the next takes its turn


def new_counts():
    return dict(passes=0, rows=0, decode_rows=0, prefill_rows=0, steady_passes=0, steady_slots=0,
                steady_decode_rows=0)


def step_logs(e):
    """One engine step, and the Logs its runner returned (engine/contract.Log: the rows each request
    ran in each pass), read from outside: the runner's run is wrapped for the step."""
    run, logs = e.runner.run, []
    e.runner.run = lambda running, queued: logs.extend(run(running, queued)) or logs
    try:
        return e.step(), logs
    finally:
        del e.runner.run                            # its own method again


def counted_step(e, counts):
    """One engine step, counted from outside from its runner's Logs (step_logs). The work-conserving
    bound (App. A.2) is Σ (depths run by requests) / B over the passes in which requests wait,
    enough to fill the batch ("steady"): a scheduler that runs every pass full reaches it. A prompt
    chunk counts as one slot of the batch, as a decode token does; a request's rows are decode rows
    when they started past its prompt (its rows are one chunk: positions started - rows ..)."""
    q = e.scheduler
    steady = len(q.waiting) > 0 and len(q.waiting) + len(q.running) >= q.max_batch
    out, logs = step_logs(e)
    for log in logs:
        ran = [(s, n) for s, n in log.ran if n]
        if not ran:                                   # a shared head call alone: no pass of the block
            continue
        rows = sum(n for _, n in ran)
        dec = sum(n for s, n in ran if s.started - n >= len(s.req.prompt))
        counts["passes"] += 1
        counts["rows"] += rows
        counts["decode_rows"] += dec
        counts["prefill_rows"] += rows - dec
        if steady:
            counts["steady_passes"] += 1
            counts["steady_slots"] += len(ran)      # requests that ran a depth (a chunk: one slot)
            counts["steady_decode_rows"] += dec
    return out


def bench_runs(model, work, configs, thr, batch, kv_pages, max_rows, attn, bar=None, seed=0):
    """Every (scheduler, mode, head) in configs serves the whole workload on its own engine and
    pool; the engines take turns of about TURN seconds of steps until all are done, the next turn
    going to the engine least far through the workload (tokens sampled so far; ties in a seeded
    random order). Turns let a slow spell of a shared machine fall on every configuration alike, and
    keeping them level lets no configuration run a stretch of the machine's time alone
    (docs/benchmarks.md). Returns their records. bar: a tqdm of requests done."""
    order = random.Random(seed)
    total = sum(o for _, o in work)
    runs = []
    for scheduler, mode, head in configs:
        e = Engine(model, kv_pages, max_batch=batch, max_rows=max_rows, scheduler=scheduler,
                   attn=attn, head=head)
        reqs = [e.add(Request(p, o, mode, thr)) for p, o in work]
        runs.append(dict(engine=e, reqs=reqs, counts=new_counts(), seconds=0.0, window_seconds=0.0,
                         window_rows=[0, 0], window_tokens=[]))
    progress = lambda run: (sum(len(r.tokens) for r in run["reqs"]) / total, order.random())
    while any(run["engine"].busy() for run in runs):
        run = min((run for run in runs if run["engine"].busy()), key=progress)
        turn, done = time.perf_counter(), run["engine"].stats["finished"]
        timed_step(run)                                       # a turn is at least one step
        while run["engine"].busy() and time.perf_counter() - turn < TURN:
            timed_step(run)
        if bar is not None:
            bar.update(run["engine"].stats["finished"] - done)
    return [bench_record(run, thr, batch) for run in runs]


def timed_step(run):
    """One engine step, timed; counted in the throughput window from the end of the first request
    to the last admission."""
    e, counts = run["engine"], run["counts"]
    measured = len(e.scheduler.waiting) > 0 and e.stats["finished"] > 0
    before = counts["prefill_rows"], counts["decode_rows"]
    t0 = time.perf_counter()
    out = counted_step(e, counts)
    dt = time.perf_counter() - t0
    run["seconds"] += dt
    if measured:
        run["window_seconds"] += dt
        run["window_tokens"] += [(r, len(r.tokens) - 1) for r, _ in out]   # (request, index) of every token
        run["window_rows"][0] += counts["prefill_rows"] - before[0]
        run["window_rows"][1] += counts["decode_rows"] - before[1]


def bench_record(run, thr, batch):
    """The record of one engine's run for the JSON line.

    tok_s is a loaded server's: from the end of the first request to the last admission, where
    prompt and decode rows come in the workload's proportion (mix_window against mix_run); Ē and the
    ideal ratio are those of the tokens sampled in that window. passes and the work-conserving bound
    count the passes while requests waited, enough to fill the batch. The whole run, tail included,
    is in tok_s_total and passes_total."""
    e, reqs, seconds, window_seconds = run["engine"], run["reqs"], run["seconds"], run["window_seconds"]
    U, s, mode = e.U, {**e.stats, **run["counts"]}, reqs[0].mode
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs if r.error][:1]
    dec = [x for r in reqs for x in r.decode_exits]
    kv_physical, sum_exits = sum(r.kv["physical"] for r in reqs), sum(sum(r.exits) for r in reqs)
    if s["preemptions"] == 0:   # pages are exactly Σ e_i (prompt rows at depth U in Dense-Ragged)
        assert kv_physical == sum_exits == s["rows"], (kv_physical, sum_exits, s["rows"])
    tokens = sum(len(r.tokens) for r in reqs)
    avg_run = sum(dec) / max(len(dec), 1)
    # token i was sampled at decode row i - 1
    win = [r.decode_exits[i - 1] for r, i in run["window_tokens"] if i > 0]
    avg = sum(win) / len(win) if win else avg_run
    return dict(scheduler=e.scheduler.kind, mode=mode, head=e.runner.head, thr=None
                if mode == "fixed" else thr, batch=batch,
                tok_s=len(run["window_tokens"]) / window_seconds if window_seconds else None,
                tok_s_total=tokens / seconds, seconds=seconds, window_seconds=window_seconds,
                mix_window=run["window_rows"][0] / max(run["window_rows"][1], 1),
                mix_run=s["prefill_rows"] / max(s["decode_rows"], 1),
                requests_s=len(reqs) / seconds, passes=s["steady_passes"],
                lower_bound=s["steady_slots"] / batch, decode_bound=s["steady_decode_rows"] / batch,
                passes_total=s["passes"], avg_decode_depth=avg, ideal_ratio=U / avg,
                avg_decode_depth_run=avg_run,
                kv_physical=kv_physical, kv_dense=sum(r.kv["dense"] for r in reqs),
                sum_exits=sum_exits,
                peak_pages=e.pool.peak, max_in_flight=s["max_in_flight"],
                preemptions=s["preemptions"], tokens=tokens, row_depths=s["rows"],
                head_calls=s["head_calls"],
                rows_per_head_call=s["head_rows"] / max(s["head_calls"], 1),
                **cost(U, weight_bytes(e.model), s["passes"], s["head_calls"], avg))


def fastest(records):
    """Of repeated runs of one configuration, the fastest (contention only ever slows a run down)."""
    return max(records, key=lambda r: r["tok_s"])


def keep_heap():
    """Keep freed CPU buffers in the process. glibc hands out buffers of a few MB (the K/V gathers
    of a pass) by mmap, returns them at free and adapts its threshold only as it goes: until it has,
    every pass page-faults its buffers in afresh, which would time the allocator, not the engine
    (docs/benchmarks.md). Linux/glibc only; elsewhere a no-op."""
    try:
        import ctypes
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)      # buffers up to 32 MiB come from the heap
    mallopt(M_TRIM_THRESHOLD, 1 << 30)       # and freed heap stays mapped (up to 1 GiB)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=engine runs it")

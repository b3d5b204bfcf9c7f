"""
The engine on a GPU at Ouro-1.4B's shape: graphed (engine/slots.py) and eager (serve_depthbatch.py),
against the Ouro way graphed and eager, and against the weight-read ceiling; and what the graphed pass
costs, counted on any device.

    python -m lab.bench --what=gpu --device=cuda --out=results/bench/engine-ouro1.4b-h200.json   # one H200: ~5 min
    python -m lab.bench --what=gpu --gpu_shape=tiny                                             # the same code on a CPU

The model: a random model of Ouro-1.4B's exact shape (24 layers of 2048, 16 heads, FFN 5632,
vocabulary 49,152, U = 4, bf16), its exit gate's bias set so that Eq. 4 at τ 0.5 puts the prompt
tokens' mean exit depth at 2.6 (decode Ē is measured and printed).

Counted first, on any device (counts): the GEMMs and launches of a layer, of the whole pass and of
finish_rows, read from Inductor's own scheduling of the pass the engine captures, in the mode it
captures it (its Triton backend, what CUDA runs; stopped before code generation, so a CPU counts it
too, the CUDA graph API stood in); the paged attention's launches at 4,096 keys; the host-to-device
copies and syncs of a steady decode step (HostTraffic); the passes launched against those with rows.

Three workloads, greedy: a fixed batch of B requests (32-token prompts, 32 new tokens; it ends with
its slowest request, so at batch 8 and 32 one request that runs deep sets the pass count), a queue of
4B requests of random lengths through B slots, all waiting at the start (a backlog: it measures the
requests a second the engine can serve), and the same requests arriving as a server sees them, a
Poisson process at 50% and 90% of that capacity, with each client's time to its first token and
between its tokens (p50, p99). Configurations: the Ouro way
(lab/ouro_way.py: every token all U loops on dense lanes, one head call per step) eager and graphed
(StaticLanes: the step compiled whole, one graph for the prompt, one for a decode step: U passes and
the head), fixed batch only; the engine's fixed@U, Dense-Ragged and ETE-Ragged, eager (Engine) and
graphed (the slot runner: the pass compiled whole, every bucket captured when it starts). The ceiling:
decode reading the weights at 4.3 TB/s, context and compute ignored: fixed@U (and the Ouro way)
B / (U·t_W + t_h) tok/s, a ragged mode B / (Ē·(t_W + t_h)) (its head runs on every pass), t_W and t_h
the time to read the block's and the LM head's weights; a run's efficiency is the time those weight
reads take, (passes·t_W + head calls·t_h) / wall, so that engine overhead shows apart from the
workload. Before timing: the graphed slot engine against the same passes without graphs (the same
kernels: equal tokens and exits), and the graphed Ouro way against graphed fixed@U (greedy tokens;
they compute alike but not bit for bit).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.bench_gpu ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import math
import os
import random
import sys
import time

import torch

from configurator import split_list
from kernels import splits_for
from lab import gpu_counts
from lab.gpu_counts import captured_launches, inductor_launches
from lab.ouro_way import OuroWay, ouro_way
from model import GPTConfig, LoopedLM, fuse_projections, threshold_exit
from ragged import PagePool, pool_pages
from engine.request import Request
from engine.shared_head import weight_bytes
from engine.build import engine_for
from serve_depthbatch import Engine
from engine.slot_pass import Slots, finish_rows

SHAPES = {   # the model of the run; "tiny" runs the same code on a CPU in seconds
    "ouro1.4b": dict(vocab_size=49152, n_layer=24, n_head=16, n_kv_head=16, n_embd=2048,
                     ffn_hidden=5632),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=4, n_embd=64, ffn_hidden=176),
}
BANDWIDTH = 4.3e12          # bytes/s: an H200's HBM3e, as the ceiling arithmetic takes it (docs/benchmarks.md)
PAPER_H100_EAGER = {        # the paper's Table of matched eager H100 runs, tok/s: (fixed@4, ragged at τ 0.3)
    1: (25.0, 41.1), 4: (100.5, 135.3), 8: (205.5, 241.2), 32: (807.9, 773.2)}
N_PROMPT, N_NEW, THR, TARGET_DEPTH = 32, 32, 0.5, 2.6
QUEUE_PER_SLOT = 4          # the queue: this many requests per slot, prompts of 8..N_PROMPT, 8..N_NEW new tokens
ARRIVAL_SHARES = (0.5, 0.9)   # arrivals at these shares of the requests a second the queue measured


def ouro_shape_model(shape, device, seed, prompts, n_layer=None):
    """A random model of the shape (n_layer: another depth of block), built on the device in bf16 on
    CUDA (fp32 on a CPU), normalized between loops as Ouro's models are; the gate's bias shifted so
    that the prompts' mean exit depth at τ 0.5 is TARGET_DEPTH (bisection on the shift: the gate
    logits move with it, nothing reruns)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**dict(SHAPES[shape], **({"n_layer": n_layer} if n_layer else {})),
                    block_size=N_PROMPT + N_NEW + 8, n_loops=4, loop_norm=True,
                    branch_norm_init=1.0)
    with torch.device(device):
        model = LoopedLM(cfg).eval()
    if torch.device(device).type == "cuda":
        model = model.to(torch.bfloat16)
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 1.5 / math.sqrt(cfg.n_embd))
        gates = model(torch.tensor(prompts, device=device))["gate_logits"].float()
        lo, hi = -20.0, 20.0
        for _ in range(40):
            mid = (lo + hi) / 2
            depth = threshold_exit(gates + mid, THR).float().mean()
            lo, hi = (lo, mid) if depth < TARGET_DEPTH else (mid, hi)
        model.early_exit_gate.bias.fill_(lo)
    return model.requires_grad_(False)


# ---------------------------------------------------------------------------- counted on any device

def kernel_counts(shape, R=2, device="cpu"):
    """Launches of the captured pass at the shape (rows R, the smallest bucket): a layer's GEMMs and
    launches (a pass of two layers less a pass of one: the layer in the middle of the block, its
    last norm fused with the next layer's first); the whole pass of the shape's n_layer layers,
    counted, not extrapolated; finish_rows's alone (the exits, the head, the aliases, the rows' next
    state), in the same inference mode; and the paged attention's launches at the shape's context
    and at 4,096 keys (two where flash-decoding splits the keys: kernels.splits_for)."""
    passes = {}
    n_layer = SHAPES[shape]["n_layer"]
    for L in sorted({1, 2, n_layer}):
        model = ouro_shape_model(shape, device, 0, [[0]], n_layer=L)
        passes[L] = captured_launches(model)
    st = Slots(fuse_projections(model), PagePool.for_model(model, 64), 2 * R, 2,
               model.config.block_size, 8)
    with inductor_launches() as finish, torch.inference_mode():
        torch.compile(lambda st, R: finish_rows(model, st, R, st.h[:R][None], True, "greedy"),
                      dynamic=True, fullgraph=True)(st, R)
    layer = {k: passes[2].count(k) - passes[1].count(k) for k in ("kernel", "gemm", "op")}
    hkv = SHAPES[shape]["n_kv_head"]
    attention = {n: 1 + (splits_for(R * hkv, n, 32) > 1) for n in (model.config.block_size, 4096)}
    return dict(rows=R, gemms_per_layer=layer["gemm"], launches_per_layer=sum(layer.values()),
                layer=layer, launches_per_pass=len(passes[n_layer]),
                finish_rows_launches=len(finish), attention_launches_by_keys=attention)


def host_counts(model, B, mode="ete_ragged", graphs=False, queue=False):
    """gpu_counts.host_counts on the fixed batch of B requests (N_PROMPT-token prompts, N_NEW new
    tokens, greedy) or on the queue (queue_requests: 4B requests through B slots)."""
    if queue:
        work = queue_requests(B, model.config.vocab_size, 0, mode)
    else:
        g = torch.Generator().manual_seed(B)
        work = [Request(p, N_NEW, mode, THR) for p in
                torch.randint(0, model.config.vocab_size, (B, N_PROMPT), generator=g).tolist()]
    return gpu_counts.host_counts(model, work, B, B * N_PROMPT, "fixed" if mode == "fixed"
                                  else "continuous", graphs)


def counts(shape, device, batches):
    """Everything counted: kernel_counts at the smallest bucket (batch 1's), host_counts at each
    batch (ETE-Ragged), on the fixed batch and on the queue."""
    out = {"kernels": kernel_counts(shape, device=device)}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, SHAPES[shape]["vocab_size"], (max(batches), N_PROMPT), generator=g).tolist()
    model = ouro_shape_model(shape, device, 0, prompts)
    cuda = torch.device(device).type == "cuda"
    out["host"] = {B: host_counts(model, B, graphs=cuda) for B in batches}
    out["host_queue"] = {B: host_counts(model, B, graphs=cuda, queue=True) for B in batches}
    return out


# ----------------------------------------------------------------------------- timed runs

def queue_requests(B, vocab, seed, mode):
    """The queue: QUEUE_PER_SLOT * B requests of random lengths (prompts of 8..N_PROMPT tokens,
    8..N_NEW new tokens), the same for every configuration of a batch size."""
    rng = random.Random(seed * 1000 + B)
    return [Request([rng.randrange(vocab) for _ in range(rng.randint(8, N_PROMPT))],
                    rng.randint(8, N_NEW), mode, THR) for _ in range(QUEUE_PER_SLOT * B)]


def run_config(model, prompts, config, runner, queue=None):
    """One timed run of a configuration, on the fixed batch (prompts) or the queue (a list of
    requests to copy); returns (seconds, tokens, what it ran)."""
    kind, mode, graphs = config
    U = model.config.n_loops
    sync = torch.cuda.synchronize if model.lm_head.weight.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if kind == "ouro_way":
        tokens = runner.generate(prompts) if graphs else ouro_way(model, prompts, N_NEW)
        sync()
        passes, sum_exits = U * N_NEW, U * len(prompts) * (N_PROMPT + N_NEW - 1)
        return time.perf_counter() - t0, tokens, dict(passes=passes, launched=passes,
                                                      head_calls=N_NEW, depth=float(U),
                                                      sum_exits=sum_exits)
    before = dict(runner.stats)
    work = ([Request(r.prompt, r.max_tokens, mode, THR) for r in queue] if queue is not None else
            [Request(p, N_NEW, mode, THR) for p in prompts])
    reqs = runner.run(work)
    sync()
    seconds = time.perf_counter() - t0
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    dec = [x for r in reqs for x in r.decode_exits]
    # the eager runner launches what runs
    launched = lambda stats: stats.get("launched", stats["passes"])
    return seconds, [r.tokens for r in reqs], dict(
        passes=runner.stats["passes"] - before["passes"],
        launched=launched(runner.stats) - launched(before),
        head_calls=runner.stats["head_calls"] - before["head_calls"],
        depth=sum(dec) / len(dec), exits=[r.exits for r in reqs],
        sum_exits=sum(sum(r.exits) for r in reqs))


def build(model, B, config, workload):
    """What runs a configuration, kept for all its runs (so that graphs are captured once): graphs
    True: CUDA graphs of the compiled passes; "ready": the graph-ready code without graphs (a CPU);
    False: the eager engine (serve_depthbatch.Engine) or ouro_way."""
    kind, mode, graphs = config
    scheduler = "fixed" if mode == "fixed" else "continuous"
    longest = N_PROMPT + N_NEW
    pages, rows = B * longest * model.config.n_loops, B * N_PROMPT
    if kind == "ouro_way":
        return OuroWay(model, B, graphs is True, N_PROMPT, N_NEW) if graphs else None
    if not graphs:
        return Engine(model, pages, max_batch=B, max_rows=rows, scheduler=scheduler)
    return Engine(model, pages, runner="slots", max_batch=B, max_rows=rows, scheduler=scheduler,
                  graphs=graphs is True,
                      fuse=graphs is True, sampling=("greedy",))


def time_configs(model, prompts, configs, rounds, queue=None):
    """Every configuration on one workload: a warm-up run (it compiles; the slot engine captured its
    graphs when built), then `rounds` rounds in turns (an eager run once: eager runs are slow and
    steady). The fastest of each."""
    B = len(prompts)
    runners = {cf: build(model, B, cf, queue) for cf in configs}
    results = {}
    for cf in configs:
        t0 = time.perf_counter()
        results[cf] = [run_config(model, prompts, cf, runners[cf], queue)]
        print(f"  batch {B} {'queue' if queue else 'batch'} {cf}: warm-up "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for i in range(rounds):
        for cf in configs:
            if cf[2] is not False or i == 0:
                results[cf].append(run_config(model, prompts, cf, runners[cf], queue))
    return {cf: min(rs, key=lambda r: r[0]) for cf, rs in results.items()}


def arrivals(runner, requests, rate, seed):
    """A server's workload: the requests arriving at `rate` a second (a Poisson process: exponential
    gaps, seeded), each added to the engine when its time comes, the engine stepping in between (and
    waiting for the next arrival when it has nothing to do). Per request, as its client sees the
    tokens come: the time from its arrival to its first token (TTFT) and between its tokens as
    delivered (TBT: a step's passes are read and delivered together, so tokens come in bursts);
    beside them what decoding takes, the time a step that launched passes spans on the device
    (step_span); the p50 and p99 of each, and the passes launched and with rows."""
    rng, t, times = random.Random(seed), 0.0, []
    for _ in requests:
        t += rng.expovariate(rate)
        times.append(t)
    seen, before = {}, dict(runner.stats)
    on_token = lambda r, tok: seen.setdefault(id(r), []).append(time.perf_counter()) if tok is not None else None
    reqs = [Request(r.prompt, r.max_tokens, r.mode, r.thr, on_token=on_token) for r in requests]
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    sync()
    start, i, spans = time.perf_counter(), 0, []
    launched = lambda: runner.stats.get("launched", runner.stats["passes"])
    while i < len(reqs) or runner.busy():
        now = time.perf_counter() - start
        while i < len(reqs) and times[i] <= now:
            runner.add(reqs[i])
            i += 1
        if runner.busy():
            n = launched()
            span = step_span(runner)
            if launched() > n:
                spans.append(span)
        elif i < len(reqs):
            time.sleep(times[i] - now)
    sync()
    steps = [s if isinstance(s, float) else s[0].elapsed_time(s[1]) / 1e3 for s in spans]
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    ttft = [seen[id(r)][0] - start - a for r, a in zip(reqs, times)]
    tbt = [b - a for r in reqs for a, b in zip(seen[id(r)], seen[id(r)][1:])]
    q = lambda xs, p: round(1e3 * sorted(xs)[min(len(xs) - 1, int(p * len(xs)))], 3)
    return dict(requests=len(reqs), rate=round(rate, 3),
                seconds=round(time.perf_counter() - start, 4),
                ttft_ms_p50=q(ttft, 0.5), ttft_ms_p99=q(ttft, 0.99), tbt_ms_p50=q(tbt, 0.5),
                tbt_ms_p99=q(tbt, 0.99), step_ms_p50=q(steps, 0.5), step_ms_p99=q(steps, 0.99),
                steps=len(steps), passes=runner.stats["passes"] - before["passes"],
                passes_launched=runner.stats.get("launched", runner.stats["passes"]) - before.get(
                    "launched", before["passes"]))


def step_span(engine):
    """One engine step, and the time it spans on the device: two CUDA events recorded on the
    device's stream around its launches, read once the run is over (so nothing waits for them), or
    on a CPU, where the host runs the passes, its wall time in seconds."""
    if engine.device.type != "cuda":
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t
    with torch.cuda.device(engine.device):
        marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks[0].record()
        engine.step()
        marks[1].record()
    return marks


def server_start(model):
    """How long a server's engine with its defaults takes from construction to ready (on a GPU:
    every compile and the capture of every bucket, kind of pass and draw)."""
    started = time.perf_counter()
    engine = engine_for(model, pool_pages(model, 0, 0, 32), 32, 256)
    graphs = getattr(engine.runner, "graphs", None)
    start = dict(seconds=round(time.perf_counter() - started, 4),
                 runner=type(engine.runner).__name__, graphs=len(graphs.graphs) if graphs else 0)
    print(f"a server's engine with its defaults ({start['runner']}, "
          f"{start['graphs']} graphs) ready in " f"{start['seconds']:.1f} s", file=sys.stderr)
    return start


def replay_checks(model, prompts, best):
    """Graphs replay exactly what the same passes compute: the slot engine without graphs (the same
    kernels) gives the graphed runs' tokens, and exits, in every mode."""
    B, U, checks = len(prompts), model.config.n_loops, []
    for mode in ("fixed", "dense_ragged", "ete_ragged"):
        plain = Engine(model, B * (N_PROMPT + N_NEW) * U, runner="slots", max_batch=B,
                       max_rows=B * N_PROMPT,
                           scheduler="fixed" if mode == "fixed" else "continuous", graphs=False,
                       fuse=True)
        reqs = plain.run([Request(p, N_NEW, mode, THR) for p in prompts])
        _, tokens, st = best["engine", mode, True]
        same = [r.tokens for r in reqs] == tokens and (mode == "fixed"
                                                       or [r.exits for r in reqs] == st["exits"])
        checks.append(dict(batch=B, check=f"{mode}: graph replays = the same passes without graphs",
                           equal=same))
    return checks


def rows_of(best, B, workload, t_w, t_h, U):
    """The JSON rows of one workload's runs: speed, passes, Σ e, time a pass, efficiency, the
    ceiling and the ratios against graphed fixed@U and the Ouro way."""
    graphed = next(g for (_, _, g) in best if g is not False)
    ref_fixed = best["engine", "fixed", graphed]
    ref_ouro, ouro_eager = best.get(("ouro_way", "fixed", graphed)), best.get(("ouro_way", "fixed", False))
    rows = []
    for (kind, mode, gr), (seconds, tokens, st) in best.items():
        n_tok = sum(len(t) for t in tokens)
        tok_s = n_tok / seconds
        ceiling = B / (U * t_w + t_h) if mode == "fixed" else B / (st["depth"] * (t_w + t_h))
        row = dict(workload=workload, batch=B, mode="ouro_way" if kind == "ouro_way" else mode,
                   graphs=gr is True,
                   graph_ready=gr is not False, tok_s=round(tok_s, 2), seconds=round(seconds, 5),
                   tokens=n_tok,
                   pass_ms=round(1e3 * seconds / st["passes"], 4), passes=st["passes"],
                   passes_launched=st["launched"], head_calls=st["head_calls"],
                   sum_exits=st["sum_exits"], avg_decode_depth=round(st["depth"], 3),
                   efficiency=float(f"{(st['passes'] * t_w + st['head_calls'] * t_h) / seconds:.4g}"),
                   ceiling_tok_s=round(ceiling, 1),
                   ceiling_fraction=float(f"{tok_s / ceiling:.4g}"),
                   x_fixed_graphed=round(ref_fixed[0] / seconds * n_tok / sum(len(t) for t in ref_fixed[1]), 4),
                   paper_h100_eager=PAPER_H100_EAGER.get(B, (None, None))[0 if mode == "fixed" else 1])
        if ref_ouro is not None:
            row.update(x_ouro_way_graphed=round(ref_ouro[0] / seconds, 4),
                       x_ouro_way_eager=round(ouro_eager[0] / seconds, 4))
        rows.append(row)
    return rows


def bench_gpu(c):
    device = c["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda"
    batches = split_list("batches", c["batches"] or "1,8,32", int)
    g = torch.Generator().manual_seed(c["seed"])
    vocab = SHAPES[c["gpu_shape"]]["vocab_size"]
    prompts = {B: torch.randint(0, vocab, (B, N_PROMPT), generator=g).tolist() for B in batches}
    t_start = time.perf_counter()
    counted = counts(c["gpu_shape"], device, batches)
    print(f"counted in {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    model = ouro_shape_model(c["gpu_shape"], device, c["seed"], prompts[max(batches)])
    fuse_projections(model)
    wb, wh = weight_bytes(model)
    t_w, t_h = wb / BANDWIDTH, wh / BANDWIDTH
    U = model.config.n_loops
    print(f"model: {c['gpu_shape']} ({model.num_params() / 1e9:.3f} B parameters, {model.lm_head.weight.dtype}) on "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; block {wb / 1e9:.3f} GB = {1e3 * t_w:.3f} ms at "
          f"{BANDWIDTH / 1e12:.1f} TB/s, head {wh / 1e9:.3f} GB = {1e3 * t_h:.3f} ms; gate bias "
          f"{float(model.early_exit_gate.bias):.3f}", file=sys.stderr)
    start = server_start(model)
    engines = [("engine", "fixed"), ("engine", "dense_ragged"), ("engine", "ete_ragged")]
    ready = [True, False] if cuda else ["ready", False]     # on a CPU: the graph-ready code without graphs
    batch_configs = [(k, m, gr) for gr in ready for k, m in [("ouro_way", "fixed")] + engines]
    queue_configs = [(k, m, gr) for gr in ready[:1] for k, m in engines]
    runs, checks, arrived, rounds = [], [], [], max(c["rounds"], 3)
    for B in batches:
        best = time_configs(model, prompts[B], batch_configs, rounds)
        graphed = True if cuda else "ready"
        agree = sum(a == b for x, y in zip(best["engine", "fixed", graphed][1], best["ouro_way", "fixed", graphed][1])
                    for a, b in zip(x, y)) / (B * N_NEW)
        checks.append(dict(batch=B, check="graphed fixed@U = graphed Ouro way, greedy tokens", agree=agree))
        runs += rows_of(best, B, "batch", t_w, t_h, U)
        if cuda:
            checks += replay_checks(model, prompts[B], best)
        queue = {m: queue_requests(B, vocab, c["seed"], m) for _, m in engines}
        best = {cf: time_configs(model, prompts[B], [cf], rounds, queue[cf[1]])[cf] for cf in queue_configs}
        runs += rows_of(best, B, "queue", t_w, t_h, U)
        for cf in queue_configs:                # arrivals at a share of what the queue measured it can serve
            capacity, runner = len(queue[cf[1]]) / best[cf][0], build(model, B, cf, "arrivals")
            for share in ARRIVAL_SHARES:
                row = arrivals(runner, queue[cf[1]], share * capacity, c["seed"] + B)
                arrived.append(dict(workload="arrivals", batch=B, mode=cf[1], graphs=cf[2] is True, share=share,
                                    capacity_req_s=round(capacity, 3), **row))
        print(f"  batch {B} done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    print_gpu(runs, checks, counted, arrived)
    out = {"bench": "engine-gpu", "model": c["gpu_shape"], "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "prompt_len": N_PROMPT, "new_tokens": N_NEW, "thr": THR,
           "gate_bias": float(model.early_exit_gate.bias), "bandwidth": BANDWIDTH, "block_bytes": wb, "head_bytes": wh,
           "seconds": round(time.perf_counter() - t_start, 1), "counts": counted, "checks": checks, "runs": runs,
           "arrivals": arrived, "server_engine_start": start}
    if c["out"]:
        os.makedirs(os.path.dirname(os.path.abspath(c["out"])), exist_ok=True)
        with open(c["out"], "w") as f:
            json.dump(out, f, indent=1)
    return out


def print_gpu(runs, checks, counted, arrived=()):
    err = sys.stderr
    k = counted["kernels"]
    print(f"counted (Inductor's Triton scheduling of the captured pass, {k['rows']} rows): a layer "
          f"{k['launches_per_layer']} launches ({k['gemms_per_layer']} GEMMs, {k['layer']['op']} "
          f"paged attention, {k['layer']['kernel']} fused kernels); the whole pass "
          f"{k['launches_per_pass']}; finish_rows {k['finish_rows_launches']}; the paged attention "
          + ", ".join(f"{n} launch(es) at {keys} keys"
                      for keys, n in k["attention_launches_by_keys"].items()),
          file=err)
    for B, h in counted["host"].items():
        print(f"counted, batch {B}: per steady decode step {h['h2d_per_steady_step']} "
              f"host-to-device copies, {h['syncs_per_steady_step']} syncs, "
              f"{h['launches_per_steady_step']} launches outside the graphs ({h['steady_steps']} "
              f"steps); passes launched {h['passes_launched']} for "
              f"{h['passes_with_rows']} with rows", file=err)
    for B, h in counted.get("host_queue", {}).items():
        print(f"counted, queue of {4 * B} through {B} slots: {100 * h['drained_share']:.1f}% of "
              "the passes read with "
              f"none behind them, host {h['host_ms_per_pass']:.3f} ms a pass, "
              f"{h['launches_outside_graphs_per_step']} "
              f"launches outside the graphs a step ({h['launches_admitting']} in the one that admits "
              f"the batch); passes launched {h['passes_launched']} for "
              f"{h['passes_with_rows']} with rows", file=err)
    print(f"{'work':<6}{'batch':>5} "
          f"{'mode':<13}{'graphs':<7}{'tok/s':>9}{'passes':>7}{'Σ e':>7}{'pass ms':>9}"
          f"{'eff':>6}{'Ē dec':>7}{'ceiling':>9}{'of it':>7}{'x fixed g':>10}{'x ouro g':>9}{'x ouro e':>9}"
          f"{'paper':>8}",
          file=err)
    for r in runs:
        paper = f"{r['paper_h100_eager']:.1f}" if r["paper_h100_eager"] else "-"
        ouro = (f"{r['x_ouro_way_graphed']:>9.2f}{r['x_ouro_way_eager']:>9.2f}"
                if "x_ouro_way_graphed" in r else f"{'-':>9}{'-':>9}")
        print(f"{r['workload']:<6}{r['batch']:>5} "
              f"{r['mode']:<13}{str(r['graphs']):<7}{r['tok_s']:>9.1f}"
              f"{r['passes']:>7}{r['sum_exits']:>7}{r['pass_ms']:>9.3f}{r['efficiency']:>6.2f}"
              f"{r['avg_decode_depth']:>7.2f}{r['ceiling_tok_s']:>9.1f}{r['ceiling_fraction']:>7.3f}"
              f"{r['x_fixed_graphed']:>10.2f}{ouro}{paper:>8}", file=err)
    for a in arrived:
        print(f"arrivals, batch {a['batch']} {a['mode']:<13} at {a['share']:.0%} of "
              f"{a['capacity_req_s']:.2f} req/s: TTFT p50 {a['ttft_ms_p50']:.2f} / p99 "
              f"{a['ttft_ms_p99']:.2f} ms, TBT p50 {a['tbt_ms_p50']:.2f} / p99 "
              f"{a['tbt_ms_p99']:.2f} ms as delivered; a step on the device p50 "
              f"{a['step_ms_p50']:.2f} / p99 {a['step_ms_p99']:.2f} ms; passes launched {a['passes_launched']} "
              f"for {a['passes']} with rows", file=err)
    for ch in checks:
        print(f"check, batch {ch['batch']}: {ch['check']}: {ch.get('agree', ch.get('equal'))}", file=err)
    print("batch: B requests of 32 + 32 tokens; queue: 4B requests of random lengths through B "
          "slots. tok/s: new tokens over the whole run (prompts included), fastest of the rounds; "
          "Σ e: block applications to tokens; eff: the weight reads' own time (passes x block + "
          "head calls x head, at the bandwidth) over the wall time; ceiling: decode reading the "
          "weights at the bandwidth (fixed and the Ouro way U passes and one head a token, ragged "
          "Ē passes and heads); x fixed g / x ouro g / x ouro e: speed against graphed fixed@U, "
          "the graphed and the eager Ouro way; paper: its eager H100 runs "
          "(fixed@4, ragged at τ 0.3)", file=err)


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=gpu runs it")

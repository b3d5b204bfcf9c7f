"""
The engine on a GPU at Ouro-1.4B's shape: graphed (slot_engine.py) and eager (serve_depthbatch.py),
against the Ouro way graphed and eager, and against the weight-read ceiling.

    python bench.py --what=gpu --device=cuda --out=results/bench/engine-ouro1.4b-h200.json   # one H200: ~5 min
    python bench.py --what=gpu --gpu_shape=tiny                                             # the same code on a CPU

The model: a random model of Ouro-1.4B's exact shape (24 layers of 2048, 16 heads, FFN 5632,
vocabulary 49,152, U = 4, bf16), its exit gate's bias set so that Eq. 4 at τ 0.5 puts the prompt
tokens' mean exit depth at 2.6 (decode Ē is measured and printed). The workload: a fixed batch of B
requests, 32-token prompts, 32 new tokens, greedy; tok/s over the whole run, prompt included.
Configurations: the Ouro way (ouro_way: every token all U loops on dense lanes, one head call
per step) eager and graphed (StaticLanes: one graph for the prompt, one for a decode step: U passes
and the head); the engine's fixed@U, Dense-Ragged and ETE-Ragged, eager (Engine) and graphed
(SlotEngine: compiled phases, a graph per bucket). The ceiling: decode reading the weights at
4.3 TB/s, context and compute ignored: fixed@U (and the Ouro way) B / (U·t_W + t_h) tok/s, a ragged
mode B / (Ē·(t_W + t_h)) (its head runs on every pass), t_W and t_h the time to read the block's
and the LM head's weights. Before timing: the graphed slot engine against the same passes without
graphs (the same kernels: equal tokens and exits), and the graphed Ouro way against graphed fixed@U
(greedy tokens; they compute alike but not bit for bit).
"""
import json
import math
import os
import sys
import time

import torch

from model import GPTConfig, LoopedLM, attention, forward_lanes, threshold_exit
from ragged import DenseLanes, StaticLanes
from request import Request, sample_token
from serve_depthbatch import Engine, weight_bytes
from slot_engine import SlotEngine
from slot_pass import Graphs
from slot_pass import PLAIN, compiled_phases

SHAPES = {   # the model of the run; "tiny" runs the same code on a CPU in seconds
    "ouro1.4b": dict(vocab_size=49152, n_layer=24, n_head=16, n_kv_head=16, n_embd=2048, ffn_hidden=5632),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=4, n_embd=64, ffn_hidden=176),
}
BANDWIDTH = 4.3e12          # bytes/s: an H200's HBM3e, as the ceiling arithmetic takes it (docs/benchmarks.md)
PAPER_H100_EAGER = {        # the paper's Table of matched eager H100 runs, tok/s: (fixed@4, ragged at τ 0.3)
    1: (25.0, 41.1), 4: (100.5, 135.3), 8: (205.5, 241.2), 32: (807.9, 773.2)}
N_PROMPT, N_NEW, THR, TARGET_DEPTH = 32, 32, 0.5, 2.6


def ouro_shape_model(shape, device, seed, prompts):
    """A random model of the shape, built on the device in bf16 on CUDA (fp32 on a CPU), normalized
    between loops as Ouro's models are; the gate's bias shifted so that the prompts' mean exit depth
    at τ 0.5 is TARGET_DEPTH (bisection on the shift: the gate logits move with it, nothing reruns)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**SHAPES[shape], block_size=N_PROMPT + N_NEW + 8, n_loops=4, loop_norm=True, branch_norm_init=1.0)
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


def ouro_way(model, prompts, n_new, temperature=0.0, top_p=1.0):
    """The baseline a user compares against: batched full-depth generation as Ouro's own code does
    it: every token runs all U loops on dense per-depth KV lanes, one LM-head call per step for the
    whole batch. prompts: equal lengths (no padding). Row i samples with seed i, as the engine's
    requests of seeds 0..B-1 do (request.sample_token: the same draws)."""
    U, dev = model.config.n_loops, model.lm_head.weight.device
    cache = DenseLanes(model, U, len(prompts[0]) + n_new, batch=len(prompts))
    idx, pos, out = torch.tensor(prompts, device=dev), 0, []
    with torch.inference_mode():
        for _ in range(n_new):
            states, _ = forward_lanes(model, idx, cache, pos, U)
            pos += idx.shape[1]
            logits = model.lm_head(states[-1])
            if temperature == 0:
                idx = logits.argmax(-1)[:, None]
            else:
                idx = torch.tensor([[sample_token(lg, temperature, 0, top_p, i, pos - 1)]
                                    for i, lg in enumerate(logits)], device=dev)
            out.append(idx[:, 0])
    return torch.stack(out, 1).tolist()


def lanes_step(model, lanes, ids, phases, exit_heads):
    """One step of the Ouro way on static lanes: the chunk `ids` [B, T] through all U loops, each
    layer's halves (compiled or not) around attention over its lane, then the greedy token of the
    last position. The same maths as model.generate's lanes (test_bench.py checks the tokens)."""
    h = model.embed_tokens(ids)
    cos, sin = model.rope(lanes.pos + torch.arange(ids.shape[1], device=ids.device), h.dtype)
    for d in range(model.config.n_loops):
        lanes.begin(d)
        for i, layer in enumerate(model.layers):
            q, k, v = phases.before(layer, h, cos, sin)
            h = phases.after(layer, h, attention(q, *lanes.layer_kv(i, k, v)))
        hn, _, h = exit_heads(model, h)
    lanes.pos += ids.shape[1]
    return model.lm_head(hn[:, -1]).argmax(-1)


class OuroWay:
    """The Ouro way at fixed shapes: a graph for the prompt step and one for a decode step (U passes,
    the head and the argmax, gpt-fast's decode_one_token with the loops unrolled)."""

    def __init__(self, model, batch, graphs, phases):
        dev = model.lm_head.weight.device
        self.model, self.phases = model, phases
        self.exit_heads = torch.compile(LoopedLM.exit_heads) if phases is not PLAIN else LoopedLM.exit_heads
        self.lanes = StaticLanes(model, model.config.n_loops, N_PROMPT + N_NEW, batch)
        self.prompt = torch.zeros(batch, N_PROMPT, dtype=torch.long, device=dev)
        self.cur = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(batch, N_NEW, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        state = [self.lanes.k, self.lanes.v, self.lanes.pos, self.cur, self.out, self.t]
        self.graphs = Graphs(lambda: state) if graphs else None

    def _step(self, ids):
        tok = lanes_step(self.model, self.lanes, ids, self.phases, self.exit_heads)
        self.out.index_copy_(1, self.t, tok[:, None])
        self.cur.copy_(tok[:, None])
        self.t += 1

    def _replay(self, name, fn):
        if self.graphs is None:
            return fn()
        self.graphs.replay(name, fn)

    def generate(self, prompts):
        self.lanes.pos.zero_()
        self.t.zero_()
        self.prompt.copy_(torch.tensor(prompts))
        with torch.inference_mode():
            self._replay("prompt", lambda: self._step(self.prompt))
            for _ in range(N_NEW - 1):
                self._replay("decode", lambda: self._step(self.cur))
        return self.out.tolist()


def run_config(model, prompts, config, runner):
    """One timed run of a configuration; returns (seconds, tokens, what it ran)."""
    kind, mode, graphs = config
    U = model.config.n_loops
    sync = torch.cuda.synchronize if model.lm_head.weight.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    if kind == "ouro_way":
        tokens = runner.generate(prompts) if graphs else ouro_way(model, prompts, N_NEW)
        sync()
        return time.perf_counter() - t0, tokens, dict(passes=U * N_NEW, head_calls=N_NEW, depth=float(U))
    before = dict(runner.stats)
    reqs = runner.run([Request(p, N_NEW, mode, THR) for p in prompts])
    sync()
    seconds = time.perf_counter() - t0
    assert all(r.finish_reason == "length" for r in reqs), [r.error for r in reqs]
    dec = [x for r in reqs for x in r.decode_exits]
    return seconds, [r.tokens for r in reqs], dict(passes=runner.stats["passes"] - before["passes"],
                                                   head_calls=runner.stats["head_calls"] - before["head_calls"],
                                                   depth=sum(dec) / len(dec), exits=[r.exits for r in reqs])


def build(model, B, config, fused):
    """What runs a configuration, kept for all its runs (so that graphs are captured once): graphs
    True: CUDA graphs of the compiled passes; "ready": the graph-ready code without graphs (a CPU);
    False: the eager engine (serve_depthbatch.Engine) or ouro_way."""
    kind, mode, graphs = config
    scheduler = "fixed" if mode == "fixed" else "continuous"
    pages, rows = B * (N_PROMPT + N_NEW) * model.config.n_loops, B * N_PROMPT
    if kind == "ouro_way":
        return OuroWay(model, B, graphs is True, fused if graphs is True else PLAIN) if graphs else None
    if not graphs:
        return Engine(model, pages, max_batch=B, max_rows=rows, scheduler=scheduler)
    return SlotEngine(model, pages, max_batch=B, max_rows=rows, scheduler=scheduler, graphs=graphs is True,
                      fuse=graphs is True)


def bench_gpu(c):
    device = c["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.device(device).type == "cuda"
    batches = [int(b) for b in (c["batches"] or "1,8,32").split(",")]
    g = torch.Generator().manual_seed(c["seed"])
    vocab = SHAPES[c["gpu_shape"]]["vocab_size"]
    prompts = {B: torch.randint(0, vocab, (B, N_PROMPT), generator=g).tolist() for B in batches}
    t_start = time.perf_counter()
    model = ouro_shape_model(c["gpu_shape"], device, c["seed"], prompts[max(batches)])
    wb, wh = weight_bytes(model)
    t_w, t_h = wb / BANDWIDTH, wh / BANDWIDTH
    U = model.config.n_loops
    print(f"model: {c['gpu_shape']} ({model.num_params() / 1e9:.3f} B parameters, {model.lm_head.weight.dtype}) on "
          f"{torch.cuda.get_device_name() if cuda else 'cpu'}; block {wb / 1e9:.3f} GB = {1e3 * t_w:.3f} ms at "
          f"{BANDWIDTH / 1e12:.1f} TB/s, head {wh / 1e9:.3f} GB = {1e3 * t_h:.3f} ms; gate bias "
          f"{float(model.early_exit_gate.bias):.3f}", file=sys.stderr)
    fused = compiled_phases() if cuda else PLAIN
    configs = [(k, m, gr) for gr in ([True, False] if cuda else [False]) for k, m in
               [("ouro_way", "fixed"), ("engine", "fixed"), ("engine", "dense_ragged"), ("engine", "ete_ragged")]]
    if not cuda:      # on a CPU the graphed configurations run their graph-ready code without graphs
        configs = [(k, m, "ready") for k, m, _ in configs] + configs
    runs, checks, rounds = [], [], max(c["rounds"], 3)
    for B in batches:
        best = time_configs(model, prompts[B], configs, fused, rounds)
        graphed = True if cuda else "ready"
        ref_fixed, ref_ouro = best["engine", "fixed", graphed], best["ouro_way", "fixed", graphed]
        ouro_eager = best["ouro_way", "fixed", False]
        agree = sum(a == b for x, y in zip(ref_fixed[1], ref_ouro[1]) for a, b in zip(x, y)) / (B * N_NEW)
        checks.append(dict(batch=B, check="graphed fixed@U = graphed Ouro way, greedy tokens", agree=agree))
        for (kind, mode, gr), (seconds, tokens, st) in best.items():
            tok_s = B * N_NEW / seconds
            ceiling = B / (U * t_w + t_h) if mode == "fixed" else B / (st["depth"] * (t_w + t_h))
            runs.append(dict(batch=B, mode="ouro_way" if kind == "ouro_way" else mode, graphs=gr is True,
                             graph_ready=gr is not False, tok_s=round(tok_s, 2), seconds=round(seconds, 5),
                             pass_ms=round(1e3 * seconds / st["passes"], 4), passes=st["passes"],
                             head_calls=st["head_calls"], avg_decode_depth=round(st["depth"], 3),
                             ceiling_tok_s=round(ceiling, 1), ceiling_fraction=float(f"{tok_s / ceiling:.4g}"),
                             x_fixed_graphed=round(ref_fixed[0] / seconds, 4),
                             x_ouro_way_graphed=round(ref_ouro[0] / seconds, 4),
                             x_ouro_way_eager=round(ouro_eager[0] / seconds, 4),
                             paper_h100_eager=PAPER_H100_EAGER.get(B, (None, None))[0 if mode == "fixed" else 1]))
        if cuda:
            checks += replay_checks(model, prompts[B], best)
        print(f"  batch {B} done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    print_gpu(runs, checks)
    out = {"bench": "engine-gpu", "model": c["gpu_shape"], "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "prompt_len": N_PROMPT, "new_tokens": N_NEW, "thr": THR,
           "gate_bias": float(model.early_exit_gate.bias), "bandwidth": BANDWIDTH, "block_bytes": wb, "head_bytes": wh,
           "seconds": round(time.perf_counter() - t_start, 1), "checks": checks, "runs": runs}
    if c["out"]:
        os.makedirs(os.path.dirname(os.path.abspath(c["out"])), exist_ok=True)
        with open(c["out"], "w") as f:
            json.dump(out, f, indent=1)
    return out


def time_configs(model, prompts, configs, fused, rounds):
    """Every configuration on one batch: a warm-up run (it compiles and captures), then `rounds`
    rounds in turns (an eager run once: eager runs are slow and steady). The fastest of each."""
    B = len(prompts)
    runners = {cf: build(model, B, cf, fused) for cf in configs}
    results = {}
    for cf in configs:
        t0 = time.perf_counter()
        results[cf] = [run_config(model, prompts, cf, runners[cf])]
        print(f"  batch {B} {cf}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for i in range(rounds):
        for cf in configs:
            if cf[2] is not False or i == 0:
                results[cf].append(run_config(model, prompts, cf, runners[cf]))
    return {cf: min(rs, key=lambda r: r[0]) for cf, rs in results.items()}


def replay_checks(model, prompts, best):
    """Graphs replay exactly what the same passes compute: the slot engine without graphs (the same
    kernels) gives the graphed runs' tokens, and exits, in every mode."""
    B, U, checks = len(prompts), model.config.n_loops, []
    for mode in ("fixed", "dense_ragged", "ete_ragged"):
        plain = SlotEngine(model, B * (N_PROMPT + N_NEW) * U, max_batch=B, max_rows=B * N_PROMPT,
                           scheduler="fixed" if mode == "fixed" else "continuous", graphs=False, fuse=True)
        reqs = plain.run([Request(p, N_NEW, mode, THR) for p in prompts])
        _, tokens, st = best["engine", mode, True]
        same = [r.tokens for r in reqs] == tokens and (mode == "fixed" or [r.exits for r in reqs] == st["exits"])
        checks.append(dict(batch=B, check=f"{mode}: graph replays = the same passes without graphs", equal=same))
    return checks


def print_gpu(runs, checks):
    err = sys.stderr
    print(f"{'batch':>5} {'mode':<13}{'graphs':<7}{'tok/s':>9}{'pass ms':>9}{'Ē dec':>7}{'ceiling':>9}{'of it':>7}"
          f"{'x fixed g':>10}{'x ouro g':>9}{'x ouro e':>9}{'paper':>8}", file=err)
    for r in runs:
        paper = f"{r['paper_h100_eager']:.1f}" if r["paper_h100_eager"] else "-"
        print(f"{r['batch']:>5} {r['mode']:<13}{str(r['graphs']):<7}{r['tok_s']:>9.1f}{r['pass_ms']:>9.3f}"
              f"{r['avg_decode_depth']:>7.2f}{r['ceiling_tok_s']:>9.1f}{r['ceiling_fraction']:>7.3f}"
              f"{r['x_fixed_graphed']:>10.2f}{r['x_ouro_way_graphed']:>9.2f}{r['x_ouro_way_eager']:>9.2f}{paper:>8}",
              file=err)
    for ch in checks:
        print(f"check, batch {ch['batch']}: {ch['check']}: {ch.get('agree', ch.get('equal'))}", file=err)
    print("tok/s: B x 32 new tokens over the whole run (32-token prompts included), fastest of the rounds; ceiling: "
          "decode reading the weights at the bandwidth (fixed and the Ouro way U passes and one head a token, ragged "
          "Ē passes and heads); x fixed g / x ouro g / x ouro e: speed against graphed fixed@U, the graphed and the "
          "eager Ouro way; paper: its eager H100 runs (fixed@4, ragged at τ 0.3)", file=err)

"""The benchmarks' own logic: the engine benchmark's pass counting against the work-conserving bound,
its JSON line, and the level turns that keep its timing fair. (Timings are never asserted.)"""
import contextlib
import json
import random
import sys

import pytest
import torch

from lab import bench, bench_engine, cost_model
from configurator import UserError
from conftest import prompt, varied_model
from engine.request import Request
from serve_depthbatch import Engine


def test_continuous_passes_reach_the_work_conserving_bound_and_nested_does_not():
    """While requests wait, every continuous pass runs a depth of every one of the B requests in flight
    (passes = bound); the nested runner idles the rows that exited until its whole wave has."""
    model = varied_model()
    work = [(prompt(random.randint(4, 12)), random.randint(8, 20)) for _ in range(16)]
    ratio = {}
    for scheduler in ("continuous", "nested"):
        e = Engine(model, 5000, max_batch=4, scheduler=scheduler)
        for p, o in work:
            e.add(Request(p, o, "ete_ragged", 0.4))
        counts = bench_engine.new_counts()
        while e.busy():
            bench_engine.counted_step(e, counts)
        assert counts["passes"] == e.stats["passes"] and counts["rows"] == e.stats["rows"]
        ratio[scheduler] = counts["steady_passes"] / (counts["steady_slots"] / 4)
    assert ratio["continuous"] == 1.0 and ratio["nested"] > 1.2


def test_bench_prints_a_consistent_json_line(capsys):
    """A small engine bench (batch 2, both workloads, two rounds): the last stdout line is strict JSON
    with every field; pages are Σ e_i, no scheduler beats the work-conserving bound, continuous meets
    it, fixed is the unit of the ratios, each round is compared with its own fixed engine, the
    weight-read cost model adds up, fixed@U gives the Ouro way's tokens (greedy, and sampled with each
    request's own seed), the shared head needs no more
    head calls than the eager one, the capacity runs stay in their pool."""
    bench.main(["--what=engine", "--shape=small_vocab", "--batches=2", "--requests=4", "--rounds=2", "--quick"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    json.dumps(out, allow_nan=False)
    U = out["model"]["n_loops"]
    queue = {(r["scheduler"], r["mode"], r["head"]): r for r in out["runs"] if r["workload"] == "queue"}
    batch = {(r["sampling"], r["scheduler"], r["mode"], r["head"]): r for r in out["runs"] if r["workload"] == "batch"}
    ragged = {("continuous", m, h) for m in ("dense_ragged", "ete_ragged") for h in ("eager", "shared")}
    nested = {("nested", m, "eager") for m in ("dense_ragged", "ete_ragged")}
    assert set(queue) == {("fixed", "fixed", "eager")} | ragged | nested
    assert set(batch) == {(s,) + k for s in ("greedy", "paper")
                          for k in {("ouro_way", "fixed", "-"), ("fixed", "fixed", "eager")} | ragged}
    for r in queue.values():
        for key in ("thr", "batch", "tok_s", "ratio_vs_fixed", "passes", "lower_bound", "avg_decode_depth",
                    "ideal_ratio", "ideal_cost", "head_calls", "rows_per_head_call", "weight_gb", "kv_physical",
                    "kv_dense",
                    "sum_exits", "peak_pages", "max_in_flight", "mix_window", "mix_run"):
            assert key in r, key
        assert r["kv_physical"] == r["sum_exits"] <= r["kv_dense"] and r["tok_s"] > 0 and r["max_in_flight"] <= 2
        assert r["passes"] >= r["lower_bound"] - 1e-9
        assert abs(r["ideal_ratio"] - U / r["avg_decode_depth"]) < 1e-3
        h = r["head_to_block"]
        assert abs(r["ideal_cost"] - (U + h) / (r["avg_decode_depth"] + h)) < 1e-3
        rounds = r["ratio_rounds"]
        assert len(rounds) == 2 and min(rounds) - 1e-3 <= r["ratio_vs_fixed"] <= max(rounds) + 1e-3
    fixed = queue["fixed", "fixed", "eager"]
    assert fixed["ratio_rounds"] == [1, 1] and fixed["ratio_vs_fixed"] == 1 and fixed["avg_decode_depth"] == U
    for mode in ("dense_ragged", "ete_ragged"):
        for head in ("eager", "shared"):
            assert queue["continuous", mode, head]["passes"] <= 1.05 * queue["continuous", mode, head]["lower_bound"]
    for s in ("greedy", "paper"):
        for mode in ("dense_ragged", "ete_ragged"):
            shared, eager = batch[s, "continuous", mode, "shared"], batch[s, "continuous", mode, "eager"]
            assert shared["head_calls"] <= eager["head_calls"]
        lanes, fixed = batch[s, "ouro_way", "fixed", "-"], batch[s, "fixed", "fixed", "eager"]
        assert lanes["ratio_vs_ouro"] == 1 and fixed["tokens_agree_with_ouro_way"] == 1
        assert fixed["passes_total"] == lanes["passes_total"] == fixed["makespan_bound"] and fixed["ideal_batch"] == 1
    for r in batch.values():
        assert r["makespan_bound"] <= r["passes_total"] and r["batch"] == 2
        if r["scheduler"] == "continuous":   # a schedule that exists costs at least the bound's
            assert 0 < r["ideal_schedule"] <= r["ideal_batch"] + 1e-9
    assert {(t["workload"], t["mode"]) for t in out["targets"]} >= {("queue", "dense_ragged"), ("batch", "fixed")}
    assert {t["sampling"] for t in out["targets"] if t["workload"] == "batch"} == {"greedy", "paper"}
    cap = out["capacity"]
    assert all(r["peak_pages"] <= cap["kv_pages"] for r in cap["runs"])


def brute_force_schedule(rows, wb, wh):
    """Every set of passes after which the LM head could run, simulated: the cheapest. A schedule
    never lasts longer than running the tokens in lockstep (one call per token, each as deep as its
    deepest request's), so that bounds the passes tried."""
    n = [len(r) for r in rows]
    lockstep = sum(max(r[t] for r in rows if t < len(r)) for t in range(max(n)))
    best = lockstep * wb + max(n) * wh
    for calls_at in range(1 << lockstep):
        tok, depth, calls = [0] * len(rows), [0] * len(rows), 0
        for p in range(1, lockstep + 1):
            for i, r in enumerate(rows):
                if tok[i] < n[i] and depth[i] < r[tok[i]]:
                    depth[i] += 1
            waiting = [tok[i] < n[i] and depth[i] == r[tok[i]] for i, r in enumerate(rows)]
            running = any(tok[i] < n[i] and depth[i] < r[tok[i]] for i, r in enumerate(rows))
            if any(waiting) and (calls_at >> (p - 1) & 1 or not running):
                calls += 1
                for i in range(len(rows)):
                    if waiting[i]:
                        tok[i], depth[i] = tok[i] + 1, 0
            if tok == n:
                best = min(best, p * wb + calls * wh)
                break
    return best


def test_quick_means_quick(monkeypatch):
    """--quick is bounded by what it runs, not by a clock: the engine benchmark's --quick takes the small
    model (256 words), batches 1 and 4 and 8 requests a batch size of its short lengths, unless the
    user gives others (what kept it over four minutes before: the 32,000-word model at batch 32); the
    other --quick runs are bounded likewise (lab/soak.py: 2,000 requests of a tiny model; the tiny grid
    of lab/reproduce.py: 16 steps a run)."""
    from lab import bench_engine, reproduce, soak
    seen = {}
    monkeypatch.setattr(bench, "bench_engine", lambda c: seen.update(c) or {})
    bench.main(["--what=engine", "--quick"])
    assert (seen["shape"], seen["batches"], seen["requests"]) == ("small_vocab", "1,4", 8)
    assert bench_engine.SHAPES["small_vocab"]["cfg"]["vocab_size"] <= 256
    assert max(map(max, bench_engine.LENGTHS["quick"])) <= 16
    bench.main(["--what=engine", "--quick", "--batches=2", "--requests=4"])   # the user's own stay
    assert (seen["batches"], seen["requests"]) == ("2", 4)
    assert "--max_iters=16" in reproduce.SIZES["quick"]["base"]
    monkeypatch.setattr(soak, "soak", lambda c: seen.update(c) or {})
    soak.main(["--quick"])
    assert seen["requests"] <= 2000 and not seen["ckpt"]


def test_head_schedule_finds_the_cheapest_head_calls_for_known_exits():
    """The best head schedule (what bench's `sched` column divides by) against every call set, on
    small random batches of known exits; narrowed to one state a pass, the search still returns a
    schedule that exists (no cheaper than the best), and never one under the makespan bound."""
    for _ in range(25):
        B, T = random.randint(1, 3), random.randint(1, 3)
        rows = [[random.randint(1, 3) for _ in range(random.randint(1, T))] for _ in range(B)]
        wh = random.choice([0.5, 1.0, 2.0, 3.0])
        best = brute_force_schedule(rows, 1.0, wh)
        assert cost_model.head_schedule(rows, 1.0, wh) == best, (rows, wh)
        narrow = cost_model.head_schedule(rows, 1.0, wh, width=1)
        n = max(map(len, rows))
        assert best <= narrow <= sum(max(r[t] for r in rows if t < len(r)) for t in range(n)) + n * wh
        assert best >= max(sum(r) for r in rows) + max(map(len, rows)) * wh


def test_bench_turns_go_to_the_engine_least_far_through_the_workload(monkeypatch):
    """The benchmark's engines take turns so that they move through the workload together: every
    turn goes to a busy engine with the fewest tokens sampled, so no configuration runs a stretch of
    the machine's time alone while others wait (the timing bias that level turns remove)."""
    engines, turns, last = [], [], [None]

    class Recorded(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.reqs = []
            engines.append(self)

        def add(self, r):
            self.reqs.append(r)
            return super().add(r)

    tokens = lambda e: sum(len(r.tokens) for r in e.reqs)
    step = bench_engine.timed_step

    def timed_step(run):
        if run["engine"] is not last[0]:      # a new turn: who was chosen, and where everyone stood
            turns.append((tokens(run["engine"]), [tokens(e) for e in engines if e.busy()]))
            last[0] = run["engine"]
        step(run)

    monkeypatch.setattr(bench_engine, "Engine", Recorded)
    monkeypatch.setattr(bench_engine, "timed_step", timed_step)
    monkeypatch.setattr(bench_engine, "TURN", 0.0)     # one step per turn: the most turns to check
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    work = [(prompt(rng.randint(3, 10)), rng.randint(4, 12)) for _ in range(6)]
    configs = [("fixed", "fixed", "eager"), ("continuous", "dense_ragged", "shared"), ("nested", "ete_ragged", "eager")]
    records = bench_engine.bench_runs(varied_model(), work, configs, 0.5, 2, 2000, 64, "torch", seed=rng.randint(0, 99))
    assert [r["tokens"] for r in records] == [sum(o for _, o in work)] * 3
    assert len(turns) > 20 and all(chosen == min(busy) for chosen, busy in turns)


def test_ouro_code_row_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    """--ouro_code: a clear error (nothing run) for a path that is not modeling_ouro.py, for one
    without configuration_ouro.py beside it, without transformers, and with the queue workload."""
    code = tmp_path / "modeling_ouro.py"
    code.write_text("")
    base = ["--what=engine", "--shape=small_vocab", "--batches=2", "--capacity=False", "--workload=batch"]
    cases = [(tmp_path / "other.py", "expected the path of Ouro's modeling_ouro.py"),
             (code, "configuration_ouro.py must lie beside it")]
    for path, message in cases:
        with pytest.raises(UserError, match=message):
            bench.main(base + [f"--ouro_code={path}"])
    (tmp_path / "configuration_ouro.py").write_text("")
    monkeypatch.setitem(sys.modules, "transformers", None)          # not installed: import fails
    with pytest.raises(UserError, match="needs the optional transformers package"):
        bench.main(base + [f"--ouro_code={code}"])
    with pytest.raises(UserError, match="a row of the fixed batch"):
        bench.main(base[:-1] + ["--workload=queue", f"--ouro_code={code}"])


def test_the_fixed_batch_runs_on_a_checkpoint_too_short_for_the_queue(tmp_path, capsys):
    """A model with a context of 128 tokens: the queue (requests up to 192 tokens) is refused with
    the context it needs, and the fixed batch (96 tokens) runs on it, its rows in the JSON line."""
    from checkpoint import model_args, save_checkpoint
    from conftest import random_model
    model = random_model(1, block_size=128)
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config), "meta": {}},
                    str(tmp_path / "ckpt.pt"))
    base = ["--what=engine", f"--ckpt={tmp_path}", "--batches=2"]
    with pytest.raises(UserError, match="needs a context of 192 tokens; the model has block_size=128"):
        bench.main(base + ["--workload=queue"])
    with pytest.raises(UserError, match="needs a context of 192 tokens"):      # the capacity table's requests
        bench.main(base + ["--workload=batch"])
    bench.main(base + ["--workload=batch", "--capacity=False", "--sampling=greedy"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {(r["workload"], r["batch"]) for r in out["runs"]} == {("batch", 2)}
    assert all(r["tokens_agree_with_ouro_way"] == 1.0 for r in out["runs"] if r["mode"] == "fixed")


def test_the_gpu_bench_runs_its_code_on_a_cpu(tmp_path, capsys, monkeypatch):
    """`lab/bench.py --what=gpu` at the tiny shape on a CPU, where the graphed configurations run their
    graph-ready code without graphs: every configuration and field of the GPU run's JSON (also
    written to --out), in the fixed batch and in the queue; the graph-ready Ouro way gives fixed@U's
    greedy tokens in as many passes and one head call a token, the ratios, the ceiling and the
    efficiency add up; the gate is set to its target depth. (Inductor's counts: test_slots.py.)"""
    from lab import bench_gpu
    from model import threshold_exit
    monkeypatch.setattr(bench_gpu, "kernel_counts", lambda shape, device: {
        "rows": 2, "gemms_per_layer": 4, "launches_per_layer": 9, "layer": {"kernel": 4, "gemm": 4, "op": 1},
        "launches_per_pass": 9, "finish_rows_launches": 14, "attention_launches_by_keys": {"72": 1, "4096": 2}})
    out_file = tmp_path / "gpu.json"
    bench.main(["--what=gpu", "--gpu_shape=tiny", "--batches=1,2", f"--out={out_file}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == out
    runs = {(r["workload"], r["batch"], r["mode"], r["graph_ready"]): r for r in out["runs"]}
    assert set(runs) == {("batch", b, m, g) for b in (1, 2) for m in ("ouro_way", "fixed", "dense_ragged", "ete_ragged")
                         for g in (True, False)} | {("queue", b, m, True) for b in (1, 2)
                                                    for m in ("fixed", "dense_ragged", "ete_ragged")}
    U, N = 4, bench_gpu.N_NEW
    t_w, t_h = out["block_bytes"] / out["bandwidth"], out["head_bytes"] / out["bandwidth"]
    for (work, b, mode, ready), r in runs.items():
        assert r["graphs"] is False and r["tok_s"] > 0
        for key in ("ceiling_fraction", "x_fixed_graphed", "pass_ms", "efficiency") + (
                ("x_ouro_way_graphed", "x_ouro_way_eager") if work == "batch" else ()):
            assert r[key] > 0, key
        ceiling = b / (U * t_w + t_h) if mode in ("fixed", "ouro_way") else b / (r["avg_decode_depth"] * (t_w + t_h))
        assert abs(r["ceiling_tok_s"] - ceiling) <= 0.05 + 1e-3 * ceiling
        assert abs(r["tokens"] / r["seconds"] / ceiling / r["ceiling_fraction"] - 1) < 1e-2
        assert abs((r["passes"] * t_w + r["head_calls"] * t_h) / r["seconds"] / r["efficiency"] - 1) < 1e-2
        assert r["sum_exits"] >= r["passes"] and (mode != "fixed" or r["sum_exits"] % U == 0)
    for b in (1, 2):
        fixed, lanes = runs["batch", b, "fixed", True], runs["batch", b, "ouro_way", True]
        assert fixed["x_fixed_graphed"] == lanes["x_ouro_way_graphed"] == 1
        assert fixed["passes"] == lanes["passes"] == U * N and fixed["head_calls"] == N
        queue = runs["queue", b, "fixed", True]
        assert queue["tokens"] > b * 8 and queue["passes"] == U * queue["head_calls"]
    assert [c["agree"] for c in out["checks"]] == [1.0, 1.0]
    for b in ("1", "2"):
        h, q = out["counts"]["host"][b], out["counts"]["host_queue"][b]
        assert h["h2d_per_steady_step"] <= 1 and h["passes_launched"] <= h["passes_with_rows"] + 1
        assert q["passes_launched"] <= q["passes_with_rows"] + 1 and q["host_ms_per_pass"] > 0
    assert all(r["passes_launched"] >= r["passes"] for r in out["runs"])
    arrived = {(a["batch"], a["mode"], a["share"]): a for a in out["arrivals"]}
    assert set(arrived) == {(b, m, s) for b in (1, 2) for m in ("fixed", "dense_ragged", "ete_ragged")
                            for s in bench_gpu.ARRIVAL_SHARES}
    for a in arrived.values():        # each client's latencies: the first token after its arrival, ordered quantiles
        assert 0 < a["ttft_ms_p50"] <= a["ttft_ms_p99"] and 0 <= a["tbt_ms_p50"] <= a["tbt_ms_p99"]
        assert 0 < a["step_ms_p50"] <= a["step_ms_p99"] and 0 < a["steps"] <= a["passes_launched"]
        assert a["requests"] == 4 * a["batch"] and abs(a["rate"] / a["capacity_req_s"] - a["share"]) < 1e-2
    assert out["server_engine_start"]["seconds"] >= 0 and out["server_engine_start"]["runner"] == "EagerRunner"
    prompts = torch.randint(0, 512, (4, bench_gpu.N_PROMPT)).tolist()
    model = bench_gpu.ouro_shape_model("tiny", "cpu", int(torch.randint(0, 1000, ())), prompts)
    gates = model(torch.tensor(prompts))["gate_logits"]
    assert abs(float(threshold_exit(gates, bench_gpu.THR).float().mean()) - bench_gpu.TARGET_DEPTH) < 0.1


def test_a_steps_device_span_is_two_events_around_its_launches(monkeypatch):
    """On a GPU, step_span records one event on the engine's device before its step and one after,
    in that order, and hands both back unread (the bench reads them once the run is over): the CUDA
    event and device API stood in, the step a counter."""
    from lab import bench_gpu
    trail = []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
        def record(self):
            trail.append(("record", self))

    class OnGPU:
        device = torch.device("cuda", 1)
        def step(self):
            trail.append(("step", None))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", lambda d: trail.append(("device", d)) or contextlib.nullcontext())
    marks = bench_gpu.step_span(OnGPU())
    assert trail == [("device", OnGPU.device), ("record", marks[0]), ("step", None), ("record", marks[1])]


def test_the_speculative_bench_checks_its_tokens_and_counts(tmp_path, capsys):
    """lab.bench --what=speculative on a saved small model (prompts of random ids: it has no data):
    every speculative row's tokens are fixed@U's, fixed@U runs U passes a token at batch 1, the
    teacher-forced agreement is a share per draft depth, and the queue row is there."""
    from checkpoint import model_args, save_checkpoint
    model = varied_model()
    save_checkpoint({"model": model.float().state_dict(), "model_args": model_args(model.config)},
                    str(tmp_path / "ckpt.pt"))
    bench.main(["--what=speculative", f"--ckpt={tmp_path}", "--prompt_len=6", "--new_tokens=10",
                "--batches=1,2", "--draft_ks=1,3"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    U = model.config.n_loops
    assert len(out["agreement_by_depth"]) == U - 1 and all(0 <= a <= 1 for a in out["agreement_by_depth"])
    rows = out["rows"]
    assert {r["workload"] for r in rows} == {"batch 1", "batch 2", "queue of 8, batch 2"}
    assert all(r["identical"] for r in rows if r["config"].startswith("speculative"))
    # fixed, Dense-Ragged, then (U - 1 draft depths and the gate) x 2 k
    assert len([r for r in rows if r["workload"] == "batch 1"]) == 2 + U * 2
    fixed = next(r for r in rows if r["workload"] == "batch 1" and r["config"] == f"fixed@{U}")
    assert fixed["passes_per_token"] == U and fixed["x_fixed"] == 1

"""The slot runner (slot_engine.py, its pass slot_pass.py) against the eager runner, its reference, in float64: the
same tokens, exits of every position, logits, pages and passes for every mode, with mixed τ, prefill options,
sampling, stop ids, cancellation, chunked prompts, staggered arrivals and the fixed scheduler; under
preemption, each request the same as with room to spare. One pass runs on the meta device (no value
is read on the host) and compiles to one graph with no recompile; after every step the host's page
tables equal the device's (SlotRunner.check)."""
import json
import random
import threading
import urllib.request

import pytest
import torch

from engine import slots as slot_engine
from configurator import UserError
from conftest import U, clone, drive, prompt, varied_model
from model import GPTConfig, LoopedLM, fuse_projections
from ragged import PagePool
from engine.request import Request
from engine.build import engine_for
from serve_depthbatch import EagerRunner, Engine
from engine.slots import SlotRunner
from engine.slot_pass import SAMPLING, Slots, Upload, bucket, run_pass, sampling_kind


def test_a_steps_writes_land_as_written_one_scatter_a_buffer(monkeypatch):
    """Random writes into buffers of every dtype the slots hold, several a buffer, some setting an
    element an earlier one set, then a permutation of the row buffers: the buffers equal the writes
    applied one by one (the later value wins), and the device saw one index_put a buffer, with no
    position twice."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    bufs = [torch.zeros(6, 5, dtype=dt) for dt in (torch.long, torch.int32, torch.bool, torch.float32,
                                                   torch.float64)] + [torch.zeros(7, dtype=torch.float32)]
    want = [b.clone() for b in bufs]
    up = Upload(torch.device("cpu"))
    for b, w in zip(bufs, want):
        for _ in range(int(torch.randint(1, 5, (), generator=g))):           # several writes a buffer
            part = torch.randperm(b.numel(), generator=g)[:int(torch.randint(1, b.numel(), (), generator=g))]
            values = torch.randn(len(part), generator=g, dtype=torch.float64) * 100
            values = values > 0 if b.dtype == torch.bool else values if b.is_floating_point() else values.long()
            up.write(b, part if b.dim() == 1 else (part // b.shape[1], part % b.shape[1]), values)
            w.view(-1)[part] = values.to(w.dtype)
    perm = torch.randperm(7, generator=g)
    scatters = []
    put = torch.Tensor.index_put_
    monkeypatch.setattr(torch.Tensor, "index_put_", lambda t, idx, v: scatters.append(idx[0]) or put(t, idx, v))
    up.send([bufs[-1]], perm)
    assert len(scatters) == len(bufs)
    # no position twice in one scatter: on CUDA a repeated one may keep either value
    assert all(len(idx.unique()) == len(idx) for idx in scatters)
    for b, w in zip(bufs[:-1], want):
        assert torch.equal(b, w)
    assert torch.equal(bufs[-1], want[-1][perm])


def mixed_requests(rng, n, fixed_depth=None):
    """Requests of every mode (or all fixed at one depth), thresholds, prefill options, some sampled,
    some with stop ids."""
    reqs = []
    for _ in range(n):
        mode = "fixed" if fixed_depth else rng.choice(["fixed", "ouro", "dense_ragged", "ete_ragged"])
        r = Request(prompt(rng.randint(3, 14)), rng.randint(1, 12), mode, rng.choice([0.2, 0.35, 0.5, 0.7]),
                    depth=fixed_depth or (rng.randint(1, U) if mode == "fixed" else 0), keep_logits=True)
        if mode == "ete_ragged" and rng.random() < 0.5:
            rng.choice([lambda: setattr(r, "prefill_thr", 0.8), lambda: setattr(r, "prefill_schedule", "cosine"),
                        lambda: setattr(r, "prefix_full", 2)])()
        if rng.random() < 0.3:
            r.temperature, r.top_p, r.top_k = 1.0, rng.choice([1.0, 0.8]), rng.choice([0, 5])
            r.seed = rng.randint(0, 2**64 - 1)
        if rng.random() < 0.3:
            r.stop = tuple(rng.sample(range(37), 3))
        reqs.append(r)
    return reqs


def assert_equal_runs(a, b, pages=True):
    for x, y in zip(a, b):
        assert (x.tokens, x.exits, x.finish_reason) == (y.tokens, y.exits, y.finish_reason), x.mode
        if x.logits:
            assert torch.allclose(torch.stack(x.logits), torch.stack(y.logits), atol=1e-9, rtol=0)
        if x.finish_reason != "cancelled":
            keys = ("physical", "logical", "dense") + (("block_evals",) if pages else ())
            assert {k: x.kv[k] for k in keys} == {k: y.kv[k] for k in keys}
            assert x.kv["physical"] == sum(x.exits) or x.mode not in ("fixed", "ete_ragged")   # Σ e_i


@pytest.mark.parametrize("scheduler,sync_every,staggered", [("continuous", 1, True), ("continuous", 8, False),
                                                           ("continuous", 3, False), ("fixed", 8, False)])
def test_the_slot_runner_equals_the_eager_runner(scheduler, sync_every, staggered):
    """Mixed requests, each engine on its own pool with room to spare: every request the same; and,
    where the slot runner reads each step's log at once (overlap=False, as the eager runner does), the
    same passes and rows, whether it launches one pass a step or a few."""
    for _ in range(3):
        rng = random.Random(int(torch.randint(0, 2**31, ())))
        model = varied_model()
        n = rng.randint(2, 8)
        reqs = mixed_requests(rng, n, rng.randint(1, U) if scheduler == "fixed" else None)
        arrive = sorted(rng.randint(0, 10) for _ in reqs) if staggered else None
        cancel = {i: rng.randint(1, 4) for i in range(n) if rng.random() < 0.2}
        batch, rows = rng.randint(1, 5), rng.choice([2, 5, 24, 64])
        e = Engine(model, 4000, max_batch=batch, max_rows=rows, scheduler=scheduler)
        a = drive(e, [clone(r) for r in reqs], arrive, cancel)
        for overlap in (False, True):
            s = Engine(model, 4000, max_batch=batch, max_rows=rows, scheduler=scheduler, runner="slots",
                       sync_every=sync_every, overlap=overlap, keep_logits=True)
            b = drive(s, [clone(r) for r in reqs], arrive, cancel)
            assert_equal_runs(a, b)
            assert overlap or (e.stats["passes"], e.stats["rows"]) == (s.stats["passes"], s.stats["rows"])


def test_the_slot_runner_equals_each_request_alone_by_the_oracles():
    """The slot runner as it serves (pipelined: each step reads the log of the step before, no check in
    between) on a queue of mixed requests through few slots, against the per-request oracles directly,
    not against the eager runner: a ragged request's exits and logits are forward_ragged's,
    teacher-forced on its own tokens (Eq. 7, with its mode's and prefill options' thresholds); a fixed
    or Ouro-mode request's tokens and exits are model.generate's dense lanes; its physical pages are
    Σ e_i where nothing runs past an exit; every page comes back."""
    from conftest import oracle_taus
    from model import forward_ragged, generate
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = mixed_requests(rng, 10)
    for r in reqs:
        r.stop = ()                  # every request runs all its tokens
    s = Engine(model, 4000, max_batch=rng.randint(2, 4), max_rows=rng.choice([5, 24]), runner="slots",
               overlap=True, keep_logits=True)
    s.run(reqs)
    assert s.pool.used == 0 and s.stats["drained"] < s.stats["launched"]
    for r in reqs:
        assert r.finish_reason == "length" and len(r.tokens) == r.max_tokens
        if r.mode in ("fixed", "ouro"):
            if r.temperature == 0:
                tokens, exits = generate(model, r.prompt, r.max_tokens, r.mode, r.depth or None, r.thr)
                assert (r.tokens, r.token_exits) == (tokens, exits), r.mode
            continue
        full = r.prompt + r.tokens[:-1]
        prefill = dict(prefill_thr=r.prefill_thr, prefill_schedule=r.prefill_schedule, prefix_full=r.prefix_full)
        o = forward_ragged(model, torch.tensor([full]),
                           taus=oracle_taus(len(r.prompt), len(full), r.mode, r.thr, **prefill))
        assert o["exits"][0].tolist() == r.exits, r.mode
        assert torch.allclose(o["logits"][0, len(r.prompt) - 1:], torch.stack(r.logits), atol=1e-10, rtol=0)
        assert r.kv["physical"] == r.kv["block_evals"] == sum(r.exits)


def test_preempted_requests_replay_their_exits_exactly():
    """A pool too small for the batch: requests are preempted (pages are reserved for every depth of a
    position before it runs, so sooner than in the Engine) and rebuilt by replaying their exits;
    each ends as it would with room to spare, and every page comes back."""
    preempted = 0
    for _ in range(4):
        rng = random.Random(int(torch.randint(0, 2**31, ())))
        model = varied_model()
        reqs = mixed_requests(rng, rng.randint(3, 7))
        for r in reqs:
            r.max_tokens = rng.randint(8, 14)
        batch, rows = rng.randint(2, 5), rng.choice([5, 24, 64])
        a = drive(Engine(model, 4000, max_batch=batch, max_rows=rows), [clone(r) for r in reqs])
        s = Engine(model, 120, max_batch=batch, max_rows=rows, runner="slots", sync_every=rng.choice([1, 8]),
                   overlap=True, keep_logits=True)
        b = drive(s, [clone(r) for r in reqs])
        assert_equal_runs(a, b, pages=False)     # block_evals count the replays' work too
        preempted += s.stats["preemptions"]
        assert sorted(s.pool.free) == list(range(120))
    assert preempted > 0


def test_a_fixed_wave_runs_the_head_once():
    """The fixed scheduler runs a wave of U passes with the LM head on its last pass only (one graph
    on CUDA), as Ouro's code calls its head once per token; the tokens are the dense lanes'."""
    model = varied_model()
    reqs = [Request(prompt(6), 5, "fixed", keep_logits=True) for _ in range(3)]
    s = Engine(model, 2000, runner="slots", max_batch=3, scheduler="fixed", keep_logits=True)
    b = drive(s, [clone(r) for r in reqs])
    a = drive(Engine(model, 2000, max_batch=3, scheduler="fixed"), [clone(r) for r in reqs])
    assert_equal_runs(a, b)
    assert s.stats["passes"] == U * 5 and s.stats["head_calls"] == 5


def test_one_pass_reads_nothing_on_the_host():
    """The pass with the model and every buffer on the meta device, where no value exists: an .item(),
    a .tolist(), a boolean-mask index or a branch on data would raise."""
    cfg = GPTConfig(vocab_size=37, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=40)
    model = LoopedLM(cfg).to("meta").eval()
    pool = PagePool.for_model(model, 64)
    st = Slots(model, pool, n_rows=8, n_reqs=3, n_keys=cfg.block_size, log_len=4, keep_logits=True)
    with torch.inference_mode():
        for sampling in SAMPLING:
            run_pass(model, st, 8, "torch", cfg.block_size, head=True, sampling=sampling)
        run_pass(model, st, 4, "torch", 16, head=False)
    assert st.t.device.type == "meta" and st.table.device.type == "meta"


def test_the_pass_compiles_to_one_graph_and_does_not_recompile():
    """torch.compile(fullgraph=True) of run_pass (Dynamo with the eager backend): no graph break (a
    break is a host read or a branch on data), one graph per kind of pass (bucket, keys read, head,
    sampling), none recompiled over the passes of a real run whose data change every pass; the
    tokens are those of the uncompiled pass."""
    import torch._dynamo
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = mixed_requests(rng, 5)
    plain = drive(Engine(model, 4000, runner="slots", max_batch=5, keep_logits=True), [clone(r) for r in reqs])
    compiled = torch.compile(run_pass, fullgraph=True, dynamic=False, backend=backend)
    kinds = set()

    def counted(model_, st, R, attn, n_keys, n_splits, head, sampling):
        kinds.add((R, n_keys, head, sampling))
        return compiled(model_, st, R, attn, n_keys, n_splits, head, sampling)
    s = Engine(model, 4000, runner="slots", max_batch=5, keep_logits=True)
    try:
        slot_engine.run_pass = counted
        b = drive(s, [clone(r) for r in reqs])
    finally:
        slot_engine.run_pass = run_pass
        torch._dynamo.reset()
    assert_equal_runs(plain, b)
    assert len(graphs) == len(kinds) and s.stats["passes"] > 3 * len(kinds)


def every_mode_requests(rng, n):
    """mixed_requests, and the Table 17 modes, which the eager Engine alone runs."""
    reqs = mixed_requests(rng, n)
    for mode in ("last_kv", "shared_kv", "collapse_kv"):
        reqs.append(Request(prompt(rng.randint(3, 14)), rng.randint(1, 10), mode, rng.choice([0.3, 0.5]),
                            keep_logits=True))
    return reqs


def test_stacked_projections_equal_the_separate_ones(monkeypatch):
    """Four GEMMs a layer (q/k/v and gate/up stacked: model.fuse_projections, which the slot runner
    calls) against seven, float64: the dense forward's logits and exits, and each engine's tokens,
    exits, logits and pages in every mode; the checkpoint's tensors and names stay as they were."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    apart = random_model_like(model)
    fuse_projections(model)
    assert model.state_dict().keys() == keys.keys()
    assert all(torch.equal(v, keys[k]) for k, v in model.state_dict().items())
    ids = torch.tensor([prompt(20)])
    with torch.inference_mode():
        seven, four = apart(ids, keep_logits=True), model(ids, keep_logits=True)
    for a, b in zip(seven["logits"], four["logits"]):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    assert torch.equal(seven["gate_logits"].argmax(-1), four["gate_logits"].argmax(-1))
    reqs = every_mode_requests(rng, 6)
    graph_ready = [r for r in reqs if r.mode in ("fixed", "ouro", "dense_ragged", "ete_ragged")]
    fused = [drive(Engine(model, 4000, max_batch=3, max_rows=24), [clone(r) for r in reqs]),
             drive(Engine(model, 4000, runner="slots", max_batch=3, max_rows=24, keep_logits=True),
                   [clone(r) for r in graph_ready])]
    monkeypatch.setattr(slot_engine, "fuse_projections", lambda model: model)
    separate = [drive(Engine(apart, 4000, max_batch=3, max_rows=24), [clone(r) for r in reqs]),
                drive(Engine(apart, 4000, runner="slots", max_batch=3, max_rows=24, keep_logits=True),
                      [clone(r) for r in graph_ready])]
    assert apart.layers[0].self_attn.qkv_weight is None and model.layers[0].self_attn.qkv_weight is not None
    for a, b in zip(fused, separate):
        assert_equal_runs(a, b)


def random_model_like(model):
    """A model with the same weights, its projections separate."""
    other = LoopedLM(model.config).double().eval()
    other.load_state_dict(model.state_dict())
    return other


def test_a_pass_samples_with_the_cheapest_draw_that_serves_every_request():
    greedy, plain, nucleus = Request([1], temperature=0.0), Request([1], temperature=0.8), Request([1], 2, top_p=0.9)
    nucleus.temperature = 1.0
    assert sampling_kind([greedy]) == "greedy" and sampling_kind([greedy, plain]) == "plain"
    assert sampling_kind([plain, nucleus]) == "nucleus"
    assert sampling_kind([Request([1], top_k=5, temperature=0.0)]) == "greedy"     # greedy: top-k has nothing to cut


def test_the_pass_is_as_lean_as_counted():
    """The counts of python -m lab.bench --what=gpu, kept at their values or below, so that a change that
    adds a kernel, a copy or a sync fails: from Inductor's own scheduling of the pass the engine
    captures, in the mode it captures it (lab/bench_gpu.py:captured_launches; its Triton backend, what
    CUDA runs), 4 GEMMs and at most 9 launches a layer (the paged attention included), at most 15 in
    finish_rows; from the host's traffic in a steady decode step, at most one copy to the device and
    one sync (the log read, one step late); no pass launched without a row in it (one allowed at the
    very end); and under a queue (4B requests through B slots, B = 8 and 32) at most 10% of the passes
    read with no pass launched behind them (the device would wait for the host), and the step that
    admits the batch at most 50 launches outside the graphs."""
    from lab import bench_gpu
    k = bench_gpu.kernel_counts("tiny")
    assert k["gemms_per_layer"] == 4 and k["layer"]["op"] == 1 and k["launches_per_layer"] <= 9, k
    assert k["finish_rows_launches"] <= 15 and k["launches_per_pass"] <= 9 * 2 + 15, k
    model = bench_gpu.ouro_shape_model("tiny", "cpu", 0, [prompt(8)])
    for B in (1, 4):
        for mode in ("ete_ragged", "dense_ragged", "fixed"):
            h = bench_gpu.host_counts(model, B, mode)
            assert h["steady_steps"] > 0 and h["h2d_per_steady_step"] <= 1 and h["syncs_per_steady_step"] <= 1, h
            assert h["passes_launched"] <= h["passes_with_rows"] + 1, (mode, h)
    for B in (8, 32):
        q = bench_gpu.host_counts(model, B, queue=True)
        assert q["drained_share"] <= 0.10 and q["passes_launched"] <= q["passes_with_rows"] + 1, q
        # admitting the batch: a scatter (and a cast) a buffer written, whatever B (not one a write)
        assert q["launches_admitting"] <= 50, q


def test_every_kind_of_pass_is_captured_when_the_engine_starts(monkeypatch, stand_in_graphs):
    """With graphs (the CUDA graph API stood in: a graph replays what it captured), the engine captures
    every bucket of rows, for each kind of pass its scheduler runs (a fixed wave: with the head and
    without) and each sampling kind, when it starts: serving mixed requests then captures nothing more
    (no first use stalls a server), and gives the Engine's results, compacting its rows while passes
    are still unread."""
    pending_compactions = 0
    choose = SlotRunner._choose_bucket

    def counted(self, due=False):
        nonlocal pending_compactions
        choose(self, due)
        pending_compactions += self._perm is not None and self.ticket is not None
    monkeypatch.setattr(SlotRunner, "_choose_bucket", counted)
    for scheduler, batch, staggered in (("continuous", 4, True), ("fixed", 4, True), ("continuous", 8, False)):
        rng = random.Random(int(torch.randint(0, 2**31, ())))
        model = varied_model()
        s = Engine(model, 4000, max_batch=batch, max_rows=24, scheduler=scheduler, runner="slots", fuse=False,
                   keep_logits=True)
        buckets = {bucket(n, s.runner.slots.R) for n in range(1, s.runner.slots.R + 1)}
        assert len(s.runner.graphs.graphs) == len(buckets) * len(SAMPLING) * (2 if scheduler == "fixed" else 1)
        at_start, replays = set(s.runner.graphs.graphs), stand_in_graphs.replays
        reqs = mixed_requests(rng, 8, rng.randint(1, U) if scheduler == "fixed" else None)
        if not staggered:               # all at once, ending one by one: rows go idle while passes run unread
            reqs = [Request(prompt(rng.randint(3, 14)), 2 + 3 * i, rng.choice(["ete_ragged", "dense_ragged"]),
                            rng.choice([0.2, 0.5]), keep_logits=True) for i in range(8)]
        if staggered:
            b = drive(s, [clone(r) for r in reqs], sorted(rng.randint(0, 12) for _ in reqs))
        else:                           # no check() between steps: it would read the passes left unread
            b = s.run([clone(r) for r in reqs])
            assert s.pool.used == 0
        assert set(s.runner.graphs.graphs) == at_start and stand_in_graphs.replays - replays == s.stats["launched"]
        # every capture and replay with the engine's own device current (cuda:N's streams, events, graphs)
        assert stand_in_graphs.captured_on == stand_in_graphs.replayed_on == {torch.device(s.device)}
        a = drive(Engine(model, 4000, max_batch=batch, max_rows=24, scheduler=scheduler), [clone(r) for r in reqs])
        assert_equal_runs(a, b)
    assert pending_compactions > 0


def test_buckets_and_what_the_slot_runner_leaves_to_the_eager_one():
    assert [bucket(n, 48) for n in (1, 2, 3, 5, 8, 9, 33, 48)] == [2, 2, 4, 8, 8, 16, 48, 48]
    model = varied_model(1)
    assert type(engine_for(model, 500).runner) is EagerRunner                 # the CPU: the eager runner
    assert type(engine_for(model, 500, runner="slots").runner) is SlotRunner
    assert not engine_for(model, 500, runner="slots").runner.overlap   # a CPU: nothing to overlap, logs read at once
    with pytest.raises(UserError, match="nested"):
        Engine(model, 500, runner="slots", scheduler="nested")
    with pytest.raises(UserError, match="shares it"):
        engine_for(model, 500, head="shared", runner="slots")
    s = Engine(model, 500, runner="slots")
    for bad, field in [(dict(mode="last_kv"), "mode"), (dict(stop=tuple(range(9))), "stop"),
                       (dict(keep_logits=True), "keep_logits")]:
        with pytest.raises(UserError) as e:
            s.add(Request(prompt(4), 3, **dict(dict(mode="ete_ragged"), **bad)))
        assert e.value.field == field
    assert not s.busy()


def test_the_compiled_phases_give_the_same_tokens():
    """The phases as CUDA runs them, compiled by Inductor (here its C++ backend): the same tokens and
    exits as the plain pass, greedy and sampled (float32; a graph break or a host read would not
    stop them, the meta test does that: this checks what the compiler makes of them)."""
    model = varied_model().float()
    reqs = [Request(prompt(9), 6, "ete_ragged", 0.4), Request(prompt(5), 5, "dense_ragged", 0.3),
            Request(prompt(7), 4, "fixed", depth=3), Request(prompt(6), 5, "ouro", 0.5, temperature=1.0, top_p=0.8,
                                                            seed=int(torch.randint(0, 2**62, ())))]
    a = Engine(model, 500, runner="slots").run([clone(r) for r in reqs])
    b = Engine(model, 500, runner="slots", fuse=True).run([clone(r) for r in reqs])
    assert [(r.tokens, r.exits) for r in a] == [(r.tokens, r.exits) for r in b]


def test_the_scripts_capture_a_loaded_checkpoint_as_a_gpu_would(tmp_path, stand_in_graphs, capsys):
    """sample.py, lab/eval.py and server.py build the graph engine (--runner=slots) on a checkpoint that
    load_checkpoint returns as users get it (its parameters require grad), and on an Ouro folder
    exported from it, with only the CUDA graph API stood in (conftest.StandInGraphs): the passes
    compile whole (Inductor), every graph is captured in inference mode, the replays run, and each
    script's tokens are the eager engine's. (Captured with grad on, the graphs would compile the
    unstacked projections, and a loaded checkpoint's would not compile at all.)"""
    from lab import eval as eval_script
    import sample
    import server
    from checkpoint import export_ouro, load_checkpoint, model_args, save_checkpoint
    from tokenizer import char_meta
    meta = char_meta(sorted(set("abcdefghij =?;\n")))
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=64, n_layer=2, n_head=4, n_kv_head=2,
                               n_embd=32, ffn_hidden=40, loop_norm=True, branch_norm_init=1.0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.early_exit_gate.bias.fill_(-0.5)
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config), "meta": meta},
                    str(ckpt / "ckpt.pt"))
    ouro = export_ouro(model, str(tmp_path / "ouro"), meta)
    args = ["--prompt=abc = d;", "--max_new_tokens=6", "--temperature=0", "--thr=0.5", "--json", "--device=cpu"]

    def sample_tokens(folder, engine):
        sample.main(["--ckpt", folder, f"--runner={engine}"] + args)
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"][0]["text"]
    for folder in (str(ckpt), ouro):
        before = stand_in_graphs.captures
        assert sample_tokens(folder, "slots") == sample_tokens(folder, "eager")
        assert stand_in_graphs.captures > before and stand_in_graphs.replays > 0
    # runner "auto" where graphs capture: the eager runner for a mode the slot runner leaves to it
    for mode in ("speculative", "last_kv"):
        assert type(engine_for(load_checkpoint(str(ckpt))[0], 64, modes=["ete_ragged", mode]).runner) is EagerRunner
        before = stand_in_graphs.captures
        outs = []
        for engine in ("auto", "eager"):
            sample.main(["--ckpt", str(ckpt), f"--runner={engine}", f"--mode={mode}"] + args)
            outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"][0]["text"])
        assert outs[0] == outs[1] and stand_in_graphs.captures == before
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"prompt": p, "answer": "x", "type": "gen", "extract": "prefix"}) + "\n"
                             for p in ("ab = c;", "ij = ?")))
    scores = []
    for engine in ("slots", "eager"):
        eval_script.main(["--ckpt", str(ckpt), f"--task={items}", "--modes=ete_ragged@0.5", "--temperature=0",
                          "--shots=0", "--max_tokens=4", "--plots=False", f"--runner={engine}",
                          f"--out={tmp_path / engine}"])
        scores.append([(r["completions"], r["prompt_exits"], r["decode_exits"])
                       for r in map(json.loads, open(tmp_path / engine / "records.jsonl"))])
    assert scores[0] == scores[1]
    httpd, srv = server.start(["--ckpt", str(ckpt), "--runner=slots", "--port=0", "--max_batch=2", "--max_rows=16"])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        body = json.dumps({"model": "run", "prompt": "abc = d;", "max_tokens": 6, "temperature": 0, "thr": 0.5,
                           "mode": "dense_ragged"}).encode()
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
        post = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(post, timeout=120) as r:
            served = json.loads(r.read())["choices"][0]["text"]
    finally:
        httpd.shutdown()
        srv.stop()
        httpd.server_close()
    assert isinstance(srv.engine.runner, SlotRunner) and served == sample_tokens(str(ckpt), "eager")
    assert srv.engine.runner.overlap                    # where graphs capture, the runner pipelines its logs
    assert stand_in_graphs.modes == {(False, True)}         # grad off, inference mode: the mode of every replay

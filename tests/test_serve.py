"""The depth-batching engine against the single-request oracles (float64): forward_ragged for the
ragged modes, model.generate for fixed and Ouro mode; concurrency, staggered arrivals, mixed modes
and thresholds, every scheduler, preemption with exact replay, rejection, and a seeded fuzz with
the page invariants checked after every step."""
import random

import pytest
import torch

from engine import rows
from lab import bench_engine
from configurator import UserError
from conftest import U, alone, assert_same, drive, engine, oracle_taus, prompt, varied_model
from model import attention, forward_ragged, generate
from engine.request import Request
from modes import MODES
from serve_depthbatch import Engine


def random_request(rng, modes=("fixed", "ouro", "dense_ragged", "ete_ragged")):
    mode = rng.choice(modes)
    r = Request(prompt(rng.randint(3, 14)), rng.randint(2, 12), mode, rng.choice([0.2, 0.35, 0.5, 0.7]),
                depth=rng.randint(1, U) if mode == "fixed" else 0, keep_logits=True)
    if mode == "ete_ragged" and rng.random() < 0.5:
        rng.choice([lambda: setattr(r, "prefill_thr", 0.8), lambda: setattr(r, "prefill_schedule", "cosine"),
                    lambda: setattr(r, "prefix_full", 2)])()
    return r


CASES = [("dense_ragged", 0.3, {}), ("dense_ragged", 0.8, {}), ("ete_ragged", 0.3, {}), ("ete_ragged", 0.7, {}),
         ("ete_ragged", 0.5, dict(prefill_schedule="cosine")), ("ete_ragged", 0.4, dict(prefill_thr=0.7)),
         ("ete_ragged", 0.5, dict(prefix_full=3))]


@pytest.mark.parametrize("head", ["eager", "shared"])
@pytest.mark.parametrize("mode,thr,prefill", CASES)
def test_one_request_equals_the_dense_shaped_oracle(mode, thr, prefill, head):
    model = varied_model()
    ids = prompt(random.randint(12, 20))
    r = alone(model, Request(ids, 16, mode, thr, keep_logits=True, **prefill), head=head)
    full = ids + r.tokens[:-1]                     # the last sampled token never runs
    o = forward_ragged(model, torch.tensor([full]), taus=oracle_taus(len(ids), len(full), mode, thr, **prefill))
    assert o["exits"][0].tolist() == r.exits
    assert torch.allclose(o["logits"][0, len(ids) - 1:], torch.stack(r.logits), atol=1e-10, rtol=0)
    s_e = sum(r.exits)
    assert r.kv["physical"] == r.kv["block_evals"] == s_e         # Σ e_i rows, nothing computed past an exit
    assert r.kv["logical"] == r.kv["dense"] == U * len(full)      # aliases fill every logical row
    if mode == "dense_ragged":
        assert r.prompt_exits == [U] * len(ids)                   # U physical rows per prompt token


@pytest.mark.parametrize("mode,depth,thr", [("fixed", 2, 0.5), ("fixed", U, 0.5), ("ouro", 0, 0.3), ("ouro", 0, 1.0)])
def test_fixed_and_ouro_modes_equal_the_dense_lanes(mode, depth, thr):
    model = varied_model()
    ids = prompt(9)
    r = alone(model, Request(ids, 14, mode, thr, depth=depth, keep_logits=True))
    tokens, exits = generate(model, ids, 14, mode, depth or None, thr)
    assert r.tokens == tokens and r.token_exits == exits


@pytest.mark.parametrize("head", ["eager", "shared"])
@pytest.mark.parametrize("scheduler", ["continuous", "nested"])
def test_concurrent_staggered_mixed_requests_equal_each_alone(scheduler, head):
    """Requests of different lengths, modes and thresholds arriving at different steps, in one
    batch: each produces what it produces alone, and the page invariants hold after every step."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = [random_request(rng) for _ in range(7)]
    arrive = sorted(rng.randint(0, 12) for _ in reqs)
    e = engine(model, 4000, head, max_batch=5, max_rows=24, scheduler=scheduler)
    drive(e, reqs, arrive)
    assert e.stats["max_in_flight"] >= 2
    for r in reqs:
        assert r.finish_reason == "length"
        assert_same(r, alone(model, r))
    assert e.pool.used == 0


def test_decode_rows_cut_into_short_and_long_tables_equal_each_alone(monkeypatch):
    """Decode rows of very different lengths: the torch path cuts them into two padded tables (short
    rows, long rows) and every request still produces what it produces alone."""
    model = varied_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    reqs = [Request(prompt(rng.randint(30, 40)), 6, "dense_ragged", 0.4, keep_logits=True)] + \
           [Request(prompt(rng.randint(2, 5)), 6, rng.choice(["dense_ragged", "ete_ragged"]), 0.4, keep_logits=True)
            for _ in range(4)]
    e = Engine(model, 4000, max_batch=5, attn="torch")
    tables = []
    cut = rows.padded_tables
    monkeypatch.setattr(rows, "padded_tables",
                        lambda ends, attn: tables.append(len(cut(ends, attn))) or cut(ends, attn))
    e.run(reqs)
    assert 2 in tables
    for r in reqs:
        assert_same(r, alone(model, r))


@pytest.mark.parametrize("thr", [0.3, 0.6])
def test_chunked_prefill_equals_one_chunk(thr):
    """A prompt run one token per chunk (--max_rows=1) equals the prompt in one chunk: depth d of a
    later chunk reads an earlier token at min(d, e_j), which the earlier chunk left in the table."""
    model = varied_model()
    r = Request(prompt(24), 3, "ete_ragged", thr, keep_logits=True)
    one, many = alone(model, r, max_rows=64), alone(model, r, max_rows=1)
    assert_same(one, many)
    assert one.kv == many.kv and len(set(one.prompt_exits)) >= 2


def test_threshold_extremes_reproduce_fixed_depths():
    model = varied_model()
    ids = prompt(10)
    top = alone(model, Request(ids, 12, "fixed", depth=U))
    one = alone(model, Request(ids, 12, "fixed", depth=1))
    for mode in ("dense_ragged", "ete_ragged"):
        never = alone(model, Request(ids, 12, mode, thr=1.0))      # CDF < 1 before the last depth
        assert never.tokens == top.tokens and set(never.decode_exits) == {U}
        zero = alone(model, Request(ids, 12, mode, thr=0.0))
        assert set(zero.decode_exits) == {1}
    assert alone(model, Request(ids, 12, "ete_ragged", thr=0.0)).tokens == one.tokens
    ouro = generate(model, ids, 12, "ouro", thr=1.0)[0]                 # Ouro's lanes at τ = 1
    assert ouro == top.tokens == alone(model, Request(ids, 12, "ouro", thr=1.0)).tokens
    assert generate(model, ids, 12, "fixed", depth=U)[0] == top.tokens


@pytest.mark.parametrize("head", ["eager", "shared"])
@pytest.mark.parametrize("kv_pages", [2000, 110])
def test_fixed_scheduler_runs_every_token_all_loops(kv_pages, head):
    """The fixed scheduler runs waves: each step takes its rows through all their passes (U, or a
    fixed request's own depth; one depth per wave), nothing joins a wave under way; with staggered
    arrivals and a pool that forces preemption (pages for every depth taken at the wave's start),
    every request equals the dense lanes at its depth, token for token."""
    model = varied_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    modes = ["ete_ragged", "ouro", "fixed", "fixed", "fixed"]
    reqs = [Request(prompt(rng.randint(5, 9)), rng.randint(4, 9), rng.choice(modes), 0.3, depth=rng.randint(0, U),
                    keep_logits=True) for _ in range(6)]
    depth = [(r.depth if r.mode == "fixed" else 0) or U for r in reqs]
    e = engine(model, kv_pages, head, max_batch=4, scheduler="fixed")
    todo, steps = list(reqs), 0
    while todo or e.busy():
        for r in [r for r in todo if steps >= reqs.index(r) * 2]:
            e.add(r)
            todo.remove(r)
        passes = e.stats["passes"]
        _, logs = bench_engine.step_logs(e)
        e.check()
        ran = {s.req for log in logs for s, n in log.ran if n}
        assert e.stats["passes"] - passes == (len(logs) if ran else 0)     # a whole wave, or nothing,
        assert {depth[reqs.index(r)] for r in ran} <= {len(logs)}          # of one depth
        steps += 1
    assert e.pool.used == 0 and (kv_pages > 1000 or e.stats["preemptions"] > 0)
    assert e.stats["rows"] == sum(r.kv["block_evals"] for r in reqs)
    for r, d in zip(reqs, depth):
        tokens, _ = generate(model, r.prompt, r.max_tokens, "fixed", d)
        assert set(r.exits) == {d} and r.tokens == tokens and r.finish_reason == "length"
        full = torch.tensor([r.prompt + r.tokens[:-1]])
        want = model(full, keep_logits=True)["logits"][d - 1][0, len(r.prompt) - 1:]
        assert torch.allclose(torch.stack(r.logits), want, atol=1e-10, rtol=0)


def test_a_fixed_batch_that_starts_together_reads_its_pages_in_place(monkeypatch):
    """B requests with prompts of one length and as many new tokens, all admitted in the first step
    (sample.py's samples, the bench's fixed batch): every decode pass finds its rows' pages on a grid
    (kernels.grid_of) and reads them without a gather, the prompt pass as one chunk call of all B
    prompts, and every request still equals the dense lanes, logits included."""
    import kernels
    from engine import rows
    model, B = varied_model(), random.randint(2, 5)
    n, m = random.randint(3, 8), random.randint(3, 7)
    reqs = [Request(prompt(n), m, "fixed", keep_logits=True) for _ in range(B)]
    found = []
    spy = lambda ids, real=kernels.grid_of: found.append((tuple(ids.shape), real(ids))) or found[-1][1]
    monkeypatch.setattr(kernels, "grid_of", spy)
    monkeypatch.setattr(rows, "grid_of", spy)
    Engine(model, 2000, max_batch=B, max_rows=B * n, scheduler="fixed").run(reqs)
    assert found and all(g is not None for _, g in found)
    assert [shape for shape, _ in found[:U]] == [(B, n)] * U       # the prompt pass: depth by depth, B chunks at once
    for r in reqs:
        tokens, _ = generate(model, r.prompt, r.max_tokens, "fixed", U)
        full = torch.tensor([r.prompt + r.tokens[:-1]])
        assert r.tokens == tokens
        assert torch.allclose(torch.stack(r.logits), model(full, keep_logits=True)["logits"][U - 1][0, n - 1:],
                              atol=1e-10, rtol=0)


@pytest.mark.parametrize("head", ["eager", "shared"])
def test_preemption_replays_the_recorded_exits_exactly(head):
    """A pool too small for the batch: the newest request is preempted, requeued and rebuilt by a
    recomputation that replays its exits; every continuation equals the request alone."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = [Request(prompt(rng.randint(6, 12)), rng.randint(10, 16), rng.choice(["dense_ragged", "ete_ragged", "ouro"]),
                    rng.choice([0.3, 0.5]), keep_logits=True) for _ in range(6)]
    e = engine(model, 150, head, max_batch=6, max_rows=64)
    for r in reqs:
        e.add(r)
    while e.busy():
        e.step()
        e.check()
    assert e.stats["preemptions"] > 0 and e.stats["replayed_rows"] > 0
    for r in reqs:
        assert r.finish_reason == "length"
        assert_same(r, alone(model, r))
    assert e.pool.used == 0 and sorted(e.pool.free) == list(range(150))


@pytest.mark.parametrize("runner", ["eager", "slots"])
def test_a_request_that_can_never_fit_is_refused_before_any_compute_and_one_that_outgrows_the_pool_keeps_its_tokens(
        runner):
    """A request whose least need exceeds the pool is refused at once, both bounds said, nothing else
    moving; one that fits its least need but not its worst, alone, ends where the pool runs dry with
    the tokens it has (each what it is alone with room to spare), finish reason length, a note saying
    why, every page back."""
    model = varied_model()
    e = Engine(model, 60, runner=runner)
    ok = e.add(Request(prompt(5), 6, "ete_ragged", 0.5))
    with pytest.raises(UserError, match=r"needs at least 84 KV pages and at worst 96 \(prompt of 20 tokens"):
        e.add(Request(prompt(20), 5, "dense_ragged", 0.5))        # 20 prompt tokens x U + 4 new; 24 x U
    assert [s.req for s in e.scheduler.waiting] == [ok] and e.stats["passes"] == 0
    e.run([])
    assert ok.finish_reason == "length" and e.pool.used == 0
    big = Request(prompt(5), 30, "fixed", 0.5)                    # at least 5 x 4 + 29, at worst 34 x 4
    e.run([big])
    room = alone(model, Request(list(big.prompt), 30, "fixed", 0.5), kv_pages=4000)
    assert big.finish_reason == "length" and big.error is None and 0 < len(big.tokens) < 30
    assert big.tokens == room.tokens[:len(big.tokens)] and e.pool.used == 0
    assert big.note.startswith(f"stopped after {len(big.tokens)} of 30 tokens") and "at worst 136" in big.note


@pytest.mark.parametrize("kw", [dict(thr=1.5), dict(thr=-0.1), dict(mode="warp"), dict(max_tokens=0), dict(top_p=0),
                                dict(depth=9), dict(prompt=[]), dict(prompt=[999]), dict(max_tokens=60),
                                dict(prefill_thr=0.5)])
def test_malformed_requests_are_refused(kw):
    e = Engine(varied_model(1), 500)
    args = dict(prompt=prompt(4), max_tokens=4, mode="dense_ragged", thr=0.5)
    args.update(kw)
    with pytest.raises(UserError):
        e.add(Request(**args))
    assert not e.busy()


@pytest.mark.parametrize("head", ["eager", "shared"])
def test_seeded_sampling_is_reproducible_whatever_else_is_batched(head):
    model = varied_model()
    r = Request(prompt(8), 12, "ete_ragged", 0.4, temperature=1.0, top_p=0.9, seed=123, keep_logits=True)
    others = [Request(prompt(5 + i), 9, "dense_ragged", 0.3, temperature=1.0, seed=i) for i in range(4)]
    e = engine(model, 3000, head, max_batch=8)
    e.run(others[:2] + [r] + others[2:])
    assert_same(r, alone(model, r))
    assert len(set(r.tokens)) > 1


def test_table17_baselines_keep_one_row_per_token():
    model = varied_model()
    ids = prompt(12)
    for mode in ("last_kv", "shared_kv", "collapse_kv"):
        r = alone(model, Request(ids, 10, mode, 0.5))
        assert r.kv["physical"] == len(ids) + 9                   # one K/V per token survives
        expect = {"last_kv": U * (len(ids) + 9), "shared_kv": U * len(ids) + sum(r.decode_exits),
                  "collapse_kv": U * len(ids) + sum(r.decode_exits)}[mode]
        assert r.kv["block_evals"] == expect


def test_collapse_kv_reads_the_exit_depth_of_every_earlier_token():
    """collapse_kv's first token comes from a dense prefill, so its logits are the dense ones at the
    exit; the next token reads every prompt token at its exit depth: a dense-shaped pass with the
    prompt's exits given and (as in Eq. 7 with d >= e) every later depth reading that row."""
    model = varied_model()
    ids = prompt(10)
    r = alone(model, Request(ids, 3, "collapse_kv", 0.5, keep_logits=True))
    dense = model(torch.tensor([ids]), keep_logits=True)
    e_last = r.prompt_exits[-1]
    assert torch.allclose(r.logits[0], dense["logits"][e_last - 1][0, -1], atol=1e-10)
    # brute force for the second token: every prompt token's K/V at every depth from the dense
    # prefill, then the decode token reads token j at its exit depth e_j at every one of its depths
    n, store = len(ids), {}
    h = model.embed_tokens(torch.tensor([ids]))
    cos, sin = model.rope(torch.arange(n), h.dtype)
    for d in range(U):
        for l, layer in enumerate(model.layers):
            def keep(q, k, v, l=l, d=d):
                store[l, d] = (k, v)
                return attention(q, k, v)
            h = layer(h, cos, sin, keep)
        _, _, h = model.exit_heads(h)
    x = model.embed_tokens(torch.tensor([r.tokens[:1]]))
    cos, sin = model.rope(torch.tensor([n]), x.dtype)
    for d in range(r.decode_exits[0]):
        for l, layer in enumerate(model.layers):
            def read(q, k, v, l=l):
                pk = torch.stack([store[l, e - 1][0][:, :, j] for j, e in enumerate(r.prompt_exits)], 2)
                pv = torch.stack([store[l, e - 1][1][:, :, j] for j, e in enumerate(r.prompt_exits)], 2)
                every = torch.ones(1, n + 1, dtype=torch.bool)
                return attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), every)
            x = layer(x, cos, sin, read)
        xn, _, x = model.exit_heads(x)
    assert torch.allclose(r.logits[1], model.lm_head(xn[0, -1]), atol=1e-10)


def test_fuzz_random_mixes_with_cancellations_return_every_page():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    e = engine(model, rng.choice([120, 200, 400]), rng.choice(["eager", "shared"]), max_batch=rng.randint(2, 6),
               max_rows=rng.randint(4, 40), scheduler=rng.choice(["continuous", "nested"]))
    reqs = []
    for step in range(400):
        if rng.random() < 0.25 and len(reqs) < 40:
            r = random_request(rng, tuple(MODES))
            r.max_tokens = rng.randint(1, 10)
            try:
                reqs.append(e.add(r))
            except UserError:
                pass
        if reqs and rng.random() < 0.05:
            rng.choice(reqs).cancelled = True
        e.step()
        e.check()
    while e.busy():
        e.step()
        e.check()
    assert e.pool.used == 0 and len(e.pool.free) == e.pool.n_pages
    assert {r.finish_reason for r in reqs} <= {"length", "cancelled", "error"} and len(reqs) > 10
    for r in reqs:
        if r.finish_reason == "length":
            assert len(r.tokens) == r.max_tokens and len(r.exits) == len(r.prompt) + r.max_tokens - 1


@pytest.mark.parametrize("scheduler", ["continuous", "fixed"])
def test_the_shared_head_calls_less_and_changes_nothing(scheduler):
    """Exited rows that wait for one shared LM-head call give the same tokens, exits and logits as
    eager calls, sample as many tokens, and need fewer calls."""
    model = varied_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    work = [(prompt(rng.randint(3, 12)), rng.randint(4, 12), rng.choice(["dense_ragged", "ete_ragged"]))
            for _ in range(6)]
    runs = {}
    for head in ("eager", "shared"):
        e = engine(model, 3000, head, max_batch=6, scheduler=scheduler)
        reqs = e.run([Request(p, o, m, 0.4, keep_logits=True) for p, o, m in work])
        runs[head] = e, reqs
    (ea, ra), (es, rs) = runs["eager"], runs["shared"]
    for a, b in zip(ra, rs):
        assert_same(a, b)
    assert ea.stats["head_rows"] == es.stats["head_rows"] == sum(o for _, o, _ in work)
    if scheduler == "continuous":      # rows exit at different passes: they can share
        assert es.stats["head_calls"] < ea.stats["head_calls"]
    else:                              # every row exits at depth U: they share already
        assert es.stats["head_calls"] <= ea.stats["head_calls"]
    assert es.pool.used == 0 and (es.runner.shared is None or not es.runner.shared.waiting())


@pytest.mark.parametrize("w_head", [0.0, 1e6, float("inf")])
def test_the_shared_head_waits_only_while_waiting_is_cheap(w_head):
    """Every decision of the shared head, checked as it is made: while requests queue, no row waits
    more than MAX_WAIT passes, and rows wait only if the cost model says a call is dearer than their
    idle slots; with no queue, no row waits more than U passes, none where a call costs less than a
    pass, and none of a request that one more pass of waiting would make the last to finish."""
    from engine.shared_head import MAX_WAIT
    model = varied_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    e = Engine(model, 3000, max_batch=3, head="shared")
    h = e.runner.shared                          # the eager runner's shared head
    h.w_head = w_head
    real, deferred = h.choose, []

    def checked(exited, others, running, queued):
        out = real(exited, others, running, queued)
        waiting = h.rows
        assert all(w < (MAX_WAIT if e.scheduler.waiting else e.U) for _, _, _, w in waiting)
        if waiting and e.scheduler.waiting:
            assert len(waiting) * h.w_block < h.w_head * e.scheduler.max_batch
        elif waiting:      # only where a call costs more than a pass, never the request that ends the batch
            end = max(h.passes_expected(s) for s in e.scheduler.running)
            assert h.w_head >= h.w_block and all(h.passes_expected(s) + w + 1 <= end for s, _, _, w in waiting)
        deferred.append(len(waiting))
        return out
    h.choose = checked
    reqs = e.run([Request(prompt(rng.randint(3, 10)), rng.randint(4, 12), "ete_ragged", 0.4) for _ in range(8)])
    assert all(r.finish_reason == "length" for r in reqs) and e.pool.used == 0 and not h.waiting()
    if w_head == 0.0:
        assert e.stats["head_calls"] > 0
    if w_head == float("inf"):
        assert max(deferred) > 0         # rows did wait

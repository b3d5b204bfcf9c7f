"""The depth-batching engine against the single-request oracles (float64): forward_ragged for the
ragged modes, model.generate for fixed and Ouro mode; concurrency, staggered arrivals, mixed modes
and thresholds, every scheduler, preemption with exact replay, rejection, and a seeded fuzz with
the page invariants checked after every step."""
import random

import pytest
import torch

from model import UserError, attention, forward_ragged, generate
from serve_depthbatch import MODES, Engine, Request
from test_ragged import U, oracle_taus, prompt, varied_model


def alone(model, r, **engine_args):
    """The request on an engine of its own; checks that every page came back and was written once
    per layer."""
    e = Engine(model, engine_args.pop("kv_pages", 4000), **engine_args)
    out = e.run([clone(r)])[0]
    assert e.pool.used == 0 and e.pool.writes == out.kv["block_evals"] * model.config.n_layer
    return out


def clone(r):
    return Request(list(r.prompt), r.max_tokens, r.mode, r.thr, r.depth, r.temperature, r.top_p, r.top_k, r.seed,
                   tuple(r.stop), r.prefill_thr, r.prefill_schedule, r.prefix_full, keep_logits=r.keep_logits)


def random_request(rng, modes=("fixed", "ouro", "dense_ragged", "ete_ragged")):
    mode = rng.choice(modes)
    r = Request(prompt(rng.randint(3, 14)), rng.randint(2, 12), mode, rng.choice([0.2, 0.35, 0.5, 0.7]),
                depth=rng.randint(1, U) if mode == "fixed" else 0, keep_logits=True)
    if mode == "ete_ragged" and rng.random() < 0.5:
        rng.choice([lambda: setattr(r, "prefill_thr", 0.8), lambda: setattr(r, "prefill_schedule", "cosine"),
                    lambda: setattr(r, "prefix_full", 2)])()
    return r


def assert_same(a, b):
    assert a.tokens == b.tokens and a.exits == b.exits, (a.mode, a.thr)
    assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), atol=1e-9, rtol=0)


CASES = [("dense_ragged", 0.3, {}), ("dense_ragged", 0.8, {}), ("ete_ragged", 0.3, {}), ("ete_ragged", 0.7, {}),
         ("ete_ragged", 0.5, dict(prefill_schedule="cosine")), ("ete_ragged", 0.4, dict(prefill_thr=0.7)),
         ("ete_ragged", 0.5, dict(prefix_full=3))]


@pytest.mark.parametrize("mode,thr,prefill", CASES)
def test_one_request_equals_the_dense_shaped_oracle(mode, thr, prefill):
    model = varied_model()
    ids = prompt(random.randint(12, 20))
    r = alone(model, Request(ids, 16, mode, thr, keep_logits=True, **prefill))
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


@pytest.mark.parametrize("scheduler", ["continuous", "nested"])
def test_concurrent_staggered_mixed_requests_equal_each_alone(scheduler):
    """Requests of different lengths, modes and thresholds arriving at different steps, in one
    batch: each produces what it produces alone, and the page invariants hold after every step."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = [random_request(rng) for _ in range(7)]
    arrive = sorted(rng.randint(0, 12) for _ in reqs)
    e = Engine(model, 4000, max_batch=5, max_rows=24, scheduler=scheduler)
    step = 0
    while step <= arrive[-1] or e.busy():
        for r, t in zip(reqs, arrive):
            if t == step:
                e.add(r)
        e.step()
        e.check()
        step += 1
    assert e.stats["max_in_flight"] >= 2
    for r in reqs:
        assert r.finish_reason == "length"
        assert_same(r, alone(model, r))
    assert e.pool.used == 0


def test_decode_rows_cut_into_short_and_long_tables_equal_each_alone():
    """Decode rows of very different lengths: the torch path cuts them into two padded tables (short
    rows, long rows) and every request still produces what it produces alone."""
    model = varied_model()
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    reqs = [Request(prompt(rng.randint(30, 40)), 6, "dense_ragged", 0.4, keep_logits=True)] + \
           [Request(prompt(rng.randint(2, 5)), 6, rng.choice(["dense_ragged", "ete_ragged"]), 0.4, keep_logits=True)
            for _ in range(4)]
    e = Engine(model, 4000, max_batch=5, attn="torch")
    tables = []
    cut = e._tables
    e._tables = lambda ends: tables.append(len(cut(ends))) or cut(ends)
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


def test_continuous_passes_reach_the_work_conserving_bound_and_nested_does_not():
    """While requests wait, every continuous pass runs a depth of every one of the B requests in flight
    (passes = bound); the nested runner idles the rows that exited until its whole wave has."""
    model = varied_model()
    work = [(prompt(random.randint(4, 12)), random.randint(8, 20)) for _ in range(16)]
    ratio = {}
    for scheduler in ("continuous", "nested"):
        e = Engine(model, 5000, max_batch=4, scheduler=scheduler)
        e.run([Request(p, o, "ete_ragged", 0.4) for p, o in work])
        ratio[scheduler] = e.stats["steady_passes"] / (e.stats["steady_slots"] / 4)
    assert ratio["continuous"] == 1.0 and ratio["nested"] > 1.2


def test_bench_prints_a_consistent_json_line(capsys):
    """A small --bench (batch 2, 4 requests): the last stdout line is strict JSON with every field the
    issue names; pages are Σ e_i, no scheduler beats the work-conserving bound, continuous meets it,
    fixed is the unit of ratio_vs_fixed and of ideal_ratio, each round is compared with its own fixed
    engine (the fastest-of ratio lies within the rounds' range), the capacity runs stay in their pool."""
    import json
    import serve_depthbatch
    serve_depthbatch.main(["--bench", "--batches=2", "--requests=4", "--repeats=2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    json.dumps(out, allow_nan=False)
    U = out["model"]["n_loops"]
    runs = {(r["scheduler"], r["mode"]): r for r in out["runs"]}
    assert set(runs) == {("fixed", "fixed")} | {(s, m) for s in ("continuous", "nested") for m in ("dense_ragged", "ete_ragged")}
    for r in out["runs"]:
        for key in ("scheduler", "mode", "thr", "batch", "tok_s", "ratio_vs_fixed", "passes", "lower_bound",
                    "avg_decode_depth", "ideal_ratio", "kv_physical", "kv_dense", "sum_exits", "peak_pages",
                    "max_in_flight", "mix_window", "mix_run"):
            assert key in r, key
        assert r["kv_physical"] == r["sum_exits"] <= r["kv_dense"] and r["tok_s"] > 0 and r["max_in_flight"] <= 2
        assert r["passes"] >= r["lower_bound"] - 1e-9
        assert abs(r["ideal_ratio"] - U / r["avg_decode_depth"]) < 1e-3
        rounds = r["ratio_rounds"]
        assert len(rounds) == 2 and min(rounds) - 1e-3 <= r["ratio_vs_fixed"] <= max(rounds) + 1e-3
    assert runs["fixed", "fixed"]["ratio_rounds"] == [1, 1]
    assert runs["fixed", "fixed"]["ratio_vs_fixed"] == 1 and runs["fixed", "fixed"]["avg_decode_depth"] == U
    for mode in ("dense_ragged", "ete_ragged"):
        assert runs["continuous", mode]["passes"] <= 1.05 * runs["continuous", mode]["lower_bound"]
    cap = out["capacity"]
    assert all(r["peak_pages"] <= cap["kv_pages"] for r in cap["runs"])


def test_bench_turns_go_to_the_engine_least_far_through_the_workload(monkeypatch):
    """The benchmark's engines take turns so that they move through the workload together: every
    turn goes to a busy engine with the fewest tokens sampled, so no configuration runs a stretch of
    the machine's time alone while others wait (the timing bias that level turns remove)."""
    import serve_depthbatch
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
    step = serve_depthbatch.timed_step

    def timed_step(run):
        if run["engine"] is not last[0]:      # a new turn: who was chosen, and where everyone stood
            turns.append((tokens(run["engine"]), [tokens(e) for e in engines if e.busy()]))
            last[0] = run["engine"]
        step(run)

    monkeypatch.setattr(serve_depthbatch, "Engine", Recorded)
    monkeypatch.setattr(serve_depthbatch, "timed_step", timed_step)
    monkeypatch.setattr(serve_depthbatch, "TURN", 0.0)     # one step per turn: the most turns to check
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    work = [(prompt(rng.randint(3, 10)), rng.randint(4, 12)) for _ in range(6)]
    configs = [("fixed", "fixed"), ("continuous", "dense_ragged"), ("nested", "ete_ragged")]
    records = serve_depthbatch.bench_runs(varied_model(), work, configs, 0.5, 2, 2000, 64, "torch", seed=rng.randint(0, 99))
    assert [r["tokens"] for r in records] == [sum(o for _, o in work)] * 3
    assert len(turns) > 20 and all(chosen == min(busy) for chosen, busy in turns)


def test_fixed_scheduler_runs_every_token_all_loops():
    model = varied_model()
    reqs = [Request(prompt(6 + i), 8, "ete_ragged", 0.3) for i in range(4)]
    e = Engine(model, 2000, max_batch=4, scheduler="fixed")
    e.run(reqs)
    for r in reqs:
        assert set(r.exits) == {U} and r.tokens == generate(model, r.prompt, 8, "fixed", U)[0]


def test_preemption_replays_the_recorded_exits_exactly():
    """A pool too small for the batch: the newest request is preempted, requeued and rebuilt by a
    recomputation that replays its exits; every continuation equals the request alone."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    reqs = [Request(prompt(rng.randint(6, 12)), rng.randint(10, 16), rng.choice(["dense_ragged", "ete_ragged", "ouro"]),
                    rng.choice([0.3, 0.5]), keep_logits=True) for _ in range(6)]
    e = Engine(model, 150, max_batch=6, max_rows=64)
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


def test_a_request_that_can_never_fit_is_rejected_and_nothing_else_moves():
    model = varied_model()
    e = Engine(model, 60)
    ok = e.add(Request(prompt(5), 6, "ete_ragged", 0.5))
    with pytest.raises(UserError, match="needs at least 84 KV pages"):   # 20 prompt tokens x U + 4 new
        e.add(Request(prompt(20), 5, "dense_ragged", 0.5))
    assert list(e.waiting) == [ok]
    e.run([])
    assert ok.finish_reason == "length" and e.pool.used == 0
    # fits the lower bound, not the worst case: alone, it fails cleanly when the pool runs dry
    bad = Request(prompt(5), 30, "fixed", 0.5)
    e.run([bad])
    assert bad.finish_reason == "error" and "KV pages" in bad.error and e.pool.used == 0


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


def test_seeded_sampling_is_reproducible_whatever_else_is_batched():
    model = varied_model()
    r = Request(prompt(8), 12, "ete_ragged", 0.4, temperature=1.0, top_p=0.9, seed=123, keep_logits=True)
    others = [Request(prompt(5 + i), 9, "dense_ragged", 0.3, temperature=1.0, seed=i) for i in range(4)]
    e = Engine(model, 3000, max_batch=8)
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
                return attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), torch.ones(1, n + 1, dtype=torch.bool))
            x = layer(x, cos, sin, read)
        xn, _, x = model.exit_heads(x)
    assert torch.allclose(r.logits[1], model.lm_head(xn[0, -1]), atol=1e-10)


def test_fuzz_random_mixes_with_cancellations_return_every_page():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    model = varied_model()
    e = Engine(model, rng.choice([120, 200, 400]), max_batch=rng.randint(2, 6), max_rows=rng.randint(4, 40),
               scheduler=rng.choice(["continuous", "nested"]))
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


# ----------------------------------------------------------------------------- HTTP API

import json
import socket
import threading
import time
import urllib.error
import urllib.request

from prepare_data import SYNTH_CHARS, char_meta, load_tokenizer


@pytest.fixture(scope="module")
def http_server():
    """A char-level random model served on a free loopback port, with the engine thread running."""
    from model import GPTConfig, LoopedLM
    from serve_depthbatch import serve
    torch.manual_seed(0)
    meta = char_meta(SYNTH_CHARS)
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=64, n_layer=2, n_head=4, n_embd=32,
                               ffn_hidden=48)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 2.0)
    encode, decode = load_tokenizer(meta)
    engine = Engine(model, 2000, max_batch=8)
    httpd, server = serve(engine, "127.0.0.1", 0, encode, decode, "tiny")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", engine, encode, decode
    httpd.shutdown()
    server.stop()
    httpd.server_close()


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_http_completion_equals_the_engine_and_streams_the_same(http_server):
    url, engine, encode, decode = http_server
    body = {"prompt": "the red cat", "max_tokens": 12, "temperature": 0, "thr": 0.4, "mode": "ete_ragged"}
    status, text = post(url + "/v1/completions", body)
    assert status == 200
    out = json.loads(text)
    direct = alone(engine.model, Request(encode("the red cat"), 12, "ete_ragged", 0.4))
    choice = out["choices"][0]
    assert choice["tokens"] == direct.tokens and choice["text"] == decode(direct.tokens)
    assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23}
    assert choice["exit_stats"]["avg_decode_depth"] == sum(direct.decode_exits) / len(direct.decode_exits)
    assert abs(sum(out["exit_stats"]["exit_fractions"]) - 1) < 1e-9
    status, text = post(url + "/v1/completions", dict(body, stream=True))
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["exit_stats"]["avg_decode_depth"] == choice["exit_stats"]["avg_decode_depth"]
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read())["free_pages"] == 2000
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def test_http_concurrent_requests_are_batched(http_server):
    url, engine, encode, _ = http_server
    engine.stats["max_in_flight"] = 0
    bodies = [{"prompt": "copy abc : ", "max_tokens": 20 + i, "temperature": 0, "thr": 0.2 + 0.1 * i} for i in range(6)]
    results = [None] * 6

    def go(i):
        results[i] = post(url + "/v1/completions", bodies[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _ in results) and engine.stats["max_in_flight"] >= 2
    for (_, text), b in zip(results, bodies):
        direct = alone(engine.model, Request(encode(b["prompt"]), b["max_tokens"], "dense_ragged", b["thr"]))
        assert json.loads(text)["choices"][0]["tokens"] == direct.tokens


def test_openai_client_completions_streaming_stop_and_seeds(http_server):
    from openai import BadRequestError, OpenAI
    url, engine, _, _ = http_server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt="the big dog", max_tokens=10, temperature=0,
                                  extra_body={"thr": 0.3})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt="the big dog", max_tokens=10, temperature=0, stream=True, extra_body={"thr": 0.3}))
    assert streamed == r.choices[0].text
    full = r.choices[0].text
    stop = next((ch for ch in full[1:] if ch.strip()), None)
    if stop is not None:                              # a stop string cuts the text before it
        cut = client.completions.create(model="tiny", prompt="the big dog", max_tokens=10, temperature=0, stop=[stop],
                                        extra_body={"thr": 0.3})
        assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    a = client.completions.create(model="tiny", prompt="sum 1+2=", max_tokens=8, n=3, seed=7, temperature=1.0)
    b = client.completions.create(model="tiny", prompt="sum 1+2=", max_tokens=8, n=3, seed=7, temperature=1.0)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"thr": 1.5})


@pytest.mark.parametrize("body,param", [
    (b"{not json", None), ({"prompt": 5}, "prompt"), ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"), ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "mode": "warp"}, "mode"), ({"prompt": "a", "thr": 1.5}, "thr"), ({"prompt": "a", "thr": -1}, "thr"),
    ({"prompt": "a" * 80}, "prompt"), ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "ABC"}, "prompt"), ({"prompt": [999]}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"), ([1, 2], None),
    ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "depth": 9}, "depth"),
])
def test_http_bad_requests_are_400_and_the_server_keeps_serving(http_server, body, param):
    url = http_server[0]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, text = post(url + path, body, raw=isinstance(body, bytes))
    err = json.loads(text)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    status, _ = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200


def test_http_client_disconnect_cancels_and_frees_pages(http_server):
    url, engine, _, _ = http_server
    host, port = url[7:].split(":")
    body = json.dumps({"prompt": "the", "max_tokens": 50, "stream": True, "temperature": 0}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:                    # the headers, then the first tokens
        got += sock.recv(4096)
    sock.close()                                   # and the client goes away mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        with urllib.request.urlopen(url + "/health") as r:
            h = json.loads(r.read())
        if h["running"] == 0 and h["waiting"] == 0 and h["free_pages"] == engine.pool.n_pages:
            break
        time.sleep(0.05)
    assert h["free_pages"] == engine.pool.n_pages and h["running"] == 0
    cancelled = [r for r in engine.finished if r.finish_reason == "cancelled"]
    assert cancelled and len(cancelled[-1].tokens) < 50


def test_http_chat_completions_on_an_ouro_folder(tmp_path):
    from openai import OpenAI
    from model import load_checkpoint
    from serve_depthbatch import serve
    from test_ouro import CFG, make_tokenizer, ouro_tensors, write_folder
    folder = write_folder(str(tmp_path / "ouro"), CFG, ouro_tensors(CFG, seed=2))
    make_tokenizer(str(tmp_path / "ouro" / "tokenizer.json"))
    model, ckpt = load_checkpoint(folder)
    encode, decode = load_tokenizer(ckpt["meta"])
    httpd, server = serve(Engine(model, 1000), "127.0.0.1", 0, encode, decode, "ouro", chat=True, eos=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="ouro", messages=[{"role": "user", "content": "the cat"}],
                                           max_tokens=6, temperature=0)
        ids = [1] + encode("user\nthe cat") + [2] + encode("\n") + [1] + encode("assistant\n")
        direct = alone(model, Request(ids, 6, "dense_ragged", 0.5, stop=(2,)))
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == decode([t for t in direct.tokens if t != 2])
        parts = list(client.chat.completions.create(model="ouro", messages=[{"role": "user", "content": "the cat"}],
                                                    max_tokens=6, temperature=0, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
    finally:
        httpd.shutdown()
        server.stop()
        httpd.server_close()

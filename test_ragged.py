"""Ragged KV: the paged compact path against the dense-shaped oracle (float64), exact page
accounting, and the page pool under a random fuzz."""
import random

import pytest
import torch

from model import FULL, decode_token, forward_ragged, generate, generate_paged, prompt_thresholds, run_chunk
from ragged import PageError, PagePool, PoolExhausted, RaggedSeq
from test_model import random_model

U = 4


def varied_model(seed=None):
    """A float64 model whose threshold exits spread over all depths."""
    seed = random.choice([1, 2]) if seed is None else seed
    model = random_model(seed)
    with torch.no_grad():
        model.early_exit_gate.weight.mul_(0.4)
        model.early_exit_gate.bias.fill_(-0.5)
    return model


def recorder(store):
    def sampler(logits):
        store.append(logits.clone())
        return int(logits.argmax())
    return sampler


def prompt(n):
    return torch.randint(0, 37, (n,)).tolist()


def oracle_taus(n_prompt, n_total, mode, thr, **prefill):
    taus = torch.full((1, n_total), float(thr), dtype=torch.float64)
    if mode == "dense_ragged":
        taus[0, :n_prompt] = FULL
    else:
        taus[0, :n_prompt] = prompt_thresholds(n_prompt, thr, **prefill)
    return taus


CASES = [("dense_ragged", 0.3, {}), ("dense_ragged", 0.5, {}), ("dense_ragged", 0.8, {}),
         ("ete_ragged", 0.3, {}), ("ete_ragged", 0.5, {}), ("ete_ragged", 0.7, {}),
         ("ete_ragged", 0.5, dict(prefill_schedule="cosine")),
         ("ete_ragged", 0.4, dict(prefill_thr=0.7)),
         ("ete_ragged", 0.5, dict(prefix_full=3))]


@pytest.mark.parametrize("mode,thr,prefill", CASES)
def test_paged_path_equals_dense_shaped_oracle(mode, thr, prefill):
    model = varied_model()
    ids = prompt(random.randint(12, 20))
    logits = []
    r = generate_paged(model, ids, 16, mode, thr, sampler=recorder(logits), **prefill)
    full = ids + r["tokens"][:-1]               # the last new token is sampled, never run
    n = len(ids)
    o = forward_ragged(model, torch.tensor([full]), taus=oracle_taus(n, len(full), mode, thr, **prefill))
    assert o["exits"][0].tolist() == r["prompt_exits"] + r["decode_exits"]
    assert torch.allclose(o["logits"][0, n - 1:], torch.stack(logits), atol=1e-10, rtol=0)
    if mode == "ete_ragged":  # every prompt position's exit state too, not only the last
        seq = RaggedSeq(PagePool.for_model(model, len(full) * U), U, len(full))
        taus = oracle_taus(n, n, mode, thr, **prefill)[0]
        exits, states = run_chunk(model, seq, torch.tensor(ids), taus)
        assert torch.allclose(states, o["states"][0, :n], atol=1e-10, rtol=0)
        seq.release()
    all_exits = r["prompt_exits"] + r["decode_exits"]
    if mode == "ete_ragged" and not prefill:
        assert len(set(all_exits)) >= 2  # the exits really vary


@pytest.mark.parametrize("thr", [0.3, 0.6])
def test_parallel_prefill_equals_one_token_at_a_time(thr):
    model = varied_model()
    ids = torch.tensor(prompt(24))
    pool = PagePool.for_model(model, 2 * 24 * U)
    a, b = RaggedSeq(pool, U, 24), RaggedSeq(pool, U, 24)
    ea, sa = run_chunk(model, a, ids, thr)
    parts = [run_chunk(model, b, ids[i:i + 1], thr) for i in range(24)]
    eb, sb = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    assert torch.equal(ea, eb) and torch.allclose(sa, sb, atol=1e-10, rtol=0)
    assert a.stats() == b.stats()
    c = RaggedSeq(pool, U, 24)   # the single-token fast path equals the reference run_chunk
    fast = [decode_token(model, c, int(t), thr) for t in ids]
    assert torch.equal(torch.cat([f[0] for f in fast]), eb)
    assert torch.allclose(torch.cat([f[1] for f in fast]), sb, atol=1e-12, rtol=0) and c.stats() == b.stats()
    same = lambda t: t[:24, :, None] == t[:24, None, :]   # which depths of a row alias each other
    assert torch.equal(same(c.table), same(b.table)) and torch.equal(c.real, b.real)
    a.release(), b.release(), c.release()
    assert pool.used == 0


def test_threshold_extremes_reproduce_fixed_depths():
    model = varied_model()
    ids = prompt(10)
    top = generate_paged(model, ids, 12, "fixed", depth=U)
    one = generate_paged(model, ids, 12, "fixed", depth=1)
    for mode in ("dense_ragged", "ete_ragged"):
        never = generate_paged(model, ids, 12, mode, thr=FULL)      # a threshold no CDF reaches
        assert never["tokens"] == top["tokens"] and set(never["decode_exits"]) == {U}
        zero = generate_paged(model, ids, 12, mode, thr=0.0)
        assert set(zero["decode_exits"]) == {1}
    assert generate_paged(model, ids, 12, "ete_ragged", thr=0.0)["tokens"] == one["tokens"]
    ouro = generate(model, ids, 12, "ouro", thr=1.0)[0]                 # Ouro's lanes at τ = 1
    assert ouro == top["tokens"] == generate_paged(model, ids, 12, "ouro", thr=1.0)["tokens"]
    assert generate(model, ids, 12, "fixed", depth=U)[0] == top["tokens"]


def test_paged_ouro_and_fixed_equal_the_dense_lanes():
    model = varied_model()
    ids = prompt(9)
    for mode, depth in (("ouro", None), ("fixed", 2), ("fixed", 3)):
        la, pa = [], []
        lanes = generate(model, ids, 14, mode, depth, 0.5, recorder(la))
        paged = generate_paged(model, ids, 14, mode, 0.5, depth, recorder(pa))
        assert lanes == (paged["tokens"], paged["exits"])
        assert torch.allclose(torch.stack(la), torch.stack(pa), atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["dense_ragged", "ete_ragged"])
def test_exact_page_accounting_and_release(mode):
    model = varied_model()
    ids = prompt(15)
    pool = PagePool.for_model(model, 2000)
    r = generate_paged(model, ids, 20, mode, 0.5, pool=pool)
    s_e = sum(r["prompt_exits"]) + sum(r["decode_exits"])
    if mode == "dense_ragged":
        assert r["prompt_exits"] == [U] * len(ids)    # U physical rows per prompt token
    assert r["kv"]["physical"] == s_e                 # Eq. 12: Σ e_i rows, not N·U
    assert r["kv"]["block_evals"] == s_e              # nothing computed past an exit
    assert r["kv"]["peak"] == s_e and r["kv"]["dense"] == U * (len(ids) + 19)
    assert r["kv"]["logical"] == r["kv"]["dense"]     # aliases fill every logical row
    assert pool.writes == s_e * model.config.n_layer  # one write per page per layer
    assert pool.used == 0 and len(pool.free) == 2000   # every page freed on release
    pool.check()


def test_tables_alias_terminal_pages_and_writes_refuse_aliases():
    model = varied_model()
    pool = PagePool.for_model(model, 400)
    seq = RaggedSeq(pool, U, 30)
    exits, _ = run_chunk(model, seq, torch.tensor(prompt(30)), 0.5)
    for i, e in enumerate(exits.tolist()):  # Eq. 11: A_d[i] = P_{i, min(d, e_i)}
        row = seq.table[i]
        assert row[e:].eq(row[e - 1]).all() and len(set(row[:e].tolist())) == e
        assert seq.real[i, :e].all() and not seq.real[i, e:].any()
    seq.check()
    i = int(torch.nonzero(exits < U)[0])
    e = int(exits[i])
    with pytest.raises(PageError):  # a write through the alias at depth e+1 is refused
        seq.write_pages(torch.tensor([i]), e, seq.table[i, e:e + 1])
    page = seq.table[0, 0:1].clone()
    seq.release()
    with pytest.raises(PageError):          # double free
        pool.release([0], seq)
    with pytest.raises(PageError):          # use of a freed page
        seq.write_pages(torch.tensor([0]), 0, page)
    with pytest.raises(PageError):          # and no more pages for a released sequence
        seq.alloc_depth(torch.tensor([0]), 0)


def test_table17_baselines_keep_one_row_per_token():
    model = varied_model()
    ids = prompt(12)
    for mode in ("last_kv", "shared_kv", "collapse_kv"):
        pool = PagePool.for_model(model, 500)
        r = generate_paged(model, ids, 10, mode, 0.5, pool=pool)
        assert r["kv"]["physical"] == len(ids) + 9    # one K/V per token survives
        expect = U * (len(ids) + 9) if mode == "last_kv" else None
        if mode == "shared_kv":
            expect = U * len(ids) + sum(r["decode_exits"])
        if mode == "collapse_kv":
            expect = U * len(ids) + sum(r["decode_exits"])
        assert r["kv"]["block_evals"] == expect
        assert pool.used == 0


def test_collapse_kv_reads_exit_depth_of_every_earlier_token():
    """Brute force for one decode step of collapse_kv: attention to the prompt must read K/V at each
    prompt token's exit depth, which equals a dense-shaped pass where the prompt's exits are given
    and (as in Eq. 7 with d >= e) every later depth reads that row."""
    model = varied_model()
    ids = prompt(10)
    logits = []
    r = generate_paged(model, ids, 2, "collapse_kv", 0.5, sampler=recorder(logits))
    # the first new token comes from a dense prefill, so its logits are the dense ones at the exit
    dense = model(torch.tensor([ids]), keep_logits=True)
    e_last = r["prompt_exits"][-1]
    assert torch.allclose(logits[0], dense["logits"][e_last - 1][0, -1], atol=1e-10)


def test_pool_exhaustion_leaves_everything_intact():
    model = varied_model()
    pool = PagePool.for_model(model, 40)
    seq = RaggedSeq(pool, U, 50)
    run_chunk(model, seq, torch.tensor(prompt(6)), 0.5)
    other = RaggedSeq(pool, U, 50)
    free, table, owner = list(pool.free), seq.table.clone(), list(pool.owner)
    with pytest.raises(PoolExhausted):
        pool.alloc(len(pool.free) + 1, other)
    assert pool.free == free and pool.owner == owner and torch.equal(seq.table, table)
    with pytest.raises(PoolExhausted):
        generate_paged(model, prompt(30), 5, "dense_ragged", 0.5, pool=pool)  # 120 pages needed
    # the failed request gave back what it had taken; the other sequence is untouched
    assert sorted(pool.free) == sorted(free) and pool.owner == owner and torch.equal(seq.table, table)
    seq.check(), pool.check()
    seq.release()
    assert pool.used == 0


def test_fuzz_pages_over_many_sequences():
    """Thousands of random allocate / run-a-depth / exit / collapse / release operations."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    pool = PagePool(300, n_layer=1, n_kv_head=1, head_dim=2)
    live, running, exits_seen = [], {}, 0
    for step in range(4000):
        op = rng.random()
        if op < 0.15 or not live:                       # a new sequence with a few new tokens
            seq = RaggedSeq(pool, U, 64)
            live.append(seq)
            running[seq] = {}
        seq = rng.choice(live)
        if op < 0.45 and seq.n < 60:                   # new tokens start at depth 1
            pos = seq.extend(rng.randint(1, 4))
            try:
                seq.alloc_depth(pos, 0)
                running[seq].update({int(p): 0 for p in pos})
            except PoolExhausted:                      # nothing was allocated; the positions stay empty
                assert (seq.table[pos] == -1).all()
        elif op < 0.75 and running[seq]:               # run one more depth, or exit
            p, d = rng.choice(list(running[seq].items()))
            t = torch.tensor([p])
            if d == U - 1 or rng.random() < 0.4:
                seq.stop(t, d)
                del running[seq][p]
                exits_seen += 1
                if rng.random() < 0.2:
                    seq.collapse(t, torch.tensor([rng.randint(0, d)]))
            else:
                try:
                    seq.alloc_depth(t, d + 1)
                    running[seq][p] = d + 1
                except PoolExhausted:
                    pass
        elif op < 0.85:
            seq.release()
            live.remove(seq)
            del running[seq]
        if step % 50 == 0:
            pool.check()
            for s in live:
                s.check()
    for s in live:
        s.release()
    pool.check()
    assert pool.used == 0 and exits_seen > 300 and pool.peak > 200


def test_sample_reports_decode_exit_statistics_and_prefill_apart(tmp_path, capsys):
    """Exit fractions and jump rates are over decode positions (the paper's convention); the prompt's
    own (all U in Dense-Ragged) are reported under "prefill"; fixed mode reports no threshold."""
    import json
    import sample
    from model import exit_stats, model_args, save_checkpoint
    model = varied_model()
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config), "meta": {}},
                    str(tmp_path / "ckpt.pt"))
    ids = ",".join(map(str, prompt(12)))
    res = sample.main(["--ckpt", str(tmp_path), "--thr", "0.3", "--prompt_ids", ids, "--max_new_tokens=20",
                       "--temperature=0", "--json", "--dtype=float64"])
    r = res[0]
    assert r["prompt_exits"] == [U] * 12 and len(set(r["decode_exits"])) >= 2
    for key in ("exit_fractions", "jump_rates", "large_jump_rate"):
        assert r[key] == exit_stats(r["decode_exits"], U)[key]
        assert r["prefill"][key] == exit_stats(r["prompt_exits"], U)[key]
    assert r["prefill"]["exit_fractions"] == [0, 0, 0, 1.0]
    capsys.readouterr()
    sample.main(["--ckpt", str(tmp_path), "--mode=fixed", "--depth=2", "--prompt_ids", ids, "--max_new_tokens=3",
                 "--json", "--dtype=float64"])
    out = capsys.readouterr()
    rec = json.loads(out.out.strip().splitlines()[-1])
    assert rec["thr"] is None and rec["depth"] == 2 and "thr=" not in out.err and "depth=2" in out.err

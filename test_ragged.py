"""Ragged KV pages: aliasing tables (Eq. 11), write and free rules, exhaustion, and the page pool
under a random fuzz; the exit statistics sample.py reports. (The engine that runs the model over
these pages is tested against the oracles in test_serve.py.)"""
import random

import pytest
import torch

from conftest import U, prompt, varied_model
from kernels import grid_of
from ragged import PageError, PagePool, PoolExhausted, RaggedSeq, alloc_wave

def run_random_exits(seq, n, rng):
    """Tokens 0..n-1 run depth by depth, each stopping at a random exit (pages as the engine takes them)."""
    exits = [rng.randint(1, U) for _ in range(n)]
    pos = seq.extend(n)
    for d in range(U):
        running = pos[[e > d for e in exits]]
        if len(running):
            seq.alloc_depth(running, d)
        stopping = pos[[e == d + 1 for e in exits]]
        if len(stopping):
            seq.stop(stopping, d)                   # Eq. 11: deeper rows alias the terminal page
    return exits


def test_the_worked_example_of_eq_7_11_12():
    """RaggedSeq's docstring, run: exits [1, 3, 2] at U = 4 give the table it draws, column 3 reads every
    token at min(3, e_j) (Eq. 7 through Eq. 11), and 6 physical pages against 12 dense rows (Eq. 12)."""
    seq = RaggedSeq(PagePool(16, n_layer=1, n_kv_head=1, head_dim=2), 4, 3)
    pos, exits = seq.extend(3), torch.tensor([1, 3, 2])
    for d in range(4):
        running = pos[exits > d]
        if len(running):
            seq.alloc_depth(running, d)
        if (exits == d + 1).any():
            seq.stop(pos[exits == d + 1], d)
    assert seq.table.tolist() == [[0, 0, 0, 0], [1, 3, 5, 5], [2, 4, 4, 4]]
    by_depth = {p: (i, d) for i in range(3) for d in range(4) for p in [seq.table[i, d].item()] if seq.real[i, d]}
    assert [by_depth[p] for p in seq.table[:, 2].tolist()] == [(0, 0), (1, 2), (2, 1)]    # min(3, e_j), 0-based
    assert seq.stats() == {"physical": 6, "logical": 12, "dense": 12, "block_evals": 6}


def test_tables_alias_terminal_pages_and_writes_refuse_aliases():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    pool = PagePool(400, n_layer=1, n_kv_head=1, head_dim=2)
    seq = RaggedSeq(pool, U, 30)
    exits = run_random_exits(seq, 30, rng)
    for i, e in enumerate(exits):  # Eq. 11: A_d[i] = P_{i, min(d, e_i)}
        row = seq.table[i]
        assert row[e:].eq(row[e - 1]).all() and len(set(row[:e].tolist())) == e
        assert seq.real[i, :e].all() and not seq.real[i, e:].any()
    assert seq.stats() == {"physical": sum(exits), "logical": 30 * U, "dense": 30 * U,
                           "block_evals": sum(exits)}
    seq.check()
    i = next(i for i, e in enumerate(exits) if e < U)
    e = exits[i]
    with pytest.raises(PageError):  # a write through the alias at depth e+1 is refused
        seq.write_pages(torch.tensor([i]), e, seq.table[i, e:e + 1])
    page = seq.table[0, 0:1].clone()
    seq.release()
    assert pool.used == 0
    with pytest.raises(PageError):          # double free
        pool.release([0], seq)
    with pytest.raises(PageError):          # use of a freed page
        seq.write_pages(torch.tensor([0]), 0, page)
    with pytest.raises(PageError):          # and no more pages for a released sequence
        seq.alloc_depth(torch.tensor([0]), 0)


def test_pool_exhaustion_leaves_everything_intact():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    pool = PagePool(40, n_layer=1, n_kv_head=1, head_dim=2)
    seq = RaggedSeq(pool, U, 50)
    run_random_exits(seq, 6, rng)
    other = RaggedSeq(pool, U, 50)
    free, table, owner = list(pool.free), seq.table.clone(), list(pool.owner)
    with pytest.raises(PoolExhausted):
        pool.alloc(len(pool.free) + 1, other)
    with pytest.raises(PoolExhausted):
        other.alloc_depth(other.extend(len(pool.free) + 1), 0)
    assert pool.free == free and pool.owner == owner and torch.equal(seq.table, table)
    assert not other.real.any() and (other.table == -1).all() and other.block_evals == 0
    seq.check(), pool.check()
    seq.release()
    assert pool.used == 0


def test_a_wave_takes_its_pages_in_one_piece_position_by_position():
    """alloc_wave lays a wave's pages [row][request][depth] from the free list: requests that start
    together on a fresh pool read every depth on a regular grid, also after later positions are
    added; a wave that does not fit takes nothing."""
    B, n = random.randint(1, 5), random.randint(1, 6)
    pool = PagePool(B * U * (n + 3), n_layer=1, n_kv_head=1, head_dim=2)
    seqs = [RaggedSeq(pool, U, n + 3) for _ in range(B)]
    pos = [s.extend(n) for s in seqs]
    pages = alloc_wave(pool, [(s, p, range(U)) for s, p in zip(seqs, pos)])
    for r, per_depth in enumerate(pages):
        assert per_depth.shape == (n, U)
        for d, pg in enumerate(per_depth.T):
            assert pg.tolist() == [i * B * U + r * U + d for i in range(n)]
            assert torch.equal(seqs[r].table[:n, d], pg)
    for _ in range(2):                                  # decode positions, one per request
        alloc_wave(pool, [(s, s.extend(1), range(U)) for s in seqs])
    for d in range(U):
        table = torch.stack([s.table[:n + 2, d] for s in seqs])
        assert grid_of(table) == (d, U if B > 1 else 0, B * U)
    free, owner = list(pool.free), list(pool.owner)
    late = RaggedSeq(pool, U, 9)
    with pytest.raises(PoolExhausted):
        alloc_wave(pool, [(seqs[0], seqs[0].extend(1), range(U)), (late, late.extend(9), range(U))])
    assert pool.free == free and pool.owner == owner and (late.table == -1).all()
    for s in seqs:
        s.check()
    pool.check()


def test_fuzz_pages_over_many_sequences():
    """Thousands of random allocate / run-a-depth / exit / collapse / release operations, on a pool
    small enough that every run fills it and meets exhaustion."""
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    pool = PagePool(150, n_layer=1, n_kv_head=1, head_dim=2)
    live, running, exits_seen, exhausted = [], {}, 0, 0
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
            except PoolExhausted:
                # nothing was allocated; the positions stay empty
                assert (seq.table[pos] == -1).all()
                exhausted += 1
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
                    exhausted += 1
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
    assert pool.used == 0 and exits_seen > 300 and pool.peak == pool.n_pages and exhausted > 0


def test_sample_reports_decode_exit_statistics_and_prefill_apart(tmp_path, capsys):
    """Exit fractions and jump rates are over decode positions (the paper's convention); the
    prompt's own (all U in Dense-Ragged) are reported under "prefill"; fixed mode reports no
    threshold."""
    import json
    import sample
    from checkpoint import model_args, save_checkpoint
    from model import exit_stats
    model = varied_model()
    save_checkpoint({"model": model.state_dict(), "model_args": model_args(model.config),
                     "meta": {}},
                    str(tmp_path / "ckpt.pt"))
    ids = ",".join(map(str, prompt(12)))
    res = sample.main(["--ckpt", str(tmp_path), "--thr", "0.3", "--prompt_ids", ids,
                       "--max_new_tokens=20", "--temperature=0", "--json", "--dtype=float64"])
    r = res[0]
    assert r["prompt_exits"] == [U] * 12 and len(set(r["decode_exits"])) >= 2
    for key in ("exit_fractions", "jump_rates", "large_jump_rate"):
        assert r[key] == exit_stats(r["decode_exits"], U)[key]
        assert r["prefill"][key] == exit_stats(r["prompt_exits"], U)[key]
    assert r["prefill"]["exit_fractions"] == [0, 0, 0, 1.0]
    capsys.readouterr()
    sample.main(["--ckpt", str(tmp_path), "--mode=fixed", "--depth=2", "--prompt_ids", ids,
                 "--max_new_tokens=3", "--json", "--dtype=float64"])
    out = capsys.readouterr()
    rec = json.loads(out.out.strip().splitlines()[-1])
    assert rec["thr"] is None and rec["depth"] == 2 and "thr=" not in out.err and "depth=2" in out.err

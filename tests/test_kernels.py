"""kernels.paged_attention: the torch reference against a float64 loop; the Triton kernel (under
TRITON_INTERPRET=1 on the CPU, float32) and the compiled FlexAttention path against the reference,
on fresh random inputs every run; the engine with each implementation; the core without triton."""
import os
import random
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import (gather_plan, grid_of, paged_attention, paged_attention_flex, paged_attention_table,
                     paged_attention_grid, paged_attention_torch, paged_attention_triton, paged_chunk_attention,
                     paged_chunk_attention_grid)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the project root


def random_case(R, Hq, Hkv, D, maxlen, P=None, dtype=torch.float32, pad="minus_one"):
    """Random rows: lengths 1..maxlen (the longest row exactly maxlen), pages drawn with repeats
    (one page read at many positions and by many rows, as aliases are), and whatever lies past a
    row's length: -1, or valid page ids that must not be read."""
    P = P or max(8, maxlen // 2)
    q = torch.randn(R, Hq, D, dtype=dtype)
    k, v = torch.randn(P, Hkv, D, dtype=dtype), torch.randn(P, Hkv, D, dtype=dtype)
    lengths = torch.randint(1, maxlen + 1, (R,))
    lengths[0] = maxlen
    ids = torch.randint(0, P, (R, maxlen), dtype=torch.int32)
    ids[min(1, R - 1), :] = ids[min(1, R - 1), 0]                  # one page read at every position of a row
    past = torch.arange(maxlen)[None, :] >= lengths[:, None]
    ids[past] = -1 if pad == "minus_one" else torch.randint(0, P, (int(past.sum()),), dtype=torch.int32)
    return q, k, v, ids, lengths


def loop_reference(q, k, v, ids, lengths, scale=None):
    """float64, one row and one head at a time, straight from the definition."""
    R, Hq, D = q.shape
    G = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(R, Hq, D, dtype=torch.float64)
    for r in range(R):
        pages = ids[r, :int(lengths[r])].long()
        for h in range(Hq):
            keys, vals = k[pages, h // G].double(), v[pages, h // G].double()
            w = torch.softmax(keys @ q[r, h].double() * scale, dim=0)
            out[r, h] = w @ vals
    return out


@pytest.mark.parametrize("R,Hq,Hkv,D,maxlen", [(5, 4, 4, 16, 40), (3, 8, 2, 32, 130), (4, 4, 1, 64, 7)])
def test_torch_reference_equals_a_float64_loop(R, Hq, Hkv, D, maxlen):
    for pad in ("minus_one", "valid_ids"):
        q, k, v, ids, lengths = random_case(R, Hq, Hkv, D, maxlen, dtype=torch.float64, pad=pad)
        scale = random.choice([None, 0.3])
        assert torch.allclose(paged_attention_torch(q, k, v, ids, lengths, scale),
                              loop_reference(q, k, v, ids, lengths, scale), atol=1e-12, rtol=0)


@pytest.mark.parametrize("R,Hq,Hkv,D,maxlen", [(6, 4, 4, 16, 6), (5, 8, 2, 32, 70), (1, 4, 1, 64, 9),
                                               (40, 4, 4, 16, 64)])
def test_chunk_attention_equals_a_float64_loop_over_the_shared_list(R, Hq, Hkv, D, maxlen):
    """The rows of one prompt chunk share one key list, each reading its own prefix of it. Rows need
    not be consecutive (rows of an ETE chunk leave as they exit); what lies past the longest row
    (-1 or valid ids) is never read."""
    for pad in ("minus_one", "valid_ids"):
        P = 2 * maxlen
        q = torch.randn(R, Hq, D, dtype=torch.float64)
        k, v = torch.randn(P, Hkv, D, dtype=torch.float64), torch.randn(P, Hkv, D, dtype=torch.float64)
        ids = torch.randperm(P)[:maxlen]
        lengths = torch.randperm(maxlen)[:R].sort().values + 1             # distinct positions, any gaps
        longest = int(lengths.max())
        ids[longest:] = -1 if pad == "minus_one" else torch.randint(0, P, (maxlen - longest,))
        scale = random.choice([None, 0.3])
        out = paged_chunk_attention(q, k, v, ids, lengths, scale)
        assert torch.allclose(out, loop_reference(q, k, v, ids.expand(R, -1), lengths, scale), atol=1e-12, rtol=0)


def test_stacked_chunks_at_the_same_positions_equal_the_loop_in_one_call():
    """G chunks whose rows sit at the same positions (the prompts of a batch that starts together)
    go in one call, page_ids [G, maxlen]: each chunk's rows equal the float64 loop over its own list,
    gathered or, when the lists lie on a grid of the pool (grid_of), read in place."""
    for _ in range(6):
        G, Hq, Hkv, D = random.randint(1, 5), 4, random.choice([1, 2, 4]), 16
        start, T = random.randint(0, 9), random.randint(1, 8)
        n = start + T
        lengths = torch.arange(start, n) + 1                                # a chunk at positions start..n-1
        U, base = random.randint(1, 4), random.randint(0, 7)
        grid = base + U * torch.arange(G)[:, None] + G * U * torch.arange(n)[None, :]   # ragged.alloc_wave's layout
        P = int(grid.max()) + 1 + random.randint(0, 5)
        q = torch.randn(G * T, Hq, D, dtype=torch.float64)
        k, v = torch.randn(P, Hkv, D, dtype=torch.float64), torch.randn(P, Hkv, D, dtype=torch.float64)
        scattered = torch.stack([torch.randperm(P)[:n] for _ in range(G)])
        scale = random.choice([None, 0.3])
        for ids in (grid, scattered):
            ref = torch.cat([loop_reference(q[g * T:(g + 1) * T], k, v, ids[g].expand(T, -1), lengths, scale)
                             for g in range(G)])
            found = grid_of(ids)
            if ids is grid:
                assert found == (base, U if G > 1 else 0, G * U if n > 1 else 1)
            assert torch.allclose(paged_chunk_attention(q, k, v, ids, lengths, scale), ref, atol=1e-12, rtol=0)
            if found is not None:
                out = paged_chunk_attention_grid(q, k, v, found, G, n, lengths, scale)
                assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_rows_on_a_grid_of_pages_are_read_in_place_and_equal_the_loop():
    """Tables with page(r, j) = base + r*s_r + j*s_j (a batch that started together) are found, read
    through a strided view of the pool, and give what the float64 loop gives; one entry off the
    grid, or a row shorter than the others, sends the same rows through the gather."""
    for _ in range(5):
        R, Hq, Hkv, D, n = random.randint(1, 6), 4, random.choice([1, 2, 4]), 16, random.randint(1, 40)
        s_r, s_j, base = random.randint(0, 9), random.randint(1, 9), random.randint(0, 20)
        P = base + (R - 1) * s_r + (n - 1) * s_j + 1 + random.randint(0, 5)
        ids = base + s_r * torch.arange(R)[:, None] + s_j * torch.arange(n)[None, :]
        lengths = torch.full((R,), n)
        q = torch.randn(R, Hq, D, dtype=torch.float64)
        k, v = torch.randn(P, Hkv, D, dtype=torch.float64), torch.randn(P, Hkv, D, dtype=torch.float64)
        plan = gather_plan(ids, lengths, "cpu")
        assert plan[2] == (base, s_r if R > 1 else 0, s_j if n > 1 else 1)
        ref = loop_reference(q, k, v, ids, lengths)
        assert torch.allclose(paged_attention_grid(q, k, v, plan[2], n), ref, atol=1e-12, rtol=0)
        assert torch.allclose(paged_attention_torch(q, k, v, ids, lengths, plan=plan), ref, atol=1e-12, rtol=0)
        assert torch.allclose(paged_attention(q, k, v, ids, lengths), ref, atol=1e-12, rtol=0)   # the dispatch
        if R * n > 2:
            off = ids.clone()
            r, j = random.randrange(R), random.randrange(n)
            off[r, j] = (off[r, j] + random.randint(1, P - 1)) % P      # one entry off the grid
            if not torch.equal(off, ids):
                assert grid_of(off) is None
                assert torch.allclose(paged_attention_torch(q, k, v, off, lengths),
                                      loop_reference(q, k, v, off, lengths), atol=1e-12, rtol=0)
        if R > 1 and n > 1:
            short = lengths.clone()
            short[-1] = n - 1
            assert gather_plan(ids, short, "cpu")[2] is None
            assert torch.allclose(paged_attention_torch(q, k, v, ids, short), loop_reference(q, k, v, ids, short),
                                  atol=1e-12, rtol=0)


CASES = [  # R, Hq, Hkv (GQA 1 and 4), D (16..128), maxlen (1..a few hundred), splits (None: the heuristic)
    (3, 4, 4, 16, 1, 1), (4, 4, 4, 16, 37, 1), (2, 8, 2, 32, 64, 3), (3, 4, 1, 64, 300, 4), (2, 16, 4, 128, 200, 1),
    (2, 4, 4, 128, 257, 5), (6, 8, 8, 48, 90, None), (1, 4, 1, 80, 333, None), (9, 2, 2, 16, 20, 2),
]


@pytest.mark.parametrize("R,Hq,Hkv,D,maxlen,splits", CASES)
def test_triton_kernel_equals_the_reference(R, Hq, Hkv, D, maxlen, splits):
    for pad in ("minus_one", "valid_ids"):
        q, k, v, ids, lengths = random_case(R, Hq, Hkv, D, maxlen, pad=pad)
        ref = paged_attention_torch(q, k, v, ids, lengths)
        out = paged_attention_triton(q, k, v, ids, lengths, num_splits=splits, poison=True)  # NaN until written
        assert not out.isnan().any()
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()


def test_triton_splits_follow_the_heuristic_and_agree():
    q, k, v, ids, lengths = random_case(2, 4, 2, 32, 400)
    assert kernels.splits_for(2 * 2, 400, 32) > 1 and kernels.splits_for(512, 400, 32) == 1
    one = paged_attention_triton(q, k, v, ids, lengths, num_splits=1, poison=True)
    many = paged_attention_triton(q, k, v, ids, lengths, poison=True)         # several splits
    assert torch.allclose(one, many, atol=2e-5, rtol=1e-4)


def random_table(R, Hkv, D, maxlen, U=4, S=3, dtype=torch.float32):
    """A page table [S + 1, U, maxlen] with repeats (aliases) and rows (request, depth, length)."""
    P = max(8, maxlen // 2)
    k, v = torch.randn(P, Hkv, D, dtype=dtype), torch.randn(P, Hkv, D, dtype=dtype)
    table = torch.randint(0, P, (S + 1, U, maxlen))
    req, depth = torch.randint(0, S + 1, (R,)), torch.randint(0, U, (R,))
    lengths = torch.randint(1, maxlen + 1, (R,))
    lengths[0] = maxlen
    return k, v, table, req, depth, lengths


@pytest.mark.parametrize("R,Hq,Hkv,D,maxlen,splits", CASES)
def test_reading_the_page_table_in_place_equals_the_reference(R, Hq, Hkv, D, maxlen, splits):
    """The slot engine's read: row r's keys are table[req[r], depth[r], :lengths[r]], read in place. The
    torch path against a float64 loop over the same lists; the Triton kernel, its grid fixed by
    n_splits and each row's span computed on the device, against the torch path (NaN-poisoned)."""
    k, v, table, req, depth, lengths = random_table(R, Hkv, D, maxlen)
    q = torch.randn(R, Hq, D)
    ids = table[req, depth]
    ref = paged_attention_table(q, k, v, table, req, depth, lengths, "torch", n_keys=maxlen)
    assert torch.allclose(ref.double(), loop_reference(q, k, v, ids, lengths), atol=2e-5, rtol=0)
    n = splits or kernels.splits_for(R * Hkv, maxlen, 32)
    out = kernels.flash_decode(q, k, v, table, req, depth, lengths, n, poison=True)
    assert not out.isnan().any()
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)                 # queries as the pass has them
    assert torch.allclose(paged_attention_table(strided, k, v, table, req, depth, lengths, "triton", n_splits=n), out,
                          atol=1e-6, rtol=0)


def test_the_slot_engine_gives_the_same_tokens_with_the_triton_kernel():
    from conftest import clone, prompt, varied_model
    from engine.request import Request
    from serve_depthbatch import Engine
    model = varied_model().float()
    reqs = [Request(prompt(9), 8, "ete_ragged", 0.4, keep_logits=True), Request(prompt(5), 6, "dense_ragged", 0.3,
                                                                             keep_logits=True)]
    a = Engine(model, 500, runner="slots", attn="torch", keep_logits=True).run([clone(r) for r in reqs])
    b = Engine(model, 500, runner="slots", attn="triton", keep_logits=True).run([clone(r) for r in reqs])
    for x, y in zip(a, b):
        assert x.exits == y.exits and x.tokens == y.tokens
        assert torch.allclose(torch.stack(x.logits), torch.stack(y.logits), atol=1e-4, rtol=1e-4)


def test_flex_attention_equals_the_reference_on_the_cpu():
    q, k, v, ids, lengths = random_case(24, 8, 2, 32, 96, P=160)
    # a row's list holds each page at most once (one page per position at one depth)
    ids = torch.stack([torch.randperm(160)[:96].int() for _ in range(24)])
    out = paged_attention_flex(q, k, v, ids, lengths)
    assert torch.allclose(out, paged_attention_torch(q, k, v, ids, lengths), atol=2e-5, rtol=1e-4)


def test_auto_is_torch_on_the_cpu_and_bad_impls_are_refused():
    assert kernels.resolve_impl("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="impl"):
        paged_attention(*random_case(1, 2, 2, 16, 3), impl="cudnn")


@pytest.mark.parametrize("attn", ["triton", "flex", "auto"])
def test_the_engine_gives_the_same_tokens_with_every_attention(attn):
    from engine.request import Request
    from serve_depthbatch import Engine
    from conftest import prompt, varied_model
    model = varied_model().float()
    p1, p2 = prompt(9), prompt(5)
    reqs = lambda: [Request(p1, 8, "ete_ragged", 0.4, keep_logits=True),
                    Request(p2, 6, "dense_ragged", 0.3, keep_logits=True)]
    a = Engine(model, 500, attn="torch").run(reqs())
    b = Engine(model, 500, attn=attn).run(reqs())
    for x, y in zip(a, b):
        assert x.exits == y.exits and x.tokens == y.tokens
        assert torch.allclose(torch.stack(x.logits), torch.stack(y.logits), atol=1e-4, rtol=1e-4)


def test_the_core_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import kernels, model, ragged, serve_depthbatch, engine.slots, server, checkpoint, tokenizer\n"
            "import sample, train\nfrom lab import bench\n"
            "assert kernels.triton is None and kernels.resolve_impl('auto', 'cpu') == 'torch'\n"
            "try:\n    kernels.resolve_impl('triton', 'cpu')\nexcept ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install triton" in r.stdout


def test_bench_kernels_smoke_runs_here(capsys):
    import json
    from lab import bench_kernels
    bench_kernels.main(["--smoke"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["checks"] and all(c["ok"] for c in out["checks"])

"""
Attention over ragged page tables: many rows, each one query reading its own list of K/V pages.

In the Ragged-KV cache (ragged.py) a row (one token of one request at one depth d) reads the key of
every earlier token j at depth min(d, e_j) (Eq. 7). Physically, deeper table entries are aliases of
the terminal page (Eq. 11), so a row's keys are a list of page ids, some of them shared across
rows and depths, which no contiguous-cache attention can read. The engine (serve_depthbatch.py)
resolves each row's list through its request's table and calls

    paged_attention(q, k_pages, v_pages, page_ids, lengths, scale=None, impl="torch")

    q         [R, Hq, D]        one query per row
    k_pages   [P, Hkv, D]       one layer of the page pool (v_pages alike)
    page_ids  [R, maxlen] int   each row's keys in order (aliases allowed); entries at or past a
                                row's length may hold anything (-1 included) and are never read
    lengths   [R] int           valid keys per row, its own key included (>= 1)
    returns   [R, Hq, D]

Grouped-query attention when Hq is a multiple of Hkv (query head h reads K/V head h // (Hq/Hkv)).
The rows of one prompt chunk read one shared key list; paged_chunk_attention(q, k_pages, v_pages,
page_ids[maxlen], lengths) gathers it once, and the chunks of requests whose rows sit at the same
positions in one call (the engine's prefill path, checked against the above).
Implementations, each checked against the first:
  torch   gather + masked SDPA: the reference, any device; rows whose pages lie on a regular grid
          (a batch that started together) are read through a strided view instead, no copy
  triton  flash-decoding on the GPU: one program per (row, K/V head, split) loads the page ids of its
          span, gathers the K/V rows, runs an online softmax in fp32 for all query heads of its K/V
          head, and writes a partial result that a second kernel reduces (split-K, for long contexts
          and small batches); storage fp32, bf16 or fp16. On the CPU it runs under TRITON_INTERPRET=1
          (float32 only: the interpreter computes bf16 arithmetic wrongly without error).
  flex    FlexAttention compiled with torch.compile, for prefill and mixed batches: the rows are the
          queries and the whole pool the keys, with a block mask built from the page tables (a page
          is visible to a row iff it is in the row's list, which already encodes causality and the
          depth min(d, e_j) of Eq. 7)
  auto    the fastest that exists on the device: triton on CUDA when installed, else torch
"""
import math
import os

import torch
import torch.nn.functional as F

try:  # an optional extra: the core imports without it
    import triton
    import triton.language as tl
except ImportError:
    triton = None

IMPLS = ["auto", "torch", "triton", "flex"]


def check_inputs(q, k_pages, v_pages, page_ids, lengths):
    R, Hq, D = q.shape
    P, Hkv, Dk = k_pages.shape
    if v_pages.shape != k_pages.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages "
                         f"{tuple(v_pages.shape)}: need the same head dim and Hq a multiple of Hkv")
    if page_ids.dim() != 2 or page_ids.shape[0] != R or lengths.shape != (R,):
        raise ValueError(f"paged_attention: page_ids {tuple(page_ids.shape)} and lengths "
                         f"{tuple(lengths.shape)} for {R} rows")


def gather_plan(page_ids, lengths, device):
    """What paged_attention_torch gathers: the flat page list, each entry past its row's length
    replaced by page 0 (never index with what lies there), the [R, 1, 1, maxlen] mask of the valid
    keys (None when every row reads its whole list), and the rows' grid (grid_of) when there is no
    mask: then paged_attention_grid reads them in place. The same in every layer of a pass: the
    engine computes it once per pass."""
    page_ids, lengths = page_ids.to(device).long(), lengths.to(device)
    # every row reads its whole list: no mask
    if int(lengths.min()) == page_ids.shape[1]:
        return page_ids.reshape(-1), None, grid_of(page_ids)
    # [R, maxlen]
    valid = torch.arange(page_ids.shape[1], device=device)[None, :] < lengths[:, None]
    return torch.where(valid, page_ids, 0).reshape(-1), valid[:, None, None, :], None


def grid_of(page_ids):
    """(base, s_r, s_j) when page_ids[r, j] = base + r*s_r + j*s_j for every entry (s_r >= 0, s_j >=
    1): the rows' pages lie on a regular grid of the pool, as when a batch of requests starts
    together (ragged.alloc_wave), and can be read in place like a dense lane (grid_view); else
    None."""
    R, n = page_ids.shape
    base = int(page_ids[0, 0])
    s_j = int(page_ids[0, 1]) - base if n > 1 else 1
    s_r = int(page_ids[1, 0]) - base if R > 1 else 0
    if s_j < 1 or s_r < 0:
        return None
    r, j = torch.arange(R, device=page_ids.device), torch.arange(n, device=page_ids.device)
    return (base, s_r, s_j) if torch.equal(page_ids, base + s_r * r[:, None] + s_j * j[None, :]) else None


def grid_view(pages, grid, R, n):
    """The [R, Hkv, n, D] keys (or values) of a grid of pages, as a strided view of the pool: no copy."""
    base, s_r, s_j = grid
    _, Hkv, D = pages.shape
    page, head, dim = pages.stride()
    return pages.as_strided((R, Hkv, n, D), (s_r * page, head, s_j * page, dim),
                            pages.storage_offset() + base * page)


def sdpa(q, k, v, mask, scale):
    """Queries [B, Hq, T, D] over keys and values [B, Hkv, L, D]; with GQA each K/V head serves
    Hq/Hkv query heads."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def paged_attention_torch(q, k_pages, v_pages, page_ids, lengths, scale=None, plan=None):
    """The reference: gather every row's keys and values, mask what lies past its length, SDPA.
    A row's page list is its request's table column at its depth, so this reads every earlier token
    j at depth min(d, e_j) (Eq. 7 through the aliases of Eq. 11). plan: gather_plan's, if known."""
    R, Hq, D = q.shape
    Hkv, maxlen = k_pages.shape[1], page_ids.shape[1]
    ids, mask, _ = plan or gather_plan(page_ids, lengths, q.device)
    # [R, Hkv, maxlen, D]; index_select is 3x faster than k_pages[ids] on a CPU
    k = k_pages.index_select(0, ids).view(R, maxlen, Hkv, D).transpose(1, 2)
    v = v_pages.index_select(0, ids).view(R, maxlen, Hkv, D).transpose(1, 2)
    return sdpa(q[:, :, None], k, v, mask, scale)[:, :, 0]


def paged_attention_grid(q, k_pages, v_pages, grid, n, scale=None):
    """The reference's fast path for rows whose n pages each lie on a grid of the pool (grid_of;
    every row reads its whole list, as a batch that started together does): the same read (Eq. 7
    through the pages of Eq. 11), in place through a strided view (grid_view), as Ouro's dense lanes
    are."""
    R = q.shape[0]
    return sdpa(q[:, :, None], grid_view(k_pages, grid, R, n), grid_view(v_pages, grid, R, n), None,
                scale)[:, :, 0]


def paged_chunk_attention(q, k_pages, v_pages, page_ids, lengths, scale=None):
    """Rows that share one key list: a prompt (or replay) chunk of one request at one depth, whose
    rows all read through the same table column, row r the first lengths[r] entries of page_ids
    (1-D, [maxlen]). Equals paged_attention(q, k_pages, v_pages, page_ids.expand(R, -1), lengths),
    but gathers the keys once and runs one causal-shaped SDPA, instead of gathering a copy of the
    keys for every row: prefill attention costs O(n + L) gathers, not O(n * L).
    page_ids [G, maxlen]: G such chunks whose rows sit at the same positions (the prompts of a
    batch that starts together), q their G * len(lengths) rows chunk by chunk, in one SDPA call."""
    Hkv, D = k_pages.shape[1:]
    G, maxlen = page_ids.shape if page_ids.dim() == 2 else (1, page_ids.shape[0])
    seen = torch.arange(maxlen, device=q.device) < lengths.to(q.device).max()
    # entries past every length: never read
    ids = torch.where(seen, page_ids.to(q.device).long(), 0).reshape(-1)
    k = k_pages.index_select(0, ids).view(G, maxlen, Hkv, D).transpose(1, 2)
    v = v_pages.index_select(0, ids).view(G, maxlen, Hkv, D).transpose(1, 2)
    return chunk_sdpa(q, k, v, lengths, scale)


def paged_chunk_attention_grid(q, k_pages, v_pages, grid, G, maxlen, lengths, scale=None):
    """paged_chunk_attention's fast path for G chunks whose key lists lie on a grid of the pool
    (grid_of, found once per pass by the engine; every entry a valid page): read in place."""
    # [G, Hkv, maxlen, D]
    k, v = grid_view(k_pages, grid, G, maxlen), grid_view(v_pages, grid, G, maxlen)
    return chunk_sdpa(q, k, v, lengths, scale)


def chunk_sdpa(q, k, v, lengths, scale):
    """The rows of G chunks (q [G * T, Hq, D], chunk by chunk) over their chunk's keys [G, Hkv,
    maxlen, D], row t of each the first lengths[t] of them."""
    (G, _, maxlen, _), (Hq, D), T = k.shape, q.shape[1:], lengths.shape[0]
    # [T, maxlen]
    valid = torch.arange(maxlen, device=q.device)[None, :] < lengths.to(q.device)[:, None]
    y = sdpa(q.view(G, T, Hq, D).transpose(1, 2), k, v, valid, scale)
    return y.transpose(1, 2).reshape(G * T, Hq, D)                       # [G, Hq, T, D] -> rows


# -------------------------------------------------------------------------- Triton (flash-decoding)

if triton is not None:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b, in exact fp32 where IEEE (the CPU interpreter and the float32 tests), else on the
        tensor cores."""
        if IEEE:
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _paged_attention_split(Q, K, V, IDS, REQ, DEPTH, LENS, O, LSE, scale, n_splits,
                               s_qr, s_qh, s_kp, s_kh, s_vp, s_vh, s_ir, s_id, s_or, s_oh, s_os, s_lr, s_lh,
                               G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, TABLE: tl.constexpr):
        """Program (row r, K/V head h, split s): the s-th of n_splits equal spans (whole blocks) of row
        r's keys, for the G query heads of K/V head h. Online softmax (running max m, sum l) in fp32.
        Row r's page ids start at IDS + r * s_ir, or, with TABLE, at its request's table column at its
        depth, IDS + REQ[r] * s_ir + DEPTH[r] * s_id: read in place, nothing built per pass. The span
        is computed here from the row's own length, so the grid is fixed while the lengths change."""
        r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if TABLE:
            ids_row = IDS + tl.load(REQ + r).to(tl.int64) * s_ir + tl.load(DEPTH + r).to(tl.int64) * s_id
        else:
            ids_row = IDS + r.to(tl.int64) * s_ir
        length = tl.load(LENS + r)
        split_len = ((length + n_splits - 1) // n_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = s * split_len
        end = tl.minimum(start + split_len, length)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        gm, dm = g < G, d < D
        q = tl.load(Q + r * s_qr + (h * G + g)[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nm = n < end
            page = tl.load(ids_row + n, mask=nm, other=0).to(tl.int64)    # never read past the length
            k = tl.load(K + page[:, None] * s_kp + h * s_kh + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            qk = tl.where(nm[None, :], _dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + page[:, None] * s_vp + h * s_vh + d[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]          # an empty split writes zeros ...
        heads = h * G + g
        if SPLIT:
            lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))   # ... and weight zero
            tl.store(O + r * s_or + heads[:, None] * s_oh + s * s_os + d[None, :], out, mask=gm[:, None] & dm[None, :])
            tl.store(LSE + r * s_lr + heads * s_lh + s, lse, mask=gm)
        else:
            tl.store(O + r * s_or + heads[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=gm[:, None] & dm[None, :])

    @triton.jit
    def _reduce_splits(O, LSE, OUT, S, s_or, s_oh, s_os, s_lr, s_lh, s_xr, s_xh,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """Program (row r, query head h): out = Σ_s exp(lse_s - M) o_s / Σ_s exp(lse_s - M)."""
        r, h = tl.program_id(0), tl.program_id(1)
        s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
        sm, dm = s < S, d < D
        lse = tl.load(LSE + r * s_lr + h * s_lh + s, mask=sm, other=float("-inf"))
        w = tl.exp(lse - tl.max(lse, 0))
        o = tl.load(O + r * s_or + h * s_oh + s[:, None] * s_os + d[None, :],
                    mask=sm[:, None] & dm[None, :], other=0.0)
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
        tl.store(OUT + r * s_xr + h * s_xh + d, out.to(OUT.dtype.element_ty), mask=dm)


def splits_for(programs, maxlen, block_n, target=264):
    """Split the keys when there are too few (row, head) programs to fill the GPU (~2 per SM of an
    H100/H200) and the context is long enough to share: flash-decoding's heuristic."""
    if programs >= target or maxlen <= 4 * block_n:
        return 1
    return max(1, min(math.ceil(target / programs), math.ceil(maxlen / (4 * block_n)), 64))


def paged_attention_triton(q, k_pages, v_pages, page_ids, lengths, scale=None, num_splits=None,
                           block_n=32, poison=False):
    """The Triton implementation of the same read (Eq. 7 through the page lists of Eq. 11),
    flash-decoding style. num_splits: key splits per row (None: splits_for); poison: fill the output
    and the split buffers with NaN first, so that anything left unwritten shows."""
    ids = page_ids.to(device=q.device, dtype=torch.int32).contiguous()
    S = splits_for(q.shape[0] * k_pages.shape[1], ids.shape[1], block_n) if num_splits is None else num_splits
    return flash_decode(q, k_pages, v_pages, ids, None, None,
                        lengths.to(device=q.device, dtype=torch.int32), S, scale, block_n, poison)


def flash_decode(q, k_pages, v_pages, ids, req, depth, lengths, n_splits, scale=None, block_n=32,
                 poison=False):
    """Launch the two kernels: row r reads ids[r] (req None), or the table ids[req[r], depth[r]] (a
    [requests, depths, keys] tensor). The grid is (rows, K/V heads, n_splits): with n_splits fixed,
    a launch reads no value on the host, so that a CUDA graph can hold it."""
    if triton is None:
        raise RuntimeError("impl='triton' needs the optional triton package (pip install triton)")
    R, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("paged_attention: k_pages and v_pages need a contiguous last dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    fill = (lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype, device=q.device)) if poison else \
        (lambda *shape, dtype: torch.empty(shape, dtype=dtype, device=q.device))
    out = fill(R, Hq, D, dtype=q.dtype)
    BLOCK_G, BLOCK_D = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    ieee = q.dtype == torch.float32
    if n_splits == 1:   # one split: the kernel writes the normalised output itself
        o, lse = out, out
        so = (out.stride(0), out.stride(1), 0)
        sl = (0, 0)
    else:
        o = fill(R, Hq, n_splits, D, dtype=torch.float32)
        lse = fill(R, Hq, n_splits, dtype=torch.float32)
        so = (o.stride(0), o.stride(1), o.stride(2))
        sl = (lse.stride(0), lse.stride(1))
    table = req is not None
    s_ir, s_id = (ids.stride(0), ids.stride(1)) if table else (ids.stride(0), 0)
    _paged_attention_split[(R, Hkv, n_splits)](
        q, k_pages, v_pages, ids, req if table else lengths, depth if table else lengths, lengths,
        o, lse, scale, n_splits, q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1),
        v_pages.stride(0), v_pages.stride(1), s_ir, s_id, *so, *sl, G=G, D=D, BLOCK_G=BLOCK_G,
        BLOCK_D=BLOCK_D, BLOCK_N=block_n, SPLIT=n_splits > 1, IEEE=ieee, TABLE=table)
    if n_splits > 1:
        _reduce_splits[(R, Hq)](o, lse, out, n_splits, *so, *sl, out.stride(0), out.stride(1),
                                D=D, BLOCK_D=BLOCK_D,
                                BLOCK_S=max(2, triton.next_power_of_2(n_splits)))
    return out


# -------------------------------------------------------------------- reading a page table in place

@torch.library.custom_op("looped::flash_decode_table", mutates_args=())
def flash_decode_table(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                       table: torch.Tensor, req: torch.Tensor, depth: torch.Tensor,
                       lengths: torch.Tensor, n_splits: int) -> torch.Tensor:
    """flash_decode reading the page table in place, as an operator that torch.compile places inside
    the graph it compiles (one launch, or two with key splits) instead of breaking the graph around
    it: the norms and residuals on either side then fuse into the compiled code (slot_pass.py)."""
    return flash_decode(q, k_pages, v_pages, table, req, depth, lengths, n_splits)


@flash_decode_table.register_fake
def _(q, k_pages, v_pages, table, req, depth, lengths, n_splits):
    return torch.empty_like(q)


def paged_attention_table(q, k_pages, v_pages, table, req, depth, lengths, impl="torch",
                          n_keys=None, n_splits=1):
    """Row r reads the first lengths[r] entries of table[req[r], depth[r]]: its request's column at
    its depth (Eq. 7 through Eq. 11), straight from the page table, with no value read on the host
    (the slot engine's pass, slot_pass.py). table [requests, depths, keys] int64. torch: gathers the
    first n_keys entries of every row (n_keys >= the longest row) and masks the rest:
    paged_attention_torch's read. triton: flash_decode with a fixed grid of n_splits."""
    if impl == "triton":
        return flash_decode_table(q, k_pages, v_pages, table, req, depth, lengths, n_splits)
    ids = table[req, depth, :n_keys]                                               # [R, n_keys]
    valid = torch.arange(ids.shape[1], device=q.device)[None, :] < lengths[:, None]
    # gather_plan's, with a mask always
    plan = torch.where(valid, ids, 0).reshape(-1), valid[:, None, None, :], None
    return paged_attention_torch(q, k_pages, v_pages, ids, lengths, None, plan)


# ----------------------------------------------------------------------------- FlexAttention

_flex = None


def paged_attention_flex(q, k_pages, v_pages, page_ids, lengths, scale=None):
    """FlexAttention over the pool: query r may read page p iff p is in r's list (within its
    length). A row's list never holds a page twice (one page per position at a given depth), so
    attention over the set equals attention over the list."""
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex is None:
        _flex = torch.compile(flex_attention, dynamic=False)
    R, Hq, D = q.shape
    P = k_pages.shape[0]
    # rows padded to a power of two: a handful of compiled shapes
    Rp = max(16, 1 << (R - 1).bit_length())
    valid = torch.arange(page_ids.shape[1], device=q.device)[None, :] < lengths.to(q.device)[:, None]
    rows = torch.arange(R, device=q.device)[:, None].expand_as(valid)
    member = torch.zeros(Rp, P, dtype=torch.bool, device=q.device)     # padding rows read nothing
    member[rows[valid], page_ids.to(q.device).long()[valid]] = True
    qp = torch.zeros(Rp, Hq, D, dtype=q.dtype, device=q.device)
    qp[:R] = q

    def may_read(b, h, q_idx, kv_idx):
        return member[q_idx, kv_idx]
    block_mask = create_block_mask(may_read, None, None, Rp, P, device=q.device)
    y = _flex(qp.transpose(0, 1)[None], k_pages.transpose(0, 1)[None],
              v_pages.transpose(0, 1)[None], block_mask=block_mask, scale=scale,
              enable_gqa=Hq != k_pages.shape[1])
    return y[0].transpose(0, 1)[:R]


# ----------------------------------------------------------------------------- the call

def resolve_impl(impl, device):
    """'auto' -> the fastest that exists on `device`; an impl that cannot run there is refused."""
    device = torch.device(device)
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton is not None else "torch"
    if impl == "triton":
        if triton is None:
            raise ValueError("--attn=triton needs the optional triton package (pip install triton)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"--attn=triton runs on CUDA devices (the model is on {device}); on "
                             "the CPU only under TRITON_INTERPRET=1, in float32")
    if impl not in IMPLS:
        raise ValueError(f"--attn={impl!r}; allowed: {', '.join(IMPLS)}")
    return impl


def paged_attention(q, k_pages, v_pages, page_ids, lengths, scale=None, impl="torch", plan=None):
    """Row r of q attends over the pages page_ids[r, :lengths[r]] (checked, then attend_pages)."""
    check_inputs(q, k_pages, v_pages, page_ids, lengths)
    impl = resolve_impl(impl, q.device) if impl == "auto" else impl
    return attend_pages(q, k_pages, v_pages, page_ids, lengths, impl, plan, scale)


def attend_pages(q, k_pages, v_pages, page_ids, lengths, impl, plan=None, scale=None):
    """paged_attention on inputs already checked, with an implementation already resolved: the
    engine checks a pass's tables once and calls this in every layer."""
    if impl == "torch":
        plan = plan or gather_plan(page_ids, lengths, q.device)
        if plan[2] is not None:                                    # on a grid: read in place
            return paged_attention_grid(q, k_pages, v_pages, plan[2], page_ids.shape[1], scale)
        return paged_attention_torch(q, k_pages, v_pages, page_ids, lengths, scale, plan)
    if impl == "triton":
        return paged_attention_triton(q, k_pages, v_pages, page_ids, lengths, scale)
    if impl == "flex":
        return paged_attention_flex(q, k_pages, v_pages, page_ids, lengths, scale)
    raise ValueError(f"paged_attention: impl={impl!r}; available: {', '.join(IMPLS)}")


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench_kernels benchmarks them")

"""
Attention over ragged page tables: many rows, each one query reading its own list of K/V pages.

In the Ragged-KV cache (ragged.py) a row (one token of one request at one depth d) reads the key of
every earlier token j at depth min(d, e_j) (Eq. 7). Physically, deeper table entries are aliases of
the terminal page (Eq. 11), so a row's keys are a list of page ids, some of them repeated across
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
impl="torch" (gather + masked SDPA) is the reference every other implementation is checked against.
"""
import torch
import torch.nn.functional as F

IMPLS = ["torch"]


def check_inputs(q, k_pages, v_pages, page_ids, lengths):
    R, Hq, D = q.shape
    P, Hkv, Dk = k_pages.shape
    if v_pages.shape != k_pages.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, v_pages "
                         f"{tuple(v_pages.shape)}: need the same head dim and Hq a multiple of Hkv")
    if page_ids.dim() != 2 or page_ids.shape[0] != R or lengths.shape != (R,):
        raise ValueError(f"paged_attention: page_ids {tuple(page_ids.shape)} and lengths {tuple(lengths.shape)} "
                         f"for {R} rows")


def paged_attention_torch(q, k_pages, v_pages, page_ids, lengths, scale=None):
    """The reference: gather every row's keys and values, mask what lies past its length, SDPA."""
    R, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    maxlen = page_ids.shape[1]
    valid = torch.arange(maxlen, device=q.device)[None, :] < lengths.to(q.device)[:, None]   # [R, maxlen]
    ids = torch.where(valid, page_ids.to(q.device).long(), 0).reshape(-1)   # never index with what lies past a length
    k = k_pages.index_select(0, ids).view(R, maxlen, Hkv, D).transpose(1, 2)   # [R, Hkv, maxlen, D]; index_select:
    v = v_pages.index_select(0, ids).view(R, maxlen, Hkv, D).transpose(1, 2)   # 3x faster than k_pages[ids] on CPU
    if Hq != Hkv:                                                  # GQA: each K/V head serves Hq/Hkv query heads
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    y = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return y[:, :, 0]


def paged_attention(q, k_pages, v_pages, page_ids, lengths, scale=None, impl="torch"):
    check_inputs(q, k_pages, v_pages, page_ids, lengths)
    if impl == "torch":
        return paged_attention_torch(q, k_pages, v_pages, page_ids, lengths, scale)
    raise ValueError(f"paged_attention: impl={impl!r}; available: {', '.join(IMPLS)}")

"""
GPU benchmark of kernels.paged_attention (the Triton flash-decoding kernel over ragged page tables).

    python -m lab.bench_kernels                  # on a CUDA device: checks, then timings; one JSON line last
    python -m lab.bench_kernels --smoke          # tiny sizes, checks only: runs on the CPU too (Triton's interpreter)

On CUDA it first checks the bf16 results (Triton and compiled FlexAttention) against the fp32 torch
reference, then times the Triton kernel against attention over a contiguous cache of the same
context (SDPA; flash-decoding too when flash_attn is installed) at batch 1, 8, 32, 128 and contexts
1k, 4k, 16k with Ouro-1.4B's head shapes (16 heads x 128, bf16): CUDA events, median of many runs,
inputs rotated so that L2 does not hold them. It reports the achieved bandwidth (K/V bytes read per
second) against the device's copy bandwidth measured in the same run (a large device-to-device
copy). Targets on an H200: >= 70% of copy bandwidth at batch 32 / context 4k, and time <= 1.1x the
contiguous baseline at equal work. Then it runs the engine benchmark with --attn=triton.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.bench_kernels ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os
import sys

import torch

# the CPU can only run Triton kernels in the interpreter, in float32
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# imported after the switch: Triton reads it when it is imported
from configurator import SEED_RULE, UserError, parse, run_cli, split_list
from kernels import paged_attention_flex, paged_attention_torch, paged_attention_triton

DEFAULTS = dict(
    smoke=False,           # tiny sizes, correctness only (any device)
    batches="1,8,32,128",  # batch sizes (rows, one query each)
    contexts="1024,4096,16384",  # keys per row
    heads=16,              # query heads = K/V heads (Ouro-1.4B: MHA)
    head_dim=128,          # Ouro-1.4B
    iters=50,              # timed runs per configuration (median)
    rotate=4,              # input sets cycled through so that L2 does not hold them
    engine=True,           # then the engine benchmark with --attn=triton
    seed=0,                # seeds the inputs
)
RULES = dict(batches="ints >= 1", contexts="ints >= 1",
             heads=">= 1", head_dim=">= 16", iters=">= 1", rotate=">= 1", seed=SEED_RULE)


def make_case(B, ctx, H, D, dtype, device, pool_pages=None, seed=0):
    """B rows of ctx keys each, on pages scattered over a pool (as a paged cache is)."""
    # drawn where they live: 16k contexts are big
    g = torch.Generator(device=device).manual_seed(seed)
    P = pool_pages or B * ctx
    k = torch.randn(P, H, D, generator=g, device=device).to(dtype)
    v = torch.randn(P, H, D, generator=g, device=device).to(dtype)
    q = torch.randn(B, H, D, generator=g, device=device).to(dtype)
    ids = torch.randperm(P, generator=g, device=device)[:B * ctx].view(B, ctx).to(torch.int32)
    lengths = torch.full((B,), ctx, dtype=torch.int32, device=device)
    return q, k, v, ids, lengths


def check(name, out, ref, tol):
    err = (out.float() - ref.float()).abs().max().item()
    return {"check": name, "max_abs_err": err, "tol": tol, "ok": bool(err <= tol)}


def checks(device, smoke):
    """bf16 (CUDA) or fp32 (the CPU interpreter) results against the fp32 reference."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    shapes = ([(2, 64, 4, 32), (3, 200, 8, 64)] if smoke else
              [(8, 1024, 16, 128), (2, 4096, 16, 128), (64, 300, 16, 128)])
    out = []
    for B, ctx, H, D in shapes:
        q, k, v, ids, lengths = make_case(B, ctx, H, D, dtype, device, B * ctx + 7)
        lengths = torch.randint(1, ctx + 1, (B,), dtype=torch.int32, device=device)
        ref = paged_attention_torch(q.float(), k.float(), v.float(), ids, lengths)
        for splits in (1, None):
            out.append(check(f"triton {dtype} B={B} ctx={ctx} splits={splits or 'auto'}",
                             paged_attention_triton(q, k, v, ids, lengths, num_splits=splits,
                                                    poison=True), ref, tol))
        if device == "cuda":
            out.append(check(f"flex {dtype} B={B} ctx={ctx}",
                             paged_attention_flex(q, k, v, ids, lengths), ref, tol))
    return out


def copy_bandwidth(device, nbytes=2 << 30):
    """Bytes moved per second by a large device-to-device copy (read + write)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    t = timed(lambda: b.copy_(a), 20)
    return 2 * a.numel() * a.element_size() / t


def timed(fn, iters):
    """Median seconds per call, CUDA events."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for _ in range(3):
        fn()
    for i in range(iters):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ms[len(ms) // 2] / 1000


def timings(c, copy_bw):
    H, D, device = c["heads"], c["head_dim"], "cuda"
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    rows = []
    for B in split_list("batches", c["batches"], int):
        for ctx in split_list("contexts", c["contexts"], int):
            kv_bytes = 2 * B * ctx * H * D * 2                      # K and V, bf16
            # rotate while memory allows
            sets = max(1, min(c["rotate"], (8 << 30) // max(kv_bytes, 1)))
            paged = [make_case(B, ctx, H, D, torch.bfloat16, device, seed=c["seed"] + i)
                     for i in range(sets)]
            # contiguous [B, H, ctx, D]
            lay_out = lambda x, ids: x[ids.long()].permute(0, 2, 1, 3).contiguous()
            # same context
            dense = [(q[:, :, None], lay_out(k, ids), lay_out(v, ids)) for q, k, v, ids, _ in paged]
            it = {"p": 0, "d": 0}

            def run_paged():
                q, k, v, ids, lengths = paged[it["p"] % sets]
                it["p"] += 1
                return paged_attention_triton(q, k, v, ids, lengths)

            def run_dense():
                q, k, v = dense[it["d"] % sets]
                it["d"] += 1
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)
            t_paged, t_dense = timed(run_paged, c["iters"]), timed(run_dense, c["iters"])
            row = {"batch": B, "context": ctx, "kv_bytes": kv_bytes, "triton_us": 1e6 * t_paged,
                   "sdpa_us": 1e6 * t_dense, "triton_gb_s": kv_bytes / t_paged / 1e9,
                   "of_copy_bw": kv_bytes / t_paged / copy_bw, "x_contiguous": t_paged / t_dense}
            if flash_attn_with_kvcache is not None:
                fa = [(q[:, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
                      for q, k, v in dense]

                def run_fa():
                    q, k, v = fa[it["d"] % sets]
                    it["d"] += 1
                    return flash_attn_with_kvcache(q, k, v)
                t_fa = timed(run_fa, c["iters"])
                row.update(flash_decoding_us=1e6 * t_fa, x_flash_decoding=t_paged / t_fa)
            rows.append(row)
            print(f"B={B:>4} ctx={ctx:>6}: triton {row['triton_us']:9.1f} us  "
                  f"{row['triton_gb_s']:7.1f} GB/s ({row['of_copy_bw']:.0%} of copy)  x contiguous "
                  f"SDPA {row['x_contiguous']:.2f}", file=sys.stderr)
            # free before the next configuration
            paged = dense = None
            torch.cuda.empty_cache()
    return rows


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not c["smoke"]:
        raise UserError("timings need a CUDA device; on the CPU run --smoke (correctness only)")
    torch.manual_seed(c["seed"])
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton "
              "interpreter)", "checks": checks(device, c["smoke"] or device == "cpu")}
    for ch in result["checks"]:
        print(f"{'ok  ' if ch['ok'] else 'FAIL'} {ch['check']}: max abs err "
              f"{ch['max_abs_err']:.2e} (tol {ch['tol']})", file=sys.stderr)
    if not c["smoke"]:
        bw = copy_bandwidth(device)
        result["copy_gb_s"] = bw / 1e9
        rows = timings(c, bw)
        result["timings"] = rows
        target = next((r for r in rows if r["batch"] == 32 and r["context"] == 4096), None)
        if target:
            result["targets"] = {"bandwidth_ge_70pct_at_b32_4k": target["of_copy_bw"] >= 0.7,
                                 "time_le_1.1x_contiguous": all(r["x_contiguous"] <= 1.1
                                                                for r in rows)}
        if c["engine"]:
            from lab import bench
            result["engine"] = bench.bench_engine(dict(bench.DEFAULTS, what="engine", attn="triton",
                                                       device="cuda"))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_cli(main)

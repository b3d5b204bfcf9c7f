"""
Generate from a trained looped LM or an Ouro checkpoint, and show how deep each token ran.

    python sample.py --ckpt out/ --thr 0.5                  # Dense-Ragged: full-depth prompt, ragged decode
    python sample.py --ckpt out/ --mode=fixed --depth=2     # every token runs exactly 2 loops
    python sample.py --ckpt out/ --mode=speculative         # fixed@U's tokens, drafted at 1 loop
    python sample.py --ckpt out/ --prompt "a=5 b=a ; b? " --temperature=0 --json
    python sample.py --ckpt path/to/Ouro-1.4B-Thinking --thr 0.5 --chat --prompt "What is 7*8?"

Modes
  fixed         every token runs --depth loops (default U); one KV lane per loop actually run.
  ouro          Ouro's own decode: every token runs all U loops and fills all U KV lanes; the
                threshold --thr (Eq. 4) only chooses which depth's logits are sampled.
  dense_ragged  the prompt is prefilled at full depth (all U lanes); each decode token runs only
                until it exits and later tokens read it at min(d, e) (Ragged KV, Eq. 7).
  ete_ragged    Ragged KV end to end: the prompt too exits early, prefilled depth by depth.
                Prefill options (App. E.2): --prefill_thr, --prefill_schedule=cosine, --prefix_full=k.
  last_kv, shared_kv, collapse_kv   the Table 17 baselines (one K/V per token, see model.py).
  speculative   fixed@U's output exactly (the same greedy tokens; sampled ones from the same law),
                usually in fewer passes: each token drafted at --draft_depth loops (0: at its exit
                gate under --thr), its position started on the draft at once and verified when the
                one before reaches U loops; at most --draft_k drafts in flight (engine/speculative.py).
The default mode is `dense_ragged` at τ 0.5 (the paper's safe choice); `--mode=fixed` runs every token
--depth loops. A flag given at the default --help shows runs exactly as if it were left out.
Every mode runs through the depth-batching engine of serve_depthbatch.py on one paged KV pool, so
their page accounting is comparable; --num_samples become concurrent requests of one batch
(model.generate keeps Ouro's own dense-lane layout as the reference and the benchmark baseline).
Sampling defaults follow the paper: temperature 1.0, top-p 0.7, top-k off.
"""
import json
import os
import random
import sys

import numpy as np
import torch

from checkpoint import load_for_script
from configurator import (MODEL_RUN, MODEL_RUN_RULES, SAMPLING_NEEDS, SEED_RULE, UserError,
                         check_needs, parse, run_cli, set_threads, split_list)
from kernels import IMPLS
from model import check_prompt, exit_stats
from engine.request import Request
from modes import MODES
from engine.scheduler import scheduler_for
from engine.shared_head import HEADS
from engine.build import RUNNERS, engine_for
from engine.slot_pass import draw_kind
from tokenizer import IM_END, chat_ids, check_chat, start_of_text

DEFAULTS = dict(
    ckpt="out",            # a directory holding ckpt.pt, or the file
    prompt="",             # text, or FILE:path; empty: the start of a text (a newline, or <|endoftext|>)
    prompt_ids="",         # comma-separated token ids (overrides --prompt)
    max_new_tokens=100,    # tokens to generate per sample
    num_samples=1,         # how many samples of the same prompt
    temperature=1.0,       # 0 = greedy
    top_k=0,               # 0 = off
    top_p=0.7,             # 1.0 = off
    seed=1337,             # seeds python, numpy and torch, and the sampler
    thr=0.5,               # exit threshold τ in [0, 1] (Eq. 4), of every mode but fixed
    mode="dense_ragged",   # how tokens run, what KV is kept (Modes above)
    depth=0,               # fixed mode: loops per token (0: all U, as everywhere a depth is asked)
    prefill_thr=None,      # ete_ragged: a prompt threshold of its own (default --thr)
    prefill_schedule="",   # ete_ragged: "cosine" = thresholds fall from 1 to τ over the prompt
    prefix_full=0,         # ete_ragged: the first k prompt tokens run at full depth
    draft_k=4,             # speculative: the most drafts in flight, not verified yet (1..64)
    draft_depth=1,         # speculative: loops a draft runs, 1..U-1 (0: its exit gate at --thr)
    chat=False,            # wrap the prompt in Ouro's ChatML template (Thinking models); stop at <|im_end|>
    attn="auto",           # paged attention (kernels.py): auto = triton on CUDA when installed, else torch
    head="auto",           # LM-head calls: shared (exited rows wait to share one), eager; auto: the engine's own
    runner="auto",         # auto: graph-captured passes (engine/slots.py) on CUDA, the eager runner on a CPU
    kv_pages=0,            # KV pages of the shared pool (0: enough for every token of every sample at every depth)
    json=False,            # print one JSON object as the last line of stdout
    show_exits=False,      # print the text with each new token colored by its exit depth
    **MODEL_RUN,           # device, threads, dtype, tiktoken_file (configurator.py)
)
RULES = dict(max_new_tokens=">= 1", num_samples=">= 1", temperature="in [0, 2]", top_k=">= 0",
             top_p="in (0, 1]",
             seed=SEED_RULE, thr="in [0, 1]", mode=list(MODES), depth=">= 0",
             prefill_thr="in [0, 1]", prefill_schedule=["", "cosine"], prefix_full=">= 0",
             draft_k="in [1, 64]", draft_depth=">= 0",
             kv_pages=">= 0", attn=IMPLS, head=["auto"] + HEADS, runner=RUNNERS, **MODEL_RUN_RULES)
# the keys that act only with another setting: refused without it (checked with
# the model's U: check_args)
prefill = ("--mode=ete_ragged (or collapse_kv)",
           lambda c: c["mode"] in ("ete_ragged", "collapse_kv"))
speculative = ("--mode=speculative", lambda c: c["mode"] == "speculative")
NEEDS = dict(depth=("--mode=fixed", lambda c: c["mode"] == "fixed"),
             draft_k=speculative, draft_depth=speculative,
             thr=("--mode=dense_ragged (any mode but fixed)", lambda c: c["mode"] != "fixed"),
             prefill_thr=prefill, prefill_schedule=prefill, prefix_full=prefill, **SAMPLING_NEEDS)


def check_args(c, U, given):
    """What RULES cannot check alone: the flags that need the mode (NEEDS), and the depth against
    the model's U."""
    mode = c["mode"]
    check_needs(c, given, NEEDS)
    depth = c["depth"] or U
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= U:
        raise UserError(f"--depth={depth!r}: must be an integer in 0..{U} (0: all U; this model "
                        f"has U={U} loops)")
    if c["draft_depth"] > U - 1:
        raise UserError(f"--draft_depth={c['draft_depth']!r}: must be an integer in 0..{U - 1} (0: the "
                        f"exit gate at --thr; this model has U={U} loops)")
    return mode, float(c["thr"]), depth


def prompt_ids(c, meta, encode):
    if c["prompt_ids"] != "":
        return split_list("prompt_ids", c["prompt_ids"], int)
    text = c["prompt"]
    if text.startswith("FILE:"):
        path = text[5:]
        if not os.path.isfile(path):
            why = "a folder, not a file" if os.path.isdir(path) else "no such file"
            raise UserError(f"--prompt=FILE:{path}: {why}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            raise UserError(f"--prompt=FILE:{path}: not UTF-8 text")
        except OSError as e:
            raise UserError(f"--prompt=FILE:{path}: cannot read it ({e.strerror or e})")
    # an empty prompt: the start of a text (tokenizer.start_of_text)
    if text == "":
        return start_of_text(meta)
    try:
        return encode(text)
    except UserError as e:
        raise UserError(f"--prompt: {e}")


def summarize(r, U, peak):
    """The JSON record of one generation (a finished engine Request): exits, average depths, KV
    rows, block evaluations, and the exit statistics of the decode positions (the paper's
    convention; in Dense-Ragged the prompt is forced to depth U) with those of the prompt beside
    them under "prefill"."""
    pe, de = r.prompt_exits, r.decode_exits
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    return {"tokens": r.tokens, "exits": r.token_exits, "prompt_exits": pe, "decode_exits": de,
            "avg_depth": {"prefill": mean(pe), "decode": mean(de), "overall": mean(pe + de)},
            "kv_rows": {"physical": r.kv["physical"], "dense": r.kv["dense"],
                        "logical": r.kv["logical"], "peak": peak},
            "block_evals": r.kv["block_evals"], **exit_stats(de, U), "prefill": exit_stats(pe, U),
            "finish_reason": r.finish_reason}


COLORS = {1: "\033[32m", 2: "\033[36m", 3: "\033[33m", 4: "\033[31m"}  # green, cyan, yellow, red
MARKS = "₁₂₃₄₅₆₇₈₉"               # subscript digits


def show_exits(tokens, exits, decode, U, prompt_text):
    """The generated text with each token colored by the depth that produced it (a subscript
    depth after each token when stdout is not a terminal), and a legend."""
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    piece = (lambda t: decode([t])) if decode else (lambda t: f"{t} ")
    out = []
    for t, e in zip(tokens, exits):
        if color:
            out.append(COLORS.get(e, "\033[35m") + piece(t) + "\033[0m")
        else:
            out.append(piece(t) + MARKS[min(e, 9) - 1])
    if color:
        legend = " ".join(COLORS.get(d, "\033[35m") + f"depth {d}" + "\033[0m"
                          for d in range(1, U + 1))
    else:
        legend = "each token is followed by the depth that produced it: " + " ".join(
            f"{MARKS[d - 1]}={d}" for d in range(1, min(U, 9) + 1))
    return f"{prompt_text}{''.join(out)}\n-- legend: {legend}"


def the_prompt(c, model, meta, encode):
    """The prompt's token ids (from --prompt, FILE:, --prompt_ids; in the chat template with
    --chat), checked against the context, and --max_new_tokens cut to what fits, with a note saying
    so."""
    if encode is None and c["prompt_ids"] == "":
        raise UserError("no tokenizer for this checkpoint: give --prompt_ids "
                        "(comma-separated token ids)")
    ids = prompt_ids(c, meta, encode)
    if c["chat"]:
        if encode is None:
            raise UserError("--chat needs the model's tokenizer (pip install tokenizers)")
        check_chat(meta)
        ids = chat_ids([("user", ids)], encode)
    try:
        # the prompt itself, with room for one token
        check_prompt(model.config, ids, 1)
    except UserError as e:
        raise UserError(f"--{'prompt_ids' if c['prompt_ids'] != '' else 'prompt'}: {e}")
    room = model.config.block_size - len(ids)
    if room < c["max_new_tokens"]:
        print(f"note: max_new_tokens={c['max_new_tokens']} cut to {room} to fit the context "
              f"length {model.config.block_size}", file=sys.stderr)
        c["max_new_tokens"] = room
    return ids


def sample_engine(c, model, ids, mode):
    """One engine for all the samples, its pool every token of every sample at every depth unless
    --kv_pages says otherwise. Every sample's prompt runs in one pass: the samples start together,
    and their pages lie on a grid that the attention reads in place (kernels.grid_of)."""
    pages = c["kv_pages"] or c["num_samples"] * (len(ids) + c["max_new_tokens"]) * model.config.n_loops
    try:
        return engine_for(model, pages, max_batch=c["num_samples"],
                          max_rows=c["num_samples"] * len(ids),
                          attn=c["attn"], head=c["head"], scheduler=scheduler_for(mode),
                          runner=c["runner"], modes=[mode],
                          sampling=[draw_kind(c["temperature"], c["top_k"], c["top_p"])]), pages
    except UserError as e:
        if e.field != "kv_pages" or c["kv_pages"]:
            raise
        raise UserError(f"--num_samples={c['num_samples']}: the default pool holds every token of "
                        f"every sample at every depth ({pages} pages) and "
                        f"{str(e).split(': ', 1)[1]}; give fewer samples or --kv_pages")


def main(argv):
    given = set()
    c = parse(argv, DEFAULTS, RULES, __file__, given)
    set_threads(c["threads"])
    model, meta, encode, decode, _ = load_for_script(c)
    mode, thr, depth = check_args(c, model.config.n_loops, given)
    ids = the_prompt(c, model, meta, encode)
    random.seed(c["seed"])
    np.random.seed(c["seed"])
    torch.manual_seed(c["seed"])
    # The samples are concurrent requests of one engine (serve_depthbatch.py) sharing one page
    # pool; sample s draws with seed + s (request.sample_token: keyed by seed and position),
    # whatever else is batched.
    engine, pages = sample_engine(c, model, ids, mode)
    reqs = [Request(ids, c["max_new_tokens"], mode, thr=thr, depth=depth if mode == "fixed" else 0,
                    temperature=c["temperature"], top_p=c["top_p"], top_k=c["top_k"],
                    seed=c["seed"] + s, stop=(IM_END,) if c["chat"] else (),
                    prefill_thr=c["prefill_thr"], prefill_schedule=c["prefill_schedule"],
                    prefix_full=c["prefix_full"], draft_k=c["draft_k"], draft_depth=c["draft_depth"])
            for s in range(c["num_samples"])]
    try:
        for r in reqs:
            engine.add(r)
    except UserError as e:
        raise UserError(f"--kv_pages={pages}: {e}" if c["kv_pages"] else str(e))
    from tqdm import tqdm
    with tqdm(total=len(reqs) * c["max_new_tokens"], desc="sample", unit="tok", file=sys.stderr,
              disable=None, leave=False) as bar:
        while engine.busy():
            bar.update(len(engine.step()))
    for i, r in enumerate(reqs):
        if r.note:                         # the pool ran dry under it: its tokens so far are kept
            print(f"note: sample {i} {r.note} (--kv_pages={pages})", file=sys.stderr)
    return report(c, reqs, ids, decode, engine, pages, (mode, thr, depth))


def report(c, reqs, ids, decode, engine, pages, spec):
    """Print every sample (with its exits under --show_exits; JSON under --json) and its depth and
    KV figures on stderr. Returns the samples' records."""
    (mode, thr, depth), U = spec, engine.model.config.n_loops
    samples = []
    for s, r in enumerate(reqs):
        rec = summarize(r, U, engine.pool.peak)
        rec["text"] = decode(r.tokens) if decode else None
        samples.append(rec)
        if c["show_exits"]:
            print(show_exits(r.tokens, r.token_exits, decode, U,
                             (decode(ids) if decode else str(ids))))
        elif not c["json"]:
            print((decode(ids) if decode else "") + (rec["text"] if decode else str(r.tokens)))
            print("-" * 40)
        a, kv = rec["avg_depth"], rec["kv_rows"]
        how = f"mode={mode}" + (f" depth={depth}" if mode == "fixed" else f" thr={thr}")
        if mode == "speculative":
            how += f" draft_k={c['draft_k']} draft_depth={c['draft_depth']}"
        print(f"sample {s}: {how} avg depth prefill {a['prefill']:.2f} decode {a['decode']:.2f} "
              f"overall {a['overall']:.2f} of U={U}; KV rows {kv['physical']}/{kv['dense']} "
              f"({kv['physical'] / kv['dense']:.1%} of dense); block evals {rec['block_evals']}",
              file=sys.stderr)
    st = engine.stats
    if mode == "speculative" and st["verifies"]:
        print(f"speculative: {st['verifies']} positions verified kept {st['accepted']} of {st['drafted']} "
              f"drafts ({st['accepted'] / max(st['drafted'], 1):.0%}); "
              f"{st['passes']} passes of the block, {st['head_calls']} LM-head calls", file=sys.stderr)
    if len(reqs) > 1:
        print(f"{len(reqs)} samples as concurrent requests: {engine.stats['passes']} passes of the "
              f"block, peak {engine.pool.peak} of {pages} KV pages", file=sys.stderr)
    if c["json"]:
        fixed = mode == "fixed"
        spec = ({"speculative": dict(draft_k=c["draft_k"], draft_depth=c["draft_depth"],
                                     **{k: st[k] for k in ("verifies", "drafted", "accepted")})}
                if mode == "speculative" else {})
        print(json.dumps({"mode": mode, "thr": None if fixed else thr, "depth": depth if fixed
                          else None, "n_loops": U, "prompt_tokens": ids, "samples": samples, **spec}))
    return samples


if __name__ == "__main__":
    run_cli(main)

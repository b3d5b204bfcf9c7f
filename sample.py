"""
Generate from a trained looped LM (or, later, an Ouro checkpoint) and show how deep each token ran.

    python sample.py --ckpt out/ --thr 0.5                  # Ouro mode: all U loops, exit picks the logits
    python sample.py --ckpt out/ --mode=fixed --depth=2     # every token runs exactly 2 loops
    python sample.py --ckpt out/ --prompt "a=5 b=a ; b? " --temperature=0 --json

Modes
  fixed   every token runs --depth loops (default U); one KV lane per loop actually run.
  ouro    Ouro's own decode: every token runs all U loops and fills all U KV lanes; the threshold
          --thr (Eq. 4) only chooses which depth's logits are sampled. No compute is saved.
With no --mode: `ouro` when --thr is given, else `fixed` at depth U.
Sampling defaults follow the paper: temperature 1.0, top-p 0.7, top-k off.
"""
import json
import os
import sys

import torch

from configurator import parse, run_cli
from model import UserError, generate, load_checkpoint
from prepare_data import load_tokenizer

DEFAULTS = dict(
    ckpt="out",            # a directory holding ckpt.pt, or the file
    prompt="",             # text, or FILE:path; empty = a newline (char models) / <|endoftext|> (gpt2)
    prompt_ids="",         # comma-separated token ids (overrides --prompt)
    max_new_tokens=100,
    num_samples=1,
    temperature=1.0,       # 0 = greedy
    top_k=0,               # 0 = off
    top_p=0.7,             # 1.0 = off
    seed=1337,
    thr=None,              # exit threshold τ in [0, 1] (Eq. 4)
    mode="",               # fixed | ouro (empty: see above)
    depth=None,            # fixed mode: loops per token (default U)
    json=False,            # print one JSON object as the last line of stdout
    device="cpu",
    dtype="",              # float32 | float64 | bfloat16 (default: as saved)
    tiktoken_file="",      # gpt2.tiktoken ranks file for GPT-2 tokenized checkpoints, offline
)
MODES = ["fixed", "ouro"]


def check_args(c, U):
    if c["mode"] not in MODES + [""]:
        raise UserError(f"--mode={c['mode']!r} is not allowed; choose one of: {', '.join(MODES)}")
    thr = c["thr"]
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 <= thr <= 1):
        raise UserError(f"--thr={thr!r} must be a number in [0, 1]")
    mode = c["mode"] or ("ouro" if thr is not None else "fixed")
    depth = c["depth"]
    if depth is None:
        depth = U
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= U:
        raise UserError(f"--depth={depth!r} must be an integer in 1..{U}")
    for key, ok, allowed in [("max_new_tokens", c["max_new_tokens"] >= 1, ">= 1"),
                             ("num_samples", c["num_samples"] >= 1, ">= 1"),
                             ("temperature", c["temperature"] >= 0, ">= 0"),
                             ("top_k", c["top_k"] >= 0, ">= 0 (0 = off)"),
                             ("top_p", 0 < c["top_p"] <= 1, "in (0, 1]")]:
        if not ok:
            raise UserError(f"--{key}={c[key]!r} must be {allowed}")
    return mode, (0.5 if thr is None else float(thr)), depth


def prompt_ids(c, meta, encode):
    if c["prompt_ids"] != "":
        try:
            return [int(t) for t in str(c["prompt_ids"]).split(",") if t.strip() != ""]
        except ValueError:
            raise UserError(f"--prompt_ids={c['prompt_ids']!r}: expected comma-separated integers")
    text = c["prompt"]
    if text.startswith("FILE:"):
        path = text[5:]
        if not os.path.isfile(path):
            raise UserError(f"--prompt=FILE:{path}: no such file")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    if text == "":
        if meta.get("tokenizer") == "gpt2":
            return [50256]
        return encode("\n") if "\n" in meta.get("chars", "") else [0]
    return encode(text)


def main(argv):
    c = parse(argv, DEFAULTS)
    dtypes = {"": None, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
    if c["dtype"] not in dtypes:
        raise UserError(f"--dtype={c['dtype']!r}; allowed: float32, float64, bfloat16")
    model, ckpt = load_checkpoint(c["ckpt"], c["device"], dtypes[c["dtype"]])
    U = model.config.n_loops
    mode, thr, depth = check_args(c, U)
    meta = ckpt.get("meta", {})
    encode, decode = load_tokenizer(meta, c["tiktoken_file"]) if meta else (None, None)
    if encode is None and c["prompt_ids"] == "":
        raise UserError("this checkpoint has no tokenizer: give --prompt_ids")
    ids = prompt_ids(c, meta, encode)
    room = model.config.block_size - len(ids)
    if 0 < room < c["max_new_tokens"]:
        print(f"note: max_new_tokens={c['max_new_tokens']} cut to {room} to fit the context "
              f"length {model.config.block_size}", file=sys.stderr)
        c["max_new_tokens"] = room

    gen = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])

    def sampler(logits):
        from model import sample_token
        return sample_token(logits, c["temperature"], c["top_k"], c["top_p"], gen)

    samples = []
    for s in range(c["num_samples"]):
        new, exits = generate(model, ids, c["max_new_tokens"], mode, depth, thr, sampler)
        text = decode(new) if decode else None
        samples.append({"tokens": new, "text": text, "exits": exits})
        if not c["json"]:
            print((decode(ids) if decode else "") + (text if text is not None else str(new)))
            print("-" * 40)
        avg = sum(exits) / len(exits)
        print(f"sample {s}: mode={mode} thr={thr} avg exit depth {avg:.2f} of U={U}", file=sys.stderr)
    if c["json"]:
        print(json.dumps({"mode": mode, "thr": thr, "depth": depth if mode == "fixed" else None,
                          "n_loops": U, "prompt_tokens": ids, "samples": samples}))
    return samples


if __name__ == "__main__":
    run_cli(main)

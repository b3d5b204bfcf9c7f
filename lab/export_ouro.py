"""
Export one of our checkpoints as an Ouro Hugging Face folder (config.json + model.safetensors with
Ouro's key names, model_type "ouro"), so tools that already run Ouro at fixed depth can load it.

    python -m lab.export_ouro --ckpt out/ --out out-ouro/ [--dtype=bfloat16] [--force]

The weights keep the checkpoint's dtype unless --dtype says otherwise: then export and import give the
same logits and tokens. --dtype=bfloat16 halves the folder and rounds every weight, which moves the
logits and so the greedy tokens and the exits (docs/ouro.md).

Only models trained with --loop_norm (Ouro's per-loop norm) can be exported: Ouro's code would run
any other model differently. Our tokenizer is written beside it as meta.json (read back by our
loader) and as the files a Hugging Face user loads (tokenizer.json: the same ids; tokenizer_config.json,
generation_config.json), so that the folder is whole. Needs the optional `safetensors` package (and
`tokenizers` for tokenizer.json; a GPT-2 tokenized checkpoint offline: --tiktoken_file).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.export_ouro ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import sys

import torch

from checkpoint import export_ouro, load_checkpoint
from configurator import check_writable, parse, run_cli

DEFAULTS = dict(
    ckpt="out",            # our checkpoint: a ckpt.pt file or a directory holding one
    out="",                # the Ouro folder to write (required)
    dtype="",              # dtype of the exported weights ("": the checkpoint's own)
    force=False,           # overwrite a folder that already holds an export
    tiktoken_file="",      # gpt2.tiktoken ranks file for a GPT-2 tokenized checkpoint's tokenizer.json, offline
)
DTYPES = {"": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
RULES = dict(dtype=list(DTYPES), out=lambda v: None if v else "required: the folder to write")


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    check_writable(c["out"], "out")
    model, ckpt = load_checkpoint(c["ckpt"])
    export_ouro(model, c["out"], ckpt.get("meta"), DTYPES[c["dtype"]], c["force"],
                c["tiktoken_file"])
    print(f"wrote Ouro folder {c['out']} ({model.num_params():,} parameters, "
          f"{c['dtype'] or str(model.lm_head.weight.dtype).replace('torch.', '')})",
          file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)

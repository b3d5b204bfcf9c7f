"""
The public Ouro modeling code as a benchmark row (`python -m lab.bench --what=engine --ouro_code
PATH/modeling_ouro.py`): the same weights opened by Ouro's own code, and its own `generate`.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.ouro_code ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import json
import os
import shutil
import tempfile

import torch

from checkpoint import export_ouro
from configurator import UserError


def ouro_code_model(model, path):
    """The same weights under the public Ouro modeling code (transformers 4.54/4.55): `model`
    written as an Ouro folder (checkpoint.export_ouro, fp32) beside copies of modeling_ouro.py and
    configuration_ouro.py, opened with AutoModelForCausalLM. For the `--ouro_code` row only."""
    code = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) != "modeling_ouro.py" or not os.path.isfile(path):
        raise UserError(f"--ouro_code={path!r}: expected the path of Ouro's modeling_ouro.py")
    if not os.path.isfile(os.path.join(code, "configuration_ouro.py")):
        raise UserError(f"--ouro_code={path!r}: configuration_ouro.py must lie beside it")
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError("--ouro_code needs the optional transformers package, in the version "
                        "Ouro's code asks for: pip install transformers==4.54.1 safetensors")
    if not model.config.loop_norm:
        raise UserError("--ouro_code: Ouro's code normalizes the state after every loop; this "
                        "model was built without it (loop_norm=False)")
    folder = tempfile.mkdtemp(prefix="bench-ouro-")
    export_ouro(model, folder, dtype=torch.float32)
    for name in ("modeling_ouro.py", "configuration_ouro.py"):
        shutil.copy(os.path.join(code, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    # the local copies, not the Hub's
    hf["auto_map"] = {"AutoConfig": "configuration_ouro.OuroConfig",
                      "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                torch_dtype=torch.float32).eval()


def ouro_code_generate(hf, prompts, n_new, temperature, top_p):
    """Its own `generate`: every token all U loops (exit_threshold only picks the logits), exactly
    n_new tokens per row. Sampling draws from torch's global generator, seeded 0 per run."""
    torch.manual_seed(0)
    ids = torch.tensor(prompts, device=hf.device)
    sample = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature else \
        dict(do_sample=False)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          min_new_tokens=n_new, pad_token_id=0, **sample)
    return out[:, ids.shape[1]:].tolist()


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=engine --ouro_code=PATH runs it")

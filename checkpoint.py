"""
Model files on disk: atomic writes (and what an interrupted one leaves), an earlier run kept aside,
our nanoGPT-style checkpoints (ckpt.pt), and Ouro Hugging Face folders (strict import, export).

    model, ckpt = load_checkpoint("out/")                 # our ckpt.pt (file or folder) or an Ouro folder
    model, meta, encode, decode = load_for_script(c)      # the same, with its tokenizer, for a script

Ouro folders (config.json + model.safetensors, model_type "ouro") load strictly: every config
field is either implemented, inert, or refused; every tensor key is consumed and every parameter
filled. Export writes Ouro's key names and an auto_map to Ouro's modeling code. Loading uses
torch.load(..., weights_only=True): a checkpoint holds tensors and plain values only.
"""
import json
import os
import sys
import tempfile
from dataclasses import asdict, fields

import torch

from configurator import DTYPES, UserError, resolve_device
from model import GPTConfig, LoopedLM
from tokenizer import EOS, hf_tokenizer, load_tokenizer


# ----------------------------------------------------------------------------- writing files

def atomic_write(path, write):
    """Write a file atomically: write(tmp) fills a temp file beside `path`, which gets the usual
    permissions (0666 less the umask; mkstemp would leave 0600) and is then renamed over `path`.
    An interrupted write leaves the old file as it was; a write that fails (a full disk: an OSError
    from a file object, a RuntimeError from torch.save) is a UserError naming the path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[-1][:120]
            raise UserError(f"cannot write {path} ({reason}); what was there "
                            "before is kept as it was") from e
        raise


def write_json(path, obj, indent=2):
    """obj as JSON at path, atomically (indent None: one line, for records of many numbers)."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent)
    atomic_write(path, write)


class OSWrites:
    """A file torch.save writes through that keeps the OS's own error: torch.save turns a failed
    write (a full disk) into an internal assertion ("unexpected pos ..."), which says nothing of the
    cause."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def save_checkpoint(obj, path):
    """torch.save, atomically (atomic_write), a failed write reported with the OS's reason."""
    def write(tmp):
        with open(tmp, "wb") as f:
            out = OSWrites(f)
            try:
                torch.save(obj, out)
            except RuntimeError as e:
                if out.error is not None:
                    # ENOSPC, EIO, ...: the OS's reason, not torch's assertion
                    raise out.error from e
                raise
    atomic_write(path, write)


# ----------------------------------------------------------------------------- our checkpoints

def check_weights_finite(state, where):
    """Weights holding NaN or infinity (a run that diverged, a corrupt file) are refused at load:
    decoding with them gives garbage without an error."""
    bad = [k for k, v in state.items() if torch.is_floating_point(v)
           and not torch.isfinite(v).all()]
    if bad:
        raise UserError(f"{where}: {len(bad)} weight tensor(s) hold NaN or infinity (e.g. "
                        f"{bad[0]}): the file is corrupt or the run diverged; "
                        "load an earlier checkpoint")


def check_one_model(folder, flag):
    """A folder holds one model: a training run's ckpt.pt, or an Ouro folder (config.json +
    safetensors), never both (one would silently shadow the other in every --ckpt)."""
    if is_ouro_folder(folder) and os.path.isfile(os.path.join(folder, "ckpt.pt")):
        raise UserError(f"{flag}={folder}: holds both a training run (ckpt.pt) and an Ouro folder "
                        f"(config.json); give the file {os.path.join(folder, 'ckpt.pt')!r} for the "
                        "run, or move the Ouro files to a folder of their own")


def resolve_ckpt_path(path, flag="--ckpt"):
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise UserError(f"{flag}: no checkpoint at {path!r}: give a ckpt.pt file or a directory "
                        "holding one (train.py writes out_dir/ckpt.pt)")
    return path


def load_checkpoint(path, device="cpu", dtype=None, flag="--ckpt"):
    """The one loader used by train, sample and serve: our ckpt.pt (file or directory) or an Ouro
    Hugging Face folder (config.json + safetensors), detected automatically. `flag` names the
    option in error messages. Returns (model, checkpoint dict)."""
    check_one_model(path, flag)
    if is_ouro_folder(path):
        return load_ouro(path, device, dtype)
    path = resolve_ckpt_path(path, flag)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not written by torch.save, or holding more than tensors
        raise UserError(f"{flag}={path}: not a readable PyTorch checkpoint (torch.load: "
                        f"{type(e).__name__}); is it truncated, or another kind of file?")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model_args"), dict) or "model" not in ckpt:
        raise UserError(f"{flag}={path}: a PyTorch file, but not one of our checkpoints (no "
                        "'model' and 'model_args'; train.py writes them)")
    known = {f.name for f in fields(GPTConfig)}
    try:
        cfg = GPTConfig(**{k: v for k, v in ckpt["model_args"].items() if k in known})
        # shapes only: the weights are the file's (no allocation)
        with torch.device("meta"):
            model = LoopedLM(cfg)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise UserError(f"{flag}={path}: its model_args do not describe a model "
                        f"({type(e).__name__})")
    except UserError as e:
        # GPTConfig.check names train.py's flags; here they are fields
        raise UserError(f"{flag}={path}: its model_args do not describe a model: "
                        f"{str(e).replace('--', '')}")
    state = ckpt["model"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise UserError(f"{flag}={path}: its 'model' is not a dict of weight tensors")
    want = model.state_dict()
    bad = sorted(set(want) ^ set(state)) or sorted(k for k in want
                                                   if tuple(want[k].shape) != tuple(state[k].shape))
    if bad:
        raise UserError(f"{flag}={path}: its weights do not match its model_args ({len(bad)} "
                        f"mismatched, e.g. {bad[0]})")
    check_weights_finite(state, f"{flag}={path}")
    model.load_state_dict(state, assign=True)
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return model, ckpt


def model_args(cfg):
    return asdict(cfg)


# ----------------------------------------------------------- Ouro checkpoints (Hugging Face format)

# config.json field -> GPTConfig field (DESIGN.md "The model")
OURO_FIELDS = {"vocab_size": "vocab_size", "hidden_size": "n_embd", "num_hidden_layers": "n_layer",
               "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head",
               "intermediate_size": "ffn_hidden", "rope_theta": "rope_theta",
               "rms_norm_eps": "norm_eps", "total_ut_steps": "n_loops",
               "max_position_embeddings": "block_size"}


def is_ouro_folder(path):
    weights = ("model.safetensors", "model.safetensors.index.json")
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in weights))


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("Ouro checkpoints are safetensors files: install the optional package with "
                        "`pip install safetensors`")
    return safetensors.torch


def ouro_key(key):
    """Our parameter name -> Ouro's: everything but the LM head lives under `model.`."""
    return key if key.startswith("lm_head.") else "model." + key


# The other fields of the published Ouro configs (1.4B, 2.6B and their -Thinking variants).
# Each is either inert here (it does not change what the model computes) or accepted with the
# only value that we implement; anything else in a config.json is refused, so no field silently
# changes the model. (tie_word_embeddings and head_dim are read by the loader;
# max_window_layers and sliding_window act only with use_sliding_window; early_exit_threshold
# is Ouro's own τ, ours is --thr.)
OURO_INERT = {"architectures", "auto_map", "model_type", "torch_dtype", "dtype",
              "transformers_version", "use_cache",
              "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
              "early_exit_threshold", "tie_word_embeddings", "head_dim", "max_window_layers",
              "sliding_window"}
OURO_ONLY = {"hidden_act": ["silu"], "rope_scaling": [None], "use_sliding_window": [False],
             "attention_dropout": [0, 0.0], "attention_bias": [False]}


def read_json(path, kind=dict):
    """A JSON file of a model folder, of the expected kind: UserError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text")
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})")
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e})")
    if not isinstance(value, kind):
        raise UserError(f"{path}: a JSON {type(value).__name__}, where a JSON object is expected")
    return value


# the types of the config fields we read: integers >= 1, positive numbers
OURO_INTS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "total_ut_steps",
             "max_position_embeddings", "head_dim"}


def ouro_config(folder):
    hf = read_json(os.path.join(folder, "config.json"))
    for key, value in hf.items():
        whole = isinstance(value, int) and not isinstance(value, bool)
        number = whole or isinstance(value, float)
        if (key in OURO_INTS and not (whole and value >= 1)) or (
                key in ("rope_theta", "rms_norm_eps") and not (number and 0 < value < float("inf"))):
            raise UserError(f"{folder}/config.json: {key}={value!r} is not a positive "
                            f"{'integer' if key in OURO_INTS else 'number'}")
    if not isinstance(hf.get("layer_types", []), list):
        raise UserError(f"{folder}/config.json: layer_types={hf['layer_types']!r} is not a list")
    if hf.get("model_type", "ouro") != "ouro":
        raise UserError(f"{folder}: model_type {hf.get('model_type')!r} is not 'ouro'")
    missing = [k for k in OURO_FIELDS if k not in hf
               and k not in ("num_key_value_heads", "max_position_embeddings")]
    if missing:
        raise UserError(f"{folder}/config.json lacks {', '.join(missing)}")
    for key, value in hf.items():
        if key in OURO_ONLY and value not in OURO_ONLY[key]:
            raise UserError(f"{folder}/config.json: {key}={value!r} is not implemented here (only "
                            f"{' or '.join(map(repr, OURO_ONLY[key]))}); refusing rather than "
                            "computing another model")
        if key == "layer_types" and any(t != "full_attention" for t in value):
            raise UserError(f"{folder}/config.json: layer_types other than 'full_attention' "
                            f"({sorted(set(value) - {'full_attention'})}) are not implemented here")
        if key not in OURO_FIELDS and key not in OURO_INERT and key not in OURO_ONLY and key != "layer_types":
            raise UserError(f"{folder}/config.json: field {key}={value!r} is not one of the Ouro "
                            "config fields this loader implements; "
                            "refusing rather than ignoring it")
    args = {ours: hf[theirs] for theirs, ours in OURO_FIELDS.items() if theirs in hf}
    args.setdefault("n_kv_head", args["n_head"])
    args.setdefault("block_size", 4096)
    # Ouro normalizes the hidden state after every loop; the in-branch gains come from the weights
    cfg = GPTConfig(**args, loop_norm=True, branch_norm_init=1.0)
    if "head_dim" in hf and hf["head_dim"] != cfg.head_dim:
        raise UserError(f"{folder}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads "
                        f"= {cfg.head_dim}")
    if len(hf.get("layer_types", [None] * cfg.n_layer)) != cfg.n_layer:
        raise UserError(f"{folder}/config.json: layer_types has {len(hf['layer_types'])} entries "
                        f"for {cfg.n_layer} layers")
    return cfg, hf


def read_ouro_tensors(folder):
    st = _safetensors()
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(v, str) and v and os.path.basename(v) == v for v in weight_map.values()):
            raise UserError(f"{index}: its weight_map must name, for every tensor, a file of this folder")
        files = sorted(set(weight_map.values()))
        absent = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if absent:
            raise UserError(f"{index} names {len(absent)} file(s) the "
                            f"folder lacks, e.g. {absent[0]}")
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        try:
            tensors.update(st.load_file(os.path.join(folder, name)))
        except Exception as e:
            raise UserError(f"cannot read {folder}/{name}: {type(e).__name__}: {str(e)[:160]}")
    return tensors


def load_ouro(folder, device="cpu", dtype=None):
    """Load an Ouro folder strictly: every key consumed, every parameter filled, shapes checked.
    The stored dtype (bf16) is kept unless `dtype` is given."""
    cfg, hf = ouro_config(folder)
    tensors = read_ouro_tensors(folder)
    with torch.device("meta"):
        model = LoopedLM(cfg)
    want = {ouro_key(k): v.shape for k, v in model.state_dict().items()}
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise UserError(f"{folder}: checkpoint keys do not match an Ouro model of this config: "
                        f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                        f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != tuple(shape):
            raise UserError(f"{folder}: {k} has shape {tuple(tensors[k].shape)}, the config "
                            f"implies {tuple(shape)}")
        if not tensors[k].is_floating_point():
            raise UserError(f"{folder}: {k} holds {str(tensors[k].dtype).replace('torch.', '')} "
                            "values; a model's weights are floating point "
                            "(bfloat16, float16 or float32)")
    state = {k: tensors[ouro_key(k)] for k in model.state_dict()}
    check_weights_finite(state, folder)
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    meta = {}
    # exported from here: our tokenizer
    if os.path.isfile(os.path.join(folder, "meta.json")):
        meta = read_json(os.path.join(folder, "meta.json"))
    elif os.path.isfile(os.path.join(folder, "tokenizer.json")):   # Ouro's own (SmolLM2-style)
        meta = {"tokenizer": "hf", "path": os.path.join(folder, "tokenizer.json"),
                "vocab_size": cfg.vocab_size}
    return model, {"model_args": asdict(cfg), "meta": meta, "ouro_config": hf}


OURO_HUB = "ByteDance/Ouro-1.4B"  # where the published Ouro modeling code lives (for auto_map)


def export_ouro(model, folder, meta=None, dtype=None, force=False, tiktoken_file=""):
    """Write an Ouro-format folder: config.json (model_type "ouro", an auto_map to the Ouro modeling
    code on the Hub) + model.safetensors with Ouro's key names, in `dtype` (None: the model's own),
    and with `meta`, our tokenizer: meta.json (read back by our loader) and the Hugging Face files a
    user of that library needs (tokenizer.json, tokenizer_config.json, generation_config.json:
    hf_tokenizer_files). Refuses a model that Ouro's code would run differently, and an existing
    Ouro folder unless `force`."""
    dtype = dtype or model.lm_head.weight.dtype
    cfg = model.config
    check_export(cfg, folder, force)
    st = _safetensors()
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded folder: its index would shadow the new single file
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
        for name in shards:
            if os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
        os.remove(index)
    hf = {"model_type": "ouro", "architectures": ["OuroForCausalLM"], "hidden_act": "silu",
          "head_dim": cfg.head_dim, "tie_word_embeddings": False, "early_exit_threshold": 1.0,
          "torch_dtype": str(dtype).replace("torch.", ""), "use_cache": True,
          "attention_dropout": 0.0,
          "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
          "max_window_layers": cfg.n_layer, "layer_types": ["full_attention"] * cfg.n_layer,
          "initializer_range": 0.02,
          "auto_map": {"AutoConfig": f"{OURO_HUB}--configuration_ouro.OuroConfig",
                       "AutoModel": f"{OURO_HUB}--modeling_ouro.OuroModel",
                       "AutoModelForCausalLM": f"{OURO_HUB}--modeling_ouro.OuroForCausalLM"}}
    hf.update({theirs: getattr(cfg, ours) for theirs, ours in OURO_FIELDS.items()})
    tensors = {ouro_key(k): v.detach().to("cpu", dtype).contiguous()
               for k, v in model.state_dict().items()}
    atomic_write(os.path.join(folder, "model.safetensors"),
                 lambda tmp: st.save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(folder, "config.json"), hf)
    if meta:
        write_json(os.path.join(folder, "meta.json"), meta)
        hf_tokenizer_files(meta, folder, cfg.block_size, tiktoken_file)
    return folder


def check_export(cfg, folder, force):
    """What export_ouro refuses before it writes anything: a model Ouro's code would run differently,
    a folder that is a file or holds a training run, an Ouro folder unless `force`."""
    if not cfg.loop_norm:
        raise UserError("this model was trained without the per-loop norm (loop_norm=False); "
                        "Ouro's code normalizes the hidden state after every loop and would "
                        "compute something else. Only models trained with "
                        "--loop_norm can be exported")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"--out={folder}: exists and is not a folder")
    if os.path.isfile(os.path.join(folder, "ckpt.pt")):
        raise UserError(f"--out={folder}: holds a training run (ckpt.pt); an Ouro folder beside it "
                        "would shadow it in every --ckpt. Write the export to a folder of its own")
    ours = ["config.json", "model.safetensors", "model.safetensors.index.json", "meta.json",
            "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    present = [f for f in ours if os.path.exists(os.path.join(folder, f))]
    if present and not force:
        raise UserError(f"--out={folder}: already holds {', '.join(present)}; "
                        "give --force to overwrite it")


def hf_tokenizer_files(meta, folder, context, tiktoken_file=""):
    """The tokenizer of an exported folder as Hugging Face reads it: tokenizer.json
    (tokenizer.hf_tokenizer: the same ids as ours), tokenizer_config.json and generation_config.json
    (the end-of-text id where the tokenizer has one, the paper's sampling: temperature 1.0, top-p
    0.7). Without the optional `tokenizers` package, a note says what is missing."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("note: no tokenizer.json written (pip install tokenizers); "
              "meta.json holds the tokenizer", file=sys.stderr)
        return
    hf_tokenizer(meta, tiktoken_file).save(os.path.join(folder, "tokenizer.json"))
    eos = EOS.get(meta.get("tokenizer"))
    special = {"eos_token": "<|endoftext|>"} if meta.get("tokenizer") == "gpt2" else {}
    write_json(os.path.join(folder, "tokenizer_config.json"),
               {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
                "clean_up_tokenization_spaces": False, **special})
    write_json(os.path.join(folder, "generation_config.json"),
               {"eos_token_id": eos, "do_sample": True, "temperature": 1.0, "top_p": 0.7})


# ----------------------------------------------------------------------------- for a script

def load_for_script(c, flag="--ckpt"):
    """What sample.py, lab/eval.py and the server do first: the checkpoint c["ckpt"] on c["device"]
    in c["dtype"], with its tokenizer when it has one. Returns (model, meta, encode, decode, eos);
    encode and decode are None for a model without a tokenizer (prompts are then token ids), and a
    tokenizer that cannot be loaded here (a missing optional package) is said in one note on
    stderr."""
    model, ckpt = load_checkpoint(c["ckpt"], resolve_device(c["device"]), DTYPES[c["dtype"]], flag)
    meta = ckpt.get("meta") or {}
    encode = decode = None
    if meta:
        try:
            encode, decode = load_tokenizer(meta, c.get("tiktoken_file", ""))
        except UserError as e:
            print(f"note: {e}; prompts must be token ids", file=sys.stderr)
    return model, meta, encode, decode, EOS.get(meta.get("tokenizer"))


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "train.py, sample.py, lab/eval.py and server.py load with it; python -m "
            "lab.export_ouro writes an Ouro folder")

"""
Command-line plumbing of every script: config files and flag overrides, --help, and the one
error type, device and dtype that all scripts share. nanoGPT style, without exec-into-globals:

    python train.py config/shakespeare_char.py --batch_size=32 --max_iters 500 --global_kl

A script declares its defaults as plain values, each with a one-line comment, and right below them
one RULES table: the allowed range of every key that has one. parse() returns the defaults
overridden, in order, by config files (python files assigning known keys) and by flags in three
forms: `--key=value`, `--key value`, and a bare `--flag` for booleans; then it checks every rule.
Values are Python literals checked against the type of the default (an int is fine where a float
is expected; a default of None takes any literal, or a string); numbers must be finite and fit in
64 bits, whatever the key (1e999 is infinity, not a learning rate). Any mistake raises UserError,
which run_cli() prints as one line naming the key. `-h` / `--help` prints the script's docstring
and every key with its default, its comment (read from the script's source) and its rule.

Rules: a list (the allowed values); a string: '>= 1', '> 0', '<= 8', 'in [0, 1]', 'in (0, 1]',
'in [0, 1)', 'floats in [0, 1]' or 'ints >= 1' (a comma-separated list of numbers, each in the
range; every list is read by split_list: an empty item or a stray comma is refused, by position);
or a function value -> error text (None when fine). A key left at a default of None is "unset"
and not checked. Beside RULES a script may declare NEEDS: the keys that act only with another
setting (--cf_thr only with --ra_method=counterfactual); set without it, such a key is refused.
"""
import ast
import io
import json
import math
import os
import re
import sys
import tempfile
import time
import tokenize
import traceback

import torch


class UserError(Exception):
    """A mistake in what the user asked for. CLIs print it as one line and exit with code 2.
    `field` names the option or request field it is about, when there is one."""

    def __init__(self, message, field=None):
        super().__init__(message)
        self.field = field


_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


INT_MAX = 2**63 - 1
SEED_RULE = "in [0, 4294967295]"   # --seed of every script: numpy's seeds are 32-bit


def _finite(key, raw, value):
    """Every number a key takes is finite and fits in 64 bits, inside lists and tuples too."""
    items = value if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if isinstance(v, float) and not math.isfinite(v):
            raise UserError(f"--{key}={raw!r}: must be a finite number")
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_MAX:
            raise UserError(f"--{key}={raw!r}: must fit in 64 bits (|value| <= 2**63 - 1)")
    return value


def _convert(key, raw, default):
    return _finite(key, raw, _typed(key, raw, default))


def _typed(key, raw, default):
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        word = str(raw).strip().lower()
        if word not in _BOOL_WORDS:
            raise UserError(f"--{key}={raw!r}: expected a boolean (True/False)")
        return _BOOL_WORDS[word]
    if isinstance(default, str):
        return str(raw)
    value = raw
    if isinstance(raw, str):
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
    if default is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not type(default):
        raise UserError(f"--{key}={raw!r}: expected {type(default).__name__} (default {default!r})")
    return value


def _unknown(key, config):
    return UserError(f"unknown option --{key}; allowed: " + ", ".join(f"--{k}" for k in sorted(config)))


def parse(argv, defaults, rules=None, source=None, given=None, needs=None):
    """defaults: {key: default}; rules: {key: rule} (see the module docstring); source: the script's
    file, for --help; given: a set that receives the keys set on the command line or in a config
    file to another value than their default (mark); needs: {key: (what, test)}, the keys that act
    only with another setting (see check_needs). Returns a new dict."""
    config = dict(defaults)
    given = set() if given is None else given
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-h", "--help"):
            print(help_text(defaults, rules, source, needs))
            raise SystemExit(0)
        if not arg.startswith("--"):
            if not arg.endswith(".py"):
                raise UserError(f"unexpected argument {arg!r}: use --key=value, or a config/*.py file")
            _apply_file(arg, config, defaults, given)
            continue
        key, eq, raw = arg[2:].partition("=")
        if key not in config:
            raise _unknown(key, config)
        if not eq:
            nxt = args[i] if i < len(args) else None
            if isinstance(defaults[key], bool):
                raw = True  # bare flag; an explicit following True/False is also accepted
                if nxt is not None and nxt.lower() in _BOOL_WORDS:
                    raw, i = nxt, i + 1
            elif nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                raise UserError(f"--{key} needs a value (default {defaults[key]!r})")
            else:
                raw, i = nxt, i + 1
        config[key] = _convert(key, raw, defaults[key])
        mark(given, key, config[key], defaults[key])
    for key, rule in (rules or {}).items():
        check(key, config[key], rule)
    check_needs(config, given, needs or {})
    return config


def check_needs(config, given, needs):
    """A key set (on the command line or in a config file) whose effect depends on another setting
    is refused when that setting is not there: it would do nothing. needs: {key: (what it needs, as
    the user would write it, test of the config)}: each script's table beside its RULES."""
    for key, (what, test) in needs.items():
        if key in given and not test(config):
            raise UserError(f"--{key}={config[key]!r} does nothing without {what}: give {what}, or "
                            f"leave --{key} out")


def check(key, value, rule):
    """Raise UserError naming --key when value breaks rule (see the module docstring)."""
    if value is None:
        return  # unset: the script decides what None means
    if isinstance(rule, list):
        if value not in rule:
            choices = [str(v) if v != "" else "'' (unset: the default)" for v in rule]
            raise UserError(f"--{key}={value!r} is not allowed; choose one of: " + ", ".join(choices))
        return
    if callable(rule):
        problem = rule(value)
        if problem:
            raise UserError(f"--{key}={value!r}: {problem}")
        return
    if rule.startswith(("floats ", "ints ")):
        kind, bound = rule.split(" ", 1)
        numbers = split_list(key, value, float if kind == "floats" else int)
        if not numbers:
            raise UserError(f"--{key}={value!r}: expected comma-separated numbers, each {bound}")
        for i, v in enumerate(numbers, 1):
            if not (math.isfinite(v) and _in_range(v, bound)):
                raise UserError(f"--{key}={value!r}: item {i} ({v}) must be {bound}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _in_range(value, rule):
        raise UserError(f"--{key}={value!r}: must be a number {rule}")


# ----------------------------------------------------------------------------- devices and dtypes

def device_rule(name):
    """auto | cpu | cuda | cuda:N | mps"""
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        return "expected auto, cpu, cuda, cuda:N or mps"


def resolve_device(name):
    """--device: auto (CUDA when there is one, else the CPU), cpu, cuda, cuda:N or mps."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device={name}: CUDA is not available on this machine; use "
                            "--device=cpu or auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UserError(f"--device={name}: this machine has "
                            f"{torch.cuda.device_count()} CUDA device(s)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device=mps: MPS is not available on this machine; use --device=cpu or auto")
    return name


def threads_rule(n):
    """0 (torch's own) or a count up to 4x the cores"""
    if not 0 <= n <= 4 * (os.cpu_count() or 1):
        return f"expected 0..{4 * (os.cpu_count() or 1)} (0: torch's own; this machine has {os.cpu_count()} cores)"


THREADS_RULE = threads_rule


def set_threads(n):
    """--threads of every torch script: torch's intra-op threads (0: leave torch's default, one per
    core). Beside other jobs on a small machine give 1: threads without a core of their own spin
    while they wait, and a run slows many times over."""
    if n:
        torch.set_num_threads(n)


# NEEDS of every script that samples: top-k and top-p shape a sampled draw, and
# greedy decoding draws none
_sampled = ("--temperature=1.0 (any above 0)", lambda c: c["temperature"] > 0)
SAMPLING_NEEDS = dict(top_k=_sampled, top_p=_sampled)

# --dtype of the inference scripts: "" keeps the checkpoint's own
DTYPES = {"": None, "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# The keys of every script that loads a model to run it (sample.py, server.py, lab/eval.py):
# declared here once, with their comments (--help reads them from this file) and their rules.
MODEL_RUN = dict(
    device="auto",         # where to run (auto: CUDA when there is one)
    threads=0,             # torch threads (0: torch's own, one per core; 1 beside other jobs)
    dtype="",              # weights dtype (default: as saved)
    tiktoken_file="",      # gpt2.tiktoken ranks file for GPT-2 tokenized checkpoints, offline
)
MODEL_RUN_RULES = dict(device=device_rule, threads=THREADS_RULE, dtype=list(DTYPES))


def split_list(key, value, kind=str):
    """The one reading of a list, a flag's or a request field's: comma-separated items, each a
    `kind` (str, int or float); an empty item (a stray or trailing comma) or one that is not a
    `kind` is a UserError naming the key and the item's position. An empty value: an empty list."""
    text = str(value).strip()
    if not text:
        return []
    out = []
    for i, item in enumerate(text.split(","), 1):
        item = item.strip()
        if not item:
            raise UserError(f"--{key}={value!r}: item {i} is empty (a stray comma?)", key)
        try:
            out.append(kind(item))
        except ValueError:
            what = {int: "an integer", float: "a number"}.get(kind, "a value")
            raise UserError(f"--{key}={value!r}: item {i} ({item!r}) is not {what}", key)
    return out


def _number(s):
    try:
        return float(s)
    except ValueError:
        return None


def _in_range(v, rule):
    m = re.fullmatch(r"in ([\[(])\s*(\S+),\s*(\S+)\s*([\])])", rule)
    if m:
        lo, hi = float(m[2]), float(m[3])
        return (lo <= v if m[1] == "[" else lo < v) and (v <= hi if m[4] == "]" else v < hi)
    op, bound = rule.split()
    return {">=": v >= float(bound), ">": v > float(bound), "<=": v <= float(bound),
            "<": v < float(bound)}[op]


def _is_number(s):
    return _number(s) is not None


def _apply_file(path, config, defaults, given=None):
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise UserError(f"cannot read config file {path!r}: {e.strerror}")
    scope = {}
    try:
        # a config file is trusted python, as in nanoGPT
        exec(compile(source, path, "exec"), {}, scope)
    except SyntaxError as e:
        raise UserError(f"config file {path}: line {e.lineno}: {e.msg}")
    except Exception as e:      # an undefined name, a failing expression: the file's own mistake
        line = next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__))
                     if f.filename == path), "?")
        raise UserError(f"config file {path}: line {line}: {type(e).__name__}: {e}")
    for key, value in scope.items():
        if key.startswith("_") or callable(value) or type(value).__name__ == "module":
            continue
        if key not in config:
            raise _unknown(key, config)
        config[key] = _convert(key, value, defaults[key])
        mark(given, key, config[key], defaults[key])


def mark(given, key, value, default):
    """A key counts as given only at a value other than its default: giving a key the default that
    --help shows is the same run as leaving it out (nothing else may read that it was written)."""
    if value == default and type(value) is type(default):
        given.discard(key)
    else:
        given.add(key)


# ----------------------------------------------------------------------------- --help

def declared_comments(source):
    """{key: comment} for every line of `source` (python text) of the form `key = value  # comment`
    or `key=value,  # comment` (a default inside dict(...)): the comment beside each default."""
    rows = {}
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            rows.setdefault(tok.start[0], []).append(tok)
    out = {}
    for toks in rows.values():
        assigned = len(toks) > 2 and toks[0].type == tokenize.NAME and toks[1].string == "="
        if assigned and toks[-1].type == tokenize.COMMENT:
            out.setdefault(toks[0].string, toks[-1].string.lstrip("#").strip())
    return out


def help_text(defaults, rules=None, source=None, needs=None):
    """The script's docstring, then every key: --key=default, its comment, its rule and what it needs."""
    doc, comments = "", {}
    if source and os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            text = f.read()
        doc = (ast.get_docstring(ast.parse(text)) or "").strip()
        # the keys declared here once (MODEL_RUN), then the script's
        with open(__file__, encoding="utf-8") as f:
            comments = dict(declared_comments(f.read()), **declared_comments(text))
    lines = [f"usage: python {command(source or 'script.py')} [config/*.py ...] [--key=value | "
             "--key value | --flag ...]", ""]
    if doc:
        lines += [doc, ""]
    lines.append("options (default, then what it does; allowed values in brackets):")
    width = min(34, max(len(f"--{k}={v!r}") for k, v in defaults.items()) + 2)
    for key, default in defaults.items():
        flag = f"--{key}={default!r}"
        need = f" (only with {needs[key][0]})" if key in (needs or {}) else ""
        lines.append(f"  {flag:<{width}} "
                     f"{comments.get(key, '')}{_describe((rules or {}).get(key))}{need}".rstrip())
    return "\n".join(lines)


def command(path):
    """How a file is run: `train.py` at the root, `-m lab.reproduce` for a lab script (a module)."""
    name = os.path.basename(path)
    lab = os.path.basename(os.path.dirname(os.path.abspath(path))) == "lab"
    return f"-m lab.{name[:-3]}" if lab else name


def _describe(rule):
    if rule is None:
        return ""
    if isinstance(rule, list):
        return " [" + " | ".join(map(repr, rule)) + "]"
    if callable(rule):
        return f" [{rule.__doc__}]" if rule.__doc__ else ""
    return f" [{rule}]"


def check_writable(path, key):
    """Before any work: can the script write to the folder `path` (given as --key)? Tries a
    temporary file in it, or in its nearest existing parent when it does not exist yet (it is not
    created)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"--{key}={path}: exists and is not a directory")
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        raise UserError(f"--{key}={path}: cannot write in {probe} ({e.strerror or e})")


def fail(line):
    """Print the error line, on a line of its own (an open progress bar is closed first), and exit
    2. Under torchrun every rank fails alike: rank 0 prints the line and each rank leaves it in
    torchrun's error file, so that torchrun's own failure report (which follows; torchrun exits 1)
    names it as the root cause instead of "<N/A>"."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)
    if os.environ.get("RANK", "0") == "0":
        from tqdm import tqdm
        # a progress bar still open ends its line first
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
        print(line, file=sys.stderr)
    sys.exit(2)


def run_cli(main, argv=None):
    """Call main(argv); a UserError becomes one line on stderr and exit code 2, and so does an OS
    error on a file (it names the path)."""
    try:
        main(sys.argv[1:] if argv is None else argv)
    except UserError as e:
        fail(f"error: {e}")
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    except OSError as e:
        if e.filename is None:
            raise
        fail(f"error: {e.filename}: {e.strerror or e}")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def library(doc, use, argv=None):
    """What a library module does when it is run as a script: with --help it says what it is (its
    docstring's first line) and how it is used (`use`: the command that runs it), exit 0; otherwise
    the same as one error line, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    name = command(sys.argv[0])
    name = f"python {name}" if name.startswith("-m ") else name
    # the first sentence: up to a full stop, colon or semicolon, but not one of the paper's "App. A.2"
    what = re.split(r"(?<!App)(?<!Eq)(?<!Fig)[.:;](?:\s|$)", " ".join(doc.strip().split("\n\n")[0].split()))[0]
    if argv and all(a in ("-h", "--help") for a in argv):
        print(f"{name}: {what}\nA library module, not a command: {use}")
        raise SystemExit(0)
    fail(f"error: {name} is a library module, not a command ({what[0].lower()}{what[1:]}): {use}")


if __name__ == "__main__":
    library(__doc__, "every script's --help and flags come from it")

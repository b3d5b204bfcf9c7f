"""
Command-line and config-file overrides, nanoGPT style but without exec-into-globals:

    python train.py config/shakespeare_char.py --batch_size=32 --max_iters 500 --global_kl

A script declares its defaults as plain values; parse() returns them overridden, in order, by
config files (python files assigning known keys) and by flags in three forms: `--key=value`,
`--key value`, and a bare `--flag` for booleans. Values are Python literals checked against the
type of the default (an int is fine where a float is expected; a default of None takes any
literal, or a string). Any mistake raises UserError, which main() prints as one line.
"""
import ast
import sys

from model import UserError

_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


def _convert(key, raw, default):
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


def parse(argv, defaults, choices=None):
    """defaults: {key: default}. choices: {key: allowed values}. Returns a new dict."""
    config = dict(defaults)
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            if not arg.endswith(".py"):
                raise UserError(f"unexpected argument {arg!r}: use --key=value, or a config/*.py file")
            _apply_file(arg, config, defaults)
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
    for key, allowed in (choices or {}).items():
        if config[key] not in allowed:
            raise UserError(f"--{key}={config[key]!r} is not allowed; choose one of: "
                            + ", ".join(map(str, allowed)))
    return config


def _is_number(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def _apply_file(path, config, defaults):
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise UserError(f"cannot read config file {path!r}: {e.strerror}")
    scope = {}
    exec(compile(source, path, "exec"), {}, scope)  # a config file is trusted python, as in nanoGPT
    for key, value in scope.items():
        if key.startswith("_") or callable(value) or type(value).__name__ == "module":
            continue
        if key not in config:
            raise _unknown(key, config)
        config[key] = _convert(key, value, defaults[key])


def run_cli(main):
    """Call main(argv); a UserError becomes one line on stderr and exit code 2."""
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

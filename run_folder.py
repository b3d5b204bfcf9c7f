"""
A training run's folder: one writer at a time (its lock), its log, its checkpoints, and an earlier run
kept aside rather than replaced unasked (train.py writes it; --init_from=resume reads it back).
"""
import json
import os
import sys

from checkpoint import atomic_write, model_args, save_checkpoint
from configurator import UserError


def remove_stale_temps(folder):
    """Remove the temp files an interrupted atomic_write left in folder (hidden, `.tmp`, each up to
    the file's size); returns their names."""
    stale = sorted(n for n in os.listdir(folder) if n.startswith(".") and n.endswith(".tmp"))
    for name in stale:
        os.remove(os.path.join(folder, name))
    return stale


def aside_folder(out_dir):
    """Where an earlier run of out_dir goes when a fresh one replaces it: out_dir/earlier-1, -2, ..."""
    k = 1
    while os.path.exists(os.path.join(out_dir, f"earlier-{k}")):
        k += 1
    return os.path.join(out_dir, f"earlier-{k}")


def keep_aside(out_dir):
    """The earlier run's ckpt.pt and log.jsonl, moved into a folder of its own: nothing a user
    trained is replaced unasked. Returns the folder."""
    folder = aside_folder(out_dir)
    os.makedirs(folder)
    for name in ("ckpt.pt", "log.jsonl"):
        if os.path.exists(os.path.join(out_dir, name)):
            os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    return folder


def lock_out_dir(c):
    """One run writes an out_dir at a time: the writing run holds an exclusive lock on out_dir/.lock
    (the system releases it when the process ends, killed or not), and a second run into the same
    folder is refused while the first one runs, before it writes anything. Where the system has no
    flock (Windows), nothing is checked. Holding the lock, it removes what an interrupted write left
    (checkpoint.atomic_write's hidden temp files, each up to a checkpoint's size), and says so."""
    try:
        import fcntl
    except ImportError:
        return None
    os.makedirs(c.out_dir, exist_ok=True)
    f = open(os.path.join(c.out_dir, ".lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"--out_dir={c.out_dir}: another train.py is writing this run now; wait "
                        "for it to end or give another --out_dir")
    stale = remove_stale_temps(c.out_dir)
    if stale:
        print(f"removed {len(stale)} file(s) an interrupted write left in {c.out_dir} "
              f"({', '.join(stale)})", file=sys.stderr)
    return f


def log_target(c, master):
    """Where training records go. A fresh run into a folder that holds an earlier run leaves that
    run's ckpt.pt and log.jsonl untouched until it has a checkpoint of its own (its log goes to
    log.jsonl.new until then); then the earlier run moves aside (keep_aside), unless --overwrite.
    Returns (log file, pending)."""
    ckpt_path, log_path = os.path.join(c.out_dir, "ckpt.pt"), os.path.join(c.out_dir, "log.jsonl")
    pending = (c.init_from == "scratch" and not c.eval_only
               and any(os.path.exists(p) for p in (ckpt_path, log_path)))
    log_file = log_path + ".new" if pending else log_path
    if master and pending:
        os.makedirs(c.out_dir, exist_ok=True)
        open(log_file, "w").close()
        then = ("it is replaced (--overwrite)" if c.overwrite else
                f"it moves to {aside_folder(c.out_dir)} (--overwrite: replace it)")
        print(f"{c.out_dir} holds an earlier run: it stays as it is until "
              "this run's first checkpoint "
              f"(iter {min(c.eval_interval, c.max_iters)}), then {then}; until then "
              f"this run logs to {log_file}", file=sys.stderr)
    return log_file, pending


def trim_log(path, iter_num):
    """A resumed run continues from its checkpoint at iter_num: the records written after it (by
    the run that was stopped) are dropped, so that the log holds each iteration once."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line).get("iter", 0) <= iter_num]
    if len(keep) < len(lines):
        atomic_write(path, lambda tmp: open(tmp, "w").writelines(keep))


def write_record(c, run, record):
    if run.master:
        os.makedirs(c.out_dir, exist_ok=True)
        with open(run.log_file, "a") as f:
            f.write(json.dumps(record) + "\n")


def save_run(c, run, it):
    """Checkpoint everything a resume needs; the first checkpoint of a fresh run over an earlier
    one moves that run aside (keep_aside; --overwrite: replaced) and makes this run's log the
    folder's log.jsonl."""
    if not run.master:
        return
    if run.pending and not c.overwrite:
        print(f"\nthe earlier run in {c.out_dir} moved to {keep_aside(c.out_dir)}", file=sys.stderr)
    m = run.model
    save_checkpoint({"model": m.state_dict(), "optimizer": run.optimizer.state_dict(),
                     "model_args": model_args(m.config), "iter_num": it, "config": vars(c), "meta": run.meta,
                     "data_rng": run.data_gen.get_state(), "exit_rng": run.exit_gen.get_state()},
                    os.path.join(c.out_dir, "ckpt.pt"))
    if run.pending:
        log_path = os.path.join(c.out_dir, "log.jsonl")
        os.replace(run.log_file, log_path)
        run.log_file, run.pending = log_path, False


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python train.py --out_dir=DIR writes one")

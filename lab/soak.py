"""
A server that runs for weeks: tens of thousands of mixed requests through the HTTP API, some of their
streams closed mid-way by their client, with the server's resident memory every few thousand
requests, the pages in its pool and the errors. Its memory should stay flat after warm-up: the engine
holds a request from its admission to its end only.

    python -m lab.soak --ckpt out/ --requests=40000 --clients=16     # the quick-start checkpoint
    python -m lab.soak --quick                                        # a random model: a minute

The last line on stdout is one JSON object: resident MB at every report, the slope after warm-up in
MB per 10,000 requests, the pages held at the end (0), the errors (0).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.soak ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import http.client
import json
import random
import sys
import threading
import time

import numpy as np
import torch

from checkpoint import load_for_script
from configurator import MODEL_RUN, MODEL_RUN_RULES, SEED_RULE, parse, run_cli, set_threads
from model import GPTConfig, LoopedLM
from prepare_data import SYNTH_CHARS
from ragged import pool_pages
from engine.build import engine_for
from server import serve
from tokenizer import char_meta, load_tokenizer

DEFAULTS = dict(
    ckpt="",               # the model served (empty: a small random character model)
    requests=20000,        # requests in all
    clients=16,            # concurrent clients
    report_every=2000,     # requests between two memory readings
    cut_share=0.15,        # the share of streamed requests whose client closes the connection mid-way
    max_batch=8,           # the engine's batch
    quick=False,           # 2,000 requests of a tiny random model (about a minute)
    seed=1337,             # the requests' draw
    **MODEL_RUN,
)
RULES = dict(requests=">= 1", clients=">= 1", report_every=">= 1", cut_share="in [0, 1]",
             max_batch=">= 1", seed=SEED_RULE, **MODEL_RUN_RULES)
MODES = ["dense_ragged", "ete_ragged", "fixed", "ouro"]


def resident_mb():
    """This process's resident memory (VmRSS), MB; None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def model_of(c):
    """The model served: the checkpoint, or a small random character model."""
    if c["ckpt"]:
        model, meta, encode, decode, _ = load_for_script(c)
        return model, encode, decode
    torch.manual_seed(c["seed"])
    meta = char_meta(SYNTH_CHARS)
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=128, n_layer=2, n_head=4,
                               n_embd=32, ffn_hidden=48)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 2.0)
    return (model, *load_tokenizer(meta))


def one_request(port, rng, c):
    """A random request: a mode, a threshold, a length, streamed or not, sampled or greedy; a share of
    the streams closed after their first tokens. Returns the HTTP status (0: cut by the client)."""
    body = {"prompt": "the " * rng.randint(1, 6), "max_tokens": rng.randint(1, 24),
            "mode": rng.choice(MODES), "temperature": rng.choice([0, 0.8]),
            "stream": rng.random() < 0.5}
    if body["mode"] == "fixed":
        body["depth"] = rng.randint(1, 4)
    else:
        body["thr"] = rng.choice([0.3, 0.5, 0.7])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if body["stream"] and rng.random() < c["cut_share"]:
            r.read(64)
            return 0
        r.read()
        return r.status
    finally:
        conn.close()


def soak(c):
    model, encode, decode = model_of(c)
    engine = engine_for(model, pool_pages(model, 0, 0, c["max_batch"]), c["max_batch"])
    httpd, server = serve(engine, "127.0.0.1", 0, encode, decode, "soak")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port, lock, done, errors, readings = httpd.server_address[1], threading.Lock(), [0], [], []
    readings.append((0, resident_mb()))

    def client(i):
        rng = random.Random(c["seed"] * 1000 + i)
        while True:
            with lock:
                if done[0] >= c["requests"]:
                    return
                done[0] += 1
                n = done[0]
            status = one_request(port, rng, c)
            with lock:
                if status not in (0, 200):
                    errors.append(status)
                if n % c["report_every"] == 0:
                    readings.append((n, resident_mb()))
                    print(f"{n} requests: {readings[-1][1]:.0f} MB resident, {engine.pool.used} "
                          f"pages held, {len(errors)} errors", file=sys.stderr, flush=True)
    started = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(c["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 30                    # the cut streams' requests end at the next steps
    while engine.busy() and time.time() < deadline:
        time.sleep(0.05)
    httpd.shutdown()
    server.stop()
    after = [(n, mb) for n, mb in readings if n >= len(readings) // 3 * c["report_every"] and mb]
    slope = (np.polyfit([n for n, _ in after], [mb for _, mb in after], 1)[0] * 10000
             if len(after) >= 2 else None)
    return dict(requests=c["requests"], seconds=round(time.time() - started, 1),
                resident_mb=[(n, round(mb, 1)) for n, mb in readings if mb],
                mb_per_10k_after_warmup=None if slope is None else round(float(slope), 2),
                pages_held=engine.pool.used, errors=len(errors), finished=engine.stats["finished"])


def main(argv):
    c = parse(argv, DEFAULTS, RULES, __file__)
    set_threads(c["threads"])
    if c["quick"]:
        c.update(requests=min(c["requests"], 2000), report_every=min(c["report_every"], 250))
    result = soak(c)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    run_cli(main)

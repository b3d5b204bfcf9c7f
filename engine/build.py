"""
The one entry point of sample.py, server.py and lab/: the engine for this device, with the runner
that applies its block (serve_depthbatch.EagerRunner, the reference, or engine/slots.py's
SlotRunner, the same pass as CUDA graphs) and the head policy that runner serves best.
"""
from configurator import UserError
from engine.graphs import can_capture
from engine.slots import runs_mode
from serve_depthbatch import Engine

RUNNERS = ["auto", "eager", "slots"]      # the runner that applies the block ("auto": engine_for picks)


def engine_for(model, kv_pages, max_batch=32, max_rows=256, scheduler="continuous", attn="auto",
               head="auto", runner="auto", sampling=None, modes=()):
    """The engine for this device, the one entry point of sample.py, server.py and lab/. runner
    "auto": the slot runner with CUDA graphs where graphs can be captured (a GPU, where the eager
    runner waits on the host); the eager runner on a CPU, where it is the faster (it gathers only the
    keys each row reads; docs/benchmarks.md), and for what the slot runner leaves to it (the nested
    scheduler, the shared LM head, and the modes it does not run: engine/slots.runs_mode, of `modes`,
    the modes a script knows its requests run). head "auto": the runner's own, eager on the
    slot runner (it runs the head on every pass), shared on the eager one. sampling: the draws the
    slot runner captures when it starts (engine/slot_pass.SAMPLING; a script that knows its
    requests' names theirs)."""
    if runner not in RUNNERS:
        raise UserError(f"--runner={runner!r}; allowed: {', '.join(RUNNERS)}", "runner")
    if runner == "auto":
        graphs = can_capture(model.lm_head.weight.device)
        runner = ("slots" if graphs and scheduler != "nested" and attn != "flex" and head != "shared"
                  and all(runs_mode(m) for m in modes) else "eager")
    if head == "auto":
        head = "eager" if runner == "slots" else "shared"
    options = {"sampling": sampling} if runner == "slots" and sampling else {}
    return Engine(model, kv_pages, max_batch, max_rows, scheduler, attn, head, runner, **options)

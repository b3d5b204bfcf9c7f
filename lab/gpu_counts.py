"""
What the graphed pass costs, counted on any device, from the very code a GPU runs: the launches of
the pass the slot runner captures (Inductor's own scheduling of the compile that the capture makes,
in the capture's mode, on its Triton backend, what CUDA runs; stopped before code generation, so
that a CPU counts it too, with the CUDA graph API stood in), and the host's traffic a step
(host-to-device copies, syncs, launches outside the graphs), the passes read with none behind them
and the host's time a pass, on a batch or a queue. lab/bench_gpu.py reports them at Ouro-1.4B's
shape; tests/test_slots.py holds the tiny shape's.
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.gpu_counts ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
import contextlib
import os
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from engine import graphs as graph_api
from engine.request import Request
from serve_depthbatch import Engine
from engine.graphs import CudaGraphs


# ----------------------------------------------------------------------------- launches

class Fused(Exception):
    """Raised once Inductor has scheduled a graph: what it would launch is known (inductor_launches)."""


@contextlib.contextmanager
def inductor_launches():
    """What Inductor launches for the graph compiled inside this block, read from its own
    scheduling: its Triton backend (the one CUDA uses, on a CPU too), stopped with Fused once the
    scheduler has fused the graph, before any code is generated. Yields a list that receives one
    kind per launch: "kernel" (a generated Triton kernel), "gemm" (a cuBLAS call), "op" (another
    operator: the paged attention)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.scheduler as scheduler
    kinds = []

    def stop(self):
        for node in self.nodes:
            kind = type(node).__name__
            if kind in ("SchedulerNode", "FusedSchedulerNode"):
                kinds.append("kernel")
            elif kind == "ExternKernelSchedulerNode" and type(node.node).__name__ != "MultiOutput":
                # a tuple's item
                name = str(getattr(node.node, "python_kernel_name", "") or "")
                kinds.append("gemm" if name.split(".")[-1] in ("mm", "addmm", "bmm", "baddbmm")
                             else "op")
        raise Fused
    torch._dynamo.reset()
    codegen, scheduler.Scheduler.codegen = scheduler.Scheduler.codegen, stop
    try:
        with inductor_config.patch(cpu_backend="triton", force_pointwise_cat=True):
            yield kinds
    except Exception as e:                      # Inductor wraps the exception that stops it
        if "Fused" not in repr(e):
            raise
    finally:
        scheduler.Scheduler.codegen = codegen
        torch._dynamo.reset()


class CountOnCpu(CudaGraphs):
    """The CUDA graph API where there is none, for counting alone: the engine captures as on a GPU
    (its first capture compiles the pass, and the count stops it there: nothing is recorded or
    replayed)."""

    def can_capture(self, device):
        return True

    def side_stream(self):
        return contextlib.nullcontext()


def captured_launches(model):
    """The launches of the first pass the slot engine captures when it starts (the smallest bucket,
    2 rows; head on; the greedy draw; the Triton attention, as on CUDA), counted from the compile
    that the capture itself makes, in the capture's own mode: what the replays run."""
    gpu = graph_api.GRAPHS.can_capture(model.lm_head.weight.device)
    saved, graph_api.GRAPHS = graph_api.GRAPHS, graph_api.GRAPHS if gpu else CountOnCpu()
    interpret = os.environ.get("TRITON_INTERPRET")
    if not gpu:
        # the attention kernel is scheduled here, never run
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        with inductor_launches() as kinds:
            Engine(model, 64, max_batch=1, max_rows=1, attn="triton", runner="slots", graphs=True,
                   fuse=True, sampling=("greedy",))
    finally:
        graph_api.GRAPHS = saved
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = interpret
    return kinds


# ----------------------------------------------------------------------------- the host's traffic

class HostTraffic(TorchFunctionMode):
    """Counts what the host does to the device while it is active, on any device: the device is the
    tensors it is given (an engine's buffers and weights) and every tensor computed from them or
    made with device=`device`. A host-to-device copy: a tensor of host data (more than a number)
    meeting a device tensor in one call (a write's value or index, copy_, an index), or sent by
    .to(device), torch.tensor(..., device=device); device-to-host copies into host tensors are
    counted apart. A sync: a device value read on the host (.item(), .tolist(), bool(), .cpu(),
    nonzero, ...). A launch: a call that computes on the device (writes a device tensor in place, or
    makes one that is not a view), counted only outside `passes()`, where the engine replays its
    graphs."""
    SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
             "nonzero", "equal", "allclose"}
    MADE = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "zeros_like",
            "ones_like", "full_like", "empty_like", "rand", "randn", "randint"}

    def __init__(self, tensors, device):
        super().__init__()
        self.device, self.keep = torch.device(device), list(tensors)
        self.ids = {id(t) for t in self.keep}
        self.h2d = self.d2h = self.syncs = self.launches = 0
        self.in_passes = False

    @contextlib.contextmanager
    def passes(self):
        self.in_passes = True
        try:
            yield
        finally:
            self.in_passes = False

    def on_device(self, t):
        return id(t) in self.ids

    def mark(self, out):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.ids:
                self.ids.add(id(t))
                self.keep.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_passes:
            out = func(*args, **kwargs)
            self.mark(out)
            return out
        name = getattr(func, "__name__", "")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if self.on_device(t)]
        host = [t for t in tensors if not self.on_device(t) and t.dim() > 0]
        target = kwargs.get("device", args[1] if name == "to" and len(args) > 1 else None)
        sent = target is not None and not isinstance(target, torch.dtype) and torch.device(target) == self.device
        if name in self.SYNCS and dev:
            self.syncs += 1
        into = args[0] if args and isinstance(args[0], torch.Tensor) and (name.endswith("_")
                                                                          or name == "__setitem__") \
            else None
        if dev and host:
            if into is not None and not self.on_device(into):
                self.d2h += 1
            else:
                self.h2d += 1
        elif sent and (name in ("tensor", "as_tensor") or (name == "to" and host)):
            self.h2d += 1
        out = func(*args, **kwargs)
        # computed: written in place, or a tensor made that shares no input's storage (not a view:
        # in inference mode a view does not know its base)
        storage = {t.untyped_storage().data_ptr() for t in tensors}
        made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_place = (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
        if dev and name not in self.SYNCS and (in_place and self.on_device(args[0]) or
                                                any(t.untyped_storage().data_ptr() not in storage
                                                    for t in made)):
            self.launches += 1
        if (dev and name not in self.SYNCS and not (into is not None and not self.on_device(into))) or \
                (sent and (name in self.MADE or name == "to")):
            self.mark(out)
        return out


def host_counts(model, work, max_batch, max_rows, scheduler="continuous", graphs=False):
    """The slot runner serving `work` (requests, all waiting at the start): per step the
    host-to-device copies, syncs (HostTraffic, and the log reads that wait for the device) and
    launches outside the graphs (and those of the first step, which admits a batch: every request
    waits at the start), the most of a steady decode step (every request admitted and past
    its prompt, none leaving); the passes launched against the passes in which a row ran; the share
    of passes whose log was read with no pass launched behind it (the device waits for the host:
    drained); and, in a second run of the same work not counted, the host's time a pass (a step's
    time less its passes')."""
    counted, steps, steady = drive_slots(model, work, max_batch, max_rows, scheduler, graphs,
                                         counted=True)
    timed = drive_slots(model, work, max_batch, max_rows, scheduler, graphs, counted=False)[0]
    launched = counted.stats["launched"]
    out = dict(steps=len(steps), passes_launched=launched, passes_with_rows=counted.stats["passes"],
               drained_share=round(counted.stats["drained"] / launched, 4),
               host_ms_per_pass=round(1e3 * timed.host_seconds / timed.stats["launched"], 3),
               launches_outside_graphs_per_step=round(sum(c[2] for c in steps) / len(steps), 2),
               launches_admitting=steps[0][2])
    if steady:
        out.update(steady_steps=len(steady), h2d_per_steady_step=max(c[0] for c in steady),
                   syncs_per_steady_step=max(c[1] for c in steady),
                   launches_per_steady_step=max(c[2] for c in steady))
    return out


def drive_slots(model, work, max_batch, max_rows, scheduler, graphs, counted):
    """host_counts's run: the engine (its .host_seconds: the steps' time less their passes'), and
    when counted, (h2d, syncs, launches) of every step and of the steady ones."""
    longest = max(len(r.prompt) + r.max_tokens for r in work)
    engine = Engine(model, max_batch * longest * model.config.n_loops, max_batch=max_batch,
                    max_rows=max_rows, scheduler=scheduler, runner="slots", graphs=graphs,
                    fuse=graphs, overlap=True, sampling=("greedy",))
    for r in work:
        engine.add(Request(list(r.prompt), r.max_tokens, r.mode, r.thr))
    runner, st = engine.runner, engine.runner.slots
    device_tensors = ([t for t in vars(st).values() if isinstance(t, torch.Tensor)] + st.k + st.v + st.log +
                      list(model.parameters()) + list(model.buffers()) + [runner.upload.dev])
    traffic = HostTraffic(device_tensors, engine.device) if counted else None
    in_passes, make = [0.0], runner._pass

    def timed(*key):           # the passes' time, and no counting inside them (what graphs replay)
        run = make(*key)

        def passes():
            t0 = time.perf_counter()
            with traffic.passes() if counted else contextlib.nullcontext():
                run()
            in_passes[0] += time.perf_counter() - t0
        return passes
    runner._pass = timed
    steps, steady, engine.host_seconds = [], [], 0.0
    now = lambda: (traffic.h2d, traffic.syncs + engine.stats["waits"], traffic.launches) if counted else (0, 0, 0)
    while engine.busy():
        sched = engine.scheduler
        before = list(sched.running)
        calm = not sched.waiting and before and all(s.done >= runner.host_end[s] for s in before)
        was, in_passes[0], t0 = now(), 0.0, time.perf_counter()
        with traffic if counted else contextlib.nullcontext():
            engine.step()
        engine.host_seconds += time.perf_counter() - t0 - in_passes[0]
        steps.append([b - a for a, b in zip(was, now())])
        if calm and list(sched.running) == before:
            steady.append(steps[-1])
    return engine, steps, steady


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=gpu reports them")

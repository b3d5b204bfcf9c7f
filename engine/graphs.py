"""
The pass compiled whole and captured as CUDA graphs: one graph per kind of pass (bucket of rows, keys
read, LM head or not, sampling), captured when the engine starts and replayed (engine/slots.py).

The CUDA API lives in one object, GRAPHS; on a CPU a test stands in for that object alone, so that the
engine's own construction and capture code runs as it would on a GPU.
"""
import contextlib

import torch

from engine.slot_pass import run_pass

_compiled = None


def compiled_pass():
    """run_pass compiled whole by torch.compile (Inductor), once per process: a layer's norms, RoPE,
    K/V page writes, SwiGLU and residuals fuse into a few kernels around its four GEMMs (the model's
    stacked projections) and the paged attention (kernels.flash_decode_table, an operator inside the
    graph), the last norm of a layer with the first of the next, the exit maths and the per-request
    counters into a few more (lab/bench.py --what=gpu counts them). The row count is dynamic from
    the start, so that a kind of pass (head, sampling) compiles once for every bucket; each bucket
    is then captured as a CUDA graph of its own."""
    global _compiled
    if _compiled is None:
        allow_recompiles()
        _compiled = torch.compile(run_pass, dynamic=True)
    return _compiled


def allow_recompiles(n=64):
    """Let one compiled function hold n graphs (kinds of pass: head or not, each sampling), not
    Dynamo's default 8, past which it would silently run the function uncompiled."""
    import torch._dynamo
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, n)


# ----------------------------------------------------------------------------- graphs of passes

class CudaGraphs:
    """The CUDA API that Graphs uses, all of it in one object: whether graphs can be captured on a
    device, the device current while they are, a side stream for the warm-up runs, and a graph that
    records what a callable launches and replays it. On a CPU a test stands in for this object alone
    (GRAPHS), so that the engine's own construction and capture code runs as it would on a GPU."""

    def can_capture(self, device):
        return torch.device(device).type == "cuda"

    def on(self, device):
        """The device current while the runner captures and steps (cuda:N's streams, events and
        graphs are made on the current device, not on the tensors')."""
        return torch.cuda.device(device) if torch.device(device).type == "cuda" else contextlib.nullcontext()

    @contextlib.contextmanager
    def side_stream(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, run, pool):
        """A CUDA graph of what run() launches, in the memory pool `pool` (None: a new one); returns
        the graph (.replay()) and its pool."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
        return graph, graph.pool()


GRAPHS = CudaGraphs()


def can_capture(device):
    """Whether passes on this device are captured as graphs (GRAPHS says)."""
    return GRAPHS.can_capture(device)


class Graphs:
    """One CUDA graph per kind of pass (bucket, keys read, head flag, sampling), captured on first
    use into one shared memory pool and replayed. A capture runs the pass a few times first
    (compilation, Triton's JIT, cuBLAS's workspaces) on a side stream, restoring the buffers
    (`buffers()`: all a pass changes but the page pool) after each run: the warm-up writes into the
    pool only the K/V that the replay writes again. Captures run in inference mode, the mode the
    engine replays in, so that the pass compiled is the one counted (Attention.qkv stacks its GEMMs
    only without autograd)."""

    def __init__(self, buffers):
        self.buffers, self.graphs, self.pool = buffers, {}, None

    def replay(self, key, run):
        if key not in self.graphs:
            self.graphs[key] = self.capture(run)
        self.graphs[key].replay()

    def capture_all(self, keys, make):
        """A graph for each key, captured now: make(*key) gives the function it records."""
        for key in keys:
            if key not in self.graphs:
                self.graphs[key] = self.capture(make(*key))

    @torch.inference_mode()
    def capture(self, run, warmup=2):
        saved = [b.clone() for b in self.buffers()]
        restore = lambda: [b.copy_(v) for b, v in zip(self.buffers(), saved)]
        with GRAPHS.side_stream():
            for _ in range(warmup):
                run()
                restore()
        graph, self.pool = GRAPHS.capture(run, self.pool)
        restore()
        return graph


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.bench --what=gpu captures the passes")

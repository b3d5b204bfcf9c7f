"""
An OpenAI-style HTTP API over the depth-batching engine: /v1/completions, /v1/chat/completions
(Ouro's ChatML), streaming, /v1/models and /health. Standard library only.

    python server.py --ckpt out/ --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "x=3 a=x ; a? ", "max_tokens": 8, "temperature": 0, "thr": 0.3}'

One engine thread steps the engine (serve_depthbatch.py); HTTP handler threads read a request,
hand it to the engine thread and relay its tokens as they are sampled. What a body may ask for and
what a response says is api.py (OpenAI's fields, and the engine's own: thr, mode, depth, top_k,
prefill_thr, prefill_schedule, prefix_full, exit_depths); every choice reports its exit
statistics. Nothing a client sends can stop the engine:
a request it cannot run fails alone, an unexpected error inside a step fails the requests of that
step and frees their pages, a client that goes away has its requests cancelled, and if the engine
thread ever stops, /health answers 503 and so does every new request.
"""
import errno
import http.server
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import urllib.parse

from api import BadRequest, Choices, Reply, parse_request, shown
from checkpoint import load_for_script
from configurator import MODEL_RUN, MODEL_RUN_RULES, UserError, parse, run_cli, set_threads
from kernels import IMPLS
from ragged import page_bytes, pool_pages
from engine.scheduler import SCHEDULERS
from engine.serving import Server
from engine.shared_head import HEADS
from engine.build import RUNNERS, engine_for
from tokenizer import has_chat, start_of_text

MAX_BODY = 16 << 20                       # bytes of one request body
MAX_HEAD = 32 << 10                       # bytes of one request's line and headers


# ----------------------------------------------------------------------------- HTTP

class Handler(http.server.BaseHTTPRequestHandler):
    """One HTTP connection's requests (a thread of the ThreadingHTTPServer). `app` is the Server it
    talks to (make_handler sets it; `server` is the socket server's own)."""
    app = None
    protocol_version = "HTTP/1.1"
    # seconds a request may stall while it arrives: a half-sent one is let go
    timeout = 15
    # seconds a whole request (its line, headers and body) may take to arrive
    deadline = 20
    write_timeout = 60                    # seconds a response may wait on a slow reader

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            # the client went away, or was let go
            self.close_connection = True

    def handle_one_request(self):
        """One request, which must have arrived whole within `deadline` seconds, however slowly it
        trickles (the per-read timeout alone lets a client hold its connection by sending a byte at
        a time): past it the connection is shut and its slot freed. The clock stops once the body is
        read."""
        self.clock = threading.Timer(self.deadline, self.let_go)
        self.clock.start()
        try:
            super().handle_one_request()
        finally:
            self.clock.cancel()

    def let_go(self):
        """The deadline passed: no more reading (a body read under way ends short and is answered 408;
        a request line or headers still to come are not answered)."""
        self.late = True
        try:
            self.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def parse_request(self):
        """The standard library's parsing, and: an HTTP/1.x request line only (a line without a
        version is not HTTP/0.9 here: it is answered 400 with a status line), headers of at most
        MAX_HEAD bytes."""
        if not super().parse_request():
            return False
        if getattr(self, "late", False):          # its headers were cut at the deadline: let it go
            self.close_connection = True
            return False
        if self.request_version == "HTTP/0.9":
            self.send_error(400, f"not an HTTP/1.x request line: {self.requestline[:80]!r}")
            return False
        if len(self.raw_requestline) + sum(len(k) + len(v) + 4 for k, v in self.headers.items()) > MAX_HEAD:
            self.send_error(431, f"the request's line and headers exceed {MAX_HEAD} bytes")
            return False
        return True

    def log_message(self, fmt, *args):  # quiet: one line per request on stderr only with --verbose
        if self.app.verbose:
            super().log_message(fmt, *args)

    def send_json(self, obj, status=200, headers=()):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own errors (an unknown method: 501, a malformed request line:
        400), as the API's JSON errors, not its HTML page."""
        self.close_connection = True
        # a status line, even for a line that was not HTTP at all
        self.request_version = "HTTP/1.1"
        try:
            self.send_error_json(BadRequest(message or http.HTTPStatus(code).phrase, status=code))
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass

    def send_error_json(self, e):
        self.send_json({"error": {"message": str(e), "type": "invalid_request_error",
                                  "param": e.param, "code": e.code}}, e.status,
                       [("Retry-After", str(e.retry_after))] if e.retry_after is not None else ())

    ALLOWED = "GET, HEAD, POST, OPTIONS"

    def get_routes(self):
        """GET's answers: (status, body) of /health and /v1/models (a query string routes as
        without)."""
        engine, path = self.app.engine, urllib.parse.urlsplit(self.path).path
        if path == "/health":
            status = (f"engine stopped: {self.app.dead}" if self.app.dead else "draining"
                      if self.app.draining else "ok")
            return 200 if status == "ok" else 503, {
                "status": status, "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting), "free_pages": len(engine.pool.free)}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.app.name, "object": "model",
                                                     "created": 0, "owned_by": "looped-lm"}]}
        return 404, {"error": {"message": f"no route GET {self.path}", "type": "invalid_request_error",
                               "param": None, "code": None}}

    def do_GET(self):
        self.clock.cancel()
        self.send_json(*reversed(self.get_routes()))

    def do_HEAD(self):
        """GET's status and headers, without the body (health checks that only look at the status)."""
        self.clock.cancel()
        status, body = self.get_routes()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(json.dumps(body).encode())))
        self.end_headers()

    def do_OPTIONS(self):
        """The methods each route allows (a browser's preflight asks before it POSTs JSON)."""
        self.clock.cancel()
        self.send_response(204)
        self.send_header("Allow", self.ALLOWED)
        self.send_header("Access-Control-Allow-Methods", self.ALLOWED)
        self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def read_body(self):
        """The JSON body, after checking its headers: a 4xx BadRequest for anything malformed. The
        body's length is its Content-Length, or it comes in chunks (Transfer-Encoding: chunked, what
        a client streaming its upload sends); one that stops short of it, or stalls, is a 408."""
        kind = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if kind != "application/json":
            raise BadRequest(f"Content-Type {shown(kind)}: send application/json", status=415)
        coding = (self.headers.get("Transfer-Encoding") or "").strip().lower()
        raw = self.headers.get("Content-Length")
        if coding and coding != "chunked":
            self.close_connection = True
            raise BadRequest(f"Transfer-Encoding {shown(coding)}: send the body whole (Content-Length) "
                             "or chunked", status=501)
        if not coding and (raw is None or not raw.strip().isdigit()):
            # the body's end is unknown: this connection cannot go on
            self.close_connection = True
            raise BadRequest("no Content-Length: give the body's length in bytes, or send it chunked "
                             "(Transfer-Encoding: chunked)" if raw is None else
                             f"Content-Length {shown(raw)}: give the body's length in bytes",
                             status=411 if raw is None else 400)
        if not coding and int(raw) > MAX_BODY:
            self.close_connection = True
            raise BadRequest(f"a body of {int(raw)} bytes; at most {MAX_BODY} are accepted", status=413)
        try:
            data = self.read_chunks() if coding else self.read_exactly(int(raw))
        except (TimeoutError, OSError):
            data = None
        if data is None:
            self.close_connection = True
            raise BadRequest(f"the body did not arrive whole within {self.timeout} s of silence or "
                             f"{self.deadline} s in all (its Content-Length, or its last chunk)",
                             status=408)
        try:
            return json.loads(data or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON: {e}")
        except RecursionError:
            raise BadRequest("malformed JSON: nested too deeply")
        except ValueError as e:                                  # an integer of thousands of digits
            raise BadRequest(f"malformed JSON: {e}")

    def read_exactly(self, n):
        """n bytes of the body, or None if the client stops sending before they are all there."""
        data = self.rfile.read(n)
        return data if len(data) == n else None

    def read_chunks(self):
        """A chunked body, whole (None: cut short); larger than MAX_BODY: a 413."""
        out = b""
        while True:
            size = self.rfile.readline(64).split(b";")[0].strip()
            if not size:
                return None
            try:
                n = int(size, 16)
            except ValueError:
                self.close_connection = True
                raise BadRequest(f"a chunk size {shown(size.decode('latin-1'))} is not hexadecimal")
            if len(out) + n > MAX_BODY:
                self.close_connection = True
                raise BadRequest(f"a body of more than {MAX_BODY} bytes; at most {MAX_BODY} are accepted",
                                 status=413)
            chunk = self.read_exactly(n + 2) if n else self.rfile.readline(64)
            if chunk is None or (n and chunk[-2:] != b"\r\n"):
                return None
            if not n:
                return out
            out += chunk[:-2]

    def do_POST(self):
        path = urllib.parse.urlsplit(self.path).path
        chat = path == "/v1/chat/completions"
        try:
            if path not in ("/v1/completions", "/v1/chat/completions"):
                raise BadRequest(f"no route POST {self.path}", status=404)
            if self.app.dead:
                raise BadRequest(f"the engine has stopped ({self.app.dead}); restart the server",
                                 status=503)
            body = self.read_body()
            self.clock.cancel()
            self.connection.settimeout(self.write_timeout)
            reqs, stream, stop, usage, echo, top, depths = parse_request(self.app, body, chat)
            events = queue.Queue()
            for r in reqs:
                r.on_token = lambda r, tok: events.put((r.tag, tok))
            self.app.submit(reqs)
        except BadRequest as e:
            self.send_error_json(e)
            return
        try:
            reply = Reply(self.app, reqs, Choices(self.app, reqs, stop, top), chat, stream, usage,
                          echo, depths)
            self.respond(reply, events)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            # the client went away: free its pages
            for r in reqs:
                r.cancelled = True
            with self.app.cv:
                self.app.cv.notify()
        finally:
            self.app.responded()

    def respond(self, reply, events):
        """Relay the tokens of the request's choices as the engine samples them: one JSON body at
        the end, or server-sent events as they come (ending with data: [DONE]; with usage, a last
        chunk before it carries the token counts, as OpenAI's stream_options.include_usage)."""
        reqs, choices = reply.reqs, reply.choices
        if reply.stream:
            self.start_stream(reply)
        while None in choices.finish:
            i, tok = events.get()
            choices.add(i, tok)
            r = reqs[i]
            if choices.finish[i] == "error" and not reply.stream:
                for o in reqs:
                    o.cancelled = True
                self.send_error_json(BadRequest(r.error, status=503 if self.app.dead else 400))
                return
            if reply.stream:
                new = choices.unsent(i)
                if new:
                    self.event(reply, i, new)
                if choices.finish[i] is not None:
                    self.event(reply, i, "", choices.finish[i], reply.ending(i))
            # the pool ran dry under it: its tokens so far are its answer
            if tok is None and r.note:
                print(f"{reply.head['id']} choice {i}: {r.note}", file=sys.stderr)
        if not reply.stream:
            self.send_json(reply.body())
            return
        if reply.usage:
            self.chunk(f"data: {json.dumps({**reply.head, 'choices': [], 'usage': reply.counts()})}\n\n".encode())
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")                     # the last chunk: the stream ended whole, not cut

    def start_stream(self, reply):
        """Server-sent events in chunked transfer encoding: a stream that ends without its last
        (empty) chunk was cut, which a client's HTTP library says (a stream delimited by closing the
        connection would end the same either way). A chat stream opens each choice with its role,
        an echoing completion with its prompt's text."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for i in range(len(reply.reqs)):
            if reply.chat:
                self.event(reply, i, "", extra={"delta": {"role": "assistant", "content": ""}})
            elif reply.echo:
                self.event(reply, i, reply.prompt_text(i))

    def event(self, reply, i, delta, reason=None, extra=None):
        self.chunk(f"data: {json.dumps(reply.chunk(i, delta, reason, extra))}\n\n".encode())

    def chunk(self, data):
        """One chunk of a chunked response (an empty one ends it)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class HTTPServer(http.server.ThreadingHTTPServer):
    """The standard library's threaded server, with a listen backlog for bursts of clients, a cap on
    the connections served at once and a smaller one on those of one address (so that one client,
    slow or idle, cannot take every slot): one past a cap is answered 503 at once and closed."""
    request_queue_size = 128
    daemon_threads = True
    max_connections = 256
    per_address = 192
    busy_body = json.dumps({"error": {"message": "too many connections; retry",
                                      "type": "server_error", "param": None,
                                      "code": None}}).encode()
    busy = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: "
            b"close\r\n" b"Content-Length: %d\r\n\r\n%s" % (len(busy_body), busy_body))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(self.max_connections)
        self.lock, self.by_address = threading.Lock(), {}

    def process_request(self, request, client_address):
        with self.lock:
            mine = self.by_address.get(client_address[0], 0)
            if mine < self.per_address:
                self.by_address[client_address[0]] = mine + 1
        if mine >= self.per_address or not self.slots.acquire(blocking=False):
            if mine < self.per_address:
                self.release(client_address)
            try:
                request.sendall(self.busy)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            self.release(client_address)

    def release(self, client_address):
        with self.lock:
            left = self.by_address[client_address[0]] - 1
            if left:
                self.by_address[client_address[0]] = left
            else:
                del self.by_address[client_address[0]]


def make_handler(server):
    return type("BoundHandler", (Handler,), {"app": server})


def serve(engine, host="127.0.0.1", port=8000, encode=None, decode=None, name="looped-lm",
          chat=False, eos=None, start=(0,)):
    """Start the engine thread and an HTTP server (not yet serving: call .serve_forever()). Returns
    (http server, Server)."""
    server = Server(engine, encode, decode, name, chat, eos, start)
    try:
        httpd = HTTPServer((host, port), make_handler(server))
    except socket.gaierror as e:
        raise UserError(f"--host={host}: not an address or a host name this machine knows "
                        f"({e.strerror or e})", "host")
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host={host}: not an address of this machine ({e.strerror})", "host")
        raise UserError(f"--port={port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                        "choose another --port (0: any free port)", "port")
    server.thread.start()
    return httpd, server


# ----------------------------------------------------------------------------- command line

DEFAULTS = dict(
    ckpt="out",            # checkpoint: a ckpt.pt file or folder, or an Ouro folder
    host="127.0.0.1",      # address to bind (loopback unless you say otherwise)
    port=8000,             # port to listen on (0: any free port)
    kv_pages=0,            # KV pages of the shared pool (0: from --kv_memory)
    kv_memory=0.0,         # KV pool in GiB (0 with --kv_pages 0: max_batch full contexts at depth U, at most 2 GiB)
    max_batch=32,          # most requests in flight at once
    max_rows=256,          # rows per pass that prefill chunks may fill next to the decode rows
    scheduler="continuous",  # how rows share passes: every pass (continuous), waves (nested), all loops at once (fixed)
    attn="auto",           # paged attention (kernels.py): auto = triton on CUDA when installed, else torch
    head="eager",          # LM-head calls: eager (every pass with an exit) or shared (rows wait to share one call)
    runner="auto",         # auto: graph-captured passes (engine/slots.py) on CUDA, the eager runner on a CPU
    **MODEL_RUN,           # device, threads, dtype, tiktoken_file (configurator.py)
    verbose=False,         # log every HTTP request
    drain_timeout=30.0,    # seconds a stopping server (SIGTERM, SIGINT) lets admitted requests finish; then they end
)
RULES = dict(port="in [0, 65535]", drain_timeout=">= 0", kv_pages=">= 0", kv_memory=">= 0",
             max_batch=">= 1", max_rows=">= 1",
             scheduler=SCHEDULERS, attn=IMPLS, head=HEADS, runner=RUNNERS, **MODEL_RUN_RULES)
# the keys that act only with another setting: refused without it (they would do nothing)
NEEDS = dict(kv_memory=("--kv_pages=0", lambda c: c["kv_pages"] == 0))


def start(argv):
    """The server of a command line, started and not yet serving: (http server, Server)."""
    c = parse(argv, DEFAULTS, RULES, __file__, needs=NEEDS)
    set_threads(c["threads"])
    model, meta, encode, decode, eos = load_for_script(c)
    cfg, size = model.config, page_bytes(model)
    pages = pool_pages(model, c["kv_pages"], c["kv_memory"], c["max_batch"])
    if pages < cfg.n_loops:
        raise UserError(f"--kv_pages={pages}: the pool must hold at least one token at every depth "
                        f"({cfg.n_loops} pages)")
    chat = encode is not None and has_chat(meta)
    started = time.perf_counter()           # a graph engine compiles and captures its passes here
    engine = engine_for(model, pages, c["max_batch"], c["max_rows"], c["scheduler"], c["attn"],
                        c["head"], c["runner"])
    ready = time.perf_counter() - started
    name = os.path.basename(os.path.normpath(c["ckpt"]))
    httpd, server = serve(engine, c["host"], c["port"], encode, decode, name, chat, eos,
                          start_of_text(meta))
    server.verbose, server.drain_seconds = c["verbose"], c["drain_timeout"]
    print(f"serving {name} (L={cfg.n_layer}, U={cfg.n_loops}) on "
          f"http://{c['host']}:{httpd.server_address[1]}/v1; KV pool {pages} pages x "
          f"{size / 1024:.1f} KiB = {pages * size / 2**30:.2f} GiB; scheduler {c['scheduler']}, "
          f"max_batch {c['max_batch']}{', chat template' if chat else ''}; engine "
          f"{type(engine).__name__} ready in {ready:.1f} s" + (f" ({len(engine.graphs.graphs)} "
                                                               "graphs captured)"
                                                              if getattr(engine, "graphs", None) else ""),
          file=sys.stderr)
    return httpd, server


def main(argv):
    """Serve until SIGTERM or SIGINT (what systemd, docker and Kubernetes send, and Ctrl-C), then
    stop gracefully (Server.drain) and exit 0."""
    httpd, server = start(argv)
    stop = threading.Event()
    why = []

    def on_signal(signum, frame):
        why.append(signal.Signals(signum).name)
        stop.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    threading.Thread(target=httpd.serve_forever, name="http", daemon=True).start()
    while not stop.wait(0.5):
        pass
    server.drain(server.drain_seconds, why[0])
    httpd.shutdown()
    server.stop()
    httpd.server_close()
    print("stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    run_cli(main)

"""
An OpenAI-style HTTP API over the depth-batching engine: /v1/completions, /v1/chat/completions
(Ouro's ChatML), streaming, /v1/models and /health. Standard library only.

    python server.py --ckpt out/ --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "x=3 a=x ; a? ", "max_tokens": 8, "temperature": 0, "thr": 0.3}'

One engine thread steps the engine (serve_depthbatch.py); HTTP handler threads parse a request,
hand it to the engine thread and relay its tokens as they are sampled. Beyond OpenAI's fields a
request may carry the engine's own: thr, mode, depth, top_k, prefill_thr, prefill_schedule,
prefix_full; every choice reports its exit statistics. Nothing a client sends can stop the engine:
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
from collections import deque

from checkpoint import load_for_script
from configurator import MODEL_RUN, MODEL_RUN_RULES, UserError, parse, run_cli, set_threads
from kernels import IMPLS
from model import exit_stats
from ragged import page_bytes, pool_pages
from engine.request import BadRequest, parse_request
from engine.scheduler import SCHEDULERS
from engine.shared_head import HEADS
from serve_depthbatch import RUNNERS, engine_for
from tokenizer import has_chat, start_of_text

MAX_BODY = 16 << 20                       # bytes of one request body
MAX_HEAD = 32 << 10                       # bytes of one request's line and headers


class Server:
    """The engine thread and what the HTTP threads share with it: an inbox of new requests."""

    def __init__(self, engine, encode=None, decode=None, name="looped-lm", chat=False, eos=None,
                 start=(0,)):
        self.engine, self.encode, self.decode, self.name, self.chat, self.eos = engine, encode, decode, name, chat, eos
        self.start = list(start)          # what an empty prompt means (tokenizer.start_of_text)
        self.inbox, self.cv, self.stopping = deque(), threading.Condition(), False
        self.dead = None                  # why the engine thread stopped, if it ever does
        # stopping: no new request, the running ones finish (drain)
        self.draining = False
        self.cut = None                   # why the requests still running at the drain's end fail
        # HTTP responses under way (the drain waits for their last bytes)
        self.responding = 0
        # how long a stopping server lets them run (--drain_timeout)
        self.drain_seconds = 30.0
        self.verbose = False
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)

    def submit(self, reqs):
        with self.cv:
            if self.dead:
                raise BadRequest(f"the engine has stopped ({self.dead}); restart the server",
                                 status=503)
            if self.draining:
                raise BadRequest("the server is stopping; retry in a moment (on another server)",
                                 status=503, retry_after=5)
            self.inbox.extend(reqs)
            self.responding += 1
            self.cv.notify()

    def loop(self):
        try:
            self.serve_engine()
        except BaseException as e:        # the engine thread must never stop silently
            with self.cv:
                self.dead = f"{type(e).__name__}: {e}"
            print(f"engine thread stopped: {self.dead}", file=sys.stderr)
            queues = self.engine.scheduler
            stranded = list(self.inbox) + [s.req for s in queues.running + list(queues.waiting)]
            for r in stranded:
                r.finish_reason, r.error = "error", f"the engine stopped: {self.dead}"
                if r.on_token is not None:
                    r.on_token(r, None)

    def serve_engine(self):
        """Take new requests, step the engine, repeat. A request the engine refuses fails alone; an
        error inside a step fails the requests of that step (their pages come back) and is
        logged."""
        while True:
            with self.cv:
                while not self.inbox and not self.engine.busy() and not self.stopping and not self.cut:
                    self.cv.wait()
                if self.stopping:
                    return
                new, self.inbox = list(self.inbox), deque()
            # the drain's end: every request left ends with an error it can read
            if self.cut:
                for r in new:
                    r.finish_reason, r.error = "error", self.cut
                    r.on_token(r, None)
                self.engine.fail_running(self.cut, queued=True)
                with self.cv:
                    self.cv.notify_all()
                    while not self.stopping:
                        self.cv.wait()
                return
            for r in new:
                try:
                    self.engine.add(r)
                except Exception as e:
                    why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
                    r.finish_reason, r.error = "error", why
                    r.on_token(r, None)
            try:
                self.engine.step()
            except Exception as e:
                print(f"engine error: {type(e).__name__}: {e}; the requests of this step fail",
                      file=sys.stderr)
                self.engine.fail_running(f"engine error: {type(e).__name__}")

    def stop(self):
        with self.cv:
            self.stopping = True
            self.cv.notify_all()

    def responded(self):
        """An HTTP response has sent its last bytes."""
        with self.cv:
            self.responding -= 1
            self.cv.notify_all()

    def drain(self, seconds, why):
        """A graceful stop, a line on stderr a stage: no new request (503, Retry-After; /health says
        draining), the admitted ones run for up to `seconds`, then those left end with an error
        their clients read (a last chunk with finish_reason "error", then data: [DONE]); it returns
        once every response has sent its last bytes (or a few seconds more have passed)."""
        with self.cv:
            self.draining = True
            queued = len(self.inbox) + len(self.engine.scheduler.waiting)
            print(f"stopping ({why}): no new requests; {len(self.engine.scheduler.running)} "
                  f"running and {queued} "
                  f"waiting may finish within {seconds:g} s", file=sys.stderr, flush=True)
            deadline = time.monotonic() + seconds
            while self.responding and not self.dead and time.monotonic() < deadline:
                self.cv.wait(deadline - time.monotonic())
            left = self.responding
            if left:
                self.cut = f"the server stopped ({why}) before this request finished"
                print(f"drain time over: {left} response(s) end with an error", file=sys.stderr,
                      flush=True)
                self.cv.notify_all()
            deadline = time.monotonic() + 5
            while self.responding and time.monotonic() < deadline:
                self.cv.wait(deadline - time.monotonic())
        print(f"drained: {left} request(s) cut, the rest finished", file=sys.stderr, flush=True)


def exit_summary(r, U):
    de = r.decode_exits
    return {"avg_decode_depth": sum(de) / len(de) if de else None,
            "avg_prefill_depth": sum(r.prompt_exits) / len(r.prompt_exits) if r.prompt_exits
            else None, **exit_stats(de, U), "mode": r.mode, "thr": None if r.mode == "fixed"
            else r.thr}


# ----------------------------------------------------------------------------- HTTP

class Choices:
    """The text of each choice of one HTTP request, cut at a stop string, as the tokens come."""

    def __init__(self, server, reqs, stop):
        self.server, self.reqs, self.stop = server, reqs, stop
        n = len(reqs)
        self.texts, self.sent, self.finish, self.n_tok = [""] * n, [0] * n, [None] * n, [0] * n

    def add(self, i, tok):
        """Take the engine's event for choice i (tok None: the request ended)."""
        r = self.reqs[i]
        if self.finish[i] is not None:
            return                                # tokens after a stop string
        if tok is None:
            self.finish[i] = r.finish_reason
            return
        self.n_tok[i] += 1
        if self.server.decode is not None and tok not in r.stop:
            text = self.server.decode(r.tokens[:self.n_tok[i]])
            cut = [text.find(s) for s in self.stop if s in text]
            if cut:                               # a stop string: the text ends before it
                text, self.finish[i], r.cancelled = text[:min(cut)], "stop", True
            self.texts[i] = text

    def unsent(self, i):
        """Text of choice i not streamed yet. While the choice runs, a tail that may be the start of
        a stop string is held back (the next tokens say whether it is: a stream never shows what the
        stop removes), and so is a tail that ends in half a character."""
        text, end = self.texts[i], len(self.texts[i])
        if self.finish[i] is None:
            end -= max([k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])],
                       default=0)
            if text[:end].endswith("\ufffd"):
                end = self.sent[i]
        new = text[self.sent[i]:max(end, self.sent[i])]
        self.sent[i] += len(new)
        return new


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
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def parse_request(self):
        """The standard library's parsing, and: an HTTP/1.x request line only (a line without a
        version is not HTTP/0.9 here: it is answered 400 with a status line), headers of at most
        MAX_HEAD bytes."""
        if not super().parse_request():
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

    def do_GET(self):
        self.clock.cancel()
        # a query string routes as without
        engine, path = self.app.engine, urllib.parse.urlsplit(self.path).path
        if path == "/health":
            status = f"engine stopped: {self.app.dead}" if self.app.dead else "draining" if self.app.draining else "ok"
            self.send_json({"status": status, "running": len(engine.scheduler.running),
                            "waiting": len(engine.scheduler.waiting),
                            "free_pages": len(engine.pool.free)},
                           200 if status == "ok" else 503)
        elif path == "/v1/models":
            self.send_json({"object": "list", "data": [{"id": self.app.name, "object": "model",
                                                        "created": 0, "owned_by": "looped-lm"}]})
        else:
            self.send_error_json(BadRequest(f"no route GET {self.path}", status=404))

    def read_body(self):
        """The JSON body, after checking its headers: a 4xx BadRequest for anything malformed."""
        kind = (self.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if kind != "application/json":
            raise BadRequest(f"Content-Type {kind!r}: send application/json", status=415)
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            # the body's end is unknown: this connection cannot go on
            self.close_connection = True
            raise BadRequest(f"Content-Length {raw!r}: give the body's length in bytes",
                             status=411 if raw is None else 400)
        if int(raw) > MAX_BODY:
            self.close_connection = True
            raise BadRequest(f"a body of {int(raw)} bytes; at most {MAX_BODY} are accepted",
                             status=413)
        try:
            return json.loads(self.rfile.read(int(raw)) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"malformed JSON: {e}")
        except RecursionError:
            raise BadRequest("malformed JSON: nested too deeply")
        except ValueError as e:                                  # an integer of thousands of digits
            raise BadRequest(f"malformed JSON: {e}")

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
            reqs, stream, stop, usage = parse_request(self.app, body, chat)
            events = queue.Queue()
            for r in reqs:
                r.on_token = lambda r, tok: events.put((r.tag, tok))
            self.app.submit(reqs)
        except BadRequest as e:
            self.send_error_json(e)
            return
        try:
            self.respond(reqs, events, stream, Choices(self.app, reqs, stop), chat, usage)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            # the client went away: free its pages
            for r in reqs:
                r.cancelled = True
            with self.app.cv:
                self.app.cv.notify()
        finally:
            self.app.responded()

    def respond(self, reqs, events, stream, choices, chat, usage=False):
        """Relay the tokens of the request's choices as the engine samples them: one JSON body at
        the end, or server-sent events as they come (ending with data: [DONE]; with usage, a last
        chunk before it carries the token counts, as OpenAI's stream_options.include_usage)."""
        U = self.app.engine.U
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].seed:x}{int(time.time() * 1e6) % 10**8:x}",
                "object": kind + (".chunk" if chat and stream else ""), "created": int(time.time()),
                "model": self.app.name}
        if stream:
            self.start_stream(head, len(reqs), chat)
        while None in choices.finish:
            i, tok = events.get()
            choices.add(i, tok)
            r = reqs[i]
            if choices.finish[i] == "error" and not stream:
                for o in reqs:
                    o.cancelled = True
                self.send_error_json(BadRequest(r.error, status=503 if self.app.dead else 400))
                return
            if stream:
                new = choices.unsent(i)
                if new:
                    self.event(head, i, new, chat)
                if choices.finish[i] is not None:
                    self.event(head, i, "", chat, choices.finish[i], {"error": r.error}
                               if r.error else
                               {"exit_stats": exit_summary(r, U),
                                **({"note": r.note} if r.note else {})})
            # the pool ran dry under it: its tokens so far are its answer
            if tok is None and r.note:
                print(f"{head['id']} choice {i}: {r.note}", file=sys.stderr)
        n_prompt, n_new = len(reqs[0].prompt), sum(choices.n_tok)
        counts = {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                  "total_tokens": n_prompt + n_new}
        if stream:
            if usage:
                self.chunk(f"data: {json.dumps({**head, 'choices': [], 'usage': counts})}\n\n".encode())
            self.chunk(b"data: [DONE]\n\n")
            self.chunk(b"")                     # the last chunk: the stream ended whole, not cut
            return
        out = []
        for i, r in enumerate(reqs):
            c = {"index": i, "finish_reason": choices.finish[i], "exit_stats": exit_summary(r, U),
                 "tokens": r.tokens[:choices.n_tok[i]], **({"note": r.note} if r.note else {})}
            text = choices.texts[i]
            c.update({"message": {"role": "assistant", "content": text}} if chat
                     else {"text": text, "logprobs": None})
            out.append(c)
        de = [e for r in reqs for e in r.decode_exits]
        self.send_json({**head, "choices": out, "usage": counts,
                        "exit_stats": {"avg_decode_depth": sum(de) / len(de) if de else None,
                                       **exit_stats(de, U)}})

    def start_stream(self, head, n, chat):
        """Server-sent events in chunked transfer encoding: a stream that ends without its last
        (empty) chunk was cut, which a client's HTTP library says (a stream delimited by closing the
        connection would end the same either way)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if chat:
            for i in range(n):
                self.event(head, i, "", chat, extra={"delta": {"role": "assistant", "content": ""}})

    def event(self, head, i, delta, chat, reason=None, extra=None):
        if chat:
            choice = {"index": i, "delta": {"content": delta} if delta else {},
                      "finish_reason": reason}
        else:
            choice = {"index": i, "text": delta, "logprobs": None, "finish_reason": reason}
        choice.update(extra or {})
        self.chunk(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())

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

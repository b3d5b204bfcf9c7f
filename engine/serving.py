"""
The engine thread of a server (server.py): the inbox the HTTP threads put requests into, the loop that
steps the engine, and a graceful drain. Nothing a client sends can stop it: a request the engine
refuses fails alone, an unexpected error inside a step fails the requests of that step and frees their
pages, and if the thread ever stops every request still in it ends with an error its client reads.
"""
import sys
import threading
import time
from collections import deque

from api import BadRequest
from configurator import UserError


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


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python server.py runs it")

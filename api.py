"""
The OpenAI-style API of server.py: what a /v1/completions or /v1/chat/completions body asks for (the
engine requests it makes, every field known or refused by name) and what its response says (each
choice's text cut at its stop strings, log-probabilities, exit depths and statistics).

Beside OpenAI's fields a body may carry the engine's own (thr, mode, depth, top_k, prefill_thr,
prefill_schedule, prefix_full, draft_k, draft_depth) and `exit_depths: true`, which returns the
depth each token was sampled at beside its log-probability. docs/serving.md lists what is accepted
and what is refused, and why.
"""
import json
import time

import torch

from configurator import UserError
from engine.request import SEED_MAX, Request
from model import exit_stats
from tokenizer import IM_END, chat_ids

ENGINE_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "thr", "mode", "depth",
                 "prefill_thr", "prefill_schedule", "prefix_full",
                 "draft_k", "draft_depth"}   # body fields that are Request fields
ACCEPTED = {"model", "user", "stream_options", "n", "stream", "stop", "seed", "prompt", "messages",
            "max_completion_tokens", "logprobs", "top_logprobs", "echo", "best_of", "suffix",
            "logit_bias", "exit_depths", "presence_penalty", "frequency_penalty"}
ROLES = ("system", "user", "assistant")   # chat roles of the ChatML template
MAX_N = 128                               # choices a body may ask for (OpenAI's limit)
MAX_LOGPROBS = 20                         # top log-probabilities a token may return (vLLM's default)
assert ENGINE_FIELDS <= set(Request.__dataclass_fields__)


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400, code=None, retry_after=None):
        super().__init__(message)
        self.param, self.status, self.code, self.retry_after = param, status, code, retry_after


def shown(value):
    """A value as JSON writes it (null, true, "text"): what a client sent, in its own terms."""
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]


def whole(v):
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- what a body asks

def prompts_of(server, body, chat):
    """The prompts' token ids (a list: a completions body may send several) and the stop ids."""
    eos = () if server.eos is None else (server.eos,)
    if chat:
        return [chat_prompt(server, body.get("messages"))], (IM_END,)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        batch = prompt                          # a batch: strings or token-id lists, one choice each
    else:
        batch = [prompt]
    return [one_prompt(server, p, i if len(batch) > 1 else None) for i, p in enumerate(batch)], eos


def one_prompt(server, prompt, index):
    """One prompt: a string, a list of token ids, or empty (the start of a text, as in sample.py)."""
    where = "'prompt'" if index is None else f"'prompt' item {index}"
    if prompt == "" or prompt == []:
        return list(server.start)
    if isinstance(prompt, str):
        if server.encode is None:
            raise BadRequest(f"{where}: this model has no tokenizer here: give token ids", "prompt")
        try:
            return server.encode(prompt)
        except UserError as e:
            raise BadRequest(f"{where}: {e}", "prompt")
    if isinstance(prompt, list):
        bad = next((i for i, t in enumerate(prompt) if not whole(t)), None)
        if bad is None:
            return list(prompt)
        raise BadRequest(f"{where}: token {bad} is {shown(prompt[bad])}, not a token id", "prompt")
    raise BadRequest(f"{where} must be a string, a list of token ids or a list of those (empty: "
                     f"the start of a text), not {shown(prompt)}", "prompt")


def chat_prompt(server, msgs):
    if not server.chat:
        raise BadRequest("this model has no chat template (Ouro's ChatML tokens); use "
                         "/v1/completions", "messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise BadRequest(f"'messages' item {i} has role {shown(m.get('role'))} and fields "
                             f"{shown(sorted(m))}; roles are {', '.join(ROLES)}, fields role, "
                             "content (and name)", "messages")
        turns.append((m["role"], message_text(m.get("content"))))
    return chat_ids(turns, server.encode)


def message_text(content):
    """A chat message's content: a string, or OpenAI's list of content parts of type text (joined)."""
    if isinstance(content, str):
        return content
    text_part = lambda p: (isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) and set(p) <= {"type", "text"})
    if isinstance(content, list) and content and all(text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest("'messages': a content must be a string or a list of {type: text, text} parts "
                     "(this model reads text only)", "messages")


def refused(body, chat):
    """The OpenAI fields this server does not serve, each refused by name, with why."""
    if body.get("suffix") is not None:
        raise BadRequest("'suffix': text insertion is not served (this model only continues)", "suffix")
    if body.get("logit_bias"):
        raise BadRequest("'logit_bias' is not served: the engine samples from the model's logits "
                         "alone (give an empty object, or leave it out)", "logit_bias")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadRequest(f"'{key}' is not served (0 or leave it out)", key)
    n, best_of = body.get("n", 1), body.get("best_of")
    if best_of is not None and best_of not in (1, n):
        raise BadRequest(f"'best_of' {shown(best_of)}: the server returns every choice it samples; "
                         "give 'n' instead (best_of may only equal n)", "best_of")
    if chat and body.get("echo") is not None:
        raise BadRequest("unknown field 'echo' (a completions field)", "echo")


def logprob_fields(body, chat):
    """How many top log-probabilities each token returns: None (none asked), 0 (the sampled token's
    alone) or more; completions: `logprobs` n, chat: `logprobs` true and `top_logprobs` n."""
    if chat:
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on not in (None, True, False):
            raise BadRequest(f"'logprobs' must be true or false, not {shown(on)}", "logprobs")
        if top is not None and not on:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        n = (top or 0) if on else None
        key = "top_logprobs"
    else:
        n, key = body.get("logprobs"), "logprobs"
    if n is not None and not (whole(n) and 0 <= n <= MAX_LOGPROBS):
        raise BadRequest(f"'{key}' must be an integer in 0..{MAX_LOGPROBS}, not {shown(n)}", key)
    return n


def parse_request(server, body, chat):
    """A /v1/completions or /v1/chat/completions body -> (requests, stream, stop strings, usage,
    echo, logprobs n, exit depths): a choice a request, prompt-major (choice p * n + j). Every field
    is known or refused by name; the engine's own fields are checked by the engine's check_request
    (one validation for the API, the CLIs and the engine)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key in body:
        if key not in ENGINE_FIELDS | ACCEPTED or key == ("prompt" if chat else "messages"):
            raise BadRequest(f"unknown field '{key}'", key)
    refused(body, chat)
    if body.get("model") not in (None, server.name):     # as the OpenAI API: a name it does not serve
        raise BadRequest(f"the model {shown(body['model'])} does not exist here; this server serves "
                         f"{shown(server.name)} (GET /v1/models)", "model", status=404,
                         code="model_not_found")
    prompts, stop_ids = prompts_of(server, body, chat)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    n, stream, seed = body.get("n", 1), body.get("stream", False), body.get("seed")
    if not (whole(n) and 1 <= n <= MAX_N):
        raise BadRequest(f"'n' must be an integer in 1..{MAX_N}, not {shown(n)}", "n")
    for key in ("stream", "echo", "exit_depths"):
        if body.get(key) not in (None, True, False):
            raise BadRequest(f"'{key}' must be true or false, not {shown(body[key])}", key)
    seed, usage = seed_of(seed, n * len(prompts)), usage_of(body.get("stream_options"), stream)
    top = logprob_fields(body, chat)
    f = engine_fields(body)
    reqs = [Request(ids, seed=seed + p * n + j, stop=stop_ids, tag=p * n + j,
                    keep_logits=top is not None, **f)
            for p, ids in enumerate(prompts) for j in range(n)]
    for r in reqs[::n]:
        try:
            server.engine.check_request(r)
        except UserError as e:
            if e.field == "keep_logits":
                raise BadRequest("'logprobs': this server's runner keeps no logits (start it with "
                                 "--runner=eager)", "logprobs")
            raise BadRequest(str(e), e.field)
    return reqs, bool(stream), stop, usage, bool(body.get("echo")), top, bool(body.get("exit_depths"))


def seed_of(seed, choices):
    """The body's seed, of the first choice (choice i draws with seed + i); none given: a random one."""
    if seed is None:
        return int(torch.randint(0, 2**31 - 1, ()))
    if not (whole(seed) and 0 <= seed <= SEED_MAX - (choices - 1)):
        raise BadRequest(f"'seed' must be an integer in [0, 2**64 - choices], not {shown(seed)}", "seed")
    return seed


def usage_of(options, stream):
    """OpenAI's stream_options: whether a last chunk carries the token counts."""
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise BadRequest("'stream_options' is {\"include_usage\": true|false}, with \"stream\": "
                         "true", "stream_options")
    return bool((options or {}).get("include_usage"))


def engine_fields(body):
    """The body's fields that are the engine's Request fields, as the engine names them."""
    f = {"temperature": 1.0, **{k: body[k] for k in ENGINE_FIELDS if body.get(k) is not None}}
    if body.get("max_completion_tokens") is not None:     # the chat API's newer name for max_tokens
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise BadRequest("'max_tokens' and 'max_completion_tokens' differ; give one",
                             "max_completion_tokens")
        f["max_tokens"] = body["max_completion_tokens"]
    mode = f.get("mode", Request.mode)
    if "depth" in f and mode != "fixed":
        raise BadRequest(f"'depth' sets the loops of mode fixed; mode {shown(mode)} decides its "
                         "depths (give 'thr')", "depth")
    if ("draft_k" in f or "draft_depth" in f) and mode != "speculative":
        raise BadRequest(f"'draft_k' and 'draft_depth' shape the drafts of mode speculative; mode "
                         f"{shown(mode)} drafts nothing", "draft_k" if "draft_k" in f else "draft_depth")
    if "thr" in f and mode == "fixed":
        raise BadRequest("'thr' is the exit threshold of the ragged modes; mode 'fixed' runs "
                         "'depth' loops", "thr")
    return f


# ----------------------------------------------------------------------------- what a response says

class Choices:
    """The text of each choice of one HTTP request, cut at a stop string, as the tokens come; with
    logprobs asked for, each token's log-probability (and the `top` most likely) at the exit depth it
    was sampled at, taken from its logits as it arrives (which are then let go)."""

    def __init__(self, server, reqs, stop, top=None):
        self.server, self.reqs, self.stop, self.top = server, reqs, stop, top
        n = len(reqs)
        self.texts, self.sent, self.finish, self.n_tok = [""] * n, [0] * n, [None] * n, [0] * n
        self.logprobs = [[] for _ in range(n)]

    def add(self, i, tok):
        """Take the engine's event for choice i (tok None: the request ended)."""
        r = self.reqs[i]
        if self.finish[i] is not None:
            return                                # tokens after a stop string
        if tok is None:
            self.finish[i] = r.finish_reason
            return
        self.n_tok[i] += 1
        if self.top is not None:
            # this token's logits (the engine thread may have appended later ones since), then let go
            k = self.n_tok[i] - 1
            lp, r.logits[k] = torch.log_softmax(r.logits[k].double(), -1), None
            best = torch.topk(lp, self.top) if self.top else None
            self.logprobs[i].append((float(lp[tok]), [] if best is None else
                                     list(zip(best.indices.tolist(), best.values.tolist()))))
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

    def token_text(self, tok):
        return self.server.decode([tok]) if self.server.decode is not None else str(tok)

    def logprobs_of(self, i, chat, first=0):
        """Choice i's log-probabilities from its token `first` on, in the shape of the API asked:
        chat: {content: [{token, logprob, bytes, top_logprobs}]}; completions: {tokens,
        token_logprobs, top_logprobs, text_offset}. None where none were asked for."""
        if self.top is None:
            return None
        toks, lps = self.reqs[i].tokens[first:self.n_tok[i]], self.logprobs[i][first:self.n_tok[i]]
        text = lambda t: self.token_text(t)
        if chat:
            entry = lambda t, lp: {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
            return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in top])
                                for t, (lp, top) in zip(toks, lps)]}
        offsets, at = [], len(self.server.decode(self.reqs[i].tokens[:first])) if (
            self.server.decode is not None) else first
        for t in toks:
            offsets.append(at)
            at += len(text(t))
        return {"tokens": [text(t) for t in toks], "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{text(a): b for a, b in top} for _, top in lps] if self.top else None,
                "text_offset": offsets}


class Reply:
    """What one HTTP request gets back: its head (id, object, created, model), each choice's body or
    stream chunk (text, or a chat message; log-probabilities, exit depths and statistics where
    asked), and the token counts. echo: a completion's text starts with its prompt's."""

    def __init__(self, server, reqs, choices, chat, stream, usage=False, echo=False, depths=False):
        self.server, self.reqs, self.choices, self.chat, self.stream = server, reqs, choices, chat, stream
        self.usage, self.echo, self.depths, self.U = usage, echo, depths, server.engine.U
        self.sent_lp = [0] * len(reqs)
        kind = "chat.completion" if chat else "text_completion"
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].seed:x}"
                           f"{int(time.time() * 1e6) % 10**8:x}",
                     "object": kind + (".chunk" if chat and stream else ""),
                     "created": int(time.time()), "model": server.name}

    def prompt_text(self, i):
        decode = self.server.decode
        return decode(self.reqs[i].prompt) if self.echo and decode is not None else ""

    def counts(self):
        prompts = {id(r.prompt): len(r.prompt) for r in self.reqs}    # a prompt once, whatever its n
        n_prompt, n_new = sum(prompts.values()), sum(self.choices.n_tok)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new}

    def extras(self, i):
        """A choice's extension fields: the depth each token was sampled at (exit_depths: true)."""
        r = self.reqs[i]
        return {"exit_depths": r.token_exits[:self.choices.n_tok[i]]} if self.depths else {}

    def ending(self, i):
        """The last chunk of choice i in a stream: its exit statistics (and depths), or its error."""
        r = self.reqs[i]
        if r.error:
            return {"error": r.error}
        return {"exit_stats": exit_summary(r, self.U), **self.extras(i),
                **({"note": r.note} if r.note else {})}

    def chunk(self, i, delta, reason=None, extra=None):
        """One server-sent event of choice i: its new text and the log-probabilities of the tokens
        that came since the last one."""
        c, lp = self.choices, None
        if c.top is not None and c.n_tok[i] > self.sent_lp[i]:
            lp, self.sent_lp[i] = c.logprobs_of(i, self.chat, self.sent_lp[i]), c.n_tok[i]
        choice = ({"index": i, "delta": {"content": delta} if delta else {}, "logprobs": lp,
                   "finish_reason": reason} if self.chat else
                  {"index": i, "text": delta, "logprobs": lp, "finish_reason": reason})
        return {**self.head, "choices": [dict(choice, **(extra or {}))]}

    def body(self):
        """The whole response of a request that does not stream."""
        out = []
        for i, r in enumerate(self.reqs):
            text, lp = self.choices.texts[i], self.choices.logprobs_of(i, self.chat)
            c = {"index": i, "finish_reason": self.choices.finish[i], "exit_stats": exit_summary(r, self.U),
                 "tokens": r.tokens[:self.choices.n_tok[i]], **self.extras(i),
                 **({"note": r.note} if r.note else {})}
            c.update({"message": {"role": "assistant", "content": text}, "logprobs": lp} if self.chat
                     else {"text": self.prompt_text(i) + text, "logprobs": lp})
            out.append(c)
        de = [e for r in self.reqs for e in r.decode_exits]
        return {**self.head, "choices": out, "usage": self.counts(),
                "exit_stats": {"avg_decode_depth": sum(de) / len(de) if de else None,
                               **exit_stats(de, self.U)}}


def exit_summary(r, U):
    """A choice's exit statistics: average decode and prefill depths, exit fractions, jump rates."""
    de = r.decode_exits
    return {"avg_decode_depth": sum(de) / len(de) if de else None,
            "avg_prefill_depth": sum(r.prompt_exits) / len(r.prompt_exits) if r.prompt_exits
            else None, **exit_stats(de, U), "mode": r.mode, "thr": None if r.mode == "fixed"
            else r.thr}


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python server.py serves it")

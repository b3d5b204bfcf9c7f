"""The OpenAI-style HTTP API (server.py) on a loopback port: completions equal the engine's, streaming,
batching of concurrent clients, the official client, bad requests, disconnects, chat on an Ouro folder
(the server fixtures are in conftest.py; tests/test_server_robust.py: what a client sends never
breaks it)."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import CFG, alone, make_tokenizer, ouro_tensors, post, write_folder
from engine.request import Request
from serve_depthbatch import Engine
from server import serve
from tokenizer import load_tokenizer


def test_http_completion_equals_the_engine_and_streams_the_same(http_server):
    url, engine, encode, decode = http_server
    body = {"prompt": "the red cat", "max_tokens": 12, "temperature": 0, "thr": 0.4, "mode": "ete_ragged"}
    status, text = post(url + "/v1/completions", body)
    assert status == 200
    out = json.loads(text)
    direct = alone(engine.model, Request(encode("the red cat"), 12, "ete_ragged", 0.4))
    choice = out["choices"][0]
    assert choice["tokens"] == direct.tokens and choice["text"] == decode(direct.tokens)
    assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 12, "total_tokens": 23}
    assert choice["exit_stats"]["avg_decode_depth"] == sum(direct.decode_exits) / len(direct.decode_exits)
    assert abs(sum(out["exit_stats"]["exit_fractions"]) - 1) < 1e-9
    status, text = post(url + "/v1/completions", dict(body, stream=True))
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == choice["text"] and chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["exit_stats"]["avg_decode_depth"] == choice["exit_stats"]["avg_decode_depth"]
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read())["free_pages"] == 2000
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "tiny"


def test_http_speculative_answers_fixed_at_full_depth(http_server):
    """mode speculative through the API: fixed@U's tokens, drafted by the body's draft_k and
    draft_depth; a draft depth the model cannot run is a 400 naming it."""
    url, engine, encode, _ = http_server
    body = {"prompt": "copy abc : ", "max_tokens": 14, "temperature": 0, "mode": "speculative",
            "draft_k": 3, "draft_depth": 1}
    status, text = post(url + "/v1/completions", body)
    assert status == 200, text
    fixed = alone(engine.model, Request(encode("copy abc : "), 14, "fixed"))
    assert json.loads(text)["choices"][0]["tokens"] == fixed.tokens
    status, text = post(url + "/v1/completions", dict(body, draft_depth=engine.U))
    assert status == 400 and json.loads(text)["error"]["param"] == "draft_depth", text


def test_http_concurrent_requests_are_batched(http_server):
    url, engine, encode, _ = http_server
    engine.stats["max_in_flight"] = 0
    bodies = [{"prompt": "copy abc : ", "max_tokens": 20 + i, "temperature": 0, "thr": 0.2 + 0.1 * i} for i in range(6)]
    results = [None] * 6

    def go(i):
        results[i] = post(url + "/v1/completions", bodies[i])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == 200 for s, _ in results) and engine.stats["max_in_flight"] >= 2
    for (_, text), b in zip(results, bodies):
        direct = alone(engine.model, Request(encode(b["prompt"]), b["max_tokens"], "dense_ragged", b["thr"]))
        assert json.loads(text)["choices"][0]["tokens"] == direct.tokens


def test_openai_client_completions_streaming_stop_and_seeds(http_server):
    from openai import BadRequestError, OpenAI
    url, engine, _, _ = http_server
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.completions.create(model="tiny", prompt="the big dog", max_tokens=10, temperature=0,
                                  extra_body={"thr": 0.3})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt="the big dog", max_tokens=10, temperature=0, stream=True, extra_body={"thr": 0.3}))
    assert streamed == r.choices[0].text
    full = r.choices[0].text
    stop = next((ch for ch in full[1:] if ch.strip()), None)
    if stop is not None:                              # a stop string cuts the text before it
        cut = client.completions.create(model="tiny", prompt="the big dog", max_tokens=10, temperature=0, stop=[stop],
                                        extra_body={"thr": 0.3})
        assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    a = client.completions.create(model="tiny", prompt="sum 1+2=", max_tokens=8, n=3, seed=7, temperature=1.0)
    b = client.completions.create(model="tiny", prompt="sum 1+2=", max_tokens=8, n=3, seed=7, temperature=1.0)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    with pytest.raises(BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"thr": 1.5})


@pytest.mark.parametrize("body,param", [
    (b"{not json", None), ({"prompt": 5}, "prompt"), ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"), ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "mode": "warp"}, "mode"), ({"prompt": "a", "thr": 1.5}, "thr"),
    ({"prompt": "a", "thr": -1}, "thr"),
    ({"prompt": "a" * 80}, "prompt"), ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "ABC"}, "prompt"), ({"prompt": [999]}, "prompt"), ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "x"}, "suffix"), ({"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "a", "logprobs": 99}, "logprobs"), ({"prompt": [[1, 2], [3, None]]}, "prompt"),
    ({"prompt": "a", "n": 129}, "n"), ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"), ([1, 2], None),
    ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "depth": 9}, "depth"),
])
def test_http_bad_requests_are_400_and_the_server_keeps_serving(http_server, body, param):
    url = http_server[0]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, text = post(url + path, body, raw=isinstance(body, bytes))
    err = json.loads(text)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    assert "None" not in err["message"], err["message"]          # a client reads JSON's null, not Python's
    status, _ = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200


def test_http_logprobs_exit_depths_batches_and_echo_as_openai_and_vllm_take_them(http_server):
    """logprobs 0: each sampled token's log-probability, the log-softmax of the logits it was sampled
    from at its exit depth (the engine's own, kept); logprobs k: the k most likely beside it; chat:
    logprobs true and top_logprobs k; exit_depths: true returns each token's depth; a prompt given as
    a list of token-id lists is one choice each, in order, as each alone; echo starts the text with
    the prompt; n up to 128."""
    url, engine, encode, decode = http_server
    ids = encode("the red cat")
    direct = alone(engine.model, Request(list(ids), 6, "ete_ragged", 0.4, keep_logits=True))
    want = [float(torch.log_softmax(lg.double(), -1)[t]) for lg, t in zip(direct.logits, direct.tokens)]
    for k in (0, 3):
        status, text = post(url + "/v1/completions", {"prompt": "the red cat", "max_tokens": 6, "temperature": 0,
                                                      "thr": 0.4, "mode": "ete_ragged", "logprobs": k,
                                                      "exit_depths": True, "echo": True})
        c = json.loads(text)["choices"][0]
        assert status == 200 and c["tokens"] == direct.tokens and c["text"] == "the red cat" + decode(direct.tokens)
        assert all(abs(a - b) < 1e-5 for a, b in zip(c["logprobs"]["token_logprobs"], want))
        assert c["exit_depths"] == direct.token_exits
        top = c["logprobs"]["top_logprobs"]
        assert (top is None) if k == 0 else all(len(t) == k and max(t.values()) >= lp - 1e-6
                                                for t, lp in zip(top, want))
    status, text = post(url + "/v1/completions", {"prompt": [ids, encode("a dog"), ids], "max_tokens": 4,
                                                  "temperature": 0, "thr": 0.4, "n": 2})
    out = json.loads(text)
    firsts = [alone(engine.model, Request(list(p), 4, thr=0.4)).tokens for p in (ids, encode("a dog"), ids)]
    assert status == 200 and [c["tokens"] for c in out["choices"]] == [t for t in firsts for _ in range(2)]
    assert out["usage"]["prompt_tokens"] == 2 * len(ids) + len(encode("a dog"))
    status, text = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 128, "user": "u-1",
                                                  "best_of": 128, "logit_bias": {}, "suffix": None})
    assert status == 200 and len(json.loads(text)["choices"]) == 128     # what OpenAI's clients send along


def test_http_as_clients_send_it_chunked_bodies_short_bodies_options_and_head(http_server, monkeypatch):
    """A body sent chunked is read; one shorter than its Content-Length, or that stalls, is answered
    408 with its reason; OPTIONS names the methods; HEAD answers a GET route's status and headers."""
    import server as srv
    url, *_ = http_server
    host, port = url[7:].split(":")
    monkeypatch.setattr(srv.Handler, "timeout", 1)

    def raw(data, stall=False):
        """Send data (then, unless it stalls, nothing more), read the answer until the server closes."""
        sock = socket.create_connection((host, int(port)), timeout=30)
        sock.sendall(data)
        if not stall:
            sock.shutdown(socket.SHUT_WR)
        got = b""
        while part := sock.recv(65536):
            got += part
        sock.close()
        return got.decode()
    body = json.dumps({"prompt": "the", "max_tokens": 3, "temperature": 0}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:7], body[7:])) + b"0\r\n\r\n"
    got = raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert got.startswith("HTTP/1.1 200") and '"finish_reason": "length"' in got
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    for short in (raw(head + body[:10]), raw(head + body[:10], stall=True)):   # cut short, or stalled
        assert short.startswith("HTTP/1.1 408") and "did not arrive whole" in short
    got = raw(b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith("HTTP/1.1 204") and "Allow: GET, HEAD, POST, OPTIONS" in got
    got = raw(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert got.startswith("HTTP/1.1 200") and "Content-Length:" in got and not got.split("\r\n\r\n", 1)[1]
    status, text = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200


def test_http_client_disconnect_cancels_and_frees_pages(http_server, monkeypatch):
    url, engine, _, _ = http_server
    host, port = url[7:].split(":")
    added, add = [], engine.add
    monkeypatch.setattr(engine, "add", lambda r: added.append(r) or add(r))
    body = json.dumps({"prompt": "the", "max_tokens": 50, "stream": True, "temperature": 0}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while b"data: " not in got:                    # the headers, then the first tokens
        got += sock.recv(4096)
    sock.close()                                   # and the client goes away mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        with urllib.request.urlopen(url + "/health") as r:
            h = json.loads(r.read())
        if h["running"] == 0 and h["waiting"] == 0 and h["free_pages"] == engine.pool.n_pages:
            break
        time.sleep(0.05)
    assert h["free_pages"] == engine.pool.n_pages and h["running"] == 0
    cancelled = [r for r in added if r.finish_reason == "cancelled"]
    assert cancelled and len(cancelled[-1].tokens) < 50


def test_http_chat_completions_on_an_ouro_folder(tmp_path):
    from openai import OpenAI
    from checkpoint import load_checkpoint
    folder = write_folder(str(tmp_path / "ouro"), CFG, ouro_tensors(CFG, seed=2))
    make_tokenizer(str(tmp_path / "ouro" / "tokenizer.json"))
    model, ckpt = load_checkpoint(folder)
    encode, decode = load_tokenizer(ckpt["meta"])
    httpd, server = serve(Engine(model, 1000), "127.0.0.1", 0, encode, decode, "ouro", chat=True, eos=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="none", max_retries=0)
        r = client.chat.completions.create(model="ouro", messages=[{"role": "user", "content": "the cat"}],
                                           max_tokens=6, temperature=0)
        ids = [1] + encode("user\nthe cat") + [2] + encode("\n") + [1] + encode("assistant\n")
        direct = alone(model, Request(ids, 6, "dense_ragged", 0.5, stop=(2,)))
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(ids)
        assert r.choices[0].message.content == decode([t for t in direct.tokens if t != 2])
        parts = list(client.chat.completions.create(model="ouro", messages=[{"role": "user", "content": "the cat"}],
                                                    max_tokens=6, temperature=0, stream=True))
        assert "".join(p.choices[0].delta.content or "" for p in parts) == r.choices[0].message.content
        # OpenAI's newer shapes: content as a list of text parts, max_completion_tokens; usage in a stream
        same = client.chat.completions.create(model="ouro", max_completion_tokens=6, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "the "}, {"type": "text", "text": "cat"}]}])
        assert same.choices[0].message.content == r.choices[0].message.content
        parts = list(client.chat.completions.create(model="ouro", messages=[{"role": "user", "content": "the cat"}],
                                                    max_tokens=6, temperature=0, stream=True,
                                                    stream_options={"include_usage": True}))
        assert parts[-1].choices == [] and parts[-1].usage.total_tokens == r.usage.total_tokens
        url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"
        for bad in [{"role": "robot", "content": "hi"}, {"role": "user", "content": [{"type": "image_url"}]},
                    {"role": "user", "content": "hi", "extra": 1}, {"role": "user"}]:
            status, text = post(url, {"messages": [bad], "max_tokens": 2})
            assert status == 400 and json.loads(text)["error"]["param"] == "messages", (bad, text)
    finally:
        httpd.shutdown()
        server.stop()
        httpd.server_close()

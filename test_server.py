"""The OpenAI-style HTTP API (server.py) on a loopback port: completions equal the engine's, streaming,
batching of concurrent clients, the official client, bad requests, disconnects, chat on an Ouro folder."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from conftest import CFG, alone, make_tokenizer, ouro_tensors, write_folder
from prepare_data import SYNTH_CHARS
from serve_depthbatch import Engine, Request
from server import serve
from tokenizer import char_meta, load_tokenizer


@pytest.fixture(scope="module")
def http_server():
    """A char-level random model served on a free loopback port, with the engine thread running."""
    from model import GPTConfig, LoopedLM
    torch.manual_seed(0)
    meta = char_meta(SYNTH_CHARS)
    model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=64, n_layer=2, n_head=4, n_embd=32,
                               ffn_hidden=48)).eval()
    with torch.no_grad():
        model.early_exit_gate.weight.normal_(0, 2.0)
    encode, decode = load_tokenizer(meta)
    engine = Engine(model, 2000, max_batch=8)
    httpd, server = serve(engine, "127.0.0.1", 0, encode, decode, "tiny")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", engine, encode, decode
    httpd.shutdown()
    server.stop()
    httpd.server_close()


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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
    ({"prompt": "a", "mode": "warp"}, "mode"), ({"prompt": "a", "thr": 1.5}, "thr"), ({"prompt": "a", "thr": -1}, "thr"),
    ({"prompt": "a" * 80}, "prompt"), ({"prompt": "a", "n": 0}, "n"), ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "ABC"}, "prompt"), ({"prompt": [999]}, "prompt"), ({"prompt": "a", "echo": True}, "echo"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"), ([1, 2], None),
    ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "depth": 9}, "depth"),
])
def test_http_bad_requests_are_400_and_the_server_keeps_serving(http_server, body, param):
    url = http_server[0]
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    status, text = post(url + path, body, raw=isinstance(body, bytes))
    err = json.loads(text)["error"]
    assert status == 400 and err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
    status, _ = post(url + "/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200


def test_http_client_disconnect_cancels_and_frees_pages(http_server):
    url, engine, _, _ = http_server
    host, port = url[7:].split(":")
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
    cancelled = [r for r in engine.finished if r.finish_reason == "cancelled"]
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
    finally:
        httpd.shutdown()
        server.stop()
        httpd.server_close()

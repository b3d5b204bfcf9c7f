"""Ouro Hugging Face folders: strict import checked against an independent plain-torch Ouro forward
(written here from the facts in DESIGN.md, float64), the ragged modes on a loaded model, export and
the round trip, and clear errors. Tiny random folders are built in the test: no download."""
import json
import math
import os
import sys

import pytest
import torch

import sample
import tokenizer
from checkpoint import export_ouro, load_checkpoint
from configurator import UserError
from conftest import CFG, make_tokenizer, ouro_tensors, write_folder
from model import GPTConfig, LoopedLM, forward_ragged
from engine.request import Request
from serve_depthbatch import Engine

def reference_ouro(t, cfg, ids):
    """Ouro's forward from DESIGN.md, plain torch, float64: four RMSNorms per layer (sandwich),
    SwiGLU, NeoX RoPE, per-loop final norm feeding the next loop and the heads, gate with bias.
    Returns logits and gate logits per loop."""
    t = {k: v.double() for k, v in t.items()}
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps = H // nh, cfg["rms_norm_eps"]
    T = len(ids)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # x: (heads, T, hd)
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = t["model.embed_tokens.weight"][ids]
    logits, gates = [], []
    causal = torch.ones(T, T).tril().bool()
    for _ in range(cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = rms(h, t[p + "input_layernorm.weight"])
            q = rope((x @ t[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1))
            k = rope((x @ t[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1))
            v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
            k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
            att = (q @ k.transpose(1, 2)) / math.sqrt(hd)
            att = att.masked_fill(~causal, float("-inf")).softmax(-1)
            o = (att @ v).transpose(0, 1).reshape(T, H) @ t[p + "self_attn.o_proj.weight"].T
            h = h + rms(o, t[p + "input_layernorm_2.weight"])
            x = rms(h, t[p + "post_attention_layernorm.weight"])
            m = (torch.nn.functional.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (x @ t[p + "mlp.up_proj.weight"].T))
            h = h + rms(m @ t[p + "mlp.down_proj.weight"].T, t[p + "post_attention_layernorm_2.weight"])
        h = rms(h, t["model.norm.weight"])                  # per-loop norm: feeds the heads and the next loop
        logits.append(h @ t["lm_head.weight"].T)
        gates.append((h @ t["model.early_exit_gate.weight"].T + t["model.early_exit_gate.bias"])[:, 0])
    return logits, gates


@pytest.mark.parametrize("shards,kv_heads", [(1, 4), (3, 2)])
def test_loaded_ouro_matches_independent_reference(tmp_path, shards, kv_heads):
    cfg = dict(CFG, num_key_value_heads=kv_heads)
    t = ouro_tensors(cfg, seed=int(torch.randint(0, 10_000, ())))
    assert len(t) == 11 * cfg["num_hidden_layers"] + 5   # 269 for Ouro-1.4B's 24 layers
    folder = write_folder(str(tmp_path / "ouro"), cfg, t, shards)
    model, ckpt = load_checkpoint(folder, dtype=torch.float64)
    assert model.config.loop_norm and model.config.n_kv_head == kv_heads
    ids = torch.randint(0, 50, (20,))
    ref_logits, ref_gates = reference_ouro(t, cfg, ids)
    out = model(ids[None], keep_logits=True)
    for d in range(4):
        assert torch.allclose(out["logits"][d][0], ref_logits[d], atol=1e-9, rtol=0)
        assert torch.allclose(out["gate_logits"][0, :, d], ref_gates[d], atol=1e-9, rtol=0)


def test_bf16_is_kept_and_ragged_modes_run(tmp_path):
    t = ouro_tensors(CFG, seed=3, dtype=torch.bfloat16)
    folder = write_folder(str(tmp_path / "ouro"), CFG, t)
    model, _ = load_checkpoint(folder)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    model64, _ = load_checkpoint(folder, dtype=torch.float64)
    ids = torch.randint(0, 50, (14,)).tolist()
    for mode in ("dense_ragged", "ete_ragged"):
        r = Engine(model64, 500).run([Request(ids, 12, mode, 0.5)])[0]
        assert r.kv["physical"] == r.kv["block_evals"] == sum(r.exits)
        full = ids + r.tokens[:-1]
        taus = torch.full((1, len(full)), 0.5, dtype=torch.float64)
        if mode == "dense_ragged":
            taus[0, :len(ids)] = float("inf")
        o = forward_ragged(model64, torch.tensor([full]), taus=taus)
        assert o["exits"][0].tolist() == r.exits
    r = Engine(model, 500).run([Request(ids, 6, "ete_ragged", 0.5)])[0]   # and in bf16 as stored
    assert len(r.tokens) == 6 and r.finish_reason == "length"


def test_strict_loading_errors(tmp_path, monkeypatch):
    t = ouro_tensors(CFG, seed=1)
    cases = {
        "missing": {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"},
        "extra": dict(t, **{"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}),
        "shape": dict(t, **{"model.norm.weight": torch.ones(31)}),
    }
    for name, tensors in cases.items():
        folder = write_folder(str(tmp_path / name), CFG, tensors)
        with pytest.raises(UserError, match={"missing": "missing", "extra": "unexpected", "shape": "shape"}[name]):
            load_checkpoint(folder)
    bad_cfg = {k: v for k, v in CFG.items() if k != "hidden_size"}
    folder = write_folder(str(tmp_path / "cfg"), bad_cfg, t)
    with pytest.raises(UserError, match="hidden_size"):
        load_checkpoint(folder)
    folder = write_folder(str(tmp_path / "ok"), CFG, t)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(UserError, match="pip install safetensors"):
        load_checkpoint(folder)


def test_export_import_round_trip_and_refusal(tmp_path):
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = LoopedLM(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                               ffn_hidden=40, loop_norm=True)).eval()
    folder = export_ouro(model, str(tmp_path / "exp"), {"tokenizer": "char", "vocab_size": 40,    # the model's dtype:
                                                         "chars": "".join(chr(97 + i % 26) for i in range(40))})
    hf = json.load(open(os.path.join(folder, "config.json")))
    assert hf["model_type"] == "ouro" and hf["total_ut_steps"] == 4 and hf["num_key_value_heads"] == 2
    back, ckpt = load_checkpoint(folder)
    ids = torch.randint(0, 40, (1, 16))
    a, b = model(ids, keep_logits=True), back(ids, keep_logits=True)
    assert all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))
    assert torch.equal(a["gate_logits"], b["gate_logits"]) and ckpt["meta"]["tokenizer"] == "char"
    # the exported keys are exactly Ouro's
    from safetensors.torch import load_file
    keys = set(load_file(os.path.join(folder, "model.safetensors")))
    assert keys == set(ouro_tensors(dict(CFG, num_hidden_layers=2), 0))
    plain = LoopedLM(GPTConfig(vocab_size=40, n_layer=1, n_embd=32, ffn_hidden=40))   # loop_norm=False
    with pytest.raises(UserError, match="per-loop norm"):
        export_ouro(plain, str(tmp_path / "no"))
    assert not os.path.exists(str(tmp_path / "no" / "model.safetensors"))


PUBLISHED = dict(CFG, hidden_act="silu", rope_scaling=None, use_sliding_window=False, sliding_window=None,
                 max_window_layers=3, layer_types=["full_attention"] * 3, head_dim=8, attention_dropout=0.0,
                 initializer_range=0.02, early_exit_threshold=1.0, torch_dtype="bfloat16", use_cache=True,
                 transformers_version="4.55.0", auto_map={"AutoConfig": "configuration_ouro.OuroConfig"})


@pytest.mark.parametrize("field,value", [("rope_scaling", {"type": "linear", "factor": 4.0}), ("hidden_act", "gelu"),
                                         ("use_sliding_window", True), ("layer_types", ["sliding_attention"] * 3),
                                         ("attention_dropout", 0.1), ("some_new_field", 1)])
def test_config_fields_not_implemented_are_refused(tmp_path, field, value):
    t = ouro_tensors(CFG, seed=4)
    assert load_checkpoint(write_folder(str(tmp_path / "ok"), PUBLISHED, t))[0].config.n_layer == 3
    folder = write_folder(str(tmp_path / "bad"), dict(PUBLISHED, **{field: value}), t)
    with pytest.raises(UserError, match=field):
        load_checkpoint(folder)


def test_export_writes_auto_map_and_refuses_to_overwrite(tmp_path):
    model = LoopedLM(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=40,
                               loop_norm=True)).eval()
    out = str(tmp_path / "exp")
    export_ouro(model, out)
    hf = json.load(open(os.path.join(out, "config.json")))
    assert hf["auto_map"]["AutoModelForCausalLM"] == "ByteDance/Ouro-1.4B--modeling_ouro.OuroForCausalLM"
    assert hf["auto_map"]["AutoConfig"] == "ByteDance/Ouro-1.4B--configuration_ouro.OuroConfig"
    assert oct(os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777) == oct(0o666 & ~_umask())
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    with pytest.raises(UserError, match="--force"):
        export_ouro(model, out)
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before
    write_folder(out, CFG, ouro_tensors(CFG, 1), shards=2)   # a sharded folder there: --force replaces it whole
    export_ouro(model, out, force=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert load_checkpoint(out)[0].config.n_layer == 2
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        export_ouro(model, str(tmp_path / "file"))


def test_no_folder_holds_two_models(tmp_path):
    """An export into a training run's folder, a run into an Ouro folder, and loading a folder that
    holds both (left by an earlier version) are refused with one line naming the folder: either model
    would silently shadow the other in every --ckpt."""
    import train
    model = LoopedLM(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=40,
                               loop_norm=True)).eval()
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"model": model.state_dict(), "model_args": vars(model.config)}, run / "ckpt.pt")
    with pytest.raises(UserError, match="holds a training run"):
        export_ouro(model, str(run))
    assert sorted(os.listdir(run)) == ["ckpt.pt"]
    assert load_checkpoint(str(run))[0].config.n_layer == 2
    write_folder(str(run), CFG, ouro_tensors(CFG, 1))              # both in one folder
    with pytest.raises(UserError, match="holds both"):
        load_checkpoint(str(run))
    assert load_checkpoint(str(run / "ckpt.pt"))[0].config.n_layer == 2      # the file itself is unambiguous
    exp = export_ouro(model, str(tmp_path / "exp"))
    with pytest.raises(UserError, match="holds an Ouro folder"):
        train.main(["--n_layer=1", f"--out_dir={exp}", "--max_iters=1"])
    assert "ckpt.pt" not in os.listdir(exp)


@pytest.mark.parametrize("case", ["config_list", "config_types", "config_not_utf8", "config_layer_types",
                                  "index_no_map", "index_missing_shard", "index_path", "meta_not_object",
                                  "meta_not_json"])
def test_malformed_ouro_folders_are_one_line_errors(tmp_path, case):
    """Every file of an Ouro folder malformed in its own way: a UserError naming the file (and the
    field), never a traceback from deep inside the loader."""
    folder = write_folder(str(tmp_path / "f"), CFG, ouro_tensors(CFG, seed=3), shards=2 if "index" in case else 1)
    path = lambda name: os.path.join(folder, name)
    if case == "config_list":
        json.dump([CFG], open(path("config.json"), "w"))
    elif case == "config_types":
        json.dump(dict(CFG, hidden_size="32"), open(path("config.json"), "w"))
    elif case == "config_not_utf8":
        open(path("config.json"), "wb").write(b'{"model_type": "ouro", "x": "\xff"}')
    elif case == "config_layer_types":
        json.dump(dict(CFG, layer_types="full_attention"), open(path("config.json"), "w"))
    elif case == "index_no_map":
        json.dump({"metadata": {}}, open(path("model.safetensors.index.json"), "w"))
    elif case == "index_missing_shard":
        os.remove(path("model-00002-of-00002.safetensors"))
    elif case == "index_path":
        index = json.load(open(path("model.safetensors.index.json")))
        index["weight_map"] = {k: "../elsewhere.safetensors" for k in index["weight_map"]}
        json.dump(index, open(path("model.safetensors.index.json"), "w"))
    elif case == "meta_not_object":
        json.dump(["char"], open(path("meta.json"), "w"))
    else:
        open(path("meta.json"), "w").write("{chars: ")
    with pytest.raises(UserError) as e:
        load_checkpoint(folder)
    assert folder in str(e.value) and len(str(e.value).splitlines()) == 1


def test_corrupt_tokenizer_entries_are_one_line_errors(tmp_path):
    for meta in ([1], {"tokenizer": "char"}, {"tokenizer": "char", "chars": 5},
                 {"tokenizer": "pieces", "pieces": ["a", ""]},
                 {"tokenizer": "hf", "path": str(tmp_path / "missing.json")}, {"tokenizer": "bpe"}):
        with pytest.raises(UserError):
            tokenizer.load_tokenizer(meta)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    with pytest.raises(UserError, match="not a readable tokenizer.json"):
        tokenizer.load_tokenizer({"tokenizer": "hf", "path": str(tmp_path / "bad.json")})


def test_weights_with_nan_or_infinity_are_refused_at_load(tmp_path):
    model = LoopedLM(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=40))
    state = model.state_dict()
    key = list(state)[int(torch.randint(0, len(state), ()))]
    bad = float(["nan", "inf", "-inf"][int(torch.randint(0, 3, ()))])
    state[key].view(-1)[int(torch.randint(0, state[key].numel(), ()))] = bad
    torch.save({"model": state, "model_args": vars(model.config)}, tmp_path / "ckpt.pt")
    with pytest.raises(UserError, match=f"NaN or infinity.*{key}"):
        load_checkpoint(str(tmp_path))
    t = ouro_tensors(CFG, seed=2)
    t["model.norm.weight"][3] = float("nan")
    with pytest.raises(UserError, match="NaN or infinity"):
        load_checkpoint(write_folder(str(tmp_path / "ouro"), CFG, t))


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_chat_template_turns_text_or_ids_and_thinking():
    enc = lambda s: [ord(ch) for ch in s]           # a character "tokenizer": the template is readable back
    text = lambda ids: "".join({tokenizer.IM_START: "<S>", tokenizer.IM_END: "<E>"}.get(i, chr(i)) for i in ids)
    assert text(tokenizer.chat_ids([("user", enc("hi"))], enc)) == "<S>user\nhi<E>\n<S>assistant\n"
    assert text(tokenizer.chat_ids([("system", "be kind"), ("user", "hi")], enc, think=True)) == \
        "<S>system\nbe kind<E>\n<S>user\nhi<E>\n<S>assistant\n<think>\n"


def test_sample_on_ouro_folder_with_tokenizer_chat_and_ids(tmp_path, monkeypatch, capsys):
    folder = write_folder(str(tmp_path / "ouro"), CFG, ouro_tensors(CFG, seed=2))
    make_tokenizer(os.path.join(folder, "tokenizer.json"))
    res = sample.main(["--ckpt", folder, "--thr", "0.5", "--prompt", "the cat sat", "--max_new_tokens=6",
                       "--temperature=0", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == [6, 7, 8] and out["mode"] == "dense_ragged" and len(res[0]["tokens"]) == 6
    sample.main(["--ckpt", folder, "--thr", "0.5", "--prompt", "the cat", "--chat", "--max_new_tokens=4", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt_tokens"] == [1, 4, 3, 6, 7, 2, 3, 1, 5, 3]
    monkeypatch.setitem(sys.modules, "tokenizers", None)   # no `tokenizers`: ids still work
    res = sample.main(["--ckpt", folder, "--thr", "0.5", "--prompt_ids", "6,7,8", "--max_new_tokens=3",
                       "--temperature=0", "--mode=ete_ragged"])
    assert res[0]["text"] is None and len(res[0]["tokens"]) == 3


def test_an_exported_folder_carries_a_tokenizer_hugging_face_reads_with_our_ids(tmp_path):
    """lab/export_ouro.py's folder is whole: tokenizer.json, tokenizer_config.json and
    generation_config.json beside meta.json, for the character and the piece tokenizers and GPT-2's
    byte-level BPE (its merges read off tiktoken's ranks; here a small encoding of the same kind, made
    from its own merges); `tokenizers` (and transformers' AutoTokenizer where installed) encodes sample
    texts to our ids and decodes them back."""
    import importlib.util
    import tiktoken
    from tokenizers import Tokenizer
    import checkpoint
    import tokenizer as tk
    from prepare_data import HOP_PIECES, SYNTH_CHARS
    cases = [(tk.char_meta(SYNTH_CHARS), ["x=3 a=x ; a? 3\n", "sum 1+2+9=2", ""]),
             (tk.pieces_meta(HOP_PIECES), ["hg na pl ei l8 i9 g3 a5 ; E9 P8 N5 H3\n", "dc ;\n"])]
    for meta, texts in cases:
        model = LoopedLM(GPTConfig(vocab_size=meta["vocab_size"], block_size=32, n_layer=1, n_head=2, n_kv_head=2,
                                   n_embd=16, ffn_hidden=24, loop_norm=True, branch_norm_init=1.0))
        folder = checkpoint.export_ouro(model, str(tmp_path / meta["tokenizer"]), meta)
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "meta.json"} <= set(
            os.listdir(folder))
        hf, (encode, _) = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), tk.load_tokenizer(meta)
        for text in texts:
            assert hf.encode(text, add_special_tokens=False).ids == encode(text) and hf.decode(encode(text)) == text
        if importlib.util.find_spec("transformers"):
            from transformers import AutoTokenizer
            auto = AutoTokenizer.from_pretrained(folder)
            assert all(auto(t, add_special_tokens=False)["input_ids"] == encode(t) for t in texts)
    # GPT-2's kind of tokenizer: byte-level BPE from tiktoken ranks (a small one, trained on a text here)
    import random
    rng = random.Random(int(torch.randint(0, 1000, ())))
    text = "".join(rng.choice(["the cat ", "sat on ", "a mat", "\n", "it's ", "Ünï 🙂 "]) for _ in range(300))
    ranks = {bytes([b]): b for b in range(256)}
    words = [w.encode() for w in text.split(" ")]
    while len(ranks) < 400:                         # byte-pair merges, most frequent first
        pairs = {}
        for w in words:
            parts = tk_split(w, ranks)
            for a, b in zip(parts, parts[1:]):
                pairs[a + b] = pairs.get(a + b, 0) + 1
        if not pairs:
            break
        ranks[max(pairs, key=pairs.get)] = len(ranks)
    gpt2_split = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("small", pat_str=gpt2_split, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    real = tk.gpt2_encoding
    try:
        tk.gpt2_encoding = lambda tiktoken_file="": enc
        hf = tk.hf_tokenizer({"tokenizer": "gpt2", "vocab_size": 50257})
    finally:
        tk.gpt2_encoding = real
    for piece in (text[:200], "the mat sat on it's cat\n\n  ", "Ünï 🙂 zebra!", "<|endoftext|>the"):
        ids = enc.encode(piece, allowed_special={"<|endoftext|>"})
        assert hf.encode(piece, add_special_tokens=False).ids == ids and len(ids) < len(piece.encode())


def tk_split(word, ranks):
    """A word's BPE parts under the ranks so far (the lowest-ranked pair merged first)."""
    parts = [bytes([b]) for b in word]
    while True:
        pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not pairs:
            return parts
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]

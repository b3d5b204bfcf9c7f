"""
Tokenizers and the chat template: what turns text into token ids and back, for every script.

A dataset's meta.json (written by prepare_data.py, stored in every checkpoint) names its tokenizer:
  char    the characters of the training text, one id each (meta["chars"])
  pieces  a list of strings, one id each, the longest that matches first (meta["pieces"]): a
          synthetic vocabulary whose tokens are more than one character (prepare_data's `hops`)
  gpt2  GPT-2's BPE through tiktoken (a local gpt2.tiktoken ranks file works offline)
  hf    an Ouro folder's tokenizer.json (SmolLM2-style), through the optional `tokenizers` package
Ouro's Thinking models talk in ChatML; chat_ids() is the one template that sample.py, lab/eval.py
and the HTTP server use.
"""
import json
import os

from configurator import UserError

IM_START, IM_END = 1, 2                  # Ouro's ChatML ids (the shipped configs say bos/eos/pad 0)
EOS = {"gpt2": 50256, "hf": 0}           # the end-of-text id of each tokenizer that has one


def gpt2_encoding(tiktoken_file=""):
    """tiktoken's GPT-2 encoding; from a local ranks file when given (no network needed)."""
    import tiktoken
    if not tiktoken_file:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise UserError(f"cannot fetch the GPT-2 encoding ({type(e).__name__}); "
                            "pass --tiktoken_file=PATH to a gpt2.tiktoken ranks file")
    if not os.path.isfile(tiktoken_file):
        raise UserError(f"--tiktoken_file={tiktoken_file!r} does not exist")
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                             mergeable_ranks=load_tiktoken_bpe(tiktoken_file),
                             special_tokens={"<|endoftext|>": 50256})


def start_of_text(meta):
    """What an empty prompt means, the same in sample.py, server.py and lab/eval.py: the start of a
    text, as the model saw texts begin in training: the end-of-text token of GPT-2 and Ouro's
    tokenizer, a newline for the character and piece tokenizers that have one, else token 0."""
    kind = (meta or {}).get("tokenizer")
    if kind in EOS:
        return [EOS[kind]]
    vocab = list(meta.get("chars", "")) if kind == "char" else meta.get("pieces", []) if kind == "pieces" else []
    return [vocab.index("\n")] if "\n" in vocab else [0]


def char_meta(chars):
    return {"tokenizer": "char", "vocab_size": len(chars), "chars": "".join(chars)}


def pieces_meta(pieces):
    return {"tokenizer": "pieces", "vocab_size": len(pieces), "pieces": list(pieces)}


def check_meta(meta, where="the model's meta"):
    """A tokenizer description (meta.json, or a checkpoint's meta) that is ours and agrees with
    itself: its entries present and well formed, and as many tokens as its vocab_size says (a char
    model whose characters are fewer than its vocabulary would decode an id it has no character
    for). UserError naming `where` and what is wrong."""
    if not isinstance(meta, dict):
        raise UserError(f"{where}: the tokenizer description is {type(meta).__name__}, not a JSON object")
    kind = meta.get("tokenizer")
    entry = {"char": "chars", "pieces": "pieces", "hf": "path"}.get(kind)
    if entry and not (isinstance(meta.get(entry), str) and meta[entry] if kind != "pieces" else
                      isinstance(meta.get(entry), list) and meta[entry] and all(isinstance(p, str) and p
                                                                               for p in meta[entry])):
        raise UserError(f"{where}: tokenizer {kind!r}: its {entry!r} is missing or malformed")
    size = meta.get("vocab_size")
    if kind in ("char", "pieces", "gpt2") and (isinstance(size, bool) or not isinstance(size, int)):
        raise UserError(f"{where}: vocab_size {size!r} is not a whole number")
    tokens = {"char": lambda: len(meta["chars"]), "pieces": lambda: len(meta["pieces"]),
              "gpt2": lambda: 50257}
    if kind in tokens and tokens[kind]() != size:
        raise UserError(f"{where}: vocab_size is {size}, but its {kind} tokenizer has "
                        f"{tokens[kind]()} tokens; prepare the dataset again with prepare_data.py")


def load_tokenizer(meta, tiktoken_file=""):
    """meta (as written to meta.json) -> (encode: str -> list[int], decode: list[int] -> str). A
    meta that is not one of ours (a corrupt file or checkpoint) is a UserError naming what is
    wrong."""
    check_meta(meta)
    kind = meta.get("tokenizer")
    if kind == "char":
        return pieces_tokenizer(meta["chars"], "characters")
    if kind == "pieces":
        return pieces_tokenizer(meta["pieces"], "pieces")
    if kind == "hf":
        return hf_tokenizer_of(meta["path"])
    if kind == "gpt2":
        enc = gpt2_encoding(tiktoken_file)
        return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode
    raise UserError(f"unknown tokenizer {json.dumps(kind)} in meta; allowed: char, pieces, gpt2, hf")


def pieces_tokenizer(pieces, what):
    """A vocabulary of characters or of pieces: the longest piece first at every position."""
    stoi = {p: i for i, p in enumerate(pieces)}
    longest = max(map(len, pieces))

    def encode(s):
        ids, i = [], 0
        while i < len(s):
            n = next((n for n in range(min(longest, len(s) - i), 0, -1) if s[i:i + n] in stoi), 0)
            if not n:
                if what == "characters":
                    bad = sorted({c for c in s if c not in stoi})
                    raise UserError(f"characters {''.join(bad)!r} are not in this "
                                    f"model's vocabulary ({''.join(pieces)!r})")
                raise UserError(f"{s[i:i + 8]!r} (at character {i}) starts with no token of "
                                f"this model's vocabulary of {len(pieces)} pieces")
            ids.append(stoi[s[i:i + n]])
            i += n
        return ids
    return encode, lambda ids: "".join(pieces[i] for i in ids)


def hf_tokenizer_of(path):
    """An Ouro folder's tokenizer.json, through the optional `tokenizers` package."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("this model's tokenizer.json needs the optional `tokenizers` package "
                        "(pip install tokenizers); --prompt_ids works without it")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:
        # a missing, truncated or foreign file: the library's own message
        raise UserError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0][:160]})")
    return (lambda s: tok.encode(s, add_special_tokens=False).ids,
            lambda ids: tok.decode(ids, skip_special_tokens=False))


# ---------------------------------------------------------------------- as a Hugging Face tokenizer

def hf_tokenizer(meta, tiktoken_file=""):
    """Our tokenizer as a `tokenizers.Tokenizer` that encodes every text to the same ids (an
    exported Ouro folder's tokenizer.json; the optional `tokenizers` package): char, one token a
    character; pieces, the longest piece that matches first (an ordered alternation, longest first);
    GPT-2, byte-level BPE whose merges are read off tiktoken's ranks (a token's merge: each split of
    it into two tokens, in the order of the ranks)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    check_meta(meta)
    kind = meta.get("tokenizer")
    if kind in ("char", "pieces"):
        vocab = list(meta["chars"]) if kind == "char" else list(meta["pieces"])
        tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(vocab)}, unk_token=vocab[0]))
        longest_first = sorted(vocab, key=len, reverse=True)
        pattern = r"[\s\S]" if kind == "char" else "|".join(_escape(p) for p in longest_first)
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return tok
    if kind == "hf":
        return Tokenizer.from_file(meta["path"])
    enc = gpt2_encoding(tiktoken_file)
    ranks = enc._mergeable_ranks
    byte_char = _bytes_to_unicode()
    text = lambda b: "".join(byte_char[x] for x in b)
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks
                  and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], text(a), text(b)) for a, b in splits]
    tok = Tokenizer(models.BPE({text(t): r for t, r in ranks.items()},
                               [(a, b) for *_, a, b in sorted(merges)], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in enc._special_tokens])
    return tok


def _escape(piece):
    """A piece as a literal in the regex of tokenizers (Oniguruma)."""
    return "".join("\\" + c if not c.isalnum() and c != " " else c for c in piece).replace("\\\n", "\\n")


def _bytes_to_unicode():
    """GPT-2's byte-level alphabet: every byte a printable character (the printable ones as
    themselves, the others shifted past 255), as byte-level BPE tokenizers write their
    vocabulary."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


# ----------------------------------------------------------------------------- ChatML

def has_chat(meta):
    """True when the tokenizer has Ouro's ChatML tokens <|im_start|> = 1 and <|im_end|> = 2."""
    if meta.get("tokenizer") != "hf":
        return False
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return False
    tok = Tokenizer.from_file(meta["path"])
    return tok.token_to_id("<|im_start|>") == IM_START and tok.token_to_id("<|im_end|>") == IM_END


def check_chat(meta):
    """--chat needs Ouro's ChatML tokens in the tokenizer."""
    if not has_chat(meta):
        raise UserError(f"--chat: this model's tokenizer ({meta.get('tokenizer', 'none')}) has no "
                        f"ChatML tokens <|im_start|>={IM_START} and <|im_end|>={IM_END}; --chat is "
                        "for Ouro (Thinking) checkpoints")


def chat_ids(turns, encode, think=False):
    """Ouro's ChatML: a <|im_start|>{role}\\n{content}<|im_end|>\\n per (role, content) turn, then
    <|im_start|>assistant\\n (and <think>\\n to open the Thinking models' reasoning). Content is
    text or token ids; the special tokens go in as ids, so it works whatever the tokenizer does with
    their strings."""
    ids = []
    for role, content in turns:
        body = encode(content) if isinstance(content, str) else list(content)
        ids += [IM_START] + encode(role + "\n") + body + [IM_END] + encode("\n")
    return ids + [IM_START] + encode("assistant\n" + ("<think>\n" if think else ""))


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python prepare_data.py and python sample.py use it")

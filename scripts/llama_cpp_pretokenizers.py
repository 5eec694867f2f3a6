"""Regenerate ``minigpt/tokenizer/llama_cpp_pretokenizers.json`` from llama.cpp's ``src/llama-vocab.cpp``.

The table is data read out of llama.cpp's source, not code: for every ``tokenizer.ggml.pre`` name that
``llama_vocab::impl::load`` accepts, the ``LLAMA_VOCAB_PRE_TYPE_*`` it maps to and the flags set with it
(``ignore_merges``), and for every type the list of split regexes of ``llm_tokenizer_bpe``'s constructor, each with
the "original regex from tokenizer.json" that llama.cpp records in a comment beside its own adaptation (the
adaptations only work around C++ ``std::regex``; the originals are what the model's tokenizer.json, and so
transformers, use). Every entry keeps the line it was read from.

Usage: python scripts/llama_cpp_pretokenizers.py LLAMA_CPP_SRC_DIR COMMIT [OUT.json]
(LLAMA_CPP_SRC_DIR holds llama-vocab.cpp and unicode.cpp; COMMIT is the llama.cpp commit it comes from, recorded in the output.)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "0": "\0"}

# Names newer than the snapshot this table is generated from, seen in a later llama.cpp (ggml-org/llama.cpp
# 00ad355e009e83abf98f96a6ded7193b95763681, src/llama-vocab.cpp), that only alias a type the snapshot already has.
LATER_ALIASES = {"f2llmv2": "QWEN2", "talkie": "GPT4O", "cohere2moe": "TINY_AYA", "mellum2": "STARCODER"}
LATER_COMMIT = "00ad355e009e83abf98f96a6ded7193b95763681"


def c_literals(text: str) -> list[tuple[str, int, bool]]:
    """``(value, offset, in_comment)`` of the C string literals in ``text``, escapes resolved."""
    out, i, comment_end = [], 0, -1
    while i < len(text):
        if text.startswith("//", i):
            comment_end = text.find("\n", i)
            comment_end = len(text) if comment_end < 0 else comment_end
            i += 2
            continue
        if text[i] == '"':
            start, i, value = i, i + 1, []
            while text[i] != '"':
                if text[i] == "\\":
                    value.append(_ESCAPES[text[i + 1]])
                    i += 2
                else:
                    value.append(text[i])
                    i += 1
            out.append(("".join(value), start, start < comment_end))
        i += 1
    return out


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def custom_handlers(unicode_src: str) -> dict[str, tuple[str, int]]:
    """Regexes that ``unicode_regex_split_custom`` (unicode.cpp) hands to a hand-written splitter: regex ->
    (splitter function, line)."""
    start = unicode_src.index("static std::vector<size_t> unicode_regex_split_custom(")
    end = unicode_src.index("return bpe_offsets;", start)
    out: dict[str, tuple[str, int]] = {}
    pending: list[tuple[str, int]] = []
    for m in re.finditer(r'regex_expr == "((?:[^"\\]|\\.)*)"|bpe_offsets = (unicode_regex_split_custom_\w+)',
                         unicode_src[start:end]):
        if m.group(1) is not None:
            value = c_literals('"' + m.group(1) + '"')[0][0]
            pending.append((value, line_of(unicode_src, start + m.start())))
        else:
            for value, line in pending:
                out[value] = (m.group(2), line)
            pending = []
    return out


# A hand-written splitter of unicode.cpp that applies several patterns at once, so no one regex stands for it.
NOT_ONE_REGEX = {"unicode_regex_split_custom_kimi_k2"}


def split_regex(entry: dict, handlers: dict[str, tuple[str, int]]) -> str | None:
    """The regex MiniGPT splits with for one llama.cpp entry: the tokenizer.json original when llama.cpp records
    one, else llama.cpp's own regex. A pseudo-property that only selects a hand-written splitter
    (``\\p{AFMoE_digits}``) becomes the real regex llama.cpp routes to the same splitter; None when the splitter
    is not one regex."""
    regex, handler = entry["original"] or entry["regex"], entry.get("handler")
    if handler in NOT_ONE_REGEX:
        return None
    if handler and re.fullmatch(r"\\p\{\w+\}", regex):
        siblings = [r for r, (h, _) in handlers.items() if h == handler and r != regex]
        return siblings[0] if siblings else None
    return regex


def regex_table(src: str, handlers: dict[str, tuple[str, int]]) -> dict:
    ctor = src.index("llm_tokenizer_bpe(const llama_vocab & vocab)")
    end = src.index("std::vector<std::string> regex_exprs;", ctor)
    types: dict[str, dict] = {}
    pending: list[tuple[str, int]] = []
    last: list[str] = []
    previous_end = ctor
    for m in re.finditer(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):|default:|regex_exprs = \{(.*?)\};|byte_encode = false",
                         src[ctor:end], re.S):
        at = ctor + m.start()
        if m.group(0).startswith(("case", "default")):
            pending.append((m.group(1) or "DEFAULT", line_of(src, at)))
        elif m.group(0).startswith("byte_encode"):
            for name in last:
                types[name]["byte_encode"] = False
        else:
            # A comment between the case labels and the block can hold the original of its first regex.
            before = [v for v, _, in_comment in c_literals(src[previous_end:at]) if in_comment]
            original = before[-1] if before else None
            block_start = ctor + m.start(2)
            regexes = []
            for value, offset, in_comment in c_literals(m.group(2)):
                if in_comment:
                    original = value
                    continue
                entry = {"regex": value, "line": line_of(src, block_start + offset), "original": original}
                if value in handlers:
                    entry["handler"] = handlers[value][0]
                entry["split"] = split_regex(entry, handlers)
                regexes.append(entry)
                original = None
            for name, line in pending:
                types[name] = {"line": line, "regexes": regexes, "byte_encode": True}
            last, pending = [n for n, _ in pending], []
        previous_end = ctor + m.end()
    return types


def name_table(src: str) -> dict:
    start = src.index("if (tokenizer_pre.empty())")
    end = src.index("unknown pre-tokenizer type", start)
    names: dict[str, dict] = {}
    for f in re.finditer(r'tokenizer_pre == "([^"]+)"', src[start:end]):
        at = start + f.start()
        kind = re.compile(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);").search(src, at)
        branch_end = src.find("} else", kind.end())
        names[f.group(1)] = {"type": kind.group(1), "line": line_of(src, at),
                             "ignore_merges": "ignore_merges = true" in src[kind.end():branch_end]}
    return names


def main(argv: list[str]) -> None:
    src_dir, commit = Path(argv[1]), argv[2]
    out = Path(argv[3]) if len(argv) > 3 else Path(__file__).resolve().parents[1] / "minigpt" / "tokenizer" / \
        "llama_cpp_pretokenizers.json"
    src = (src_dir / "llama-vocab.cpp").read_text(encoding="utf-8")
    handlers = custom_handlers((src_dir / "unicode.cpp").read_text(encoding="utf-8"))
    types, names = regex_table(src, handlers), name_table(src)
    for name, kind in LATER_ALIASES.items():
        if name not in names and kind in types:
            names[name] = {"type": kind, "line": None, "ignore_merges": False, "commit": LATER_COMMIT}
    missing = sorted({v["type"] for v in names.values()} - set(types))
    if missing:
        raise SystemExit(f"types without regexes: {missing}")
    table = {
        "source": {"repository": "ggml-org/llama.cpp", "path": "src/llama-vocab.cpp", "commit": commit},
        "custom_splitters": {r: {"function": f, "path": "src/unicode.cpp", "line": n} for r, (f, n) in handlers.items()},
        "names": dict(sorted(names.items())),
        "types": dict(sorted(types.items())),
    }
    out.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(names)} names, {len(types)} types")


if __name__ == "__main__":
    main(sys.argv)

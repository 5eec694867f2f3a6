"""Hostile model files, fuzzed: the headers of the GGUF, safetensors, llama2.c and config.json files of a tiny
model are mutated, and every load (``load_model``, and ``load_tokenizer`` where the file carries the tokenizer) must
either succeed or raise our one-line :class:`MiniGPTError`, within a memory bound (the loads run in a child process
under ``RLIMIT_AS``) and a time bound. A ``RecursionError``, ``MemoryError``, allocator failure, hang or any other
exception escaping is what the CLI would print as a traceback (or never finish).

Each format gets a sweep (every header field, one at a time, set to each edge value: 0, -1, 2^31 - 1, 2^64 - 1,
NaN, a string where a number belongs...) as hypothesis' explicit examples, then examples hypothesis draws (several
fields at once, truncations, flipped bytes). All are derandomized, the same every run, and take well under a minute
on one core: one child process serves them all, so torch is imported once.
"""
import json
import math
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import hypothesis
import pytest
import torch
from conftest import TINY_MODEL, random_model
from hypothesis import strategies as st

from minigpt.checkpoint.convert import export_gguf, export_hf
from minigpt.checkpoint.native import save_pretrained
from minigpt.model.rope import half_to_interleaved

MEMORY_LIMIT = 3 << 30  # bytes of address space for the loading child (torch alone maps ~0.6 GB)
LOAD_TIMEOUT = 20.0  # seconds per example; a tiny model loads in milliseconds
EXAMPLES = {"gguf": 300, "safetensors": 300, "llama2c": 300, "config": 200, "hf_config": 200}


def fuzz(kind: str):
    """Settings of one fuzz run: ``EXAMPLES[kind]`` examples, the same ones every time, nothing stored on disk."""
    return hypothesis.settings(max_examples=EXAMPLES[kind], derandomize=True, database=None, deadline=None,
                               print_blob=False, suppress_health_check=list(hypothesis.HealthCheck))


# --------------------------------------------------------------------------------------------- the loading child
WORKER = r"""
import json, resource, sys, traceback
import torch
from minigpt.checkpoint import load_model, load_tokenizer
from minigpt.errors import MiniGPTError

torch.set_num_threads(1)
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def attempt(fn, path):
    try:
        fn(path)
        return "ok", ""
    except MiniGPTError as e:
        message = str(e)
        return ("error" if message and "\n" not in message else "escaped"), f"MiniGPTError: {message!r}"
    except BaseException:  # everything else is a bug: the CLI would print a traceback
        return "escaped", traceback.format_exc(limit=-6)


for line in sys.stdin:
    request = json.loads(line)
    results = [attempt(load_model, request["path"])]
    if request["tokenizer"]:
        results.append(attempt(load_tokenizer, request["path"]))
    worst = "escaped" if any(r[0] == "escaped" for r in results) else results[0][0]
    print("RESULT " + json.dumps({"outcome": worst, "detail": [r[1] for r in results]}), flush=True)
"""


class Loader:
    """One long-lived child process that loads paths on request, restarted after a crash or a timeout."""

    def __init__(self) -> None:
        self.proc = None

    def _start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(MEMORY_LIMIT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.buffer = b""

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def load(self, path: Optional[Path], tokenizer: bool) -> dict:
        """``{"outcome": "ok" | "error" | "escaped" | "crashed" | "timeout", "detail": ...}`` of loading ``path``
        (None: ``load_model(None)``, a call that must escape, to test the harness)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        request = {"path": None if path is None else str(path), "tokenizer": tokenizer}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        while True:
            lines = self.buffer.split(b"\n")
            for i, line in enumerate(lines[:-1]):
                if line.startswith(b"RESULT "):
                    self.buffer = b"\n".join(lines[i + 1:])
                    return json.loads(line[len("RESULT "):])
            ready, _, _ = select.select([fd], [], [], LOAD_TIMEOUT)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                outcome = "timeout" if not ready else f"crashed (exit code {self.proc.wait()})"
                self.close()
                return {"outcome": outcome, "detail": str(path)}
            self.buffer += chunk


@pytest.fixture(scope="module")
def loader():
    child = Loader()
    yield child
    child.close()


# --------------------------------------------------------------------------------------------- the tiny model
def write_llama2c(model, path: Path, version: int) -> None:
    """A llama2.c ``.bin`` of ``model`` (layouts in :mod:`minigpt.interop.llama2c`; written independently here)."""
    c, sd = model.config, model.state_dict()
    stack = lambda name, f=lambda w: w: torch.stack([f(sd[f"layers.{i}.{name}"]) for i in range(c.n_layers)])  # noqa: E731
    q = stack("attention.wq.weight", lambda w: half_to_interleaved(w, c.n_heads))
    k = stack("attention.wk.weight", lambda w: half_to_interleaved(w, c.n_kv_heads))
    dims = (c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size, c.max_seq_len)
    ffn = [stack("feed_forward.w1.weight"), stack("feed_forward.w2.weight"), stack("feed_forward.w3.weight")]
    if version == 0:
        header = struct.pack("<7i", *dims)
        rope = torch.zeros(c.max_seq_len * c.head_dim // 2)
        arrays = [sd["tok_embeddings.weight"], stack("attention_norm.weight"), q, k, stack("attention.wv.weight"),
                  stack("attention.wo.weight"), stack("ffn_norm.weight"), *ffn, sd["norm.weight"], rope, rope]
    else:
        header = struct.pack("<Ii7iB", 0x616B3432, 1, *dims, 1)
        header += bytes(256 - len(header))
        arrays = [stack("attention_norm.weight"), stack("ffn_norm.weight"), sd["norm.weight"],
                  sd["tok_embeddings.weight"], q, k, stack("attention.wv.weight"), stack("attention.wo.weight"), *ffn]
    path.write_bytes(header + b"".join(a.detach().float().contiguous().numpy().tobytes() for a in arrays))


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """The unmutated files: a MiniGPT directory (config.json, model.safetensors, tokenizer.json), its Hugging Face
    export, its GGUF (with the tokenizer metadata) and llama2.c files of both versions."""
    from minigpt.data.sources import BUNDLED
    from minigpt.tokenizer.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("originals")
    tokenizer = train_tokenizer([BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:5000]], 280)
    model = random_model(TINY_MODEL, vocab_size=tokenizer.vocab_size)
    save_pretrained(model, root / "native", tokenizer)
    export_hf(root / "native", root / "hf")
    export_gguf(root / "native", root / "model.gguf")
    for version in (0, 1):
        write_llama2c(model, root / f"v{version}.bin", version)
    for folder in ("native", "hf"):
        (root / folder / "manifest.json").unlink(missing_ok=True)  # an attacker rewrites or drops it anyway
    return root


# --------------------------------------------------------------------------------------------- mutations
INTERESTING = [0, 1, 2, 3, 4, 7, 8, 16, 255, 256, 4096, 2**15 - 1, 2**16, 2**24, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1, -1, -2, -(2**31), -(2**63)]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, 3.4e38, math.inf, -math.inf, math.nan]
INT_FORMATS = {(1, "u"): "<B", (1, "i"): "<b", (2, "u"): "<H", (2, "i"): "<h", (4, "u"): "<I", (4, "i"): "<i",
               (8, "u"): "<Q", (8, "i"): "<q"}


def int_values(width: int, kind: str, current: int):
    """Values for an integer field of ``width`` bytes: edge cases, near the current value, or anything."""
    bits = 8 * width
    lo, hi = (0, 2**bits - 1) if kind == "u" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    near = st.integers(-3, 3).map(lambda d: min(hi, max(lo, current + d)))
    return st.one_of(st.sampled_from([v for v in INTERESTING if lo <= v <= hi]), near, st.integers(lo, hi))


@st.composite
def patched_fields(draw, data: bytes, fields: list[tuple[str, int, int, str]], n: int = 3) -> bytes:
    """``data`` with 1..n of ``fields`` (``(group, offset, width, kind)``, kind ``u``/``i``/``f``) overwritten;
    a group is drawn first, so that the 280 token strings of a vocabulary do not drown the dimensions."""
    out = bytearray(data)
    groups = sorted({f[0] for f in fields})
    for _ in range(draw(st.integers(1, n))):
        group = draw(st.sampled_from(groups))
        _, offset, width, kind = draw(st.sampled_from([f for f in fields if f[0] == group]))
        if kind == "f":
            value = draw(st.sampled_from(FLOATS) | st.floats(width=8 * width))
            out[offset:offset + width] = struct.pack("<f" if width == 4 else "<d", value)
        else:
            fmt = INT_FORMATS[width, kind]
            value = draw(int_values(width, kind, struct.unpack_from(fmt, out, offset)[0]))
            out[offset:offset + width] = struct.pack(fmt, value)
    return bytes(out)


SWEEP_INTS = [0, 1, -1, 2**24, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]
SWEEP_FLOATS = [0.0, -1.0, 1e30, math.inf, math.nan]
JSON_EDGES = [None, True, -1, 0, 2**31 - 1, 2**64, 1.5, math.inf, math.nan, "x", [], {"x": 1}]


def field_sweep(data: bytes, fields: list[tuple[str, int, int, str]], per_group: int = 3) -> list[bytes]:
    """One file per (field, edge value): the first ``per_group - 1`` fields and the last of every group, each set
    to every value of :data:`SWEEP_INTS` that fits (and to its own value + 1), or of :data:`SWEEP_FLOATS`."""
    out = []
    for group in sorted({f[0] for f in fields}):
        members = [f for f in fields if f[0] == group]
        for _, offset, width, kind in members[:per_group - 1] + members[per_group - 1:][-1:]:
            if kind == "f":
                packed = [struct.pack("<f" if width == 4 else "<d", v) for v in SWEEP_FLOATS]
            else:
                fmt = INT_FORMATS[width, kind]
                lo, hi = (0, 2 ** (8 * width) - 1) if kind == "u" else (-(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1)
                values = SWEEP_INTS + [struct.unpack_from(fmt, data, offset)[0] + 1]
                packed = [struct.pack(fmt, v) for v in dict.fromkeys(values) if lo <= v <= hi]
            out.extend(data[:offset] + p + data[offset + width:] for p in packed)
    return out


@st.composite
def cut_or_flip(draw, data: bytes, header_end: int) -> bytes:
    """``data`` truncated inside or just after its header, or with a few header bytes replaced."""
    if draw(st.booleans()):
        return data[:draw(st.integers(0, min(len(data), header_end + 64)))]
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        out[draw(st.integers(0, header_end - 1))] = draw(st.integers(0, 255))
    return bytes(out)


GGUF_SCALARS = {0: (1, "u"), 1: (1, "i"), 2: (2, "u"), 3: (2, "i"), 4: (4, "u"), 5: (4, "i"), 6: (4, "f"),
                7: (1, "u"), 10: (8, "u"), 11: (8, "i"), 12: (8, "f")}


def gguf_fields(data: bytes) -> tuple[list[tuple[str, int, int, str]], int]:
    """Every integer/float field of a GGUF header (v3: magic, version, counts, key-value pairs, tensor infos) as
    ``(group, offset, width, kind)``, and where the header ends. Parsed here independently of the reader."""
    fields = [("header", 4, 4, "u"), ("header", 8, 8, "u"), ("header", 16, 8, "u")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(group):
        nonlocal pos
        fields.append((group, pos, 8, "u"))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(group, kind):
        nonlocal pos
        if kind == 8:
            string(group)
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", data, pos)
            fields.extend([(group, pos, 4, "u"), (group, pos + 4, 8, "u")])
            pos += 12
            for _ in range(count):
                value(group, item)
        else:
            width, k = GGUF_SCALARS[kind]
            fields.append((group, pos, width, k))
            pos += width

    for _ in range(n_kv):
        start = pos
        string("keys")
        key = data[start + 8:pos].decode()
        fields.append((key, pos, 4, "u"))
        pos += 4
        value(key, struct.unpack_from("<I", data, pos - 4)[0])
    for i in range(n_tensors):
        group = f"tensor {i}"
        string(group)
        n_dims = struct.unpack_from("<I", data, pos)[0]
        fields.append((group, pos, 4, "u"))
        pos += 4
        fields.extend((group, pos + 8 * d, 8, "u") for d in range(n_dims))
        pos += 8 * n_dims
        fields.extend([(group, pos, 4, "u"), (group, pos + 4, 8, "u")])
        pos += 12
    return fields, pos


def llama2c_fields(version: int) -> list[tuple[str, int, int, str]]:
    names = ["dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"]
    base = 0 if version == 0 else 8
    fields = [(name, base + 4 * i, 4, "i") for i, name in enumerate(names)]
    if version == 1:
        fields += [("magic", 0, 4, "u"), ("version", 4, 4, "i"), ("shared", 36, 1, "u")]
    return fields


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from(INTERESTING), st.integers(-(2**70), 2**70),
                         st.sampled_from(FLOATS), st.floats(), st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def mutated_dict(draw, d: dict, keys: list[str], values=JSON_VALUES, n: int = 3) -> dict:
    """``d`` with 1..n keys (existing ones, or one of ``keys``) set to a drawn JSON value or removed."""
    d = dict(d)
    for _ in range(draw(st.integers(1, n))):
        key = draw(st.sampled_from(sorted(set(d) | set(keys))))
        if draw(st.integers(0, 5)) == 0:
            d.pop(key, None)
        else:
            d[key] = draw(values)
    return d


SAFETENSORS_DTYPES = ["F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "Q4", ""]


@st.composite
def safetensors_header(draw, header: dict) -> dict:
    """A tensor entry of a safetensors header with its dtype, shape or data offsets replaced (or the metadata)."""
    names = sorted(header)
    name = draw(st.sampled_from(names))
    entry = dict(header[name]) if isinstance(header[name], dict) else {}
    part = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry"]))
    ints = st.sampled_from(INTERESTING) | st.integers(0, 4096)
    if part == "dtype":
        entry["dtype"] = draw(st.sampled_from(SAFETENSORS_DTYPES) | JSON_SCALARS)
    elif part == "shape":
        entry["shape"] = draw(st.lists(ints, max_size=5) | JSON_VALUES)
    elif part == "data_offsets":
        entry["data_offsets"] = draw(st.lists(ints, min_size=2, max_size=2) | JSON_VALUES)
    else:
        entry = draw(JSON_VALUES)
    return {**header, name: entry}


# --------------------------------------------------------------------------------------------- the checks
class Cases:
    """Fresh example directories under one module-level folder, removed after each example."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(dir=self.root))
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def check(loader: Loader, path: Path, tokenizer: bool, seen: dict) -> None:
    result = loader.load(path, tokenizer)
    seen[result["outcome"]] = seen.get(result["outcome"], 0) + 1
    assert result["outcome"] in ("ok", "error"), result


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(tmp_path_factory.mktemp("cases"))


def test_the_originals_load(loader, originals):
    for name, tokenizer in (("native", True), ("hf", True), ("model.gguf", True), ("v0.bin", False),
                            ("v1.bin", False)):
        assert loader.load(originals / name, tokenizer) == {"outcome": "ok", "detail": [""] * (1 + tokenizer)}


def test_the_harness_tells_errors_from_escapes(loader, tmp_path):
    """A file the loader refuses gives ``error``, an exception other than MiniGPTError ``escaped``, and a child
    that died is replaced."""
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert loader.load(tmp_path / "x.gguf", False)["outcome"] == "error"
    escaped = loader.load(None, False)
    assert escaped["outcome"] == "escaped" and "TypeError" in escaped["detail"][0]
    loader.proc.kill()
    loader.proc.wait()
    assert loader.load(tmp_path / "x.gguf", False)["outcome"] == "error"


def run_fuzz(kind: str, strategy, sweep: list, body) -> dict:
    """Run ``body(example, seen)`` on every example of ``sweep`` (explicit: the edge values of each field, one at
    a time) and on ``EXAMPLES[kind]`` drawn from ``strategy`` (several fields at once, cuts, flips); returns the
    outcomes counted."""
    seen: dict = {}

    def run(mutated):
        body(mutated, seen)

    for example in sweep:
        run = hypothesis.example(example)(run)
    fuzz(kind)(hypothesis.given(strategy)(run))()
    print(f"{kind}: {len(sweep)} swept + {EXAMPLES[kind]} drawn examples: {seen}")
    return seen


@pytest.mark.slow  # hundreds of mutated files, ~12 s (make test-slow, its own CI stage)
def test_fuzz_gguf_headers(loader, originals, cases):
    data = (originals / "model.gguf").read_bytes()
    fields, header_end = gguf_fields(data)

    def body(mutated, seen):
        with cases as folder:
            (folder / "model.gguf").write_bytes(mutated)
            check(loader, folder / "model.gguf", True, seen)

    run_fuzz("gguf", st.one_of(patched_fields(data, fields), cut_or_flip(data, header_end)),
             field_sweep(data, fields), body)


@pytest.mark.slow
def test_fuzz_safetensors_headers(loader, originals, cases):
    data = (originals / "native" / "model.safetensors").read_bytes()
    n = struct.unpack_from("<Q", data)[0]
    header, body_bytes = json.loads(data[8:8 + n]), data[8 + n:]

    def encode(h) -> bytes:
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + body_bytes

    mutations = st.one_of(
        safetensors_header(header).map(encode),
        mutated_dict(header, ["__metadata__"]).map(encode),
        patched_fields(data, [("length", 0, 8, "u")], 1),
        cut_or_flip(data, 8 + n),
    )
    name = next(k for k in header if k != "__metadata__")
    sweep = [encode({**header, name: {**header[name], part: value}}) for part, values in (
        ("dtype", SAFETENSORS_DTYPES + [None, 3]),
        ("shape", [[], [0], [-1], [2**31 - 1, 2**31 - 1], [2**64], [1] * 64, "x", None]),
        ("data_offsets", [[0, 0], [0, 2**63], [2**64, 0], [-1, 4], [4, 0], [0], None]))
        for value in values]
    sweep += [encode({**header, name: None}), encode({"__metadata__": header.get("__metadata__")})]
    sweep += field_sweep(data, [("length", 0, 8, "u")])

    def body(mutated, seen):
        with cases as folder:
            shutil.copytree(originals / "native", folder / "m")
            (folder / "m" / "model.safetensors").write_bytes(mutated)
            check(loader, folder / "m", False, seen)

    run_fuzz("safetensors", mutations, sweep, body)


@pytest.mark.slow
def test_fuzz_llama2c_headers(loader, originals, cases):
    files = {v: (originals / f"v{v}.bin").read_bytes() for v in (0, 1)}

    def body(mutated, seen):
        with cases as folder:
            (folder / "m.bin").write_bytes(mutated)
            check(loader, folder / "m.bin", False, seen)

    mutations = st.sampled_from([0, 1]).flatmap(
        lambda v: patched_fields(files[v], llama2c_fields(v)) | cut_or_flip(files[v], 28 if v == 0 else 256))
    run_fuzz("llama2c", mutations, [m for v in (0, 1) for m in field_sweep(files[v], llama2c_fields(v))], body)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["config", "hf_config"])
def test_fuzz_config_json(loader, originals, cases, kind):
    folder_name = "native" if kind == "config" else "hf"
    config = json.loads((originals / folder_name / "config.json").read_text())
    # Keys the reader looks at but the file may lack: the HF RoPE and MoE entries, a MiniGPT variant or two.
    extra = ["rope_scaling", "rope_parameters", "head_dim", "num_local_experts", "sliding_window", "layer_types",
             "use_sliding_window", "partial_rotary_factor", "quantization", "pos_encoding", "n_experts"]
    rope = st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "dynamic", "llama3", "yarn", "default", 3]),
                                  "factor": JSON_SCALARS}, optional={
        "original_max_position_embeddings": JSON_SCALARS, "low_freq_factor": JSON_SCALARS,
        "high_freq_factor": JSON_SCALARS, "beta_fast": JSON_SCALARS, "rope_theta": JSON_SCALARS})
    values = JSON_VALUES | rope if kind == "hf_config" else JSON_VALUES
    keys = sorted(set(config) | set(extra))
    sweep = [{k: v for k, v in config.items() if k != key} for key in keys]
    sweep += [{**config, key: value} for key in keys for value in JSON_EDGES]

    def body(mutated, seen):
        with cases as folder:
            shutil.copytree(originals / folder_name, folder / "m")
            (folder / "m" / "config.json").write_text(json.dumps(mutated))
            check(loader, folder / "m", True, seen)

    run_fuzz(kind, mutated_dict(config, extra, values), sweep, body)

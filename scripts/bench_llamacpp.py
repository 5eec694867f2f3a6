"""llama.cpp and MiniGPT side by side on the same weights, on this CPU, batch 1, greedy.

What it does (``python scripts/bench_llamacpp.py [--model SRC | --preset small]``):

1. Builds llama.cpp (once, into ``--cache``, default ``/work/cache/llama.cpp``) from the vendored source of the
   ``llama_cpp_python`` sdist (``pip download --no-binary :all: --no-deps llama_cpp_python``), with cmake and ninja
   from PyPI, ``-DGGML_NATIVE=ON`` (``-march=native``), at ``nice -n 19`` and ``--jobs`` (default 1) compile jobs,
   and only the tools it needs: ``llama-bench``, ``llama-completion`` (the CLI: ``-t`` threads, non-interactive),
   ``llama-simple`` and ``llama-quantize``.
2. Takes a Hugging Face fp32 directory (``--model``: any MiniGPT model source, exported with ``minigpt export
   --format hf`` when it is not one already; default ``../shared/data/models/stories260K/hf``; or ``--preset``: a
   random-weight MiniGPT preset exported the same way) and converts it with llama.cpp's own
   ``convert_hf_to_gguf.py`` to F32, F16, BF16 and Q8_0 GGUF, and with ``llama-quantize`` from F32 to Q4_0.
3. Measures, in ``--rounds`` interleaved rounds (each round: every precision, llama.cpp then MiniGPT), medians:

   * decode tokens/s, batch 1, ``--new-tokens`` (128) tokens: llama-bench ``tg128`` (from an empty context) vs
     MiniGPT's warm in-process ``generate_tokens`` from a 1-token prompt (compiled decode step, an AOTInductor
     package unless ``--no-aoti``, eager with ``--no-compile``; compilation happens before the rounds);
   * prefill tokens/s over ``--prefill`` (512) tokens: llama-bench ``pp512`` vs a MiniGPT forward into a fresh KV
     cache, last position's logits only;
   * time to first token, ms: a ``--ttft-prompt`` (128) token prompt plus one generated token -- llama-bench
     ``-pg 128,1`` (time = 129 / its tokens/s) vs MiniGPT's prefill plus one decode step;
   * end-to-end wall time of one CLI call generating ``--new-tokens`` tokens from a short prompt:
     ``llama-completion -no-cnv --temp 0 -t T`` vs ``minigpt generate --temperature 0 --threads T`` (a fresh
     process each: start-up, load, prompt, decode; each side reads the weights saved once in that precision:
     the GGUF, and a MiniGPT directory made by ``minigpt export --dtype`` or ``minigpt quantize``;
     ``--cli-compile`` adds ``--compile``, after one untimed call
     per precision that saves the compiled step for the timed ones to load; ``--cli-warm`` runs each side's call
     once untimed right before its timed one), with the number of tokens
     each generated (either may stop at EOS) and the decode rate each CLI reports for its call (llama.cpp's
     ``eval time`` line, MiniGPT's ``--stats``);
   * with ``--chat``: the decode rate and time to first token of `minigpt chat --compile --stats` answering three
     user turns greedily (``--new-tokens`` each, the conversation's KV cache kept between turns; medians over the
     answers), after one untimed conversation that compiles and saves its steps; its ratio is to llama-bench's
     ``tg`` (llama.cpp's decode from an empty context).

   MiniGPT's matching precision: F32 = fp32, F16 = fp16 weights, BF16 = bf16 weights, Q8_0 = int8 weight-only
   (per channel), Q4_0 = int4 weight-only (groups of 32, Q4_0's own layout). Ratios are MiniGPT / llama.cpp for
   rates and llama.cpp / MiniGPT for times, so > 1 means MiniGPT is faster; under the table, each round's ratio
   and their median. The CPU model (family and model numbers), its SIMD flags, the thread count and the load average
   before and after are printed with the table (``--json FILE``: every sample).

``--isa avx2`` runs both sides as on an AVX2-only CPU, for hosts that have more: llama.cpp built without
``-march=native`` for AVX, AVX2, FMA, F16C and BMI2 (``build-avx2``), MiniGPT under ``ATEN_CPU_CAPABILITY=avx2``
(ATen, Inductor's generated code and MiniGPT's own kernels), ``ONEDNN_MAX_CPU_ISA=AVX2`` and
``MKL_ENABLE_INSTRUCTIONS=AVX2`` (oneMKL's GEMMs follow neither of the others). Same memory system on both sides:
an indication for such CPUs, not a measurement on one.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
TOOLS = ("llama-bench", "llama-completion", "llama-simple", "llama-quantize")
# llama.cpp type -> (converter --outtype or None for llama-quantize, MiniGPT label, torch dtype name, --quantize)
PRECISIONS = {
    "F32": ("f32", "fp32", "float32", None),
    "F16": ("f16", "fp16", "float16", None),
    "BF16": ("bf16", "bf16", "bfloat16", None),
    "Q8_0": ("q8_0", "int8", "float32", "int8"),
    "Q4_0": (None, "int4", "float32", "int4"),
}
FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
PROMPT = "Once upon a time, there was a little girl"
CHAT = "Tell me a story about a little girl.\nWhat happened next?\nAnd then?\n"  # --chat's three user turns


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cmd, check: bool = True, **kw) -> subprocess.CompletedProcess:
    # errors="replace": a model's text may end mid-character (random weights print stray bytes)
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", **kw)
    if proc.returncode and check:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stderr[-3000:]}")
    return proc


# ------------------------------------------------------------------------------------------------- build
def llama_source(cache: Path) -> Path:
    """The vendored llama.cpp tree of the llama_cpp_python sdist in ``cache`` (downloaded and extracted once)."""
    sdists = sorted(glob.glob(str(cache / "llama_cpp_python-*.tar.gz")))
    if not sdists:
        log("downloading the llama_cpp_python sdist")
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "llama_cpp_python",
             "-d", cache])
        sdists = sorted(glob.glob(str(cache / "llama_cpp_python-*.tar.gz")))
    sdist = Path(sdists[-1])
    tree = cache / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    return tree


def build_llamacpp(cache: Path, jobs: int, no_amx: bool = False, isa: str = "native") -> tuple[Path, Path]:
    """``(llama.cpp source tree, its bin directory)``, building the missing tools first. ``no_amx``: a second build
    (``build-noamx``) compiled with ``-mno-amx-*``, for hosts where llama.cpp's AMX kernels fault (seen here: a
    general protection fault at ``ldtilecfg`` in ``ggml_backend_amx_mul_mat`` during prompt processing of Q8_0 and
    Q4_0 weights, whose repacked buffers route matrix products to AMX). ``isa="avx2"``: a build for an AVX2-only
    CPU (``build-avx2``: ``-DGGML_NATIVE=OFF`` with AVX, AVX2, FMA, F16C and BMI2 on, what an AVX2 EPYC has)."""
    cache.mkdir(parents=True, exist_ok=True)
    tree = llama_source(cache)
    build = cache / ("build-avx2" if isa == "avx2" else "build-noamx" if no_amx else "build")
    bins = build / "bin"
    missing = [t for t in TOOLS if not (bins / t).is_file()]
    if not missing:
        return tree, bins
    if not (VENV_BIN / "cmake").is_file() or not (VENV_BIN / "ninja").is_file():
        log("installing cmake and ninja from PyPI into the venv")
        run([sys.executable, "-m", "pip", "install", "-c", ROOT / "constraints.txt", "cmake", "ninja"])
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    no_amx_flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    extra = [f"-DCMAKE_C_FLAGS={no_amx_flags}", f"-DCMAKE_CXX_FLAGS={no_amx_flags}"] if no_amx else []
    if isa == "avx2":
        extra = ["-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2"))]
    if not (build / "build.ninja").is_file():
        run(["nice", "-n", "19", VENV_BIN / "cmake", "-S", tree, "-B", build, "-G", "Ninja",
             "-DCMAKE_BUILD_TYPE=Release", *(["-DGGML_NATIVE=ON"] if isa != "avx2" else []),
             "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF", *extra], env=env)
    log(f"building {', '.join(missing)} with {jobs} job(s) at nice 19 (minutes on a small machine)")
    run(["nice", "-n", "19", VENV_BIN / "ninja", "-C", build, f"-j{jobs}", *missing], env=env)
    return tree, bins


# ---------------------------------------------------------------------------------------------- weights
def hf_source(args, work: Path) -> Path:
    """A Hugging Face fp32 directory of the weights to compare: --model as is when it is one, else exported."""
    if args.preset:
        src = work / f"{args.preset}-minigpt"
        # llama.cpp's converter needs a tokenizer it knows: stories260K's SentencePiece model (512 pieces; the
        # converter pads the vocabulary to the model's rows: 4096, or the preset's own vocab_size).
        code = ("import sys, torch; from minigpt import Transformer, save_pretrained; "
                "from minigpt.model.config import preset; from minigpt.tokenizer.tokenizer import Tokenizer; "
                "from minigpt.model.config import PRESETS; "
                f"vocab = PRESETS[{args.preset!r}].get('vocab_size', 4096); "
                f"torch.manual_seed(0); model = Transformer(preset({args.preset!r}, vocab_size=vocab, "
                "max_seq_len=1024)); save_pretrained(model, sys.argv[1], Tokenizer.from_file(sys.argv[2]))")
        run([sys.executable, "-c", code, src, args.tokenizer])
    else:
        src = Path(args.model)
        if (src / "config.json").is_file() and "architectures" in json.loads((src / "config.json").read_text()):
            return src
    out = work / "hf"
    run([sys.executable, "-m", "minigpt", "export", src, out, "--format", "hf", "--dtype", "float32"])
    return out


def convert(hf_dir: Path, tree: Path, bins: Path, cache: Path, types: list[str]) -> dict[str, Path]:
    """``{llama.cpp type: GGUF path}``, converted with llama.cpp's tools (kept in ``cache/gguf/<hash>``)."""
    # Keyed by the weights' bytes, not the directory: a --preset run exports to a new temporary directory each
    # time (the same seed, the same bytes), and a path key left a new set of GGUFs behind per run (31 GB at 1.1B).
    h = hashlib.sha256((hf_dir / "config.json").read_bytes())
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    key = h.hexdigest()[:12]
    out = cache / "gguf" / key
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for kind in ["F32"] + [t for t in types if t != "F32"]:
        path = out / f"model-{kind}.gguf"
        if not path.is_file():
            outtype = PRECISIONS[kind][0]
            log(f"converting to {kind}")
            if outtype is None:  # Q4_0: llama-quantize from F32, as llama.cpp's docs do
                run([bins / "llama-quantize", paths["F32"], path, kind])
            else:
                run([sys.executable, tree / "convert_hf_to_gguf.py", hf_dir, "--outtype", outtype, "--outfile",
                     path])
        paths[kind] = path
    return {t: paths[t] for t in types}


# ----------------------------------------------------------------------------------------------- timing
# Types whose CPU weight repacking crashed llama.cpp (seen on this host for Q8_0 and Q4_0: the repacked buffers send
# prompt processing to AMX, which faults; see build_llamacpp's no_amx): they run with repacking off from then on, and
# the table says so.
NO_REPACK: set[str] = set()


def run_llama(cmd: list, kind: str, off_flag: list) -> subprocess.CompletedProcess:
    """Run a llama.cpp tool; if it dies of a signal with weight repacking on, once more with ``off_flag``."""
    if kind not in NO_REPACK:
        proc = run(cmd, check=False)
        if proc.returncode >= 0:
            if proc.returncode:
                raise SystemExit(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stderr[-3000:]}")
            return proc
        log(f"llama.cpp crashed (signal {-proc.returncode}) on {kind} with weight repacking: retrying without "
            "(on a host whose AMX kernels fault, --no-amx keeps repacking, llama.cpp's fast path, on)")
        NO_REPACK.add(kind)
    return run(cmd + off_flag)


def llama_bench(bins: Path, gguf: Path, kind: str, args) -> dict[str, float]:
    """One llama-bench run (``-r 1``): decode tok/s (tg), prefill tok/s (pp) and time to first token (s)."""
    p = run_llama([bins / "llama-bench", "-m", gguf, "-p", args.prefill, "-n", args.new_tokens, "-pg",
                   f"{args.ttft_prompt},1", "-t", args.threads, "-r", 1, "-o", "json"], kind, ["--repack", 0])
    out = {}
    for test in json.loads(p.stdout):
        n_prompt, n_gen, rate = test["n_prompt"], test["n_gen"], test["avg_ts"]
        if n_prompt and n_gen:
            out["ttft_s"] = (n_prompt + n_gen) / rate
        elif n_gen:
            out["decode"] = rate
        else:
            out["prefill"] = rate
    return out


def minigpt_variant(hf_dir: Path, kind: str, args):
    import torch

    from minigpt.infer.fastpath import load_for_inference

    _, _, dtype, quantize = PRECISIONS[kind]
    return load_for_inference(hf_dir, dtype=getattr(torch, dtype), quantize=quantize, compile=not args.no_compile,
                              aoti=not args.no_aoti)


def minigpt_measure(fp, args) -> dict[str, float]:
    """MiniGPT in this process: decode tok/s, prefill tok/s, time to first token (prefill + one step), seconds."""
    import torch

    from minigpt.infer.generate import generate_tokens
    from minigpt.infer.sampling import SamplingParams

    vocab = fp.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0)
    with torch.inference_mode():
        t = time.perf_counter()
        n = len(list(generate_tokens(fp, [1], greedy)))  # no stop ids: exactly new_tokens
        decode = n / (time.perf_counter() - t)
        tokens = torch.randint(0, vocab, (1, args.prefill), generator=gen)
        t = time.perf_counter()
        fp(tokens, 0, fp.new_kv_cache(1, args.prefill), last_only=True)
        prefill = args.prefill / (time.perf_counter() - t)
        prompt = torch.randint(0, vocab, (1, args.ttft_prompt), generator=gen)
        t = time.perf_counter()
        cache = fp.new_kv_cache(1, args.ttft_prompt + 1)
        logits = fp(prompt, 0, cache, last_only=True)[:, -1]
        fp.decode_step(logits.argmax(-1, keepdim=True), args.ttft_prompt, cache)
        ttft = time.perf_counter() - t
    return {"decode": decode, "prefill": prefill, "ttft_s": ttft}


def cli_sources(hf_dir: Path, work: Path, types: list[str]) -> dict[str, Path]:
    """``{llama.cpp type: model directory}`` for the CLI calls, each saved once in its own precision as llama.cpp's
    GGUFs are: F32 the fp32 directory, F16/BF16 ``minigpt export --dtype``, Q8_0/Q4_0 ``minigpt quantize``."""
    # The CLI's bytecode, as a pip-installed package has it: an editable checkout under PYTHONDONTWRITEBYTECODE=1
    # would otherwise compile MiniGPT's sources in every timed call (~0.3 s measured).
    run([sys.executable, "-m", "compileall", "-q", ROOT / "minigpt"])
    out = {}
    for kind in types:
        _, label, dtype, quantize = PRECISIONS[kind]
        if kind == "F32":
            out[kind] = hf_dir
            continue
        out[kind] = work / f"minigpt-{label}"
        if quantize:
            run([sys.executable, "-m", "minigpt", "quantize", hf_dir, out[kind], "--dtype", quantize])
        else:
            run([sys.executable, "-m", "minigpt", "export", hf_dir, out[kind], "--format", "hf", "--dtype", dtype])
    return out


def cli_calls(bins: Path, gguf: Path, model_dir: Path, kind: str, args) -> dict[str, float]:
    """Wall seconds (and generated tokens) of one llama-completion and one `minigpt generate` call, each on the
    weights saved in this precision (``gguf``; ``model_dir`` from :func:`cli_sources`)."""
    _, _, dtype, _ = PRECISIONS[kind]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    llama = [bins / "llama-completion", "-m", gguf, "-n", args.new_tokens, "--temp", 0, "-t", args.threads,
             "-no-cnv", "-p", PROMPT]
    if args.cli_warm:
        run_llama(llama, kind, ["--no-repack"])
    t = time.perf_counter()
    p = run_llama(llama, kind, ["--no-repack"])
    llama_s = time.perf_counter() - t
    m = re.search(r"\beval time =.*?/\s*(\d+) runs.*?([\d.]+) tokens per second", p.stderr)
    cmd = [sys.executable, "-m", "minigpt", "generate", model_dir, "--prompt", PROMPT, "--max-new-tokens",
           args.new_tokens, "--temperature", 0, "--threads", args.threads, "--dtype", dtype, "--stats"]
    cmd += ["--compile"] if args.cli_compile else []
    if args.cli_warm:
        run(cmd, env=env)
    t = time.perf_counter()
    q = run(cmd, env=env)
    ours_s = time.perf_counter() - t
    n = re.search(r"total (\d+) tokens", q.stderr)
    d = re.search(r"decode ([\d.]+) tokens/s", q.stderr)
    # The decode rate each CLI reports for its own call (llama.cpp: "eval time", the tokens after the first).
    return {"llama_cli_s": llama_s, "llama_cli_tokens": int(m.group(1)) + 1 if m else -1,
            "llama_cli_decode": float(m.group(2)) if m else float("nan"),
            "minigpt_cli_s": ours_s, "minigpt_cli_tokens": int(n.group(1)) if n else -1,
            "minigpt_cli_decode": float(d.group(1)) if d else float("nan")}


def chat_call(model_dir: Path, kind: str, args, compile: bool = True) -> dict[str, float]:
    """One `minigpt chat --stats` conversation of three greedy answers of ``--new-tokens`` tokens each (the
    conversation growing to ~400 tokens); the median of its answers' decode rates and times to first token."""
    cmd = [sys.executable, "-m", "minigpt", "chat", model_dir, "--stats", "--temperature", 0, "--max-tokens",
           args.new_tokens, "--threads", args.threads, "--dtype", PRECISIONS[kind][2], *(["--compile"] * compile)]
    p = subprocess.run([str(c) for c in cmd], input=CHAT, capture_output=True, text=True, check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    answers = re.findall(r"time to first token ([\d.]+) s \| decode ([\d.]+) tokens/s", p.stderr)
    if len(answers) != CHAT.count("\n"):
        raise SystemExit(f"minigpt chat printed {len(answers)} --stats lines:\n{p.stderr[-2000:]}")
    return {"chat_decode": statistics.median(float(d) for _, d in answers),
            "chat_ttft_s": statistics.median(float(t) for t, _ in answers)}


# ----------------------------------------------------------------------------------------------- report
def cpu_description() -> str:
    model, flags = "unknown CPU", []
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        model += " (family {} model {})".format(*(re.search(rf"{f}\s*:\s*(\d+)", text).group(1)  # "AMD EPYC":
                                                   for f in ("cpu family", "model")))  # which generation?
        have = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
        flags = [f for f in FLAGS if f in have]
    except (OSError, AttributeError):
        pass
    return f"{model}; flags: {' '.join(flags) or 'none of ' + ' '.join(FLAGS)}; {os.cpu_count()} logical CPUs"


def round_ratios(samples: dict, types: list[str], args) -> str:
    """Each round's ratio of the two sides' figures (run back to back: a slow phase of a shared host touches both),
    and their median: robust where the medians of each side drift apart."""
    keys = [("decode", "decode", True), ("prefill", f"pp{args.prefill}", True), ("ttft_s", "TTFT", False)]
    lines = ["per-round ratios (> 1: MiniGPT faster), median in brackets:"]
    for kind in types:
        both = list(zip(samples["llama"][kind], samples["minigpt"][kind]))
        pairs = [(name, [b[key] / a[key] if rate else a[key] / b[key] for a, b in both]) for key, name, rate in keys]
        if not args.no_cli:
            cli = samples["cli"][kind]
            pairs += [("one CLI call", [c["llama_cli_s"] / c["minigpt_cli_s"] for c in cli]),
                      ("CLI decode", [c["minigpt_cli_decode"] / c["llama_cli_decode"] for c in cli])]
        lines.append(f"  {kind}: " + "; ".join(f"{name} {'/'.join(f'{r:.2f}' for r in rs)} "
                                               f"({statistics.median(rs):.2f})" for name, rs in pairs))
    return "\n".join(lines)


def table(samples: dict, types: list[str], args) -> str:
    med = lambda side, kind, key: statistics.median(r[key] for r in samples[side][kind])  # noqa: E731
    head = ["llama.cpp", "MiniGPT", "decode tok/s llama.cpp", "MiniGPT", "ratio", f"pp{args.prefill} llama.cpp",
            "MiniGPT", "ratio", f"TTFT ms ({args.ttft_prompt}+1) llama.cpp", "MiniGPT", "ratio"]
    if not args.no_cli:
        head += ["CLI wall s llama.cpp", "MiniGPT", "ratio", "tokens (llama.cpp / MiniGPT)",
                 "CLI decode tok/s llama.cpp", "MiniGPT", "ratio"]
    if args.chat:
        head += ["chat --compile decode tok/s", "ratio to llama.cpp decode", "chat TTFT ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in types:
        row = [kind + (" (no repack)" if kind in NO_REPACK else ""), PRECISIONS[kind][1]]
        for key, rate in (("decode", True), ("prefill", True), ("ttft_s", False)):
            a, b = med("llama", kind, key), med("minigpt", kind, key)
            scale = 1 if rate else 1000
            row += [f"{a * scale:,.2f}", f"{b * scale:,.2f}", f"**{(b / a if rate else a / b):.2f}×**"]
        if not args.no_cli:
            a, b = med("cli", kind, "llama_cli_s"), med("cli", kind, "minigpt_cli_s")
            counts = f"{samples['cli'][kind][0]['llama_cli_tokens']} / {samples['cli'][kind][0]['minigpt_cli_tokens']}"
            row += [f"{a:.2f}", f"{b:.2f}", f"**{a / b:.2f}×**", counts]
            a, b = med("cli", kind, "llama_cli_decode"), med("cli", kind, "minigpt_cli_decode")
            row += [f"{a:,.2f}", f"{b:,.2f}", f"**{b / a:.2f}×**"]
        if args.chat:
            a, b = med("llama", kind, "decode"), med("chat", kind, "chat_decode")
            row += [f"{b:,.2f}", f"**{b / a:.2f}×**", f"{med('chat', kind, 'chat_ttft_s') * 1000:,.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "../shared/data/models/stories260K/hf"),
                    help="model source (HF fp32 dir, or anything `minigpt export` reads); default stories260K")
    ap.add_argument("--preset", help="a random-weight MiniGPT preset (e.g. small) instead of --model")
    ap.add_argument("--tokenizer", default=str(ROOT / "../shared/data/models/stories260K/tok512.model"),
                    help="SentencePiece model saved with --preset (default stories260K's)")
    ap.add_argument("--cache", default="/work/cache/llama.cpp", help="llama.cpp sdist, build and GGUF cache")
    ap.add_argument("--jobs", type=int, default=1, help="compile jobs for the llama.cpp build (default 1)")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp and stop")
    ap.add_argument("--no-amx", dest="no_amx", action="store_true",
                    help="use a llama.cpp build without AMX kernels (build-noamx), for hosts where they fault")
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: both sides as on an AVX2-only CPU (llama.cpp built for AVX2; MiniGPT with "
                         "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2): an "
                         "indication on an AVX-512 host")
    ap.add_argument("--precisions", default="F32,F16,BF16,Q8_0,Q4_0", help="llama.cpp types, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported; >= 3 for a table)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads on both sides")
    ap.add_argument("--new-tokens", dest="new_tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--ttft-prompt", dest="ttft_prompt", type=int, default=128)
    ap.add_argument("--no-compile", dest="no_compile", action="store_true", help="MiniGPT in-process eager")
    ap.add_argument("--no-cli", dest="no_cli", action="store_true", help="skip the end-to-end CLI calls")
    ap.add_argument("--no-aoti", dest="no_aoti", action="store_true",
                    help="MiniGPT's compiled step through torch.compile's saved step, not an AOTInductor package")
    ap.add_argument("--cli-compile", dest="cli_compile", action="store_true",
                    help="`minigpt generate --compile`, after one untimed call that fills the compile cache")
    ap.add_argument("--cli-warm", dest="cli_warm", action="store_true",
                    help="precede each timed CLI call by the same call untimed, so that both sides find their weights "
                         "in the page cache (a 1.1B model's four precisions outgrow a 24 GB host's, and the side "
                         "whose files were read last would have them)")
    ap.add_argument("--chat", action="store_true",
                    help="also time `minigpt chat --compile --stats` (three greedy answers of --new-tokens tokens, "
                         "after one untimed conversation that compiles its steps) against llama-bench's decode")
    ap.add_argument("--json", dest="json_path", help="write every sample here")
    args = ap.parse_args()
    types = [t.strip().upper() for t in args.precisions.split(",") if t.strip()]
    bad = [t for t in types if t not in PRECISIONS]
    if bad or args.rounds < 1:
        ap.error(f"unknown precisions {bad} (choose from {list(PRECISIONS)}) or --rounds < 1")
    cache = Path(args.cache)
    tree, bins = build_llamacpp(cache, args.jobs, args.no_amx, args.isa)
    if args.build_only:
        print(f"llama.cpp tools in {bins}")
        return 0
    if args.isa == "avx2":  # before torch loads (ATen reads it once); the CLI calls inherit it
        os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2")

    import torch

    torch.set_num_threads(args.threads)
    cpu, load_before = cpu_description(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        hf_dir = hf_source(args, Path(tmp))
        ggufs = convert(hf_dir, tree, bins, cache, types)
        cli_dirs = {} if args.no_cli and not args.chat else cli_sources(hf_dir, Path(tmp), types)
        if cli_dirs and not os.environ.get("MINIGPT_NATIVE_CACHE_GB"):
            # Each precision's CLI calls run from a native bundle, a copy of its weights, and the cache keeps 8 GB of
            # bundles by default: the four of a 1.1B model (8.5 GB) pushed each other out, so every timed call
            # rebuilt its own. A user's repeated calls with one model keep theirs; so does this run's limit.
            need = sum(f.stat().st_size for d in cli_dirs.values() for f in Path(d).iterdir() if f.is_file())
            os.environ["MINIGPT_NATIVE_CACHE_GB"] = f"{max(8.0, 1.5 * need / 1e9):.1f}"
            log(f"native bundles kept to {os.environ['MINIGPT_NATIVE_CACHE_GB']} GB for this run")
        log("loading (and compiling) the MiniGPT variants")
        variants = {}
        for kind in types:
            t = time.perf_counter()
            variants[kind] = minigpt_variant(hf_dir, kind, args)
            minigpt_measure(variants[kind], args)  # warm-up: compiles the decode step
            log(f"  {kind}: ready in {time.perf_counter() - t:.1f} s")
            if args.cli_compile and not args.no_cli:
                # One untimed call first: it compiles the CLI's decode step and saves it in the compile cache
                # (minigpt.infer.fastpath.aot), so the timed calls measure a user's second and later runs.
                cli_calls(bins, ggufs[kind], cli_dirs[kind], kind, args)
            if args.chat:
                chat_call(cli_dirs[kind], kind, args)
        samples = {side: {k: [] for k in types} for side in ("llama", "minigpt", "cli", "chat")}
        for r in range(args.rounds):
            for kind in types:
                samples["llama"][kind].append(llama_bench(bins, ggufs[kind], kind, args))
                samples["minigpt"][kind].append(minigpt_measure(variants[kind], args))
                if not args.no_cli:
                    samples["cli"][kind].append(cli_calls(bins, ggufs[kind], cli_dirs[kind], kind, args))
                if args.chat:
                    samples["chat"][kind].append(chat_call(cli_dirs[kind], kind, args))
                log(f"round {r + 1}/{args.rounds} {kind}: llama.cpp {samples['llama'][kind][-1]} | MiniGPT "
                    f"{samples['minigpt'][kind][-1]}" + ("" if args.no_cli else f" | {samples['cli'][kind][-1]}")
                    + (f" | {samples['chat'][kind][-1]}" if args.chat else ""))
    report = table(samples, types, args)
    loads = [" ".join(f"{x:.2f}" for x in avg) for avg in (load_before, os.getloadavg())]
    restricted = ("; both sides restricted to AVX2 (llama.cpp built for it, MiniGPT under ATEN_CPU_CAPABILITY=avx2, "
                  "ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2)") if args.isa == "avx2" else ""
    footer = (f"\n{cpu}; {args.threads} threads; torch {torch.__version__}; {args.rounds} interleaved round(s), "
              f"medians; MiniGPT in-process {'eager' if args.no_compile else 'compiled decode step'}"
              f"{'' if args.no_compile else (' (torch.compile)' if args.no_aoti else ' (AOTInductor)')}, CLI "
              f"{'--compile' if args.cli_compile else 'eager'}; load average {loads[0]} -> {loads[1]}; "
              f"weights {args.preset or args.model}; llama.cpp from {tree.parents[1].name}"
              f"{' built without AMX' if args.no_amx and args.isa != 'avx2' else ''}{restricted}")
    print(report + footer + "\n" + round_ratios(samples, types, args))
    if args.json_path:
        from minigpt.paths import write_output

        write_output(args.json_path, json.dumps({"samples": samples, "cpu": cpu, "args": vars(args)}, indent=1) + "\n",
                     "--json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

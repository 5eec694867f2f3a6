"""Shared pytest fixtures and helpers."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# Compiled decode steps are saved for later processes (minigpt.infer.fastpath.aot): the tests, and the CLIs they
# start, keep theirs in a directory of this session rather than in the user's cache.
SESSION_COMPILE_CACHE = Path(tempfile.mkdtemp(prefix="minigpt-compiled-"))
os.environ["MINIGPT_COMPILE_CACHE"] = str(SESSION_COMPILE_CACHE)
# Likewise the record of checkpoint files already hashed against their manifests (minigpt.checkpoint.atomic).
os.environ["MINIGPT_VERIFIED_CACHE"] = str(Path(tempfile.mkdtemp(prefix="minigpt-verified-")) / "verified.json")
_SESSION_DIRS = (SESSION_COMPILE_CACHE, Path(os.environ["MINIGPT_VERIFIED_CACHE"]).parent)


def pytest_unconfigure(config):
    """Remove this session's compile cache and stamp record: a run leaves ~0.5-50 MB there (the runner library,
    packages), and CI hosts and workstations run the suite many times."""
    import shutil

    for directory in _SESSION_DIRS:
        shutil.rmtree(directory, ignore_errors=True)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The offline corpora / checkpoint directory next to the repository; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is absent")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared data directory: the first 80 kB of the bundled Tiny Shakespeare, a 320-token BPE."""
    from minigpt.data.prepare import prepare
    from minigpt.data.sources import BUNDLED

    root = tmp_path_factory.mktemp("tiny_data")
    text = BUNDLED["shakespeare"].path.read_text(encoding="utf-8")[:80_000]
    src = root / "slice.txt"
    src.write_text(text, encoding="utf-8")
    prepare(str(src), root / "prepared", vocab_size=320)
    return root / "prepared"


# A model small enough that a training step takes milliseconds on 2 cores.
TINY_MODEL = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64, "multiple_of": 16}


@pytest.fixture
def float32_prefill(monkeypatch):
    """The fast path's float32 GEMM for many rows of bf16, int8 or int4 weights even on CPUs with native bf16, where it
    otherwise runs in bf16 (``Proj._gemm``, tested with its own bound in
    tests/infer/test_fastpath_prefill_bf16.py): for tests that compare with the float32 model at float32
    tolerances."""
    from minigpt.infer.fastpath import kernels

    monkeypatch.setattr(kernels, "native_bf16", lambda device_type="cpu": False)


@pytest.fixture
def failing_aot_compile(monkeypatch) -> list:
    """Make every ahead-of-time compile of a decode step fail (minigpt.infer.fastpath.aot, an experimental API);
    the ordinary torch.compile still works. Returns the list that gets one entry per attempt."""
    from minigpt.infer.fastpath import aot

    real, tries = aot.compile_step, []

    class Failing:
        def aot_compile(self, *a, **k):
            tries.append(1)
            raise RuntimeError("unsupported here")

    monkeypatch.setattr(aot, "compile_step", lambda fp, mode, serializable=False, greedy=False:
                        Failing() if serializable else real(fp, mode, greedy=greedy))
    return tries


@pytest.fixture
def runner_cache(tmp_path) -> Path:
    """A compile cache of this test alone (``tmp_path / "cache"``, empty of packages and bundles) that already
    holds the native runner library, built once per session in the session's cache and linked here. Building it
    is the same C++ compilation each time (~25-70 s on 2 cores); the tests that compile their own packages and
    bundles into a cache of their own would otherwise each pay it (13 slow tests, ~14 minutes of CI)."""
    from minigpt.infer.fastpath.library import build_runner

    runner = build_runner(SESSION_COMPILE_CACHE)  # at once when it is there
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    try:
        os.link(runner, cache / runner.name)
    except OSError:  # another filesystem
        import shutil

        shutil.copy2(runner, cache / runner.name)
    return cache


def some_slow(values, slow) -> list:
    """``values`` for ``pytest.mark.parametrize`` with those in ``slow`` marked ``slow``: the cases that keep
    ``make test`` within its 10 minutes run in CI's second stage (``make test-slow``)."""
    return [pytest.param(v, marks=pytest.mark.slow) if v in slow else v for v in values]


def random_model(shape: dict, seed: int = 0, *, noise: float = 0.0, norm_noise: float | None = None, **overrides):
    """The one tiny random model of the test suite: ``Transformer(ModelConfig(**{**shape, **overrides}))`` built
    after ``torch.manual_seed(seed)``, in eval mode.

    ``noise`` adds N(0, noise) to every weight and ``norm_noise`` (default: ``noise``) to the norm gains and the
    biases, so that parity tests cannot pass because a norm is the identity or a bias is zero. Each test module
    keeps its own ``shape`` (vocabulary, widths, context) as a constant.
    """
    import torch

    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**shape, **overrides})).eval()
    norm_noise = noise if norm_noise is None else norm_noise
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = norm_noise if "norm" in name or name.endswith("bias") else noise
            if scale:
                p.add_(torch.randn_like(p) * scale)
    return model


def train_config(tiny_data, out_dir, **kw):
    """A pretraining config on :func:`tiny_data` with the :data:`TINY_MODEL` shape; ``kw`` overrides any field."""
    from minigpt.train.loop import TrainConfig

    base = dict(data=str(tiny_data), out_dir=str(out_dir), preset="tiny", model=dict(TINY_MODEL), seq_len=32,
                batch_size=8, lr=3e-3, warmup_steps=5, max_steps=60, eval_interval=30, eval_windows=16,
                log_interval=5, ckpt_interval=1000, seed=0, threads=1)
    base.update(kw)
    return TrainConfig(**base)


# Subprocesses of the CLI: one thread each (the suite shares 2 cores) and never a hub lookup.
CLI_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}


def float_kernel_paths(code: str, cap_variable: str, isa: str) -> tuple[str, list[str]]:
    """Run ``code`` (a script that prints a float kernel's instruction set, then one line per case) in a child
    process capped to ``isa`` by ``cap_variable`` (``"native"``: not capped) and return ``(this CPU's best path,
    the printed lines)``; skip when ``isa`` is ``"avx2"`` and the CPU has no AVX2. For the float kernels of the
    runner library (``minigpt_ops::float_isa``), which pick their path once per process."""
    from minigpt.runtime import cpu_flags

    if isa == "avx2" and "avx2" not in cpu_flags():
        pytest.skip("the AVX2 path needs an AVX2 CPU")
    best = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags() else "avx2" if "avx2" in cpu_flags() \
        else "scalar"
    env = {**CLI_ENV, **({cap_variable: isa} if isa != "native" else {})}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    return best, out.stdout.strip().splitlines()


def run_cli(*args, stdin=None, env=None):
    """Run ``python -m minigpt ARGS`` (``env``: variables added to :data:`CLI_ENV`) and return the completed
    process (text mode). Forked from a process that has imported torch (``tests/cli_zygote.py``) where that is the
    same process, else a fresh interpreter."""
    command = [sys.executable, "-m", "minigpt", *map(str, args)]
    if env is None and _zygote.usable():
        return _zygote.run(command, stdin, timeout=300)
    return subprocess.run(command, capture_output=True, text=True, env={**CLI_ENV, **(env or {})}, input=stdin,
                          timeout=300)


class _Zygote:
    """The test process's end of ``tests/cli_zygote.py``: started at the first call, kept for the session."""

    def __init__(self):
        self.ready, self.buffer = None, b""

    def usable(self) -> bool:
        if self.ready is None:
            self.ready = False
            if os.environ.get("MINIGPT_TEST_FRESH_CLI") not in (None, "", "0"):
                return False
            requests_r, self.requests = os.pipe()
            self.replies, replies_w = os.pipe()
            subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_zygote.py")), str(requests_r),
                              str(replies_w)], pass_fds=(requests_r, replies_w), env=CLI_ENV, stdin=subprocess.DEVNULL)
            os.close(requests_r)
            os.close(replies_w)
            self.ready = bool((self._reply(120) or {}).get("ready"))
        return self.ready

    def _reply(self, timeout):
        """The zygote's next reply, None after ``timeout`` seconds; raises EOFError if it is gone."""
        import select
        import time

        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if not select.select([self.replies], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                self.ready = False
                raise EOFError("the CLI zygote exited")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, command, stdin, timeout):
        import locale

        with tempfile.TemporaryDirectory() as tmp:
            paths = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            for name, path in paths.items():
                with open(path, "w", encoding="utf-8") as f:
                    f.write(stdin if name == "stdin" and stdin is not None else "")
            request = {"args": command[3:], "cwd": os.getcwd(), "env": CLI_ENV, **paths}
            os.write(self.requests, (json.dumps(request) + "\n").encode())
            pid = self._reply(60)["pid"]
            reply = self._reply(timeout)
            if reply is None:
                os.kill(pid, 9)
                self._reply(60)
                raise subprocess.TimeoutExpired(command, timeout)
            encoding = locale.getpreferredencoding(False)
            out = [Path(paths[name]).read_bytes().decode(encoding).replace("\r\n", "\n").replace("\r", "\n")
                   for name in ("stdout", "stderr")]
        return subprocess.CompletedProcess(command, reply["returncode"], *out)


_zygote = _Zygote()


def assert_one_line_error(proc, *fragments):
    """The CLI failed with exit 1 and exactly one ``error: ...`` line containing every fragment, no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# A chat template in the shape of Qwen2.5's (ChatML with a tools section): the tools as JSON lines inside <tools>,
# the model's calls as <tool_call>{"name", "arguments"}</tool_call> blocks, tool answers as <tool_response> blocks
# in a user turn. Shared by the tools-rendering tests (tokenizer) and the tool-call round trip (serve).
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role in ('user', 'system') or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + tool_call.arguments | tojson"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

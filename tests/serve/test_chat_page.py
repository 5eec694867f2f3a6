"""The chat page in a real headless Chromium: type a message, press Enter, watch the answer stream in.

The browser is driven through the Chrome DevTools Protocol over ``--remote-debugging-pipe`` (JSON messages ending
in a NUL byte on file descriptors 3 and 4), so the test needs no driver package and no network port.
"""
import json
import os
import shutil
import subprocess
import time
import urllib.request

import pytest
import torch
from conftest import TINY_MODEL
from serve_helpers import ServerProcess

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install -y chromium) so the browser test of the chat page cannot run")


class DevTools:
    """A minimal CDP client over the pipe of a Chromium started with --remote-debugging-pipe."""

    def __init__(self, url, profile):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds_3_and_4():
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-pipe", url],
            pass_fds=(3, 4), preexec_fn=fds_3_and_4, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._next_id = 0
        self.session = None

    def call(self, method, session=True, timeout=60, **params):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" not in self._buf:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the DevTools pipe")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
        raise TimeoutError(method)

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture(scope="module")
def server(tiny_data, tmp_path_factory):
    from minigpt.checkpoint.native import save_pretrained
    from minigpt.model.config import ModelConfig
    from minigpt.model.transformer import Transformer
    from minigpt.tokenizer.tokenizer import Tokenizer

    torch.manual_seed(0)
    tok = Tokenizer.from_dir(tiny_data)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, **{**TINY_MODEL, "max_seq_len": 128})).eval()
    ckpt = save_pretrained(model, tmp_path_factory.mktemp("page") / "page-model", tokenizer=tok)
    srv = ServerProcess(ckpt)
    yield srv
    srv.stop()


def test_typed_message_gets_a_streamed_answer(server, tmp_path):
    expected_body = {"messages": [{"role": "user", "content": "Good morrow"}], "max_tokens": 24, "temperature": 0}
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(expected_body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        expected = json.loads(r.read())["choices"][0]["message"]["content"]

    browser = DevTools(server.url + "/", tmp_path / "profile")
    try:
        deadline = time.monotonic() + 60
        page = None
        while page is None and time.monotonic() < deadline:
            pages = [t for t in browser.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
            page = next((t for t in pages if t["url"].startswith(server.url)), None)
            if page is None:
                time.sleep(0.2)
        assert page is not None, "chromium opened no page"
        browser.session = browser.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        # Headless pages are never "focused" unless told to be; typing goes to the focused element.
        browser.call("Emulation.setFocusEmulationEnabled", enabled=True)
        while not browser.evaluate("document.readyState === 'complete' && typeof chat === 'function'"):
            assert time.monotonic() < deadline, "the chat page did not load"
            time.sleep(0.1)
        browser.evaluate("document.getElementById('temperature').value = '0';"
                         "document.getElementById('max-tokens').value = '24'")
        while browser.evaluate("document.getElementById('input').value") != "Good morrow":
            assert time.monotonic() < deadline, "could not type into the message box"
            browser.evaluate("document.getElementById('input').value = ''; document.getElementById('input').focus()")
            browser.call("Input.insertText", text="Good morrow")
        for kind in ("keyDown", "keyUp"):
            browser.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        state = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = browser.evaluate(
                "(() => { const a = [...document.querySelectorAll('.msg')].pop();"
                " return a ? {cls: a.className, state: a.dataset.state, chunks: Number(a.dataset.chunks || 0),"
                " text: a.textContent, user: document.querySelector('.user')?.textContent} : {}; })()")
            if state.get("state") in ("done", "error"):
                break
            time.sleep(0.1)
        assert state.get("state") == "done", state
        assert state["user"] == "Good morrow"
        assert state["text"] == expected and expected
        assert state["chunks"] > 1, "the answer arrived in one piece, not streamed"
        assert browser.evaluate("document.getElementById('input').value") == ""
    finally:
        browser.close()

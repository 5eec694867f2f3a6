"""Run the tests' ``python -m minigpt ARGS`` calls as children forked from one process that has imported torch.

Why: a fresh interpreter spends about 2 s importing torch before the command starts, and the suite makes a few
hundred such calls. Forked from a process that has already imported it (and nothing of MiniGPT), a call starts in a
few tenths of a second and is otherwise the same process: the same interpreter, environment (:data:`CLI_ENV`
of conftest, fixed when the zygote starts), working directory, ``sys.argv`` and ``sys.path`` as ``python -m``
sets them, stdin from a file (or ``/dev/null``), stdout and stderr to files, and a normal interpreter exit
(``atexit`` handlers, flushes). Forking is safe only while the zygote has a single thread, which it checks (OpenMP
and OpenBLAS start theirs at first use, and ``OMP_NUM_THREADS=1`` keeps it so); otherwise, or with
``MINIGPT_TEST_FRESH_CLI=1``, or when a call adds its own environment, conftest runs a fresh interpreter.

Protocol (one JSON object a line): the test process writes ``{"args", "cwd", "env", "stdin", "stdout",
"stderr"}`` (the last three: file paths); the zygote answers ``{"pid"}`` once forked, then ``{"returncode"}``.
"""
import json
import os
import sys


def _child(request: dict, pipes: tuple[int, int]) -> None:
    """In the forked child: become ``python -m minigpt ARGS``. Its exit (SystemExit, or an uncaught exception's
    traceback and status 1) ends this process as it ends a fresh one."""
    for fd, path, flags in ((0, request["stdin"], os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    for fd in pipes:  # the zygote's: a child holding them open would keep the test waiting
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # what `python -m` puts first
    sys.argv = ["-m", *request["args"]]  # runpy sets argv[0] to the module's file, as `python -m` does
    import runpy

    runpy.run_module("minigpt", run_name="__main__", alter_sys=True)
    sys.exit(0)


def main(requests_fd: int, replies_fd: int) -> None:
    sys.path[0] = os.getcwd()  # as the children have it (`python -m`), not this file's folder
    import torch  # noqa: F401  (the import every call would otherwise pay)

    requests, replies = os.fdopen(requests_fd, "r"), os.fdopen(replies_fd, "w")
    single = len(os.listdir("/proc/self/task")) == 1
    replies.write(json.dumps({"ready": single}) + "\n")
    replies.flush()
    if not single:
        return
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (requests_fd, replies_fd))  # never returns: the child exits from inside it
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

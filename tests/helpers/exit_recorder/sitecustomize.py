"""Test instrument: each torchrun worker records how it ended, because torchrun reports its workers' exit statuses
only when it was not itself told to stop (SIGTERM: ``scancel``, preemption).

Python imports ``sitecustomize`` at start-up from ``sys.path``; with this directory on ``PYTHONPATH`` and
``LCTRAIN_TEST_EXIT_DIR`` set, a process that runs a module as ``__main__`` (``python -m lctrain ...``, as torchrun
starts its workers) writes ``rank_<RANK>_<pid>.json`` into that directory when the module returns or raises:

- ``status``: the exit status the interpreter is about to return (``SystemExit(code)``: ``code``; an uncaught
  exception: 1, with its type in ``uncaught``, and Python prints its traceback);
- ``rank``, ``node`` (the slurm node, else the hostname) and ``time`` (``time.time()`` at the end);
- ``log_dir``: the worker's directory under torchrun's ``--log-dir`` (``stdout.log`` and ``stderr.log`` with
  ``--redirects`` or ``--tee``).

A worker killed by a signal writes nothing.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import time

_EXIT_DIR = os.environ.get("LCTRAIN_TEST_EXIT_DIR")
_run_module_as_main = runpy._run_module_as_main


def _record(status: int, uncaught: str | None) -> None:
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    report = {
        "rank": int(os.environ.get("RANK", -1)),
        "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "status": status,
        "uncaught": uncaught,
        "log_dir": os.path.dirname(error_file) if error_file else None,
        "time": time.time(),
    }
    os.makedirs(_EXIT_DIR, exist_ok=True)
    path = os.path.join(_EXIT_DIR, f"rank_{report['rank']}_{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.replace(path + ".tmp", path)


def _recording_run_module_as_main(*args: object, **kwargs: object) -> object:
    try:
        result = _run_module_as_main(*args, **kwargs)
    except SystemExit as exit_:
        code = exit_.code
        _record(0 if code is None else code if isinstance(code, int) else 1, None)
        raise
    except BaseException as error:
        _record(1, type(error).__name__)
        raise
    _record(0, None)
    return result


if _EXIT_DIR:
    runpy._run_module_as_main = _recording_run_module_as_main

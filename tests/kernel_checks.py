"""Checks of the Triton kernels on the CPU through Triton's interpreter, one process per kernel file.

    python tests/kernel_checks.py [--jobs N] SPEC [SPEC ...]

SPEC: KERNEL, the checks of tests/kernel_checks_KERNEL.py (KERNEL: a file of creditlab/kernels) but those of its
parts, or KERNEL:PART, the checks of one part (a group of checks slow enough to want a process of its own beside
the kernel's others). Each SPEC's checks run in a process of their own, N at once (by default one a core), and
as each finishes one JSON line is printed: {"spec", "returncode", "report" (check name -> result), "stderr" (its
tail)}. tests/test_kernels.py reads them.

The interpreter is chosen when a kernel is defined, so it cannot be switched on inside a running test: this process
sets TRITON_INTERPRET=1 before the package is imported. It imports torch, Triton and the checks once, then forks a
process for each SPEC: each runs its checks apart (a check may patch the package for its own ends), and a failure
names its kernel, without each paying the imports again.
"""

import argparse
import importlib
import json
import os
import sys
import tempfile
import traceback

os.environ["TRITON_INTERPRET"] = "1"
# one thread a process (numpy's BLAS too): several run at once, one a core
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def checks_of(spec: str) -> dict:
    """The checks `spec` (KERNEL or KERNEL:PART) names: {name: a function of no arguments returning its JSON-able
    result}."""
    kernel, _, part = spec.partition(":")
    module = importlib.import_module(f"kernel_checks_{kernel}")
    parts = getattr(module, "PARTS", {})
    if part and part not in parts:
        raise ValueError(f"{kernel} has no part {part!r}; its parts: {', '.join(parts) or 'none'}")
    in_parts = {name for names in parts.values() for name in names}
    names = parts[part] if part else [name for name in module.CHECKS if name not in in_parts]
    return {name: module.CHECKS[name] for name in names}


def _child(spec: str, out_path: str, err_path: str) -> None:
    """The forked process of one spec: its checks' report into out_path, its output and any traceback into
    err_path; never returns."""
    code = 1
    try:
        err = os.open(err_path, os.O_WRONLY)
        os.dup2(err, 1)  # a check's prints go with the errors, not into the parent's JSON lines
        os.dup2(err, 2)
        report = {name: check() for name, check in checks_of(spec).items()}
        with open(out_path, "w") as f:
            json.dump(report, f)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(specs: list[str], jobs: int) -> int:
    """Each spec's checks in a forked process, `jobs` at once; one JSON line a spec as it finishes. Returns how
    many failed."""
    for spec in specs:  # every spec's modules imported here, once, before any fork
        try:
            checks_of(spec)
        except Exception:  # the spec's own process fails the same way, with the traceback in its line
            pass
    for name in ("creditlab.model", "creditlab.ops.loss", "creditlab.ops.relu2", "creditlab.ops.qk_norm",
                 "creditlab.ops.attention_gate", "creditlab.credit.teacher"):
        importlib.import_module(name)
    torch.set_num_threads(1)
    waiting, running, failed = list(enumerate(specs)), {}, 0
    with tempfile.TemporaryDirectory() as folder:
        while waiting or running:
            while waiting and len(running) < jobs:
                index, spec = waiting.pop(0)
                out_path, err_path = (os.path.join(folder, f"{index}.{kind}") for kind in ("json", "err"))
                open(err_path, "w").close()
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    _child(spec, out_path, err_path)
                running[pid] = spec, out_path, err_path
            pid, status = os.wait()
            spec, out_path, err_path = running.pop(pid)
            returncode = os.waitstatus_to_exitcode(status)
            with open(err_path) as f:
                err = f.read()
            report = None
            if returncode == 0:
                with open(out_path) as f:
                    report = json.load(f)
            failed += returncode != 0
            print(json.dumps({"spec": spec, "returncode": returncode, "report": report, "stderr": err[-3000:]}),
                  flush=True)
    return failed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", metavar="SPEC")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser.add_argument("--jobs", type=int, default=cores)
    args = parser.parse_args(argv)
    return 1 if run(args.specs, max(1, args.jobs)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

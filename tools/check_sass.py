#!/usr/bin/env python3
"""Reads the compiled kernels of a CUDA object/archive and fails unless they are what we meant to build.

  check_sass.py FILE [--cuobjdump PATH] [--require-hgmma REGEX ...] [--max-instructions REGEX=N ...]

For every kernel: no stack frame and no local memory (spilled or indexed registers live there), and no
LDL/STL instructions in its SASS. For every kernel whose name matches a --require-hgmma regex: at least one
wgmma instruction on the tensor cores (HGMMA for bf16, QGMMA for FP8; HMMA or FFMA alone means a slower path).
For every kernel whose name matches a --max-instructions regex: at most N SASS instructions. Why a size budget:
a kernel that streams more code per tile than the SM's instruction cache keeps waits on instruction fetch (the
down dgrad at 9,000 instructions: 19 % of its stall samples, 22 % slower; docs/perf_notes.md, round 17).
Prints one line per kernel (registers, shared memory, wgmma count, instructions). Exit 0 pass, 1 fail, 77 when no
cuobjdump is available.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys


def find_cuobjdump(explicit):
    for candidate in [explicit, shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]:
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def demangled_short(name):
    match = re.search(r"[a-z][a-z_]*_kernel", name)
    return match.group(0) if match else name[:60]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--cuobjdump")
    parser.add_argument("--require-hgmma", action="append", default=[])
    parser.add_argument("--max-instructions", action="append", default=[], metavar="REGEX=N")
    args = parser.parse_args()
    budgets = []
    for spec in args.max_instructions:
        pattern, _, limit = spec.rpartition("=")
        if not pattern or not limit.isdigit():
            parser.error(f"--max-instructions: expected REGEX=N, got '{spec}'")
        budgets.append((pattern, int(limit)))
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        print("check_sass: SKIPPED: no cuobjdump (install the CUDA toolkit's, or pip nvidia-cuda-cuobjdump)")
        return 77
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")  # nvdisasm beside cuobjdump
    usage = subprocess.run([tool, "-res-usage", args.file], capture_output=True, text=True, env=env)
    sass = subprocess.run([tool, "-sass", args.file], capture_output=True, text=True, env=env)
    if usage.returncode != 0 or sass.returncode != 0:
        print(usage.stderr + sass.stderr)
        return 1

    resources = {}
    lines = usage.stdout.splitlines()
    for i, line in enumerate(lines):
        match = re.search(r"Function (\S+):", line)
        if match and i + 1 < len(lines):
            fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", lines[i + 1]))
            resources[match.group(1)] = {k: int(v) for k, v in fields.items()}

    bodies, current = {}, None
    for line in sass.stdout.splitlines():
        match = re.search(r"Function : (\S+)", line)
        if match:
            current = match.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)

    if not resources:
        print(f"check_sass: no kernels found in {args.file}")
        return 1
    failures = []
    for name, res in sorted(resources.items()):
        body = "\n".join(bodies.get(name, []))
        hgmma = len(re.findall(r"\b[HQ]GMMA\b", body))
        local_ops = len(re.findall(r"\b(LDL|STL)\b", body))
        instructions = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", body))
        short = demangled_short(name)
        print(f"{short:28s} REG {res.get('REG', 0):3d}  STACK {res.get('STACK', 0):4d}  LOCAL {res.get('LOCAL', 0):4d}  "
              f"SHARED {res.get('SHARED', 0):6d}  GMMA {hgmma:3d}  LDL/STL {local_ops}  SASS {instructions}")
        for pattern, limit in budgets:
            if re.search(pattern, name) and instructions > limit:
                failures.append(f"{short}: {instructions} SASS instructions, over its budget of {limit} "
                                f"(--max-instructions {pattern}={limit}: the instruction cache)")
        if res.get("STACK", 0) or res.get("LOCAL", 0) or local_ops:
            failures.append(f"{short}: stack/local memory in use (register spills or indexed arrays)")
        if any(re.search(pattern, name) for pattern in args.require_hgmma) and hgmma == 0:
            failures.append(f"{short}: no wgmma (HGMMA / QGMMA) instruction")
    for failure in failures:
        print("FAIL", failure)
    if not any(any(re.search(p, n) for n in resources) for p in args.require_hgmma):
        print("FAIL no kernel matches", args.require_hgmma)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Fails unless a shared library exports its own API and nothing else (cmake/MokSharedLibrary.cmake).

  check_exports.py LIB.so --allowed REGEX [--forbid-needed REGEX]

Reads the dynamic symbol table (readelf --dyn-syms) and lists every defined global or weak symbol whose
name does not fully match --allowed; the symbols the linker itself defines in every shared library
(_init, _fini, _edata, _end, __bss_start) are always allowed. A library exporting nothing that matches
--allowed fails too (its API went missing). --forbid-needed fails when a DT_NEEDED entry matches (e.g. a
shared libstdc++ where the runtime should be linked statically). Prints the offending names, demangled.
Exit 0 pass, 1 fail, 77 when readelf is missing.
"""
import argparse
import re
import shutil
import subprocess
import sys

LINKER_SYMBOLS = {"_init", "_fini", "_edata", "_end", "__bss_start"}


def run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"check_exports: {' '.join(command)} failed:\n{result.stderr}")
    return result.stdout


def defined_dynamic_symbols(readelf, path):
    """Names of the defined, non-local, visible symbols of the dynamic table, without version suffixes."""
    names = set()
    for line in run([readelf, "--dyn-syms", "--wide", path]).splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(fields) < 8 or not fields[0].endswith(":") or not fields[0][:-1].isdigit():
            continue
        bind, visibility, section, name = fields[4], fields[5], fields[6], fields[7]
        if section == "UND" or bind == "LOCAL" or visibility in ("HIDDEN", "INTERNAL"):
            continue
        names.add(name.split("@")[0])
    return names


def demangle(names):
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return list(names)
    result = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    return result.stdout.splitlines() if result.returncode == 0 else list(names)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("library")
    parser.add_argument("--allowed", required=True, help="regex the exported names must fully match")
    parser.add_argument("--forbid-needed", help="regex no DT_NEEDED library may match")
    parser.add_argument("--show", type=int, default=40, help="how many offending names to print")
    args = parser.parse_args()
    readelf = shutil.which("readelf")
    if readelf is None:
        print("check_exports: SKIPPED: no readelf (binutils)")
        return 77

    allowed = re.compile(args.allowed)
    exported = defined_dynamic_symbols(readelf, args.library)
    api = sorted(n for n in exported if allowed.fullmatch(n))
    extra = sorted(n for n in exported - LINKER_SYMBOLS if not allowed.fullmatch(n))
    failed = False
    print(f"check_exports: {args.library}: {len(exported)} exported, {len(api)} match '{args.allowed}'")
    for name in api:
        print(f"  api: {name}")
    if not api:
        print(f"check_exports: FAIL: nothing matching '{args.allowed}' is exported")
        failed = True
    if extra:
        runtime = [n for n in extra if re.match(r"_ZNS|_ZNKS|_ZSt|_ZNSt|_ZNKSt|__cxa_|__gxx_|_ZT[ISV]S", n)]
        print(f"check_exports: FAIL: {len(extra)} symbols outside the API ({len(runtime)} of them from the "
              f"C++ runtime: std::, __cxa_, __gxx_); the first {min(args.show, len(extra))}:")
        for name in demangle(extra[:args.show]):
            print(f"  extra: {name[:160]}")
        failed = True
    if args.forbid_needed:
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", run([readelf, "-d", "--wide", args.library]))
        bad = [n for n in needed if re.search(args.forbid_needed, n)]
        print(f"check_exports: needs {', '.join(needed) or 'nothing'}")
        if bad:
            print(f"check_exports: FAIL: needs {', '.join(bad)} (matches '{args.forbid_needed}'): the C++ runtime "
                  "should be linked statically")
            failed = True
    print("check_exports: " + ("FAIL" if failed else "ok: only the API is exported"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

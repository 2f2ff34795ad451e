#!/usr/bin/env bash
# Build .whl/: the wheels the lent GPU machine lacks for the GPU suite (tests/gpu, run there by
# scripts/gpu_suite.sh). That machine has Python 3.12, torch 2.11, transformers 5.17, peft,
# accelerate, lightning, pytest, no network, and no trl, datasets, deepspeed, mlflow, pycocotools.
#
# What goes in: the roots below at the versions of scripts/constraints.txt (the stack the CPU
# suite runs), then their dependency closure for CPython 3.12 on x86-64 Linux, each dependency
# checked against the GPU image's package list (/work/.library/device/KINDS.md, or the file
# named by GPU_HOST_PACKAGES): carried when the image lacks it, or when the image's version is
# known (KINDS.md's pip-list row) and does not satisfy; otherwise left to the image, and said so
# ("unchecked": its version there is unknown here; gpu_suite.sh checks it on the machine).
# DeepSpeed ships only an sdist: it is built here into a pure-Python wheel (DS_BUILD_OPS=0; ops
# are JIT-compiled on use). OPTIONAL roots (transformers, peft at the CPU suite's versions, which
# the GPU runs of the TRL recipes used before) go in only if the bundle still fits.
#
# A device call carries 64 MiB in all (repository included). Whatever does not fit, or has no
# wheel, or conflicts with the image, is printed under PROBLEMS and the script exits 1.
#
#   bash scripts/gpu_wheels.sh          # -> .whl/*.whl + .whl/MANIFEST.json (.whl is git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DEST:-.whl}
PY=${PYTHON:-/root/.cache/gpulaunch-ci/venv/bin/python}   # needs pip, packaging, and torch
[ -x "$PY" ] || PY=python3                               # (torch: to build DeepSpeed's wheel)
KINDS=${GPU_HOST_PACKAGES:-/work/.library/device/KINDS.md}
REQUIRED="trl datasets deepspeed mlflow-skinny sqlalchemy alembic pycocotools torchao"
OPTIONAL="transformers peft"
# what else travels with the wheels: the repository's files (tracked and untracked, not ignored)
repo_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null \
  | tail -1 | cut -f1)
mkdir -p "$DEST"
exec "$PY" - "$DEST" "$KINDS" "$REQUIRED" "$OPTIONAL" "$repo_bytes" <<'PYEOF'
import json, os, re, shutil, subprocess, sys, tempfile, zipfile
from email.parser import Parser
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name as canon
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name as canon
    from pip._vendor.packaging.version import Version

dest, kinds, required, optional, repo_bytes = sys.argv[1:6]
dest = Path(dest)
LIMIT = 64 << 20
budget = LIMIT - int(repo_bytes) - (2 << 20)         # 2 MiB for what gets added before a call
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64",
             "linux_x86_64"]
NEVER = re.compile(r"^(torch|triton|numpy|nvidia-.*|cuda-.*)$")   # the image's own stack

# ---- what the GPU image has (names; versions where KINDS.md's pip-list row gives them)
if not os.path.exists(kinds):
    sys.exit(f"{kinds} not found: set GPU_HOST_PACKAGES to a file holding the GPU image's "
             "package list ('Packages: a, b, ...'); without it every dependency would look missing")
text = open(kinds).read()
m = re.search(r"Packages: ([^\n]+)", text)
host = {canon(n.strip().rstrip(".")) for n in m.group(1).split(",")} if m else set()
row = re.search(r"pip list, as a session saw it \|[^|]*filtered by the names it asked for: ([^|]+)\|",
                text)
host_ver = {}
for pair in (row.group(1).split(",") if row else []):
    parts = pair.split()
    if len(parts) == 2:
        host_ver[canon(parts[0])] = parts[1]
if not host:
    sys.exit(f"no 'Packages:' list in {kinds}")

# ---- the CPU suite's versions
pins = {}
for line in open("scripts/constraints.txt"):
    mm = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;#]+)", line)
    if mm:
        pins[canon(mm.group(1))] = mm.group(2)
# torchao's wheels are built for one torch each: 0.17.0 is the one for the image's torch 2.11
# (tests/gpu/test_gpu_mesh.py's FP8 recipe), whatever the CPU suite's torch takes
pins["torchao"] = "0.17.0"

notes, problems = [], []
image = {}        # canon name -> what the bundle needs of the image's copy
bundle = {}       # canon name -> {"name", "version", "file", "bytes", "for", "group"}


def wheel_meta(path: Path):
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode("utf-8", "replace"))


def existing(c: str, version: str):
    for f in dest.glob("*.whl"):
        n, v = f.name.split("-")[:2]
        if canon(n) == c and v == version:
            return f
    return None


def fetch(name: str, spec: str) -> Path | None:
    """One wheel for `name` (== pinned version, or the newest matching `spec`)."""
    c = canon(name)
    pinned = spec[2:] if spec.startswith("==") else None
    got = existing(c, pinned) if pinned else None     # built or fetched before: reuse it
    if got is not None:
        return got
    stage = Path(tempfile.mkdtemp(prefix="gpu-wheels-"))
    try:
        if c == "deepspeed":      # sdist only: build a pure-Python wheel without its CUDA ops
            env = {**os.environ, "DS_BUILD_OPS": "0"}
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                   "--no-build-isolation", "-w", str(stage), f"{name}{spec}"]
            ok = subprocess.run(cmd, env=env, capture_output=True, text=True).returncode == 0
            if not ok:   # no torch in this interpreter: an isolated build brings its own
                cmd.remove("--no-build-isolation")
                ok = subprocess.run(cmd, env=env, capture_output=True, text=True).returncode == 0
        else:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                   "-d", str(stage)] + [a for p in PLATFORMS for a in ("--platform", p)] + \
                  [f"{name}{spec}"]
            p = subprocess.run(cmd, capture_output=True, text=True)
            ok = p.returncode == 0
            if not ok:
                problems.append(f"NO WHEEL: {name}{spec} for CPython 3.12 x86-64: "
                                f"{p.stderr.strip().splitlines()[-1:]}")
        wheels = sorted(stage.glob("*.whl"))
        if not ok or not wheels:
            if c == "deepspeed":
                problems.append(f"BUILD FAILED: {name}{spec} (pip wheel)")
            return None
        target = dest / wheels[0].name
        shutil.move(str(wheels[0]), target)
        return target
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def add(name: str, spec: str, why: str, group: str) -> list[str]:
    """Put `name` (and, recursively, what the image lacks of its needs) into the bundle;
    return the names added."""
    c = canon(name)
    if c in bundle:
        return []
    if NEVER.match(c):
        problems.append(f"CONFLICT: {why} needs {name}{spec}, which is the image's own stack "
                        "and never carried")
        return []
    pin = pins.get(c)
    if spec.startswith("=="):
        want = spec
    elif pin and SpecifierSet(spec or ">=0").contains(Version(pin), prereleases=True):
        want = f"=={pin}"
    else:
        want = spec
    path = fetch(name, want)
    if path is None:
        return []
    meta = wheel_meta(path)
    bundle[c] = {"name": meta["Name"], "version": meta["Version"], "file": path.name,
                 "bytes": path.stat().st_size, "for": why, "group": group}
    added = [c]
    for raw in meta.get_all("Requires-Dist") or []:
        r = Requirement(raw)
        if r.marker is not None and not r.marker.evaluate(ENV):
            continue
        d = canon(r.name)
        who = f"{meta['Name']} {meta['Version']}"
        if d in bundle:
            v = bundle[d]["version"]
            if not r.specifier.contains(Version(v), prereleases=True):
                problems.append(f"CONFLICT: {who} needs {r.name}{r.specifier}, bundle has {v}")
            continue
        if d in host:
            hv = host_ver.get(d)
            left = image.setdefault(d, {"version": hv, "needs": []})
            left["needs"].append(f"{who}: {r.specifier or 'any'}")
            if hv is not None and not r.specifier.contains(Version(hv), prereleases=True):
                notes.append(f"image has {r.name} {hv}, {who} needs {r.specifier}: carried")
                image.pop(d)
                added += add(r.name, str(r.specifier), who, group)
            continue
        added += add(r.name, str(r.specifier), who, group)
    return added


def total() -> int:
    return sum(b["bytes"] for b in bundle.values())


for root in required.split():
    pin = pins.get(canon(root))
    add(root, f"=={pin}" if pin else "", "root", "required")
for root in optional.split():
    pin = pins.get(canon(root))
    added = add(root, f"=={pin}" if pin else "", "optional root", "optional")
    if total() > budget:
        for c in added:
            (dest / bundle.pop(c)["file"]).unlink(missing_ok=True)
        notes.append(f"LEFT OUT (does not fit): {root} and {added[1:]}; the image's own is used")
for f in dest.glob("*.whl"):                  # one version of each: stale wheels go
    if f.name not in {b["file"] for b in bundle.values()}:
        f.unlink()
if total() > budget:
    problems.append(f"DOES NOT FIT: {total() / 2**20:.1f} MiB of wheels + "
                    f"{int(repo_bytes) / 2**20:.1f} MiB of repository > 62 MiB")

for d, left in sorted(image.items()):
    if d in bundle:
        continue
    hv = left["version"]
    verdict = "version unknown here: gpu_suite.sh checks it there" if hv is None else "ok"
    notes.append(f"{d} {hv or '?'} ({verdict}) <- " + "; ".join(sorted(set(left["needs"]))))
manifest = {"wheels": sorted(bundle.values(), key=lambda b: b["name"].lower()),
            "total_bytes": total(), "repo_bytes": int(repo_bytes), "notes": notes,
            "problems": problems}
(dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
print(f"{'wheel':44} {'version':14} {'KiB':>7}  needed by")
for b in manifest["wheels"]:
    print(f"{b['name']:44} {b['version']:14} {b['bytes'] // 1024:7d}  {b['for']}")
print("\n".join(["", "Left to the GPU image (its version, then who needs what):"]
                + [f"  {n}" for n in manifest["notes"]]))
print(f"\n{len(bundle)} wheels, {total() / 2**20:.1f} MiB in {dest}/ (+ repository "
      f"{int(repo_bytes) / 2**20:.1f} MiB; a device call carries at most 64 MiB)")
if problems:
    print("\nPROBLEMS:\n" + "\n".join(f"  {p}" for p in problems))
    sys.exit(1)
PYEOF

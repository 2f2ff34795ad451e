# Sourced by bench/llm_frameworks_bundle.sh and bench/llm_foundry_bundle.sh: packages for the lent
# GPU machine (Python 3.12, x86_64, no network) fetched here as wheels and unpacked into site
# trees under $WORK, which the device call puts on PYTHONPATH. Set before sourcing: WORK;
# optionally PYTHON (the pip that fetches) and SITE_FOR=here (wheels for that interpreter instead
# of the GPU's Python 3.12: a tree this machine can import, for the CPU tests).
PY=${PYTHON:-python3}
if [ "${SITE_FOR:-gpu}" = here ]; then
  PLAT=(--only-binary=:all:)
else
  PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
fi

site_tree() {  # name, specs...: fetch the wheels, unpack them into $WORK/site-<name>
  local name=$1 spec; shift
  mkdir -p "$WORK/wheels-$name"
  for spec in "$@"; do   # a few ship only an sdist (pure Python): build their wheel here
    "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels-$name" "$spec" \
        >/dev/null 2>&1 \
      || "$PY" -m pip wheel -q --no-deps -w "$WORK/wheels-$name" "$spec" >/dev/null 2>&1 \
      || { echo "cannot fetch $spec" >&2; return 1; }
  done
  "$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$WORK/site-$name" \
    "$WORK"/wheels-"$name"/*.whl 2>&1 | { grep -v -e "^WARNING: Location" -e "as the 'root' user" || true; }
}

site_pack() {  # dest, names...: drop scripts and bytecode, then one xz archive of the site trees
  local dest=$1 name trees=(); shift
  for name in "$@"; do trees+=("site-$name"); rm -rf "$WORK/site-$name/bin"; done
  find "$WORK" -name __pycache__ -type d -prune -exec rm -rf {} +
  (cd "$WORK" && du -sh "${trees[@]}")
  mkdir -p "$(dirname "$dest")"
  tar -C "$WORK" -cf - "${trees[@]}" | xz -6 -T0 > "$dest"
  ls -la "$dest"
}

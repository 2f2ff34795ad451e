#!/usr/bin/env bash
# Make sure a headless Chromium is installed, for tests/notebook/test_panel_browser.py (the live panel
# in a real JupyterLab; jupyterlab itself comes from the test extra, scripts/venv.sh): nothing
# to do when it is; else apt-get install Debian's chromium, non-interactively, as root only.
# Exit 0 when it is installed at the end, 1 (with the reason on stderr) when not; the browser
# test then skips and says why.
set -uo pipefail
have() { for b in chromium chromium-browser google-chrome google-chrome-stable; do
  command -v "$b" >/dev/null && return 0; done; return 1; }
have && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "ci_browser: no chromium and not root to install it; the browser test will be skipped" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "ci_browser: chromium is not installed and there is no apt-get here;" \
       "the browser test will be skipped" >&2
  exit 1
fi
log="${TMPDIR:-/tmp}/gpulaunch-ci-apt-browser.log"
install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=120 chromium
}
echo "ci_browser: installing chromium with apt-get (log: $log)" >&2
if ! install >"$log" 2>&1; then
  # a fresh image may have no package lists yet
  DEBIAN_FRONTEND=noninteractive apt-get update -q -o DPkg::Lock::Timeout=120 >>"$log" 2>&1
  install >>"$log" 2>&1
fi
if have; then exit 0; fi
echo "ci_browser: could not install chromium; the browser test will be skipped. Last lines" \
     "of $log:" >&2
tail -n 5 "$log" >&2
exit 1

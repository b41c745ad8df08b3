#!/usr/bin/env bash
# Installs what the tests need (Debian audio packages when run as root, a venv with the
# package and its test extras), checks lint and formatting with ruff, and runs the test
# suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
# pulseaudio(-utils) + the ALSA pulse plugin carry the audio tests' virtual sound card.
# chromium runs the browser test of the web page (python -m moshi_mlx web).
for pkg in pulseaudio pulseaudio-utils libasound2-plugins libportaudio2 libsndfile1 espeak-ng sox chromium; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ "${#need_apt[@]}" -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    else
        echo "missing Debian packages (install them as root): ${need_apt[*]}" >&2
    fi
fi

python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
# Lint first: the house style is checked like the tests (ruff's settings are in pyproject.toml).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"

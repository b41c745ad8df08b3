#!/usr/bin/env bash
# Builds /opt/venvs/unmute: Kyutai's Unmute backend (github.com/kyutai-labs/unmute), installed
# unmodified from a clone passed as UNMUTE_SRC, with the exact versions of its uv.lock (the
# backend's dependencies only, not its dev group). tests/e2e/test_unmute.py runs
# `uvicorn unmute.main_websocket:app` from it against our server and skips without it.
#
# Unmute asks for Python 3.12 and its code needs it (PEP 695 generics: `class Quest[T]`), so the
# venv is made with the first Python 3.12 found: UNMUTE_PYTHON, `python3.12` on PATH, or a pyenv
# 3.12 (this machine's image has one). `uv` comes from PyPI into a throw-away tool venv; it only
# exports the lock to a requirements list and installs it: no interpreter is downloaded.
# Usage (as root, ~1 GB):  UNMUTE_SRC=/path/to/unmute ./scripts/make_unmute_env.sh
# Idempotent: a venv whose recorded source commit/lock matches is left as it is.
set -euo pipefail
src=${UNMUTE_SRC:?set UNMUTE_SRC to a clone (or exported tree) of github.com/kyutai-labs/unmute}
root=${MOSHI_MLX_REFERENCE_ENVS:-/opt/venvs}
venv="$root/unmute"
[ -f "$src/uv.lock" ] && [ -f "$src/unmute/main_websocket.py" ] \
    || { echo "no uv.lock and unmute/main_websocket.py in $src" >&2; exit 2; }

find_python() {
    local candidate
    for candidate in "${UNMUTE_PYTHON:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
        [ -n "$candidate" ] || continue
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$candidate" || echo "$candidate"
            return 0
        fi
    done
    echo "no Python 3.12 found (Unmute's code needs it): set UNMUTE_PYTHON" >&2
    return 2
}

stamp="$(sha256sum "$src/uv.lock" "$src/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.unmute-stamp" 2>/dev/null)" = "$stamp" ]; then
    echo "$venv is up to date"
    exit 0
fi

python=$(find_python)
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/pip" install -q --disable-pip-version-check uv
uv="$tools/venv/bin/uv"

# The lock, as pinned requirements (platform markers kept; the project itself left out).
(cd "$src" && "$uv" export --frozen --no-dev --no-hashes --no-emit-project \
    --output-file "$tools/requirements.txt" >/dev/null)

rm -rf "$venv"
"$python" -m venv "$venv"
"$uv" pip install -q --python "$venv/bin/python" -r "$tools/requirements.txt"
# Unmute itself, as an editable install of a copy kept inside the venv: it reads voices.yaml
# beside its package (Path(__file__).parents[2]), which a wheel would not carry. --no-deps: every
# dependency is already the locked one.
mkdir -p "$venv/src"
cp -r "$src/unmute" "$src/voices.yaml" "$src/pyproject.toml" "$src/uv.lock" "$src/LICENSE" \
    "$src/README.md" "$venv/src/"
"$uv" pip install -q --python "$venv/bin/python" --no-deps -e "$venv/src"
"$venv/bin/python" -c 'import unmute.main_websocket' >/dev/null
echo "$stamp" >"$venv/.unmute-stamp"
echo "built $venv with $("$venv/bin/python" --version) from $src"

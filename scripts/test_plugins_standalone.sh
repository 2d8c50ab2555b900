#!/usr/bin/env bash
# Runs each plugin's tests from a copy outside the repository, as the plugin's author would
# beside an installed atom-core: a test that reaches into this checkout (its tests package,
# bench/) fails here. Extra arguments go to pytest (e.g. -x, -k name).
#
#     scripts/test_plugins_standalone.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
case "$PY" in
    */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;  # the copies run elsewhere
    *) PY=$(command -v "$PY") ;;
esac
work=$(mktemp -d -t atom-plugins-XXXXXX)
trap 'rm -rf "$work"' EXIT
failed=()
for plugin in plugins/*/; do
    name=$(basename "$plugin")
    [ -f "$plugin/pyproject.toml" ] || continue
    cp -r "$plugin" "$work/$name"
    echo "== $name (from $work/$name)"
    if ! (cd "$work/$name" &&
          env -u PYTHONPATH "$PY" -m pytest -q -p no:cacheprovider tests "$@"); then
        failed+=("$name")
    fi
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed: ${failed[*]}"
    exit 1
fi
echo "every plugin's tests pass from a copy outside the repository"

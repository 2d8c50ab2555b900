#!/usr/bin/env bash
# A/B of two trees on one machine, back to back: a tree packed by `git archive` (the
# "before"; the GPU machine has no .git) against the working tree ("after"). Each is
# installed with its plugins into its own `pip install --target` directory, and each
# command runs once per tree, before then after, with ATOM_BENCH_COMMIT naming the tree.
#
#   git archive -o before.tar COMMIT                     # here, beside the working tree
#   bash bench/ab.sh before.tar COMMIT -- python bench/decode_latency.py --models qwen3-8b
#
# The first tree to run pays for the Triton kernels both trees share that a bench compiles
# inside its timing (throughput_offline.py lists them): the second finds them in Triton's
# cache. AB_ROUNDS=2 runs the pair twice; read the second round.
#
# The after tree is labelled with git's HEAD; a copied tree (a device machine's) may carry
# a .git of another commit: name it with AB_AFTER_COMMIT.
#
# Add a wheel directory first on PYTHONPATH (e.g. /tmp/site) where packages are missing;
# PYTHON names the interpreter that installs the trees (default python3). Run it where
# the project is not installed already (the GPU machine), or two copies would register.
set -uo pipefail
tar=$1 before_commit=$2
shift 2
[ "${1:-}" = "--" ] && shift
root=$(pwd)
work=${AB_WORK:-/tmp/atom-ab}
after_commit=${AB_AFTER_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo after)}
if [ ! -d "$work/before-src" ]; then
    mkdir -p "$work/before-src" && tar -xf "$tar" -C "$work/before-src" || exit 1
fi
for tree in before after; do
    [ -d "$work/$tree" ] && continue
    src=$([ $tree = before ] && echo "$work/before-src" || echo "$root")
    (cd "$src" && "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-build-isolation \
        --no-compile --target "$work/$tree" . plugins/*/) || exit 1
done
for round in $(seq "${AB_ROUNDS:-1}"); do
    for tree in before after; do
        src=$([ $tree = before ] && echo "$work/before-src" || echo "$root")
        commit=$([ $tree = before ] && echo "$before_commit" || echo "$after_commit")
        echo "=== $tree ($commit) round $round $(date +%T): $*"
        (cd "$src" && ATOM_BENCH_COMMIT=$commit PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$work/$tree" "$@")
    done
done

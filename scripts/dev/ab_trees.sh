#!/usr/bin/env bash
# A/B of git branches on the lent GPU machine, which gets a copy of the working tree but not its git history.
#
#   bash scripts/dev/ab_trees.sh prepare BRANCH...     # here: each branch's package and scripts into .ab/<branch>/
#   OUT=... bash scripts/dev/ab_trees.sh run CMD...    # there (run with carry [".whl", ".ab"]): CMD once per tree
#
# `run` sources gpu_env.sh (the working tree as locks_hf), then runs CMD for the working tree ("work") and for each
# tree under .ab/, one after the other, twice over (work, a, b, work, a, b: drift on the machine shows as a
# difference between the two rounds). CMD runs in a scratch folder: $S is the tree's scripts folder (absolute), $TREE
# its name, $ROUND 1 or 2, $OUT absolute; every run's output goes to one file, $OUT/ab_trees.log (a device call
# brings back at most 8 files), e.g.
#   bash scripts/dev/ab_trees.sh run 'python3 $S/dev/bench_select.py --kernels --configs glm4-9b:524384:1 --sweep "" --out $OUT/${TREE}_$ROUND.json'
# .ab/ is git-ignored; `prepare` replaces the trees it names.
set -u
mode=${1:-}
shift || true
case $mode in
  prepare)
    [ $# -gt 0 ] || { echo "ab_trees: name the branches to prepare" >&2; exit 2; }
    for branch in "$@"; do
      dir=.ab/${branch//\//_}
      rm -rf "$dir" && mkdir -p "$dir" || exit 1
      git archive "$branch" locks_hf kernels eval scripts | tar -x -C "$dir" || { echo "ab_trees: cannot export $branch" >&2; exit 1; }
      echo "ab_trees: $branch -> $dir ($(git rev-parse --short "$branch"))"
    done ;;
  run)
    [ $# -gt 0 ] || { echo "ab_trees: give the command to run in each tree" >&2; exit 2; }
    source scripts/dev/gpu_env.sh || exit 1
    ROOT=$PWD
    OUT=$(realpath -m "${OUT:-out}")
    mkdir -p "$OUT"
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OUT
    WORK=$PYTHONPATH
    SITE=${WORK%%:/tmp/pk}
    trees=(work)
    for dir in .ab/*/; do
      [ -d "${dir}kernels" ] || continue
      name=$(basename "$dir")
      stage_package "${dir%/}" "/tmp/ab/$name" || { echo "ab_trees: cannot stage $dir" >&2; exit 1; }
      trees+=("$name")
    done
    echo "ab_trees: trees ${trees[*]} on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no GPU')"
    start=$SECONDS
    for ROUND in 1 2; do
      for TREE in "${trees[@]}"; do
        if [ "$TREE" = work ]; then S=$ROOT/scripts PYTHONPATH=$WORK; else S=$ROOT/.ab/$TREE/scripts PYTHONPATH=$SITE:/tmp/ab/$TREE; fi
        export S TREE ROUND PYTHONPATH
        # from a folder of its own: `python3 -c` puts the working folder first on the path, whose locks_hf/
        # (the repository's, without its kernels) would shadow the tree's
        (cd /tmp/ab && bash -c "$*") > "/tmp/ab/${TREE}_$ROUND.log" 2>&1
        status=$?
        { echo "== $TREE round $ROUND: exit $status"; cat "/tmp/ab/${TREE}_$ROUND.log"; } >> "$OUT/ab_trees.log"
        echo "== $TREE round $ROUND: exit $status, $((SECONDS - start)) s"
        grep -v -i warn "/tmp/ab/${TREE}_$ROUND.log" | tail -8 | cut -c1-220
      done
    done ;;
  *) echo "usage: ab_trees.sh prepare BRANCH... | ab_trees.sh run CMD..." >&2; exit 2 ;;
esac

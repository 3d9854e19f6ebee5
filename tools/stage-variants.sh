#!/usr/bin/env bash
# Builds the `fp4spec` executable of several variants (commits, or the working tree with some
# kernels/targets.toml values changed), optionally test and bench executables, and packs them
# stripped into .gpu/bins.tar.xz for a device call with carry [".gpu"]. Variants of one tree are
# near-identical files, and single-threaded xz keeps each later one to a few hundred KB (six
# binaries of 6-8 MB each took 6 MB), where the 64 MiB a call may carry held seven unpacked.
#
#   usage: tools/stage-variants.sh [--target T] [--out FILE] ITEM...   (FILE: .gpu/bins.tar.xz)
#     NAME=head                      the working tree as it is             -> bin/fp4spec-NAME
#     NAME=REV                       a commit, built from `git archive`     -> bin/fp4spec-NAME
#     NAME=set:TABLE.KEY=VALUE[,...] the working tree with these values in target T's
#                                    [target.TABLE] (T: --target, default sm_90a) -> bin/fp4spec-NAME
#     test:NAME / bench:NAME         the working tree's test / bench executable -> bin/NAME / bin/NAME-bench
#   e.g. tools/stage-variants.sh head=head base=605fe29 planes8=set:moe.router_planes=8 test:gpu bench:verify
#
# On the device, from the checkout root:
#   python3 -c "import tarfile; tarfile.open('.gpu/bins.tar.xz').extractall('.gpu')"
# (several archives unpack side by side: give each call's variants their own names)
# then run .gpu/bin/* with FP4SPEC_CACHE_DIR=.gpu/bin/cache: every variant's kernels, compiled
# here (NVRTC 13.0, as on the GPU host), so the first runs there do not compile them (a cold
# machine spent ~30 s of device time on it). The test and bench executables of the working tree
# find theirs there when a variant of the working tree as it is (NAME=head) is staged too.
# Commits build in their own target folder (target/variants): sharing the working tree's, a
# build of another checkout of this crate reran the build script against the wrong sources
# (twenty-third session). Needs the toolchains: run it as
# `bash tools/toolchains.sh bash tools/stage-variants.sh ...`. Leaves .gpu's other files alone.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
target=sm_90a
out_file=.gpu/bins.tar.xz
while [ $# -gt 0 ]; do case "$1" in
  --target) target=$2; shift 2;;
  --out) out_file=$2; shift 2;;
  *) break;;
esac; done
[ $# -gt 0 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
work=$(mktemp -d)
# a set: variant edits kernels/targets.toml in place; whatever happens, the original goes back
restore() { if [ -f "$work/targets.toml" ]; then cp "$work/targets.toml" kernels/targets.toml; fi; rm -rf "$work"; }
trap restore EXIT
mkdir -p "$work/bin" .gpu
manifest="$work/bin/MANIFEST-$(basename "$out_file" .tar.xz)"
echo "staged $(date -u +%F) from $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (uncommitted changes)')" > "$manifest"

# Sets TABLE.KEY = VALUE in target $target of targets.toml FILE (each key must exist there once).
set_values() {
  python3 - "$1" "$target" "$2" <<'PY'
import re, sys
path, target, assignments = sys.argv[1], sys.argv[2], sys.argv[3]
lines = open(path).read().split("\n")
for item in assignments.split(","):
    name, _, value = item.partition("=")
    table, _, key = name.rpartition(".")
    if not table or not key or not value:
        sys.exit(f"stage-variants: '{item}' is not TABLE.KEY=VALUE")
    # a target's name is in its [[target]] header, before its first [target.*] table
    in_header = in_target = in_table = False
    hits = []
    for i, line in enumerate(lines):
        if line.strip() == "[[target]]":
            in_header, in_target, in_table = True, False, False
        elif line.startswith("[target."):
            in_header = False
            in_table = in_target and line.strip() == f"[target.{table}]"
        elif in_header and (m := re.match(r'name = "([^"]+)"', line)):
            in_target = m.group(1) == target
        elif in_table and re.match(rf"{re.escape(key)}\s*=", line):
            hits.append(i)
    if len(hits) != 1:
        sys.exit(f"stage-variants: {table}.{key} found {len(hits)} times in target {target} of {path}")
    lines[hits[0]] = f"{key} = {value}"
open(path, "w").write("\n".join(lines))
PY
}

# Builds `fp4spec` in source folder $1 with target folder $2 and copies it, stripped, to $3;
# then compiles its kernels for $target into bin/cache (`kernels --fill-cache`: families another
# variant already put there are skipped).
build_cli() {
  (cd "$1" && CARGO_TARGET_DIR="$2" cargo build --release --bin fp4spec --quiet)
  cp "$2/release/fp4spec" "$3" && strip "$3"
  FP4SPEC_CACHE_DIR="$work/bin/cache" "$3" kernels --fill-cache --target "$target" > /dev/null
}

# The executable a `cargo test` / `cargo bench` --no-run JSON line names.
# The executable of test or bench target NAME ($1) among cargo's JSON messages on stdin: a build
# of a test or bench also (re)builds the crate's own binaries when their sources changed (a set:
# variant's targets.toml put back), so the last executable artifact is not always the target's
# (forty-first session: bench:gemm staged the fp4spec CLI as gemm-bench).
executable_of() {
  python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("target", {}).get("name") == name:
        print(m["executable"])' "$1"
}

for item in "$@"; do
  case "$item" in
    test:*)
      name=${item#test:}
      exe=$(cargo test --release --no-run --test "$name" --message-format=json --quiet | executable_of "$name" | tail -1)
      cp "$exe" "$work/bin/$name" && strip "$work/bin/$name"
      echo "$name: test executable of the working tree" >> "$manifest";;
    bench:*)
      name=${item#bench:}
      exe=$(cargo bench --no-run --bench "$name" --message-format=json --quiet | executable_of "$name" | tail -1)
      cp "$exe" "$work/bin/$name-bench" && strip "$work/bin/$name-bench"
      echo "$name-bench: bench executable of the working tree" >> "$manifest";;
    *=*)
      name=${item%%=*}; spec=${item#*=}
      out="$work/bin/fp4spec-$name"
      case "$spec" in
        head)
          build_cli "$root" "$root/target" "$out"
          echo "fp4spec-$name: the working tree" >> "$manifest";;
        set:*)
          cp kernels/targets.toml "$work/targets.toml"
          set_values kernels/targets.toml "${spec#set:}"
          build_cli "$root" "$root/target" "$out"
          # copied back, not moved: the file must look newer than this build, or cargo keeps the
          # set value's build for the next variant (mv kept the copy's older mtime: the twenty-
          # third session's "head" was the previous run's last set build)
          cp "$work/targets.toml" kernels/targets.toml && rm "$work/targets.toml"
          echo "fp4spec-$name: the working tree with $target ${spec#set:}" >> "$manifest";;
        *)
          rev=$(git rev-parse --verify --quiet "$spec^{commit}") || { echo "stage-variants: no commit $spec" >&2; exit 2; }
          # every commit in the same folder, its files dated now (tar -m): cargo's dep-info names
          # the files of the previous build by path, so a second commit unpacked elsewhere, or
          # with its commit dates, looked fresh and reused the first one's build (twenty-fifth
          # session: w12's build script ran main's parser on w12's targets.toml)
          src="$work/src-commit"; rm -rf "$src"; mkdir -p "$src"
          git archive "$rev" | tar -x -m -C "$src"
          ln -sfn "$root/../shared" "$work/shared"  # what the crate finds beside it
          build_cli "$src" "$root/target/variants" "$out"
          echo "fp4spec-$name: commit $(git rev-parse --short "$rev")" >> "$manifest";;
      esac;;
    *) echo "stage-variants: '$item' is none of NAME=SPEC, test:NAME, bench:NAME" >&2; exit 2;;
  esac
done
tar -C "$work" -cf - bin | xz -T1 -6 > "$out_file"
cat "$manifest"
echo "packed: $out_file, $(du -h "$out_file" | cut -f1)"

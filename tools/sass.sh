#!/usr/bin/env bash
# Writes the SASS of every NVIDIA kernel family of the working tree, one file per target and
# family, with addresses, encodings and line-table comments stripped: what a refactor of the
# templates must leave alone, checked without a GPU. Two trees' outputs compared with `diff -r`
# (or `cmp`) say whether the compiled code changed; the CUBINs themselves differ whenever a line
# moves (the kernels are compiled with -lineinfo).
#   bash tools/sass.sh OUT_DIR        # e.g. before and after an edit, then: diff -r BEFORE AFTER
# Builds the release binary, fills a fresh CUBIN cache with it (`fp4spec kernels --fill-cache`)
# and disassembles with cuobjdump and nvdisasm (PyPI wheels nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm, installed on first use in .toolchains/; 13.5 reads NVRTC 13.0's CUBINs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: bash tools/sass.sh OUT_DIR}
# pinned: another nvdisasm prints the same code differently (constant-bank operands, order)
tools_version=13.5.37
venv="$root/.toolchains/sass-venv-$tools_version"
if ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/nvdisasm >/dev/null 2>&1 \
   || ! ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump >/dev/null 2>&1; then
  echo "sass: installing cuobjdump and nvdisasm into $venv (pip)" >&2
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "nvidia-cuda-cuobjdump==$tools_version" "nvidia-cuda-nvdisasm==$tools_version" >&2
fi
bin=$(dirname "$(ls "$venv"/lib/python3*/site-packages/nvidia/cu13/bin/cuobjdump | head -n 1)")
export PATH="$bin:$PATH"  # cuobjdump -sass runs nvdisasm
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
(cd "$root" && bash tools/toolchains.sh cargo build --release --quiet)
FP4SPEC_CACHE_DIR="$cache" bash "$root/tools/toolchains.sh" "$root/target/release/fp4spec" kernels --fill-cache >/dev/null
mkdir -p "$out"
for cubin in "$cache"/*.cubin; do
  # family-target-hash-nvrtcX.cubin -> family-target.sass
  name=$(basename "$cubin" | cut -d- -f1-2)
  cuobjdump -sass "$cubin" \
    | grep -E '^[[:space:]]+/\*[0-9a-f]{4}\*/|Function :' \
    | sed -E 's@^[[:space:]]+/\*[0-9a-f]+\*/[[:space:]]*@@; s@[[:space:]]*/\*[^*]*\*/[[:space:]]*;?@@g; s/[[:space:]]+/ /g' \
    > "$out/$name.sass"
done
echo "sass: $(ls "$out" | wc -l) families' SASS in $out"

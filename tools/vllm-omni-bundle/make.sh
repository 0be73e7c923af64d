#!/bin/bash
# make.sh OUT_DIR: offline bundle of vllm-omni 0.24.0 for the GPU image (CPython 3.12, torch 2.11.0+cu130), to sit on
# PYTHONPATH before the vllm 0.24.0 bundle (../../../shared/tools/vllm-bundle): PYTHONPATH=/tmp/omni-site:/tmp/vsite.
# It packs only what neither the image nor the vllm bundle holds (README.md beside this file lists what and why).
# Run in the project checkout, with the vllm bundle's resolution (its st/need.txt) at hand:
#   VLLM_BUNDLE=.vllm-bundle tools/vllm-omni-bundle/make.sh .vllm-omni-bundle     (OUT_DIR stays git-ignored)
# Output: OUT_DIR/piece-K/omni.tar.xz.NN (PIECE_MIB MiB each, default 30) and OUT_DIR/SHA256SUMS.
# On the GPU machine (each piece-K/ in its own call while the machine stays up):
#   mkdir -p /tmp/pieces && cp piece-K/* /tmp/pieces/
#   mkdir -p /tmp/omni-site && cat /tmp/pieces/omni.tar.xz.* | tar -C /tmp/omni-site -xJ
#   export DIFFRL_VLLM_OMNI_PYTHON=python3 DIFFRL_VLLM_OMNI_PYTHONPATH=/tmp/omni-site:/tmp/vsite
#
# How it resolves: with a Python 3.12 interpreter (pip evaluates markers with the running one), against placeholder
# wheels for what the image has and vllm-omni or its deps name (torch, torchvision, torchaudio, triton, numba) and for
# vllm 0.24.0 (the vllm bundle's), constrained to the vllm bundle's exact versions and the image's (pip freeze there),
# except the versions vllm-omni pins itself (PINNED: they win inside this bundle, which comes first on PYTHONPATH).
# openai-whisper has no wheel on PyPI: one is built from its sdist (pure Python) with `pip wheel --no-deps`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUT=${1:?usage: make.sh OUT_DIR}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
if [ -z "${PY:-}" ]; then  # the first Python 3.12 that runs (a pyenv shim may exist without it being selected)
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do "$c" -c "" 2>/dev/null && { PY=$(command -v "$c"); break; }; done
fi
[ -x "${PY:-}" ] || { echo "make.sh needs a Python 3.12 interpreter (set PY=...)"; exit 1; }
SHARED=${SHARED:-$REPO/../shared/tools}
IMAGE_LIST=${IMAGE_LIST:-$SHARED/gpu-image-packages.txt}
IMAGE_FREEZE=${IMAGE_FREEZE:-$SHARED/gpu-image-freeze.txt}
VLLM_BUNDLE=${VLLM_BUNDLE:-$REPO/.vllm-bundle}
VLLM_NEED=${VLLM_NEED:-$VLLM_BUNDLE/st/need.txt}
[ -s "$VLLM_NEED" ] || { echo "make.sh needs the vllm bundle's st/need.txt (build it with $SHARED/vllm-bundle/make.sh, or set VLLM_NEED=...)"; exit 1; }
for f in "$IMAGE_LIST" "$IMAGE_FREEZE"; do [ -s "$f" ] || { echo "make.sh: $f missing (set IMAGE_LIST / IMAGE_FREEZE)"; exit 1; }; done
PIECE_MIB=${PIECE_MIB:-30}
XZ_OPTS=${XZ_OPTS:---lzma2=preset=9e,dict=256MiB}
OMNI=${OMNI:-vllm-omni==0.24.0}
WHISPER=${WHISPER:-openai-whisper==20250625}
export PIP_CONSTRAINT=   # this machine's /etc/xdg/pip/constraints.txt caps torch; irrelevant with placeholders
quiet() { grep -v -e '^WARNING: Location' -e 'Running pip as the' || true; }

# Exact pins of vllm-omni that differ from the image: this bundle's copy wins (it is first on PYTHONPATH).
PINNED=(accelerate diffusers)
# Optional for a text-to-image diffusion pipeline (evidence in README.md); their exclusive deps go with them.
OPTIONAL=(av imageio-ffmpeg)   # video muxing/decoding (127 MiB) and the ffmpeg binary (165 MiB): video models only
[ "${WITH_FA3:-0}" = 1 ] || OPTIONAL+=(fa3-fwd)   # FA3 forward kernels, 105 MiB .so: WITH_FA3=1 packs them
EXTRA_EXCLUDE=${EXTRA_EXCLUDE:-}   # comma-separated, for experiments

PLAT=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:)
for n in 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
ST=$OUT/st; mkdir -p "$ST/fl" "$OUT/whl"

# 1. placeholders: the image's torch stack and numba, the vllm bundle's vllm
mk() { local n=$1 v=$2 mod=$3 d=$ST/dummy/$1; rm -rf "$d"; mkdir -p "$d/$mod" "$d/$n-$v.dist-info"; : > "$d/$mod/__init__.py"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$n" "$v" > "$d/$n-$v.dist-info/METADATA"
  printf 'Wheel-Version: 1.0\nGenerator: omni-bundle\nRoot-Is-Purelib: true\nTag: py3-none-any\n' > "$d/$n-$v.dist-info/WHEEL"
  : > "$d/$n-$v.dist-info/RECORD"
  (cd "$d" && "$PY" -m zipfile -c "$ST/fl/$n-$v-py3-none-any.whl" "$mod" "$n-$v.dist-info"); }
mk torch 2.11.0+image torch; mk torchvision 0.26.0+image torchvision; mk torchaudio 2.11.0+image torchaudio
mk triton 3.6.0+image triton; mk numba 0.68.0+image numba; mk vllm 0.24.0+bundle vllm
PLACEHOLDERS=(torch==2.11.0+image torchvision==0.26.0+image torchaudio==2.11.0+image triton==3.6.0+image numba==0.68.0+image
  vllm==0.24.0+bundle)

# 2. openai-whisper: sdist only on PyPI; build its (pure Python) wheel once
if ! ls "$OUT"/whl/openai_whisper-*.whl > /dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps --no-binary openai-whisper -w "$OUT/whl" "$WHISPER" 2>&1 | quiet
fi
cp "$OUT"/whl/openai_whisper-*.whl "$ST/fl/"

# 3. constraints (the vllm bundle's versions, then the image's, less placeholders and PINNED) and the HAVE list
skip="^($(IFS='|'; echo "torch|torchvision|torchaudio|triton|numba|vllm|${PINNED[*]}"))=="
{ printf "%s\n" "${PLACEHOLDERS[@]}"; grep -v "^vllm==" "$VLLM_NEED"; grep '==' "$IMAGE_FREEZE" | grep -viE "$skip"; } \
  | awk -F== '{n=tolower($1); gsub(/[-_.]+/, "-", n); if (!(n in s)) {s[n]=1; print}}' > "$ST/constraints.txt"
{ grep -v '^#' "$IMAGE_LIST" | grep -viE "^($(IFS='|'; echo "${PINNED[*]}"))\b"; sed 's/==.*//' "$VLLM_NEED"
  printf '%s\n' torch torchvision torchaudio triton numba; } > "$ST/have.txt"

# 4. resolve, walk from vllm-omni
if [ ! -s "$ST/report.json" ] || [ "${RESOLVE:-0}" = 1 ]; then
  "$PY" -m pip install -q --dry-run --ignore-installed --report "$ST/report.json" --find-links "$ST/fl" \
    -c "$ST/constraints.txt" "${PLAT[@]}" --target "$ST/t" "$OMNI" 2>&1 | quiet
fi
"$PY" "$HERE/graph.py" "$ST/report.json" "$ST/have.txt" "${OMNI%%==*}" \
  --exclude "$(IFS=,; echo "${OPTIONAL[*]}"),$EXTRA_EXCLUDE" > "$ST/graph-final.txt"
awk '/^NEED /{print $2}' "$ST/graph-final.txt" > "$ST/need.txt"
echo "make.sh: $(wc -l < "$ST/need.txt") distributions to pack: $(tr '\n' ' ' < "$ST/need.txt")"
[ "${RESOLVE_ONLY:-0}" = 1 ] && exit 0

# 5. download (cached; the whisper wheel is already there) and install into staging
grep -v '^openai-whisper==' "$ST/need.txt" > "$ST/download.txt"
"$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/whl" -r "$ST/download.txt" 2>&1 | quiet
mapfile -t WHEELS < <("$PY" - "$ST/need.txt" "$OUT/whl" <<'PY'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {(norm(n), v): None for n, v in (line.strip().split("==") for line in open(sys.argv[1]))}
for f in os.listdir(sys.argv[2]):
    parts = f.split("-")
    if (norm(parts[0]), parts[1]) in want:
        want[(norm(parts[0]), parts[1])] = os.path.join(sys.argv[2], f)
missing = [k for k, v in want.items() if v is None]
if missing:
    sys.exit(f"missing wheels: {missing}")
print("\n".join(sorted(want.values())))
PY
)
rm -rf "$ST/site"; mkdir -p "$ST/site"
"$PY" -m pip install -q --no-deps --no-compile "${PLAT[@]}" --target "$ST/site" "${WHEELS[@]}" 2>&1 | quiet
# stray top-level folders: einx's test/ (it would shadow the standard library's `test` package) and docs/, soundfile's
# licensing/; none is imported
rm -rf "$ST"/site/test "$ST"/site/docs "$ST"/site/licensing
# console scripts: pip wrote this machine's interpreter into them; use the image's python3 from PATH
for f in "$ST"/site/bin/*; do
  if [ -f "$f" ] && head -c 2 "$f" | grep -q '#!'; then sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$f"; fi
done
find "$ST/site" -name __pycache__ -type d -prune -exec rm -rf {} +
echo "make.sh: $(du -sm "$ST/site" | cut -f1) MiB installed; compressing (xz $XZ_OPTS)"
[ "${STAGE_ONLY:-0}" = 1 ] && exit 0

# 6. archive (directories first, then files grouped by type so the window finds more repeats), split into pieces
rm -rf "$OUT"/piece-* "$ST"/omni.tar.xz.*
(cd "$ST/site" && { find . -type d | sort; find . ! -type d | "$PY" -c '
import os, sys
def key(f):
    b = os.path.basename(f)
    e = "so" if ".so" in b else (b.rsplit(".", 1)[-1] if "." in b else "")
    return (e, os.path.dirname(f), b)
print("\n".join(sorted((l.rstrip("\n") for l in sys.stdin), key=key)))'; }) > "$ST/filelist.txt"
tar -C "$ST/site" --owner=0 --group=0 --no-recursion -T "$ST/filelist.txt" -cf - | xz -T1 $XZ_OPTS \
  | split -d -b "${PIECE_MIB}M" - "$ST/omni.tar.xz."
i=0
for f in "$ST"/omni.tar.xz.*; do i=$((i + 1)); mkdir -p "$OUT/piece-$i"; mv "$f" "$OUT/piece-$i/"; done
(cd "$OUT" && sha256sum piece-*/omni.tar.xz.* > SHA256SUMS)
echo "make.sh: $i pieces, $(cat "$OUT"/piece-*/omni.tar.xz.* | wc -c) bytes total"
ls -la "$OUT"/piece-*/

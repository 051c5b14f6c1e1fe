#!/usr/bin/env bash
# Creates (once) the virtual environment that runs the official qwen-tts 0.1.1, our oracle.
#
# qwen-tts pins transformers==4.57.3 while our own code runs on transformers 5.x, so the oracle lives
# in its own venv. It is created with --system-site-packages to reuse the system torch (a second torch
# would cost minutes and gigabytes); a constraint pins torch to the system version so pip fails rather
# than replacing it. torchaudio is replaced by an import-only stand-in (standin/torchaudio explains why).
#
# Usage: tests/oracle/setup_env.sh            (idempotent; a stamp makes reruns instant)
# Env:   QWEN_ORACLE_VENV  venv location (default <repo>/.cache/oracle-venv)
#        PYTHON            base interpreter (default python3)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${QWEN_ORACLE_VENV:-$root/.cache/oracle-venv}
base_python=${PYTHON:-python3}
stamp="$venv/.oracle-stamp"

# Read from metadata: importing torch just to learn its version costs seconds on every rerun.
torch_version=$("$base_python" -c 'from importlib.metadata import version; print(version("torch"))') || {
    echo "setup_env.sh: '$base_python' has no torch installed; install torch in the base Python first" >&2
    exit 1
}

# The stamp covers everything that shapes the venv: this script, the requirements, the stand-in,
# the base interpreter and its torch.
key=$(
    {
        cat "$here/setup_env.sh" "$here/requirements.txt"
        find "$here/standin" -name '*.py' | LC_ALL=C sort | xargs cat
        "$base_python" -c 'import sys; print(sys.version, sys.prefix)'
        echo "$torch_version"
    } | sha256sum | cut -d' ' -f1
)
# Concurrent test runs share the venv: one builds, the others wait and then find the stamp.
mkdir -p "$(dirname "$venv")"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$venv.lock"
    flock 9
fi
if [[ -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
    echo "oracle venv up to date: $venv"
    exit 0
fi

echo "creating oracle venv at $venv (torch $torch_version from the base Python)"
rm -rf "$venv"
"$base_python" -m venv --system-site-packages "$venv"
vpy="$venv/bin/python"
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# A venv made from a venv Python inherits the *base* interpreter's site-packages, not the outer
# venv's, where torch may live; list the outer venv's package dirs after our own (same precedence
# as --system-site-packages) so its torch is reused there too.
"$base_python" - >"$site/_oracle_base_env.pth" <<'PY'
import sys
import sysconfig

if sys.prefix != sys.base_prefix:
    paths = sysconfig.get_paths()
    for path in dict.fromkeys((paths["purelib"], paths["platlib"])):
        print(path)
PY

# '==X' without a local label also matches the installed '+cpu' build.
constraints="$venv/oracle-constraints.txt"
echo "torch==${torch_version%%+*}" >"$constraints"

pip_install() {
    "$vpy" -m pip install --disable-pip-version-check --no-input --quiet -c "$constraints" "$@"
}
pip_install -r "$here/requirements.txt"
# --no-deps: its metadata also asks for gradio (web demo only) and a real torchaudio.
pip_install --no-deps "qwen-tts==0.1.1"

cp -r "$here/standin/torchaudio" "$site/"

# Check the result: the right versions win over the system site-packages and the package imports.
"$vpy" - "$torch_version" <<'PY'
import sys
import warnings

warnings.simplefilter("ignore")
import torch
import transformers
import qwen_tts  # noqa: F401  (imports every runtime dependency, the stand-in included)

want_torch = sys.argv[1]
if torch.__version__ != want_torch:
    sys.exit(f"oracle venv: torch {torch.__version__} shadows the system torch {want_torch}")
if transformers.__version__ != "4.57.3":
    sys.exit(f"oracle venv: transformers {transformers.__version__}, expected 4.57.3")
print(f"oracle venv ok: torch {torch.__version__}, transformers {transformers.__version__}")
PY

echo "$key" >"$stamp"

# Sourced by the peers' setup scripts: each peer gets its own venv under .cache/ so that its requirements never
# move the project's pins.
#
#   source "$(dirname "${BASH_SOURCE[0]}")/venv.sh" NAME     # -> ROOT, VENV (.cache/venv-NAME), PIP (an array)
#   ...  "${PIP[@]}" install ...                              # the peer's own pins
#   drop_media_packages                                       # after installing
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.cache/venv-${1:?usage: source venv.sh NAME}"
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$ROOT/.cache"
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" --disable-pip-version-check)

# No peer needs these, and the CUDA builds that torch's dependents drag in break `import transformers` paths on a
# CPU torch.
drop_media_packages() {
    local pkg
    for pkg in torchvision torchaudio torchcodec; do
        if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
            "${PIP[@]}" uninstall -y -q "$pkg"
        fi
    done
}

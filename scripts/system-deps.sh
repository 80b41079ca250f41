#!/usr/bin/env bash
# The system packages the tests start or load, installed when missing (apt; root or sudo):
#   etcd-server, etcd-client  etcd for the directory's etcd backend (tests start members on loopback);
#   libibverbs1, libnuma1, libcurl4  shared libraries of Mooncake's master and store client
#                                    (the [mooncake] extra; libibverbs is needed even over TCP);
#   g++, libssl-dev           SGLang builds its page-hash extension (C++, linked with -lcrypto) the
#                             first time a test derives page keys with SGLang's own hash;
#   python3-venv              only where python3 cannot create a venv;
#   python3-dev               only where python3 has no headers (kvcc accel build compiles the
#                             spec's and the validator's hot modules with Cython and g++'s gcc).
# A no-op when everything is present. Fails loudly when something is missing and cannot be
# installed: a test that would then be skipped is a test that did not run.
set -euo pipefail

PACKAGES=(etcd-server etcd-client libibverbs1 libnuma1 libcurl4 g++ libssl-dev)
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    PACKAGES+=(python3-venv)
fi
if ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' >/dev/null 2>&1; then
    PACKAGES+=(python3-dev)
fi

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
[ "${#missing[@]}" -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "system-deps: missing ${missing[*]}; run as root or install them: apt-get install ${missing[*]}" >&2
        exit 1
    fi
    SUDO="sudo"
fi
echo "system-deps: apt-get install ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

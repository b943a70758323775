#!/bin/sh
# `pip install` in the image's build stage, with what docker/build-extras/ holds: its wheels are
# found before any index, and its ca-bundle.crt, when there is one, is the CA bundle pip trusts.
set -e
if [ -f /tmp/build-extras/ca-bundle.crt ]; then
    export PIP_CERT=/tmp/build-extras/ca-bundle.crt
fi
exec /opt/venv/bin/pip install --find-links /tmp/build-extras "$@"

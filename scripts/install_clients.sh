#!/usr/bin/env bash
# Idempotent install of the real agent clients the server is tested against
# (tests/server/test_real_clients.py): Claude Code and Codex from npm into a cache outside git,
# and openai-agents into .venv (it is also in the `test` extra of pyproject.toml).
#
#   ZEN5_CLIENTS   where the npm clients go (default ~/.cache/zen5/clients); the tests read the same
#                  variable and find the binaries under $ZEN5_CLIENTS/node_modules/.bin/
#
# Never fails CI: with no node/npm or no registry, it says so and exits 0, and the tests that need
# a missing client skip with that reason.
set -uo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${ZEN5_CLIENTS:-$HOME/.cache/zen5/clients}
CLAUDE_CODE=@anthropic-ai/claude-code@2.1.332
CODEX=@openai/codex@0.171.0
AGENTS=openai-agents==0.24.0
status=ok

note() { echo "install_clients: $*"; }

installed_version() {  # package name -> version installed under $CLIENTS, or nothing
  local pj="$CLIENTS/node_modules/$1/package.json"
  [ -f "$pj" ] && node -e 'console.log(require(process.argv[1]).version)' "$pj" 2>/dev/null
}

npm_client() {  # spec (name@version), binary name
  local spec=$1 bin=$2 name=${1%@*} want=${1##*@}
  if [ "$(installed_version "$name")" = "$want" ] && [ -x "$CLIENTS/node_modules/.bin/$bin" ]; then
    note "$spec already installed in $CLIENTS"
    return 0
  fi
  if [ -z "${registry_ok:-}" ]; then  # one quick probe, so an offline CI does not wait on retries
    if timeout 60 npm view "$spec" version --fetch-retries=0 >/dev/null 2>&1; then registry_ok=yes; else registry_ok=no; fi
  fi
  if [ "$registry_ok" != yes ]; then
    note "WARNING: the npm registry is unreachable; $spec not installed and its tests will skip"
    status=partial
    return 0
  fi
  note "installing $spec into $CLIENTS"
  # Claude Code 2.1.332 declares engines.node >=22 but is a native binary that runs on Node 20:
  # the EBADENGINE warning is expected. Postinstall scripts are not needed (the platform binary
  # comes as an optional dependency).
  if timeout 900 npm install --prefix "$CLIENTS" --no-audit --no-fund --loglevel=error "$spec"; then
    if "$CLIENTS/node_modules/.bin/$bin" --version >/dev/null 2>&1; then
      note "$spec: $("$CLIENTS/node_modules/.bin/$bin" --version 2>&1 | head -1)"
    else
      note "WARNING: $spec installed but '$bin --version' fails; its tests will skip"
      status=partial
    fi
  else
    note "WARNING: npm could not install $spec (registry unreachable?); its tests will skip"
    status=partial
  fi
}

if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then
  mkdir -p "$CLIENTS" || { note "WARNING: cannot create $CLIENTS"; status=partial; }
  [ -f "$CLIENTS/package.json" ] || echo '{"name":"zen5-clients","private":true}' > "$CLIENTS/package.json"
  npm_client "$CLAUDE_CODE" claude
  npm_client "$CODEX" codex
else
  note "WARNING: node/npm not found; the Claude Code and Codex tests will skip"
  status=partial
fi

PY=.venv/bin/python
if [ -x "$PY" ]; then
  if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("openai-agents") != "0.24.0")' 2>/dev/null; then
    note "$AGENTS already installed in .venv"
  elif timeout 600 "$PY" -m pip install -q --retries 1 --timeout 20 "$AGENTS"; then
    note "$AGENTS installed in .venv"
  else
    note "WARNING: pip could not install $AGENTS (index unreachable?); its test will skip"
    status=partial
  fi
else
  note "WARNING: no .venv (run scripts/setup.sh first); openai-agents not installed"
  status=partial
fi

note "done ($status)"
exit 0

